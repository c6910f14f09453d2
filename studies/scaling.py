"""FD against training FLOPs (`--part scaling`): monolith vs the FLOP-matched ensemble (top-1, top-2, full) over
data sets x model sizes x K x budgets x training seeds, with 95 % intervals and a plot.

Several --k make it the K sweep. --splits adds arms that test why the ensemble wins or loses: DDM's split
(experts at batch B/K), equal batch (experts at batch B for 1/K of the steps, the same FLOPs) and a random
partition; --router-share holds the router at one share of every budget; --until-plateau keeps doubling the
budget until the monolith's FD has stopped improving (plateau_budget), the regime DDM's claim is about."""
import os

import numpy as np

from command_line import UsageError
from studies.common import SCALING_METHODS, check_budgets, fd_plot, interval, plateau_budget, routed_sample, scaling_run, share_eval


def run(args):
    """FD against training FLOPs: monolith vs ensemble (top-1, top-2, full), K x model sizes x budgets x seeds x splits."""
    for k in args.k:
        if args.batch_size % k:
            raise UsageError(f"--batch-size {args.batch_size} must split evenly over {k} experts")
    if args.until_plateau and len(args.train_seeds) < 2:
        raise UsageError("--until-plateau compares each budget's FD with its interval: give at least two --train-seeds")
    check_budgets(args, args.k, args.splits)
    root = os.path.join(args.out, "scaling")
    results = {"data": args.data, "k": args.k, "n": args.n, "solver": args.solver, "sample_steps": args.sample_steps,
               "train_seeds": args.train_seeds, "base_monolith_steps": args.monolith_steps, "batch_size": args.batch_size,
               "splits": args.splits, "router_model": args.router_model, "router_share": args.router_share, "runs": [],
               "plateau": {}}
    for model in args.models:
        for k in args.k:
            budgets = sorted(set(args.budgets))
            while budgets:
                budget = budgets.pop(0)
                for seed in args.train_seeds:
                    results["runs"] += measure_point(args, root, model, k, budget, seed)
                monolith = [(s["budget"], s["fd_mean"], s["fd_half"]) for s in summarise(results["runs"])
                            if (s["model"], s["k"], s["method"]) == (model, k, "monolith")]
                results["plateau"][f"{model} K={k}"] = plateau_budget(monolith)
                if not budgets and args.until_plateau and results["plateau"][f"{model} K={k}"] is None and 2 * budget <= args.max_budget:
                    budgets.append(2 * budget)
    results["summary"] = summarise(results["runs"])
    results["paired"] = paired_differences(results["runs"])
    lines = report(args, results)
    if args.plots:
        plot_scaling(results["summary"], os.path.join(args.out, f"{plot_name(args)}.png"))
        lines += ["", f"Plot: {os.path.join(args.out, plot_name(args) + '.png')}"]
    return results, lines


def plot_name(args):
    data = args.data.split(":")[0]
    return "scaling" if data == "digits" else f"scaling-{data}"


def measure_point(args, root, model, k, budget, seed):
    """The rows of one (model, K, budget, seed): the monolith once, from the point's own folder whatever --splits
    lists, and every routing rule of every split (none with --monolith-only)."""
    base, flops = scaling_run(args, model, k, budget, seed, monolith_only=True)
    share_eval(base, root)
    measured = [("monolith", "monolith", base, flops["monolith"], np.nan)]
    for split in [] if args.monolith_only else args.splits:
        run, flops = scaling_run(args, model, k, budget, seed, split)
        share_eval(run, root)
        measured += [(method, split, run, flops["ensemble"], flops["router_share"]) for method in SCALING_METHODS if method != "monolith"]
    rows = []
    for method, split, run, spent, router_share in measured:
        r = routed_sample(args, run, method)
        rows.append({"model": model, "k": k, "budget": budget, "seed": seed, "method": method, "split": split,
                     "flops": spent, "router_share": router_share, "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"]})
    return rows


