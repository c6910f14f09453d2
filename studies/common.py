"""What the studies share: running a stage by its flags, borrowed run folders, the FLOP-matched run,
sampling and measuring with resume, Student-t intervals, and the FD plot.

Every study drives the stage scripts through their command lines (`stage(module, *flags)`), so
each number in docs/ can be re-made by hand, and every finished network or measured batch is
found again by its path: a killed study resumes where it stopped.
"""
import contextlib
import json
import os

import numpy as np
import torch

import cluster
import eval as evaluate
import sample
import train_expert
import train_router
from command_line import UsageError
from run_dir import atomic_path


def stage(module, *argv):
    module.main(module.build_parser().parse_args([str(a) for a in argv]))


def link_run(dst, src_run, experts, router_from=None):
    """A run folder that borrows another run's cluster file, these expert folders and a router (symlinks)."""
    os.makedirs(os.path.join(dst, "experts"), exist_ok=True)
    for name, target in [("clusters.pt", os.path.join(src_run, "clusters.pt"))] + \
                        ([("router", os.path.join(router_from, "router"))] if router_from else []) + \
                        [(os.path.join("experts", str(k)), folder) for k, folder in experts.items()]:
        path = os.path.join(dst, name)
        if not os.path.lexists(path):
            os.symlink(os.path.abspath(target), path)
    return dst


def measure(run_dir, files, *extra):
    stage(evaluate, *files, "--run-dir", run_dir, *extra)
    out = []
    for f in files:
        with open(f[:-4] + ".eval.json") as fh:
            out.append(json.load(fh))
    return out


def log_of(folder):
    with open(os.path.join(folder, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def interval(values, level=0.95):
    """(mean, half-width) of a Student-t interval over seeds; the half-width is nan for a single value."""
    from scipy import stats
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    half = stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean()), float(half)


def spread(values):
    """'mean (min-max)' of a metric over seeds."""
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def sample_and_measure(run_dir, path, *flags, eval_flags=()):
    """One sample batch and its metrics; a batch already measured is reused, so a killed study resumes."""
    if not os.path.isfile(path[:-4] + ".eval.json"):
        stage(sample, "--run-dir", run_dir, "--out", path, *flags)
        measure(run_dir, [path], *eval_flags)
    with open(path[:-4] + ".eval.json") as f:
        return json.load(f)


def need_experts(run_dir):
    if not os.path.isdir(os.path.join(run_dir, "experts")) or not os.path.isfile(os.path.join(run_dir, "router", "ckpt.pt")):
        raise UsageError(f"--part guidance/solvers sample the ensemble in --run-dir {run_dir}: run ./ddm pipeline (or the stages) first")


def share_eval(run, root):
    """run/eval -> root/eval: one evaluation classifier and one set of reference statistics for every arm of a study."""
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    if not os.path.lexists(os.path.join(run, "eval")):
        os.symlink(os.path.abspath(os.path.join(root, "eval")), os.path.join(run, "eval"))


def trained_to(folder, steps):
    path = os.path.join(folder, "ckpt.pt")
    return os.path.isfile(path) and torch.load(path, weights_only=True)["step"] >= steps


def matched_expert_steps(monolith_steps, monolith_flops_per_step, router_flops):
    """DDM's FLOP matching: K experts at 1/K of the monolith's batch, for the monolith's FLOPs minus the router's.

    A step's FLOPs scale with the batch, so an expert step costs monolith_flops_per_step / K."""
    return int((monolith_steps * monolith_flops_per_step - router_flops) // monolith_flops_per_step)


def flop_matched_run(run, model, monolith_steps, batch, seed, k, router_steps):
    """One arm of the scaling study in its own run folder: clusters, router, a monolith and K FLOP-matched experts.

    Finished pieces are skipped, so a killed study resumes where it stopped. Returns the FLOPs of each side."""
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", k, "--seed", seed, "--run-dir", run)
    if not os.path.isfile(os.path.join(run, "router", "ckpt.pt")):
        stage(train_router, "--seed", seed, "--steps", router_steps, "--run-dir", run)
    common = ["--model", model, "--seed", seed, "--run-dir", run]
    if not trained_to(os.path.join(run, "experts", "all"), monolith_steps):
        stage(train_expert, "--cluster", "all", "--steps", monolith_steps, "--batch-size", batch, *common)
    router_flops = torch.load(os.path.join(run, "router", "ckpt.pt"), weights_only=True)["config"]["flops"]
    per_step = torch.load(os.path.join(run, "experts", "all", "ckpt.pt"), weights_only=True)["config"]["flops_per_step"]
    expert_steps = matched_expert_steps(monolith_steps, per_step, router_flops)
    if expert_steps < 1:
        raise UsageError(f"{monolith_steps} monolith steps of {model} buy less than the router's FLOPs; raise --monolith-steps")
    for j in range(k):
        if not trained_to(os.path.join(run, "experts", str(j)), expert_steps):
            stage(train_expert, "--cluster", j, "--objective", "fm", "--steps", expert_steps, "--batch-size", batch // k, *common)
    expert_flops = sum(torch.load(os.path.join(run, "experts", str(j), "ckpt.pt"), weights_only=True)["config"]["flops"] for j in range(k))
    return {"monolith": monolith_steps * per_step, "ensemble": expert_flops + router_flops, "expert_steps": expert_steps}


SCALING_METHODS = {"monolith": ["--experts", "all"], "top-1": ["--routing", "top1"], "top-2": ["--routing", "top2"],
                   "full": ["--routing", "full"]}


def scaling_run(args, model, k, budget, seed):
    """The scaling study's run folder for one point, trained if missing, and its FLOPs (see flop_matched_run)."""
    run = os.path.join(args.out, "scaling", f"{model.replace('/', '')}-k{k}-x{budget:g}-seed{seed}")
    # the router grows with the budget, so that it costs the ensemble the same share at every budget
    return run, flop_matched_run(run, model, max(1, round(args.monolith_steps * budget)), args.batch_size, seed, k,
                                 max(1, round(args.router_steps * budget)))


def routed_sample(args, run, method):
    """The metrics of RUN/samples/METHOD.npz, one of SCALING_METHODS at the study's N, solver and steps (sampling seed 0)."""
    return sample_and_measure(run, os.path.join(run, "samples", f"{method}.npz"), *SCALING_METHODS[method], "--n", args.n,
                              "--seed", 0, "--solver", args.solver, "--steps", args.sample_steps,
                              eval_flags=["--classifier-steps", args.classifier_steps])


@contextlib.contextmanager
def fd_plot(path, xlabel, ylabel, xlog=False):
    """Axes to draw FD curves on (log FD axis), written atomically as a PNG at `path` on exit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    yield ax
    if xlog:
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
