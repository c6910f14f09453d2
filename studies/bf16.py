"""Training precision (`--part precision`): fp32 vs bf16 autocast for one monolith
(DiT-S/2 by default) on digits at 16 px."""
import os

import numpy as np

import cluster
from studies.common import link_run, log_of, sample_and_measure, share_eval, stage
import train_expert


def run(args):
    """fp32 vs bf16 training of one monolith on digits upscaled to 16 px: two fp32
    seeds give the run-to-run spread."""
    root = os.path.join(args.out, "precision")
    stage(cluster, "--k", 2, "--image-size", 16, "--run-dir", root)
    arms = [("fp32", 0), ("fp32", 1), ("bf16", 0)]
    results = {"model": args.precision_model, "image_size": 16, "steps": args.precision_steps,
               "batch_size": 32, "n": args.n, "rows": []}
    for precision, seed in arms:
        folder = os.path.join(root, "experts", f"{precision}-seed{seed}")
        stage(train_expert, "--cluster", "all", "--model", args.precision_model, "--batch-size", 32,
              "--lr", 3e-4, "--steps", args.precision_steps,
              "--precision", precision, "--seed", seed, "--run-dir", root, "--out-dir", folder)
        view = link_run(os.path.join(root, f"view-{precision}-seed{seed}"), root, {"all": folder})
        share_eval(view, root)
        r = sample_and_measure(view, os.path.join(root, f"{precision}-seed{seed}.npz"), "--experts",
                               "all", "--n", args.n,
                               "--steps", 25, "--seed", 0,
                               eval_flags=["--classifier-steps", args.classifier_steps])
        log = log_of(folder)
        # the first logged interval holds the warm-up; a run that logged once has no timed one
        timed = [line["images_per_s"] for line in log[1:]]
        results["rows"].append({"precision": precision, "seed": seed,
                                "final_loss": np.mean([line["loss"] for line in log[-4:]]),
                                "images_per_s": float(np.median(timed)) if timed else None,
                                "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"]})
    lines = [f"Precision: {args.precision_model} monolith on digits at 16x16, batch 32, "
             f"{args.precision_steps} steps, lr 3e-4; N = {args.n}, 25 Euler steps, "
             "sampling seed 0. Final loss: mean of the last 4 logged values.", "",
             "| precision | training seed | final loss | FD | class accuracy % | "
             "images/s |",
             "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        speed = "-" if r["images_per_s"] is None else f"{r['images_per_s']:.1f}"
        lines.append(f"| {r['precision']} | {r['seed']} | {r['final_loss']:.4f} | "
                     f"{r['fd']:.2f} | {100 * r['accuracy']:.1f} | {speed} |")
    return results, lines