def report(args, results):
    """The study's table: one row per (model, K, budget, split), the monolith's FD beside the routed ensembles'."""
    router = f"router {args.router_model} at {args.router_share:.0%} of each budget" if args.router_share else \
        f"router {args.router_model} for {args.router_steps} steps per x1"
    arms = "monoliths only, no experts or router" if args.monolith_only else f"splits: {', '.join(args.splits)}; {router}"
    lines = [f"Scaling, {args.data}, FLOP-matched (monolith at batch {args.batch_size}; {arms}); "
             f"training seeds {args.train_seeds}; N = {args.n}, {args.solver} x {args.sample_steps} steps, sampling seed 0. "
             f"FD-classifier (lower is better): mean ± 95 % t-interval over training seeds.", "",
             "| model | K | budget | TFLOPs | split | router share | monolith | top-1 | top-2 | full |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cell = lambda s: f"{s['fd_mean']:.2f} ± {s['fd_half']:.2f}"
    groups = {}
    for s in results["summary"]:
        groups.setdefault((s["model"], s["k"], s["budget"]), {}).setdefault(s["split"], {})[s["method"]] = s
    for (model, k, budget), by_split in sorted(groups.items()):
        monolith = by_split["monolith"]["monolith"]
        prefix = f"| {model} | {k} | x{budget:g} | {monolith['flops_mean'] / 1e12:.2f} |"
        routed = [s for s in args.splits if s in by_split]
        for split in routed:
            row = by_split[split]
            lines.append(f"{prefix} {split} | {row['top-1']['router_share_mean']:.1%} | {cell(monolith)} | "
                         + " | ".join(cell(row[m]) for m in SCALING_METHODS if m != "monolith") + " |")
        if not routed:   # --monolith-only
            lines.append(f"{prefix} monolith only | – | {cell(monolith)} | " + " | ".join("–" for m in SCALING_METHODS if m != "monolith") + " |")
    rows = {}
    for d in results["paired"]:
        rows.setdefault((d["model"], d["k"], d["budget"], d["split"]), {})[d["method"]] = d
    if rows:   # none with --monolith-only
        lines += ["", "Paired by training seed (the same seed's clusters and monolith), routed FD minus the monolith's: "
                  "below zero, the ensemble is ahead; an interval that includes zero is no difference.", "",
                  "| model | K | budget | split | " + " | ".join(f"{m} − monolith" for m in SCALING_METHODS if m != "monolith") + " |",
                  "|---|---|---|---|" + "---|" * (len(SCALING_METHODS) - 1)]
    for (model, k, budget, split), row in sorted(rows.items()):
        lines.append(f"| {model} | {k} | x{budget:g} | {split} | "
                     + " | ".join(f"{row[m]['diff_mean']:+.2f} ± {row[m]['diff_half']:.2f}" for m in SCALING_METHODS if m in row) + " |")
    for point, budget in results["plateau"].items():
        measured = sum(f"{s['model']} K={s['k']}" == point and s["method"] == "monolith" for s in results["summary"])
        verdict = f"stopped improving at x{budget:g} (two doublings, each inside its interval)" if budget else \
            "was still improving at the largest budget" if measured >= 3 else \
            f"is not judged for a plateau here ({measured} budget{'s' * (measured != 1)}; the rule needs three that double)"
        lines.append(f"\n{point}: the monolith's FD {verdict}")
    return lines


def summarise(runs):
    """Per (model, K, budget, split, method): FD and accuracy means with their 95 % intervals over training seeds, mean FLOPs."""
    key = lambda r: (r["model"], r["k"], r["budget"], r.get("split", "ddm"), r["method"])
    out = []
    for point in sorted({key(r) for r in runs}):
        rows = [r for r in runs if key(r) == point]
        fd, fd_half = interval([r["fd"] for r in rows])
        acc, acc_half = interval([r["accuracy"] for r in rows])
        out.append({**dict(zip(("model", "k", "budget", "split", "method"), point)), "seeds": len(rows), "fd_mean": fd,
                    "fd_half": fd_half, "accuracy_mean": acc, "accuracy_half": acc_half,
                    "flops_mean": float(np.mean([r["flops"] for r in rows])),
                    "router_share_mean": float(np.mean([r.get("router_share", np.nan) for r in rows]))})
    return out


def paired_differences(runs):
    """Per (model, K, budget, split, routing rule): the mean and 95 % interval over training seeds of its FD minus the
    same seed's monolith's. The seeds share clusters and a monolith run, so the seed-to-seed spread the unpaired
    intervals carry largely cancels."""
    run_of = lambda r: (r["model"], r["k"], r["budget"], r["seed"])
    monolith = {run_of(r): r["fd"] for r in runs if r["method"] == "monolith"}
    by_point = {}
    for r in runs:
        if r["method"] != "monolith" and run_of(r) in monolith:
            point = (r["model"], r["k"], r["budget"], r.get("split", "ddm"), r["method"])
            by_point.setdefault(point, []).append(r["fd"] - monolith[run_of(r)])
    out = []
    for point, diffs in sorted(by_point.items()):
        mean, half = interval(diffs)
        out.append({**dict(zip(("model", "k", "budget", "split", "method"), point)), "seeds": len(diffs),
                    "diff_mean": mean, "diff_half": half})
    return out


def plot_scaling(summary, path):
    """FD against training FLOPs (log axes) with 95 % intervals: one line per model size, K, split and routing rule."""
    with fd_plot(path, "training FLOPs", "FD (classifier features)", xlog=True) as ax:
        for model, k, split in sorted({(s["model"], s["k"], s["split"]) for s in summary}):
            for method in SCALING_METHODS:
                points = sorted((s["flops_mean"], s["fd_mean"], s["fd_half"]) for s in summary
                                if (s["model"], s["k"], s["split"], s["method"]) == (model, k, split, method))
                if len(points) < 2:   # a single-budget arm (the K sweep) is a table row, not a line
                    continue
                x, y, err = zip(*points)
                label = f"{model} monolith" if method == "monolith" else f"{model} K={k} {split} {method}"
                ax.errorbar(x, y, yerr=[0 if np.isnan(e) else e for e in err], marker="o", capsize=3, label=label,
                            linestyle="-" if method == "monolith" else "--")
