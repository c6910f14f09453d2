"""The real images' reference statistics (features, mean, covariance), cached in
RUN_DIR/eval/ under a key of everything that made them, and checked when read back: a
damaged or foreign file under the right name is computed again, never trusted."""
import os

import numpy as np

from plumbing.command_line import first_line
from plumbing.evaluation.metrics import statistics_problem
from plumbing.run_dir import atomic_path

PARTS = ("features", "mu", "sigma")


def cached_reference(path, n):
    """The statistics of n real images cached at `path`, or None (none there, or a file
    that fails the checks, which is said in one line)."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            cached = {part: stored[part] for part in PARTS}
        problem = statistics_problem(*(cached[part] for part in PARTS), n)
    except Exception as e:
        problem = f"unreadable ({first_line(e)})"
    if problem:
        print(f"the cached reference statistics {path} are {problem}; computing them again")
        return None
    return cached


def cache_reference(path, reference):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_path(path) as tmp:
        np.savez(tmp, **reference)
