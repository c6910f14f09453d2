"""HDDM's mixed ensembles (`--part heterogeneous`): DDPM experts among flow ones, on
the scaling study's runs."""
import os

from studies.common import (SCALING_METHODS, interval, link_run, plus_minus,
                            routed_sample, scaling_run, share_eval, stage, trained_to)
import train_expert
from plumbing.command_line import UsageError


HETEROGENEOUS_ARMS = {
    "flow": "every expert flow, from scratch (the scaling study's ensemble)",
    "ddpm+flow": "the first --ddpm-experts experts DDPM, the rest flow from scratch",
    "ddpm+converted": "the first --ddpm-experts experts DDPM, the rest flow converted from a "
                      "DDPM monolith of all digits (not charged, as in --part conversion)"}


def run(args):
    """HDDM's mixed ensembles: a few DDPM (epsilon) experts among flow experts, against
    all-flow, at equal budget.

    Builds on the scaling study's runs (same folders, so finished ones are reused):
    their flow experts and router are the homogeneous arm. The DDPM experts take the
    same steps, batch and seed as the flow experts they replace; the router is shared,
    since it never sees an expert."""
    root = os.path.join(args.out, "heterogeneous")
    rows = []
    for model in args.models:
        source = os.path.join(root, f"source-ddpm-{model.replace('/', '')}")
        for k in args.k:
            if not 0 < args.ddpm_experts < k:
                raise UsageError(f"--ddpm-experts {args.ddpm_experts} must leave at least one of "
                                 f"the {k} experts flow")
            if args.batch_size % k:
                raise UsageError(f"--batch-size {args.batch_size} must split evenly over {k} "
                                 "experts")
            for budget in args.budgets:
                for seed in args.train_seeds:
                    run, flops = scaling_run(args, model, k, budget, seed)
                    name = os.path.basename(run)
                    # the source sees all data: the first run's clusters are as good as
                    # any for it
                    if "ddpm+converted" in args.arms and not trained_to(source, args.source_steps):
                        stage(train_expert, "--cluster", "all", "--objective", "ddpm", "--model", model,
                              "--steps", args.source_steps, "--batch-size", args.batch_size, "--seed", 0,
                              "--run-dir", run, "--out-dir", source)
                    common = ["--model", model, "--seed", seed, "--run-dir", run, "--steps", flops["expert_steps"],
                              "--batch-size", args.batch_size // k]
                    experts = {arm: {} for arm in HETEROGENEOUS_ARMS if arm == "flow"
                               or arm in args.arms}
                    for j in range(k):
                        flow = experts["flow"][j] = os.path.join(run, "experts", str(j))
                        if j < args.ddpm_experts:
                            folder, flags = os.path.join(root, name, f"ddpm-{j}"), ["--objective", "ddpm"]
                        elif "ddpm+converted" in experts:
                            folder = os.path.join(root, name, f"converted-{j}")
                            flags = ["--objective", "fm", "--init", os.path.join(source, "ckpt.pt"),
                                     "--time-map", "snr"]
                        else:
                            folder = None
                        for arm in experts.keys() - {"flow"}:
                            experts[arm][j] = folder if j < args.ddpm_experts or arm == "ddpm+converted" else flow
                        if folder and not trained_to(folder, flops["expert_steps"]):
                            stage(train_expert, "--cluster", j, "--out-dir", folder,
                                  *common, *flags)
                    for arm, folders in experts.items():
                        view = run if arm == "flow" else link_run(
                            os.path.join(root, name, arm), run, folders, router_from=run)
                        # the scaling study's classifier: FDs comparable
                        share_eval(view, os.path.join(args.out, "scaling"))
                        for method in SCALING_METHODS:
                            if method == "monolith" and arm != "flow":
                                continue
                            r = routed_sample(args, view, method)
                            point = {"model": model, "k": k, "budget": budget, "seed": seed}
                            rows.append({**point, "method": method, "fd": r["fd_classifier"],
                                         "arm": "monolith" if method == "monolith" else arm,
                                         "accuracy": r["conditional_accuracy"]})
    return {"rows": rows, "arms": HETEROGENEOUS_ARMS, "ddpm_experts": args.ddpm_experts}, report(args, rows)


def report(args, rows):
    """The table of every point's arms, and each mixed arm paired by seed against the
    all-flow one."""
    methods = [m for m in SCALING_METHODS if m != "monolith"]
    lines = [f"Heterogeneous ensembles, digits: {args.ddpm_experts} DDPM experts of K, the rest "
             f"flow, at the scaling study's FLOP match (batch {args.batch_size}/K per expert); "
             "flow experts from scratch or converted from a DDPM monolith of all digits "
             f"({args.source_steps} steps, not charged). Training seeds {args.train_seeds}; N = "
             f"{args.n}, {args.solver} x {args.sample_steps} steps, sampling seed 0. "
             "FD-classifier: mean ± 95 % t-interval over training seeds.", "",
             "| model | K | budget | monolith | arm | " + " | ".join(methods) + " |",
             "|---|---|---|---|---|" + "---|" * len(methods)]
    key = lambda r: (r["model"], r["k"], r["budget"])
    def cell(point, arm, method):
        fd, half = interval([r["fd"] for r in rows if key(r) == point
                             and (r["arm"], r["method"]) == (arm, method)])
        return plus_minus(fd, half)
    for point in sorted({key(r) for r in rows}):
        model, k, budget = point
        for arm in [a for a in HETEROGENEOUS_ARMS if a == "flow" or a in args.arms]:
            label = arm if arm == "flow" else f"{args.ddpm_experts} {arm.replace('+', ' + ')}"
            lines.append(f"| {model} | {k} | x{budget:g} | {cell(point, 'monolith', 'monolith')} | "
                         f"{label} | "
                         + " | ".join(cell(point, arm, m) for m in methods) + " |")
    # the arms share seeds (clusters, router, flow experts), so the per-seed difference is
    # the sharper comparison
    lines += ["", "Paired by training seed: FD of the mixed arm minus FD of the all-flow arm, "
                  "mean ± 95 % t-interval (negative: the mixed arm is better).", "",
              "| model | K | budget | arm | " + " | ".join(methods) + " |",
              "|---|---|---|---|" + "---|" * len(methods)]
    for point in sorted({key(r) for r in rows}):
        model, k, budget = point
        fd = {(r["arm"], r["method"], r["seed"]): r["fd"] for r in rows if key(r) == point}
        for arm in [a for a in HETEROGENEOUS_ARMS if a != "flow" and a in args.arms]:
            cells = []
            for m in methods:
                diff, half = interval([fd[arm, m, seed] - fd["flow", m, seed]
                                       for seed in args.train_seeds])
                cells.append(plus_minus(diff, half, "+.2f"))
            lines.append(f"| {model} | {k} | x{budget:g} | {args.ddpm_experts} "
                         f"{arm.replace('+', ' + ')} | " + " | ".join(cells) + " |")
    return lines
