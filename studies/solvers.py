"""Sampling steps (`--part solvers`): FD against network evaluations, Euler vs Heun, on
the models of --run-dir."""
import os

import numpy as np

from studies.common import need_experts, sample_and_measure, spread
from plumbing.command_line import UsageError


def run(args):
    """FD and class accuracy against network evaluations (NFE), Euler vs Heun, for the
    monolith, top-1 and full ensembles."""
    need_experts(args.run_dir)
    if not os.path.isfile(os.path.join(args.run_dir, "experts", "all", "ckpt.pt")):
        raise UsageError("--part solvers also samples the monolith: train it first "
                         "(train_expert.py --cluster all, or --part distill, which "
                         f"trains it FLOP-matched) in {args.run_dir}")
    out = os.path.join(args.out, "solvers")
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds, "rows": []}
    models = {"monolith": ["--experts", "all"], "top-1": ["--routing", "top1"],
              "full": ["--routing", "full"]}
    for name, flags in models.items():
        # full routing costs K expert calls per evaluation
        seeds = args.seeds[:1] if name == "full" else args.seeds
        for solver in ("euler", "heun"):
            for nfe in (6, 10, 16, 24, 50):
                steps = nfe // (2 if solver == "heun" else 1)
                runs = [sample_and_measure(
                    args.run_dir, os.path.join(out, f"{name}-{solver}-{nfe}-seed{seed}.npz"),
                    *flags, "--solver", solver, "--steps", steps, "--n", args.n, "--seed", seed)
                    for seed in seeds]
                row = {"model": name, "solver": solver, "nfe": nfe, "steps": steps, "seeds": seeds}
                results["rows"].append({**row, "fd": [r["fd_classifier"] for r in runs],
                                        "accuracy": [r["conditional_accuracy"] for r in runs]})
    lines = [f"Solvers, {args.run_dir}: N = {args.n} per batch, sampling seeds "
             f"{args.seeds} (full routing: {args.seeds[:1]}), no guidance. FD-classifier "
             "(class accuracy %): mean over seeds (min-max). NFE = network evaluations "
             "per sample (Heun: 2 per step).", "",
             "| model | solver | NFE 6 | NFE 10 | NFE 16 | NFE 24 | NFE 50 |",
             "|---|---|---|---|---|---|---|"]
    for i in range(0, len(results["rows"]), 5):
        rows = results["rows"][i:i + 5]
        lines.append(f"| {rows[0]['model']} | {rows[0]['solver']} | " + " | ".join(
            f"{spread(r['fd'])} "
            f"({np.mean(r['accuracy']) * 100:.0f})" for r in rows) + " |")
    for name in models:
        reference = np.mean(next(r["fd"] for r in results["rows"]
                                 if (r["model"], r["solver"], r["nfe"]) == (name, "euler", 50)))
        good = [r for r in results["rows"] if r["model"] == name
                and np.mean(r["fd"]) <= 1.05 * reference]
        best = min(good, key=lambda r: (r["nfe"], r["solver"]))
        lines.append(f"\n{name}: the fewest evaluations within 5 % of Euler-50's FD "
                     f"({reference:.2f}): {best['solver']} at NFE {best['nfe']}")
    return results, lines
