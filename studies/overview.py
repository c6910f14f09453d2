"""The short default (`--part main`): every comparison of the papers once, at one seed, on
digits.

1. FLOP-matched, as DDM does it: the global batch is split evenly over the experts, so a
   monolith at batch B and K=4 experts at batch B/K take the same optimizer steps for the
   same FLOPs; the router's FLOPs are counted on the DDM side (the experts get that many
   fewer steps).
   Same sampler for both; routing top-1, top-2, full, threshold, and an oracle that sends each
   requested class to the expert whose cluster holds most of that class.
2. Heterogeneous: 2 DDPM + 2 flow experts vs 4 flow experts, same budget, same router.
3. Conversion: a flow expert for cluster 0 started by convert_ddpm_to_fm from the DDPM
   expert of cluster 1 (a network trained on *other* data, like HDDM's ImageNet start) vs one
   from scratch: loss and FD (against cluster 0's own images) along training.
4. Router: held-out accuracy per t-bin, with and without the class label, and what a
   label-blind router does to class-conditional sampling.
5. Clustering: K=4 k-means clusters vs a random partition of equal sizes.

Raw numbers: OUT/results.json; the tables: OUT/results.md.
"""
import os

import numpy as np
import torch

import cluster
import sample
from studies.common import (config_of, link_run, log_of, matched_expert_steps, measure,
                            stage)
import train_expert
import train_router
from plumbing.command_line import UsageError
from plumbing.data.datasets import load_dataset
from plumbing.run_dir import atomic_json, atomic_path

# The router every figure of this study in the README and docs/ was measured with, named
# here since train_router.py's default became a size rule (a smaller router for these experts)
ROUTER = ("--model", "DiT-M/2")


