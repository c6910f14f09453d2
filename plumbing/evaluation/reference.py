"""The real images' reference statistics (features, mean, covariance) and the floor at each
batch size, cached in RUN_DIR/eval/ under a key of everything that made them, and checked
when read back: a damaged or foreign file under the right name is computed again, never
trusted."""
import json
import math
import os

import numpy as np

from plumbing.command_line import first_line
from plumbing.evaluation.metrics import FD_KEYS, FLOOR_DRAWS, statistics_problem
from plumbing.run_dir import atomic_json, atomic_path

PARTS = ("features", "mu", "sigma")
MAX_FLOOR_BYTES = 1 << 16   # a floor record is a few hundred bytes: never read a huge file whole


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


def floor_problem(floor, n, spaces):
    """What is wrong with a floor read back for batch size n in these feature spaces, or None."""
    if not isinstance(floor, dict) or not isinstance(floor.get("images"), str):
        return "not a floor record"
    if (floor.get("n"), floor.get("draws")) != (n, FLOOR_DRAWS):
        return f"of N = {floor.get('n')} over {floor.get('draws')} draws"
    for key in (key + sd for space in spaces for key in FD_KEYS[space] for sd in ("", "_sd")):
        value = floor.get(key)
        if not isinstance(value, float) or not math.isfinite(value):
            return f"without a finite {key}"
    return None


def cached_floor(path, n, spaces, measure_floor):
    """The floor at batch size n: read back from `path` (checked), else measure_floor()
    written there. Its 5 draws of n real images through every feature network cost as much
    as five batches, and the studies run eval.py once per batch, so it is measured once per
    reference and N, not once per run. A floor that could not be measured (None) is not kept."""
    if os.path.isfile(path):
        try:
            if os.path.getsize(path) > MAX_FLOOR_BYTES:
                raise ValueError("far larger than a floor record")
            with open(path) as f:
                floor = json.load(f)
            problem = floor_problem(floor, n, spaces)
        except Exception as e:   # unreadable, not JSON, or huge
            problem = f"unreadable ({first_line(e)})"
        if problem:
            print(f"the cached floor {path} is {problem}; measuring it again")
        else:
            return floor
    floor = measure_floor()
    if floor is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_json(floor, path)
    return floor
