"""Why epsilon-experts lag (`--part epsilon`): flow vs DDPM monoliths of equal size and
budget."""
import os

import cluster
from studies.common import (interval, link_run, log_of, plus_minus, sample_and_measure,
                            share_eval, stage, trained_to)
import train_expert


EPSILON_ARMS = {"fm": ["--objective", "fm"], "ddpm-linear": ["--objective", "ddpm"],
                "ddpm-cosine": ["--objective", "ddpm", "--beta-schedule", "cosine"],
                "ddpm-linear-lr3e-4": ["--objective", "ddpm", "--lr", "3e-4"],
                "ddpm-cosine-ema0.999":
                    ["--objective", "ddpm", "--beta-schedule", "cosine", "--ema-decay", "0.999"],
                # the velocity target with the DDPM network's inputs (x_t rescaled, the
                # SNR-matched step): separates the epsilon target from the input
                # parametrisation
                "fm-ddpm-inputs": ["--objective", "fm", "--time-map", "snr"]}


def run(args):
    """Why do epsilon-experts lag here? Monoliths of equal size and budget: flow vs DDPM
    under schedule, lr and EMA choices.

    Every arm is sampled by the same flow ODE (a DDPM network read as a velocity by
    exact SNR match), so differences are in what training reached, not in the sampler."""
    root = os.path.join(args.out, "epsilon")
    run = os.path.join(root, "run")
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", args.k[0], "--seed", 0, "--run-dir", run)
    rows = []
    for seed in args.train_seeds:
        for arm, flags in EPSILON_ARMS.items():
            folder = os.path.join(root, f"{arm}-seed{seed}")
            if not trained_to(folder, args.monolith_steps):
                stage(train_expert, "--cluster", "all", "--model", args.model, "--steps",
                      args.monolith_steps, "--batch-size",
                      args.batch_size, "--seed", seed, "--run-dir", run,
                      "--out-dir", folder, *flags)
            view = link_run(folder + "-view", run, {"all": folder})
            share_eval(view, root)
            out = os.path.join(folder, "samples.npz")
            r = sample_and_measure(view, out, "--experts", "all", "--n", args.n, "--seed", 0,
                                   "--steps", args.sample_steps,
                                   eval_flags=["--classifier-steps", args.classifier_steps])
            rows.append({"arm": arm, "seed": seed, "fd": r["fd_classifier"],
                         "accuracy": r["conditional_accuracy"],
                         "final_loss": log_of(folder)[-1]["loss"]})
    lines = [f"Epsilon vs flow monoliths, digits: {args.model}, {args.monolith_steps} "
             f"steps at batch {args.batch_size}, training seeds {args.train_seeds}; N = "
             f"{args.n}, {args.sample_steps} Euler steps of the flow ODE for every arm. "
             "Mean ± 95 % t-interval over training seeds.", "",
             "| arm | flags | FD-classifier | class accuracy |", "|---|---|---|---|"]
    for arm, flags in EPSILON_ARMS.items():
        fd, fd_half = interval([r["fd"] for r in rows if r["arm"] == arm])
        acc, acc_half = interval([r["accuracy"] for r in rows if r["arm"] == arm])
        lines.append(f"| {arm} | `{' '.join(flags)}` | {plus_minus(fd, fd_half)} | "
                     f"{plus_minus(acc, acc_half, '.1%')} |")
    return {"rows": rows, "arms": EPSILON_ARMS}, lines