def run(args):
    """The short default: the comparisons of the module docstring, one seed, into
    OUT/results.json and results.md."""
    root = args.out
    n, seed, K = args.n, args.seed, 4
    results = {"settings": vars(args)}
    common = ["--seed", seed, "--model", args.model]
    if args.batch_size % K:
        raise UsageError(f"--batch-size {args.batch_size} must split evenly over {K} experts")

    # --- 1. FLOP-matched -------------------------------------------------------------------------
    A = os.path.join(root, "kmeans")
    expert_steps, results["flops"], common = flop_matched(args, A, common, K)

    samples = os.path.join(root, "samples")
    files = {}
    def draw(name, run_dir, *argv):
        files[name] = os.path.join(samples, f"{name}.npz")
        stage(sample, "--run-dir", run_dir, "--n", n, "--seed", seed, "--out", files[name], *argv)
        return files[name]

    draw("monolith", A, "--experts", "all")
    for routing in ["top1", "top2", "full", "threshold:0.2"]:
        draw(f"ddm-{routing.replace(':', '-')}", A, "--routing", routing)
    # oracle: each class from the expert whose cluster holds most of it
    clusters = torch.load(os.path.join(A, "clusters.pt"), weights_only=True)
    labels = load_dataset("digits").labels
    owner = [int(np.bincount(clusters["assignments"].numpy()[labels == c], minlength=K).argmax())
             for c in range(10)]
    parts = [draw(f"oracle-part-{c}", A, "--class", c, "--routing", f"oracle:{owner[c]}")
             for c in range(10)]
    files["ddm-oracle"] = os.path.join(samples, "ddm-oracle.npz")
    per_class = -(-n // 10)
    with atomic_path(files["ddm-oracle"]) as tmp:
        loaded = [np.load(p) for p in parts]
        np.savez(tmp, arr_0=np.concatenate([b["arr_0"][:per_class] for b in loaded])[:n],
                 arr_1=np.concatenate([b["arr_1"][:per_class] for b in loaded])[:n])
    for p in parts:
        del files[os.path.basename(p)[:-4]]
    results["oracle_owner_of_class"] = owner

    # --- 4 (part). a label-blind router with the same experts ------------------------------------
    blind = link_run(os.path.join(root, "blind-router"), A,
                     {k: os.path.join(A, "experts", str(k)) for k in range(K)})
    stage(train_router, "--seed", seed, "--run-dir", blind, "--condition", "none", *ROUTER)
    draw("ddm-top1-label-blind-router", blind, "--routing", "top1")

    # --- 2. heterogeneous ------------------------------------------------------------------------
    ddpm_dirs = {k: os.path.join(root, "ddpm", str(k)) for k in (0, 1)}
    for k, folder in ddpm_dirs.items():
        stage(train_expert, "--cluster", k, "--objective", "ddpm", "--steps", expert_steps,
              "--run-dir", A, "--out-dir", folder, *common)
    flow_dirs = {k: os.path.join(A, "experts", str(k)) for k in (2, 3)}
    het = link_run(os.path.join(root, "hetero"), A, {**ddpm_dirs, **flow_dirs}, router_from=A)
    draw("hetero-2ddpm-2fm-top1", het, "--routing", "top1")
    draw("hetero-2ddpm-2fm-full", het, "--routing", "full")

    # --- 5. clustering vs a random partition -----------------------------------------------------
    R = os.path.join(root, "random")
    stage(cluster, "--k", K, "--seed", seed, "--run-dir", R, "--clustering", "random")
    stage(train_router, "--seed", seed, "--run-dir", R, *ROUTER)
    for k in range(K):
        stage(train_expert, "--cluster", k, "--objective", "fm", "--steps", expert_steps,
              "--run-dir", R, *common)
    draw("random-partition-top1", R, "--routing", "top1")
    draw("random-partition-full", R, "--routing", "full")

    results["samples"] = {name: row for name, row in zip(files, measure(A, list(files.values())))}

    # --- 3. conversion ---------------------------------------------------------------------------
    results["conversion"] = conversion_curve(
        args, root, A, os.path.join(ddpm_dirs[1], "ckpt.pt"), expert_steps, common)

    # --- 4. router accuracy ----------------------------------------------------------------------
    aware = torch.load(os.path.join(A, "router", "ckpt.pt"), weights_only=True)["config"]
    blind_cfg = torch.load(os.path.join(blind, "router", "ckpt.pt"), weights_only=True)["config"]
    results["router"] = {"t_bins": aware["t_bins"],
                         "label_aware_with_label": aware["accuracy"]["with_condition"],
                         "label_aware_without_label": aware["accuracy"]["without_condition"],
                         "label_blind": blind_cfg["accuracy"]["without_condition"]}

    atomic_json(results, os.path.join(root, "results.json"))
    table = report(results)
    with atomic_path(os.path.join(root, "results.md")) as tmp, open(tmp, "w") as f:
        f.write(table)
    print(table)


def flop_matched(args, A, common, K):
    """The monolith and DDM's K experts of run A at equal training FLOPs (router
    included): returns the experts' steps, the accounting and the experts' flags."""
    expert_batch = args.batch_size // K
    stage(cluster, "--k", K, "--seed", args.seed, "--run-dir", A)
    stage(train_router, "--seed", args.seed, "--run-dir", A, *ROUTER)
    router_flops = config_of(os.path.join(A, "router"))["flops"]
    stage(train_expert, "--cluster", "all", "--steps", args.monolith_steps, "--batch-size",
          args.batch_size, "--run-dir", A, *common)
    monolith_per_step = config_of(os.path.join(A, "experts", "all"))["flops_per_step"]
    expert_steps = matched_expert_steps(args.monolith_steps, monolith_per_step, router_flops)
    if expert_steps < 1:
        raise UsageError(f"--monolith-steps {args.monolith_steps} buys less than the "
                         "router's FLOPs; give the monolith more steps")
    common = [*common, "--batch-size", expert_batch]
    for k in range(K):
        stage(train_expert, "--cluster", k, "--objective", "fm", "--steps", expert_steps,
              "--run-dir", A, *common)
    # the budget assumed FLOPs linear in the batch; what is reported is what the experts
    # counted
    per_step = config_of(os.path.join(A, "experts", "0"))["flops_per_step"]
    flops = {"monolith": args.monolith_steps * monolith_per_step,
             "experts": K * expert_steps * per_step, "router": router_flops}
    accounting = {**flops, "expert_steps": expert_steps, "monolith_steps": args.monolith_steps,
                  "monolith_batch": args.batch_size, "expert_batch": expert_batch}
    print(f"FLOP budget: monolith {flops['monolith'] / 1e12:.2f} TFLOPs "
          f"({args.monolith_steps} steps at batch {args.batch_size}); DDM {K} experts x "
          f"{expert_steps} steps at batch {expert_batch} + router = "
          f"{(flops['experts'] + flops['router']) / 1e12:.2f} TFLOPs")
    return expert_steps, accounting, common


def conversion_curve(args, root, run_dir, ddpm_checkpoint, expert_steps, common):
    """Cluster 0's flow expert from scratch and converted from a DDPM checkpoint: loss
    and FD along training."""
    curve = {}
    for name, init in [("scratch", None), ("converted", ddpm_checkpoint)]:
        folder = os.path.join(root, "convert", name)
        view = link_run(os.path.join(root, "convert", f"{name}-run"), run_dir, {0: folder})
        curve[name] = []
        for i in range(1, args.curve_points + 1):
            steps = expert_steps * i // args.curve_points
            stage(train_expert, "--cluster", 0, "--objective", "fm", "--steps", steps, "--run-dir",
                  run_dir, "--out-dir", folder,
                  *common, *(["--init", init] if init else []))
            out = os.path.join(root, "convert", f"{name}-{steps}.npz")
            stage(sample, "--run-dir", view, "--experts", "0", "--routing", "oracle:0", "--n",
                  args.curve_n, "--seed", args.seed,
                  "--out", out)
            fd = measure(run_dir, [out], "--cluster", 0)[0]["fd_classifier"]
            curve[name].append({"step": steps, "loss": log_of(folder)[-1]["loss"],
                                "fd_classifier_vs_cluster0": fd})
    target = curve["scratch"][-1]["fd_classifier_vs_cluster0"]
    reached = next((p["step"] for p in curve["converted"]
                    if p["fd_classifier_vs_cluster0"] <= target), None)
    return {"curve": curve, "scratch_final_fd": target, "converted_steps_to_reach_it": reached}


def report(results):
    fmt = lambda v, f: "-" if v is None else f.format(v)
    lines = [f"FLOPs: monolith {results['flops']['monolith'] / 1e12:.2f} T "
             f"({results['flops']['monolith_steps']} steps at batch "
             f"{results['flops']['monolith_batch']}); DDM 4 experts x "
             f"{results['flops']['expert_steps']} steps at batch "
             f"{results['flops']['expert_batch']} + router = "
             f"{(results['flops']['experts'] + results['flops']['router']) / 1e12:.2f} "
             f"T. N = {results['settings']['n']} samples each, 50 Euler steps, no "
             "guidance.", "",
             "| samples | FD-classifier | class accuracy | precision | recall | "
             "diversity | experts used (%) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["samples"].items():
        lines.append(f"| {name} | {r['fd_classifier']:.2f} | "
                     f"{fmt(r.get('conditional_accuracy'), '{:.1%}')} | "
                     f"{r['precision']:.2f} | {r['recall']:.2f} | {fmt(r['diversity'], '{:.2f}')} | "
                     f"{(r.get('routing') or {}).get('expert_share_percent') or '-'} |")
    c = results["conversion"]
    lines += ["", "Conversion (cluster 0; FD against cluster 0's own images):", "",
              "| step | loss scratch | loss converted | FD scratch | FD converted |",
              "|---|---|---|---|---|"]
    for s, v in zip(c["curve"]["scratch"], c["curve"]["converted"]):
        lines.append(f"| {s['step']} | {s['loss']:.4f} | {v['loss']:.4f} | "
                     f"{s['fd_classifier_vs_cluster0']:.2f} | "
                     f"{v['fd_classifier_vs_cluster0']:.2f} |")
    reached = c["converted_steps_to_reach_it"]
    lines += ["", "Converted run reaches the scratch run's final FD "
                  f"({c['scratch_final_fd']:.2f}) at step "
                  f"{reached if reached is not None else 'never (within the budget)'}.",
              "", "Router accuracy (held out) per t-bin:", "",
              "| t | label-aware, with label | label-aware, label hidden | label-blind |",
              "|---|---|---|---|"]
    r = results["router"]
    for i, b in enumerate(r["t_bins"]):
        lines.append(f"| {b} | {r['label_aware_with_label'][i]:.3f} | "
                     f"{r['label_aware_without_label'][i]:.3f} | "
                     f"{r['label_blind'][i]:.3f} |")
    return "\n".join(lines) + "\n"
