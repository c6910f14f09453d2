"""The ensemble distilled into one model (`--part distill`), against the ensemble and a
FLOP-matched monolith."""
import json
import os

import numpy as np

import distill
from studies.common import config_of, need_experts, sample_and_measure, spread, stage
import train_expert


def network_calls(sample_file):
    """(expert calls, router calls) per image, from the usage counts sample.py
    recorded."""
    with open(sample_file[:-4] + ".json") as f:
        record = json.load(f)
    calls = float(np.sum(record["usage_per_t_bin"]["counts"])) / record["n"]
    return calls, (0 if record["routing"].startswith("oracle")
                   or record["experts"] in (["all"], ["distilled"])
                   else record["network_evaluations"])


def run(args):
    """The ensemble of --run-dir distilled into one model, against the ensemble (top-1,
    full) and a monolith of the experts' + router's training FLOPs: FD, class accuracy,
    training FLOPs and network calls per image, two sampling seeds."""
    need_experts(args.run_dir)
    experts = {k: config_of(os.path.join(args.run_dir, "experts", str(k))) for k in range(4)}
    router_flops = config_of(os.path.join(args.run_dir, "router"))["flops"]
    ensemble_flops = sum(c["flops"] for c in experts.values()) + router_flops
    flags = experts[0]["flags"]
    # a monolith step of the same model and batch costs the same as an expert's
    per_step = experts[0]["flops_per_step"]
    monolith_steps = round(ensemble_flops / per_step)
    stage(train_expert, "--cluster", "all", "--steps", monolith_steps, "--batch-size",
          flags["batch_size"], "--model", flags["model"],
          "--seed", flags["seed"], "--run-dir", args.run_dir)
    stage(distill, "--run-dir", args.run_dir, "--steps", args.distill_steps)
    student = config_of(os.path.join(args.run_dir, "experts", "distilled"))
    arms = {"ensemble top-1": (["--routing", "top1"], ensemble_flops),
            "ensemble full": (["--routing", "full"], ensemble_flops),
            "distilled (full teacher)": (["--experts", "distilled"],
                                         ensemble_flops + student["distillation_flops"]),
            f"monolith ({monolith_steps} "
            "steps)": (["--experts", "all"], monolith_steps * per_step)}
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds,
               "distill_steps": args.distill_steps,
               "monolith_steps": monolith_steps, "rows": []}
    for name, (flags, flops) in arms.items():
        files = [os.path.join(args.out, "distill", f"{name.split()[0]}-{flags[-1]}-seed{seed}.npz")
                 for seed in args.seeds]
        runs = [sample_and_measure(args.run_dir, f, *flags, "--n", args.n, "--seed", seed) for f,
                seed in zip(files, args.seeds)]
        expert_calls, router_calls = network_calls(files[0])
        results["rows"].append({"arm": name, "training_flops": flops,
                                "fd": [r["fd_classifier"] for r in runs],
                                "accuracy": [r["conditional_accuracy"] for r in runs],
                                "expert_calls_per_image": expert_calls,
                                "router_calls_per_image": router_calls})
    lines = [f"Distillation, {args.run_dir} (training seed 0): N = {args.n} per batch, "
             f"sampling seeds {args.seeds}, 50 Euler steps, no guidance. FD-classifier "
             "and class accuracy: mean over sampling seeds (min-max). The student: "
             f"{args.distill_steps} steps of distill.py's defaults.", "",
             "| model | training TFLOPs | FD | class accuracy (%) | expert calls / image "
             "| router calls / image |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['arm']} | {r['training_flops'] / 1e12:.2f} | "
                     f"{spread(r['fd'])} | {spread([100 * a for a in r['accuracy']])} | "
                     f"{r['expert_calls_per_image']:.0f} | "
                     f"{r['router_calls_per_image']:.0f} |")
    return results, lines
