"""HDDM's conversion (`--part conversion`): flow experts fine-tuned from a DDPM
checkpoint vs from scratch."""
import json
import os

import numpy as np

import cluster
import sample
from studies.common import (fd_plot, interval, link_run, log_of, measure,
                            measured_as_asked, plus_minus, stage, trained_to)
import train_expert


CONVERSION_ARMS = {"scratch": [], "converted-linear": ["--time-map", "linear"],
                   "converted-snr": ["--time-map", "snr"]}


def run(args):
    """HDDM's conversion: flow experts fine-tuned from a public DDPM checkpoint vs from
    scratch, per cluster and seed.

    The source is a DDPM monolith trained on all of digits, treated as a public
    checkpoint: its training is not charged, as HDDM does not charge ImageNet
    pretraining. Each arm trains the flow expert of every cluster for
    --conversion-steps in --curve-points increments, and measures FD against that
    cluster's own images (N = --curve-n, oracle routing to the expert)."""
    root = os.path.join(args.out, "conversion")
    run = os.path.join(root, "run")
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", args.k[0], "--seed", 0, "--run-dir", run)
    source = os.path.join(root, "source-ddpm")
    if not trained_to(source, args.source_steps):
        stage(train_expert, "--cluster", "all", "--objective", "ddpm", "--model", args.model,
              "--steps", args.source_steps,
              "--batch-size", args.batch_size, "--seed", 0, "--run-dir", run, "--out-dir", source)
    rows = []
    for j in range(args.k[0]):
        for seed in args.train_seeds:
            for arm, flags in CONVERSION_ARMS.items():
                folder = os.path.join(root, f"cluster{j}-{arm}-seed{seed}")
                view = link_run(folder + "-view", run, {j: folder})
                init = ["--init", os.path.join(source, "ckpt.pt")] if arm != "scratch" else []
                for i in range(1, args.curve_points + 1):
                    steps = args.conversion_steps * i // args.curve_points
                    if not trained_to(folder, steps):
                        stage(train_expert, "--cluster", j, "--objective", "fm", "--model",
                              args.model, "--steps", steps,
                              "--batch-size", args.batch_size // args.k[0], "--seed", seed,
                              "--run-dir", run, "--out-dir", folder,
                              *init, *flags)
                    out = os.path.join(folder, f"samples-{steps}.npz")
                    if not os.path.isfile(out[:-4] + ".eval.json"):
                        stage(sample, "--run-dir", view, "--experts", j, "--routing", f"oracle:{j}",
                              "--n", args.curve_n, "--seed", 0,
                              "--steps", args.sample_steps, "--out", out)
                    if not measured_as_asked(out, ["--classifier-steps", args.classifier_steps]):
                        measure(run, [out], "--cluster", j, "--classifier-steps",
                                args.classifier_steps)
                    with open(out[:-4] + ".eval.json") as f:
                        fd = json.load(f)["fd_classifier"]
                    loss = [r["loss"] for r in log_of(folder) if r["step"] <= steps][-1]
                    rows.append({"cluster": j, "seed": seed, "arm": arm, "step": steps,
                                 "fd": fd, "loss": loss})
    summary = conversion_summary(rows, args.train_seeds)
    lines = [f"Conversion, digits, K = {args.k[0]}: each cluster's flow expert "
             f"({args.model}, batch {args.batch_size // args.k[0]}) from scratch or "
             "converted from a DDPM monolith trained on all digits for "
             f"{args.source_steps} steps at batch {args.batch_size} (not charged). "
             f"FD-classifier against the cluster's own images, N = {args.curve_n}, "
             f"{args.sample_steps} Euler steps; mean over the {args.k[0]} clusters, then "
             f"mean ± 95 % t-interval over training seeds {args.train_seeds}.", "",
             "| step | " + " | ".join(CONVERSION_ARMS) + " |",
             "|---|" + "---|" * len(CONVERSION_ARMS)]
    for step in sorted({r["step"] for r in rows}):
        cells = [plus_minus(summary[arm][step]["fd_mean"], summary[arm][step]["fd_half"])
                 for arm in CONVERSION_ARMS]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    reached = steps_to_reach(rows, args.conversion_steps)
    lines += ["", "Steps each converted arm needs to reach the scratch run's final FD "
                  "(same cluster and seed; '-' = not within the budget):", ""]
    for arm, found in reached.items():
        lines.append(f"- {arm}: " + ", ".join(f"c{j}/s{seed}: {step if step else '-'}"
                                              for (j, seed), step in sorted(found.items())))
    if args.plots:
        plot_conversion(summary, os.path.join(args.out, "conversion.png"))
        lines += ["", f"Plot: {os.path.join(args.out, 'conversion.png')}"]
    by_arm = {arm: {str(k): v for k, v in by_step.items()} for arm, by_step in summary.items()}
    to_reach = {arm: {f"{j}/{seed}": step for (j, seed), step in found.items()}
                for arm, found in reached.items()}
    return {"rows": rows, "summary": by_arm, "steps_to_reach_scratch_final": to_reach}, lines


def conversion_summary(rows, seeds):
    """{arm: {step: FD mean over clusters, then mean and 95 % interval over seeds}}."""
    out = {}
    for arm in CONVERSION_ARMS:
        out[arm] = {}
        for step in sorted({r["step"] for r in rows}):
            per_seed = [np.mean([r["fd"] for r in rows
                                 if (r["arm"], r["step"], r["seed"]) == (arm, step, seed)])
                        for seed in seeds]
            mean, half = interval(per_seed)
            out[arm][step] = {"fd_mean": mean, "fd_half": half, "per_seed": per_seed}
    return out


def steps_to_reach(rows, final_step):
    """{converted arm: {(cluster, seed): the first measured step whose FD is at most
    scratch's final FD, or None}}."""
    out = {}
    for arm in [a for a in CONVERSION_ARMS if a != "scratch"]:
        out[arm] = {}
        for j, seed in sorted({(r["cluster"], r["seed"]) for r in rows}):
            target = next(r["fd"] for r in rows if (r["arm"], r["cluster"], r["seed"],
                                                    r["step"]) == ("scratch", j, seed, final_step))
            curve = sorted((r["step"], r["fd"]) for r in rows
                           if (r["arm"], r["cluster"], r["seed"]) == (arm, j, seed))
            out[arm][(j, seed)] = next((step for step, fd in curve if fd <= target), None)
    return out


def plot_conversion(summary, path):
    """FD against fine-tuning steps, one line per arm, with 95 % intervals over seeds."""
    with fd_plot(path, "fine-tuning steps",
                 "FD vs the cluster's images (mean over clusters)") as ax:
        for arm, by_step in summary.items():
            steps = sorted(by_step)
            ax.errorbar(steps, [by_step[s]["fd_mean"] for s in steps], capsize=3,
                        marker="o", label=arm,
                        yerr=[0 if np.isnan(by_step[s]["fd_half"]) else by_step[s]["fd_half"]
                              for s in steps])
