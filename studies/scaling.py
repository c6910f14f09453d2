"""FD against training FLOPs (`--part scaling`): monolith vs the FLOP-matched ensemble (top-1, top-2, full) over
model sizes x K x budgets x training seeds, with 95 % intervals and a plot. Several --k make it the K sweep."""
import os

import numpy as np

from command_line import UsageError
from studies.common import SCALING_METHODS, fd_plot, interval, routed_sample, scaling_run, share_eval


def run(args):
    """FD against training FLOPs: monolith vs ensemble (top-1, top-2, full), K x model sizes x budgets x training seeds."""
    for k in args.k:
        if args.batch_size % k:
            raise UsageError(f"--batch-size {args.batch_size} must split evenly over {k} experts")
    root = os.path.join(args.out, "scaling")
    results = {"k": args.k, "n": args.n, "solver": args.solver, "sample_steps": args.sample_steps, "train_seeds": args.train_seeds,
               "base_monolith_steps": args.monolith_steps, "batch_size": args.batch_size, "runs": []}
    for model in args.models:
        for k in args.k:
            for budget in args.budgets:
                for seed in args.train_seeds:
                    run, flops = scaling_run(args, model, k, budget, seed)
                    share_eval(run, root)
                    for method in SCALING_METHODS:
                        r = routed_sample(args, run, method)
                        results["runs"].append({"model": model, "k": k, "budget": budget, "seed": seed, "method": method,
                                                "flops": flops["monolith" if method == "monolith" else "ensemble"],
                                                "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"]})
    results["summary"] = summarise(results["runs"])
    lines = [f"Scaling, digits, FLOP-matched as DDM (K experts at 1/K of the monolith's batch {args.batch_size}); "
             f"training seeds {args.train_seeds}; N = {args.n}, {args.solver} x {args.sample_steps} steps, sampling seed 0. "
             f"FD-classifier (lower is better): mean ± 95 % t-interval over training seeds.", "",
             "| model | K | budget | TFLOPs | monolith | top-1 | top-2 | full |", "|---|---|---|---|---|---|---|---|"]
    for (model, k, budget), row in group_rows(results["summary"]):
        cells = " | ".join(f"{row[m]['fd_mean']:.2f} ± {row[m]['fd_half']:.2f}" for m in SCALING_METHODS)
        lines.append(f"| {model} | {k} | x{budget:g} | {row['monolith']['flops_mean'] / 1e12:.2f} | {cells} |")
    if args.plots:
        plot_scaling(results["summary"], os.path.join(args.out, "scaling.png"))
        lines += ["", f"Plot: {os.path.join(args.out, 'scaling.png')}"]
    return results, lines


def summarise(runs):
    """Per (model, K, budget, method): FD and accuracy means with their 95 % intervals over training seeds, and mean FLOPs."""
    key = lambda r: (r["model"], r["k"], r["budget"], r["method"])
    out = []
    for model, k, budget, method in sorted({key(r) for r in runs}):
        rows = [r for r in runs if key(r) == (model, k, budget, method)]
        fd, fd_half = interval([r["fd"] for r in rows])
        acc, acc_half = interval([r["accuracy"] for r in rows])
        out.append({"model": model, "k": k, "budget": budget, "method": method, "seeds": len(rows), "fd_mean": fd, "fd_half": fd_half,
                    "accuracy_mean": acc, "accuracy_half": acc_half, "flops_mean": float(np.mean([r["flops"] for r in rows]))})
    return out


def group_rows(summary):
    groups = {}
    for s in summary:
        groups.setdefault((s["model"], s["k"], s["budget"]), {})[s["method"]] = s
    return sorted(groups.items())


def plot_scaling(summary, path):
    """FD against training FLOPs (log axis) with 95 % intervals: one line per method, model size and K."""
    with fd_plot(path, "training FLOPs", "FD (classifier features)", xlog=True) as ax:
        for model, k in sorted({(s["model"], s["k"]) for s in summary}):
            for method in SCALING_METHODS:
                points = sorted((s["flops_mean"], s["fd_mean"], s["fd_half"]) for s in summary
                                if (s["model"], s["k"], s["method"]) == (model, k, method))
                if len(points) < 2:   # a single-budget arm (the K sweep) is a table row, not a line
                    continue
                x, y, err = zip(*points)
                ax.errorbar(x, y, yerr=[0 if np.isnan(e) else e for e in err], marker="o", capsize=3,
                            label=f"{model} K={k} {method}", linestyle="-" if method == "monolith" else "--")
