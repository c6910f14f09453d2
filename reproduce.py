"""Reproduce the seeds' comparisons at small scale: digits, CPU, one fixed seed, one command.

    python reproduce.py                  # about 20 minutes on 2 CPU cores; writes runs/repro/

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

Everything goes through the stage scripts' main() functions with their command-line flags,
so each number here can be re-made by hand. Raw numbers: runs/repro/results.json; the
tables: runs/repro/results.md.
"""
import argparse
import contextlib
import json
import os

import numpy as np
import torch

import cluster
import distill
import eval as evaluate
import sample
import train_expert
import train_router
from data import Parser, UsageError, atomic_json, atomic_path, load_dataset, run_main


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


def conversion_curve(args, root, run_dir, ddpm_checkpoint, expert_steps, common):
    """Cluster 0's flow expert from scratch and converted from a DDPM checkpoint: loss and FD along training."""
    curve = {}
    for name, init in [("scratch", None), ("converted", ddpm_checkpoint)]:
        folder = os.path.join(root, "convert", name)
        view = link_run(os.path.join(root, "convert", f"{name}-run"), run_dir, {0: folder})
        curve[name] = []
        for i in range(1, args.curve_points + 1):
            steps = expert_steps * i // args.curve_points
            stage(train_expert, "--cluster", 0, "--objective", "fm", "--steps", steps, "--run-dir", run_dir, "--out-dir", folder,
                  *common, *(["--init", init] if init else []))
            out = os.path.join(root, "convert", f"{name}-{steps}.npz")
            stage(sample, "--run-dir", view, "--experts", "0", "--routing", "oracle:0", "--n", args.curve_n, "--seed", args.seed,
                  "--out", out)
            fd = measure(run_dir, [out], "--cluster", 0)[0]["fd_classifier"]
            curve[name].append({"step": steps, "loss": log_of(folder)[-1]["loss"], "fd_classifier_vs_cluster0": fd})
    target = curve["scratch"][-1]["fd_classifier_vs_cluster0"]
    reached = next((p["step"] for p in curve["converted"] if p["fd_classifier_vs_cluster0"] <= target), None)
    return {"curve": curve, "scratch_final_fd": target, "converted_steps_to_reach_it": reached}


def matched_expert_steps(monolith_steps, monolith_flops_per_step, router_flops):
    """DDM's FLOP matching: K experts at 1/K of the monolith's batch, for the monolith's FLOPs minus the router's.

    A step's FLOPs scale with the batch, so an expert step costs monolith_flops_per_step / K."""
    return int((monolith_steps * monolith_flops_per_step - router_flops) // monolith_flops_per_step)


def interval(values, level=0.95):
    """(mean, half-width) of a Student-t interval over seeds; the half-width is nan for a single value."""
    from scipy import stats
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    half = stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean()), float(half)


def sample_and_measure(run_dir, path, *flags, eval_flags=()):
    """One sample batch and its metrics; a batch already measured is reused, so a killed study resumes."""
    if not os.path.isfile(path[:-4] + ".eval.json"):
        stage(sample, "--run-dir", run_dir, "--out", path, *flags)
        measure(run_dir, [path], *eval_flags)
    with open(path[:-4] + ".eval.json") as f:
        return json.load(f)


def spread(values):
    """'mean (min-max)' of a metric over seeds."""
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def need_experts(run_dir):
    if not os.path.isdir(os.path.join(run_dir, "experts")) or not os.path.isfile(os.path.join(run_dir, "router", "ckpt.pt")):
        raise UsageError(f"--part guidance/solvers sample the ensemble in --run-dir {run_dir}: run ./ddm pipeline (or the stages) first")


def guidance_part(args):
    """FD and class accuracy of guided ensembles: scale x routing x how the unconditional branch is routed, two seeds."""
    need_experts(args.run_dir)
    out = os.path.join(args.out, "guidance")
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds, "rows": []}
    for routing in ("top1", "top2", "full"):
        for cfg_routing in ("shared", "independent"):
            for scale in (1.5, 2.0, 3.0):
                # under full routing both choices are the same exact guided mixture (tests/test_sample.py), so it is sampled once
                sampled_as = "shared" if routing == "full" else cfg_routing
                runs = [sample_and_measure(args.run_dir, os.path.join(out, f"{routing}-{sampled_as}-{scale}-seed{seed}.npz"),
                                           "--routing", routing, "--cfg-scale", scale, "--cfg-routing", sampled_as,
                                           "--n", args.n, "--seed", seed) for seed in args.seeds]
                results["rows"].append({"routing": routing, "cfg_routing": cfg_routing, "cfg_scale": scale,
                                        "fd": [r["fd_classifier"] for r in runs],
                                        "accuracy": [r["conditional_accuracy"] for r in runs]})
    lines = [f"Guided sampling, {args.run_dir}: N = {args.n} per batch, sampling seeds {args.seeds}, 50 Euler steps. "
             f"FD-classifier and class accuracy: mean over seeds (min-max).", "",
             "| routing | unconditional branch | FD @1.5 | FD @2 | FD @3 | acc @1.5 | acc @2 | acc @3 |", "|---|---|---|---|---|---|---|---|"]
    for i in range(0, len(results["rows"]), 3):
        rows = results["rows"][i:i + 3]
        lines.append(f"| {rows[0]['routing']} | {rows[0]['cfg_routing']} | " + " | ".join(spread(r["fd"]) for r in rows) + " | "
                     + " | ".join(spread([100 * a for a in r["accuracy"]]) for r in rows) + " |")
    return results, lines


def network_calls(sample_file):
    """(expert calls, router calls) per image, from the usage counts sample.py recorded."""
    with open(sample_file[:-4] + ".json") as f:
        record = json.load(f)
    calls = float(np.sum(record["usage_per_t_bin"]["counts"])) / record["n"]
    return calls, (0 if record["routing"].startswith("oracle") or record["experts"] in (["all"], ["distilled"]) else record["network_evaluations"])


def distill_part(args):
    """The ensemble of --run-dir distilled into one model, against the ensemble (top-1, full) and a monolith of the
    experts' + router's training FLOPs: FD, class accuracy, training FLOPs and network calls per image, two sampling seeds."""
    need_experts(args.run_dir)
    experts = {k: torch.load(os.path.join(args.run_dir, "experts", str(k), "ckpt.pt"), weights_only=True)["config"] for k in range(4)}
    router_flops = torch.load(os.path.join(args.run_dir, "router", "ckpt.pt"), weights_only=True)["config"]["flops"]
    ensemble_flops = sum(c["flops"] for c in experts.values()) + router_flops
    flags = experts[0]["flags"]
    per_step = experts[0]["flops_per_step"]   # a monolith step of the same model and batch costs the same as an expert's
    monolith_steps = round(ensemble_flops / per_step)
    stage(train_expert, "--cluster", "all", "--steps", monolith_steps, "--batch-size", flags["batch_size"], "--model", flags["model"],
          "--seed", flags["seed"], "--run-dir", args.run_dir)
    stage(distill, "--run-dir", args.run_dir, "--steps", args.distill_steps)
    student = torch.load(os.path.join(args.run_dir, "experts", "distilled", "ckpt.pt"), weights_only=True)["config"]
    arms = {"ensemble top-1": (["--routing", "top1"], ensemble_flops), "ensemble full": (["--routing", "full"], ensemble_flops),
            "distilled (full teacher)": (["--experts", "distilled"], ensemble_flops + student["distillation_flops"]),
            f"monolith ({monolith_steps} steps)": (["--experts", "all"], monolith_steps * per_step)}
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds, "distill_steps": args.distill_steps,
               "monolith_steps": monolith_steps, "rows": []}
    for name, (flags, flops) in arms.items():
        files = [os.path.join(args.out, "distill", f"{name.split()[0]}-{flags[-1]}-seed{seed}.npz") for seed in args.seeds]
        runs = [sample_and_measure(args.run_dir, f, *flags, "--n", args.n, "--seed", seed) for f, seed in zip(files, args.seeds)]
        expert_calls, router_calls = network_calls(files[0])
        results["rows"].append({"arm": name, "training_flops": flops, "fd": [r["fd_classifier"] for r in runs],
                                "accuracy": [r["conditional_accuracy"] for r in runs], "expert_calls_per_image": expert_calls,
                                "router_calls_per_image": router_calls})
    lines = [f"Distillation, {args.run_dir} (training seed 0): N = {args.n} per batch, sampling seeds {args.seeds}, 50 Euler steps, "
             f"no guidance. FD-classifier and class accuracy: mean over sampling seeds (min-max). The student: "
             f"{args.distill_steps} steps of distill.py's defaults.", "",
             "| model | training TFLOPs | FD | class accuracy (%) | expert calls / image | router calls / image |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['arm']} | {r['training_flops'] / 1e12:.2f} | {spread(r['fd'])} | {spread([100 * a for a in r['accuracy']])} | "
                     f"{r['expert_calls_per_image']:.0f} | {r['router_calls_per_image']:.0f} |")
    return results, lines


def solvers_part(args):
    """FD and class accuracy against network evaluations (NFE), Euler vs Heun, for the monolith, top-1 and full ensembles."""
    need_experts(args.run_dir)
    if not os.path.isfile(os.path.join(args.run_dir, "experts", "all", "ckpt.pt")):
        raise UsageError(f"--part solvers also samples the monolith: train it first (train_expert.py --cluster all, "
                         f"or --part distill, which trains it FLOP-matched) in {args.run_dir}")
    out = os.path.join(args.out, "solvers")
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds, "rows": []}
    models = {"monolith": ["--experts", "all"], "top-1": ["--routing", "top1"], "full": ["--routing", "full"]}
    for name, flags in models.items():
        seeds = args.seeds[:1] if name == "full" else args.seeds   # full routing costs K expert calls per evaluation
        for solver in ("euler", "heun"):
            for nfe in (6, 10, 16, 24, 50):
                steps = nfe // (2 if solver == "heun" else 1)
                runs = [sample_and_measure(args.run_dir, os.path.join(out, f"{name}-{solver}-{nfe}-seed{seed}.npz"), *flags,
                                           "--solver", solver, "--steps", steps, "--n", args.n, "--seed", seed) for seed in seeds]
                results["rows"].append({"model": name, "solver": solver, "nfe": nfe, "steps": steps, "seeds": seeds,
                                        "fd": [r["fd_classifier"] for r in runs], "accuracy": [r["conditional_accuracy"] for r in runs]})
    lines = [f"Solvers, {args.run_dir}: N = {args.n} per batch, sampling seeds {args.seeds} (full routing: {args.seeds[:1]}), "
             f"no guidance. FD-classifier "
             f"(class accuracy %): mean over seeds (min-max). NFE = network evaluations per sample (Heun: 2 per step).", "",
             "| model | solver | NFE 6 | NFE 10 | NFE 16 | NFE 24 | NFE 50 |", "|---|---|---|---|---|---|---|"]
    for i in range(0, len(results["rows"]), 5):
        rows = results["rows"][i:i + 5]
        lines.append(f"| {rows[0]['model']} | {rows[0]['solver']} | " + " | ".join(
            f"{spread(r['fd'])} ({np.mean(r['accuracy']) * 100:.0f})" for r in rows) + " |")
    for name in models:
        reference = np.mean(next(r["fd"] for r in results["rows"] if (r["model"], r["solver"], r["nfe"]) == (name, "euler", 50)))
        good = [r for r in results["rows"] if r["model"] == name and np.mean(r["fd"]) <= 1.05 * reference]
        best = min(good, key=lambda r: (r["nfe"], r["solver"]))
        lines.append(f"\n{name}: the fewest evaluations within 5 % of Euler-50's FD ({reference:.2f}): {best['solver']} at NFE {best['nfe']}")
    return results, lines


def precision_part(args):
    """fp32 vs bf16 training of one DiT-S/2 monolith on digits upscaled to 16 px: two fp32 seeds give the run-to-run spread."""
    root = os.path.join(args.out, "precision")
    stage(cluster, "--k", 2, "--image-size", 16, "--run-dir", root)
    arms = [("fp32", 0), ("fp32", 1), ("bf16", 0)]
    results = {"model": "DiT-S/2", "image_size": 16, "steps": args.precision_steps, "batch_size": 32, "n": args.n, "rows": []}
    for precision, seed in arms:
        folder = os.path.join(root, "experts", f"{precision}-seed{seed}")
        stage(train_expert, "--cluster", "all", "--model", "DiT-S/2", "--batch-size", 32, "--lr", 3e-4, "--steps", args.precision_steps,
              "--precision", precision, "--seed", seed, "--run-dir", root, "--out-dir", folder)
        view = link_run(os.path.join(root, f"view-{precision}-seed{seed}"), root, {"all": folder})
        share_eval(view, root)
        r = sample_and_measure(view, os.path.join(root, f"{precision}-seed{seed}.npz"), "--experts", "all", "--n", args.n,
                               "--steps", 25, "--seed", 0)
        log = log_of(folder)
        results["rows"].append({"precision": precision, "seed": seed, "final_loss": np.mean([line["loss"] for line in log[-4:]]),
                                "images_per_s": np.median([line["images_per_s"] for line in log[1:]]),
                                "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"]})
    lines = [f"Precision: DiT-S/2 monolith on digits at 16x16, batch 32, {args.precision_steps} steps, lr 3e-4; "
             f"N = {args.n}, 25 Euler steps, sampling seed 0. Final loss: mean of the last 4 logged values.", "",
             "| precision | training seed | final loss | FD | class accuracy % | images/s |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['precision']} | {r['seed']} | {r['final_loss']:.4f} | {r['fd']:.2f} | {100 * r['accuracy']:.1f} | {r['images_per_s']:.1f} |")
    return results, lines


def share_eval(run, root):
    """run/eval -> root/eval: one evaluation classifier and one set of reference statistics for every arm of a study."""
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    if not os.path.lexists(os.path.join(run, "eval")):
        os.symlink(os.path.abspath(os.path.join(root, "eval")), os.path.join(run, "eval"))


def trained_to(folder, steps):
    path = os.path.join(folder, "ckpt.pt")
    return os.path.isfile(path) and torch.load(path, weights_only=True)["step"] >= steps


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


def scaling_part(args):
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


CONVERSION_ARMS = {"scratch": [], "converted-linear": ["--time-map", "linear"], "converted-snr": ["--time-map", "snr"]}


def conversion_part(args):
    """HDDM's conversion: flow experts fine-tuned from a public DDPM checkpoint vs from scratch, per cluster and seed.

    The source is a DDPM monolith trained on all of digits, treated as a public checkpoint: its
    training is not charged, as HDDM does not charge ImageNet pretraining. Each arm trains the
    flow expert of every cluster for --conversion-steps in --curve-points increments, and
    measures FD against that cluster's own images (N = --curve-n, oracle routing to the expert).
    """
    root = os.path.join(args.out, "conversion")
    run = os.path.join(root, "run")
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", args.k[0], "--seed", 0, "--run-dir", run)
    source = os.path.join(root, "source-ddpm")
    if not trained_to(source, args.source_steps):
        stage(train_expert, "--cluster", "all", "--objective", "ddpm", "--model", args.model, "--steps", args.source_steps,
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
                        stage(train_expert, "--cluster", j, "--objective", "fm", "--model", args.model, "--steps", steps,
                              "--batch-size", args.batch_size // args.k[0], "--seed", seed, "--run-dir", run, "--out-dir", folder,
                              *init, *flags)
                    out = os.path.join(folder, f"samples-{steps}.npz")
                    if not os.path.isfile(out[:-4] + ".eval.json"):
                        stage(sample, "--run-dir", view, "--experts", j, "--routing", f"oracle:{j}", "--n", args.curve_n, "--seed", 0,
                              "--steps", args.sample_steps, "--out", out)
                        measure(run, [out], "--cluster", j, "--classifier-steps", args.classifier_steps)
                    with open(out[:-4] + ".eval.json") as f:
                        fd = json.load(f)["fd_classifier"]
                    loss = [r["loss"] for r in log_of(folder) if r["step"] <= steps][-1]
                    rows.append({"cluster": j, "seed": seed, "arm": arm, "step": steps, "fd": fd, "loss": loss})
    summary = conversion_summary(rows, args.train_seeds)
    lines = [f"Conversion, digits, K = {args.k[0]}: each cluster's flow expert ({args.model}, batch {args.batch_size // args.k[0]}) "
             f"from scratch or converted from a DDPM monolith trained on all digits for {args.source_steps} steps at batch "
             f"{args.batch_size} (not charged). FD-classifier against the cluster's own images, N = {args.curve_n}, "
             f"{args.sample_steps} Euler steps; mean over the {args.k[0]} clusters, then mean ± 95 % t-interval over training "
             f"seeds {args.train_seeds}.", "",
             "| step | " + " | ".join(CONVERSION_ARMS) + " |", "|---|" + "---|" * len(CONVERSION_ARMS)]
    for step in sorted({r["step"] for r in rows}):
        lines.append(f"| {step} | " + " | ".join(f"{summary[arm][step]['fd_mean']:.2f} ± {summary[arm][step]['fd_half']:.2f}"
                                                 for arm in CONVERSION_ARMS) + " |")
    reached = steps_to_reach(rows, args.conversion_steps)
    lines += ["", "Steps each converted arm needs to reach the scratch run's final FD (same cluster and seed; "
              "'-' = not within the budget):", ""]
    for arm, found in reached.items():
        lines.append(f"- {arm}: " + ", ".join(f"c{j}/s{seed}: {step if step else '-'}" for (j, seed), step in sorted(found.items())))
    if args.plots:
        plot_conversion(summary, os.path.join(args.out, "conversion.png"))
        lines += ["", f"Plot: {os.path.join(args.out, 'conversion.png')}"]
    return {"rows": rows, "summary": {arm: {str(k): v for k, v in by_step.items()} for arm, by_step in summary.items()},
            "steps_to_reach_scratch_final": {arm: {f"{j}/{seed}": step for (j, seed), step in found.items()}
                                             for arm, found in reached.items()}}, lines


def conversion_summary(rows, seeds):
    """{arm: {step: FD mean over clusters, then mean and 95 % interval over seeds}}."""
    out = {}
    for arm in CONVERSION_ARMS:
        out[arm] = {}
        for step in sorted({r["step"] for r in rows}):
            per_seed = [np.mean([r["fd"] for r in rows if (r["arm"], r["step"], r["seed"]) == (arm, step, seed)]) for seed in seeds]
            mean, half = interval(per_seed)
            out[arm][step] = {"fd_mean": mean, "fd_half": half, "per_seed": per_seed}
    return out


def steps_to_reach(rows, final_step):
    """{converted arm: {(cluster, seed): the first measured step whose FD is at most scratch's final FD, or None}}."""
    out = {}
    for arm in [a for a in CONVERSION_ARMS if a != "scratch"]:
        out[arm] = {}
        for j, seed in sorted({(r["cluster"], r["seed"]) for r in rows}):
            target = next(r["fd"] for r in rows if (r["arm"], r["cluster"], r["seed"], r["step"]) == ("scratch", j, seed, final_step))
            curve = sorted((r["step"], r["fd"]) for r in rows if (r["arm"], r["cluster"], r["seed"]) == (arm, j, seed))
            out[arm][(j, seed)] = next((step for step, fd in curve if fd <= target), None)
    return out


def plot_conversion(summary, path):
    """FD against fine-tuning steps, one line per arm, with 95 % intervals over seeds."""
    with fd_plot(path, "fine-tuning steps", "FD vs the cluster's images (mean over clusters)") as ax:
        for arm, by_step in summary.items():
            steps = sorted(by_step)
            ax.errorbar(steps, [by_step[s]["fd_mean"] for s in steps], capsize=3, marker="o", label=arm,
                        yerr=[0 if np.isnan(by_step[s]["fd_half"]) else by_step[s]["fd_half"] for s in steps])


EPSILON_ARMS = {"fm": ["--objective", "fm"], "ddpm-linear": ["--objective", "ddpm"],
                "ddpm-cosine": ["--objective", "ddpm", "--beta-schedule", "cosine"],
                "ddpm-linear-lr3e-4": ["--objective", "ddpm", "--lr", "3e-4"],
                "ddpm-cosine-ema0.999": ["--objective", "ddpm", "--beta-schedule", "cosine", "--ema-decay", "0.999"],
                # the velocity target with the DDPM network's inputs (x_t rescaled, the SNR-matched step): separates the
                # epsilon target from the input parametrisation
                "fm-ddpm-inputs": ["--objective", "fm", "--time-map", "snr"]}


def epsilon_part(args):
    """Why do epsilon-experts lag here? Monoliths of equal size and budget: flow vs DDPM under schedule, lr and EMA choices.

    Every arm is sampled by the same flow ODE (a DDPM network read as a velocity by exact SNR
    match), so differences are in what training reached, not in the sampler."""
    root = os.path.join(args.out, "epsilon")
    run = os.path.join(root, "run")
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", args.k[0], "--seed", 0, "--run-dir", run)
    rows = []
    for seed in args.train_seeds:
        for arm, flags in EPSILON_ARMS.items():
            folder = os.path.join(root, f"{arm}-seed{seed}")
            if not trained_to(folder, args.monolith_steps):
                stage(train_expert, "--cluster", "all", "--model", args.model, "--steps", args.monolith_steps, "--batch-size",
                      args.batch_size, "--seed", seed, "--run-dir", run, "--out-dir", folder, *flags)
            view = link_run(folder + "-view", run, {"all": folder})
            share_eval(view, root)
            out = os.path.join(folder, "samples.npz")
            r = sample_and_measure(view, out, "--experts", "all", "--n", args.n, "--seed", 0, "--steps", args.sample_steps,
                                   eval_flags=["--classifier-steps", args.classifier_steps])
            rows.append({"arm": arm, "seed": seed, "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"],
                         "final_loss": log_of(folder)[-1]["loss"]})
    lines = [f"Epsilon vs flow monoliths, digits: {args.model}, {args.monolith_steps} steps at batch {args.batch_size}, training "
             f"seeds {args.train_seeds}; N = {args.n}, {args.sample_steps} Euler steps of the flow ODE for every arm. "
             f"Mean ± 95 % t-interval over training seeds.", "", "| arm | flags | FD-classifier | class accuracy |", "|---|---|---|---|"]
    for arm, flags in EPSILON_ARMS.items():
        fd, fd_half = interval([r["fd"] for r in rows if r["arm"] == arm])
        acc, acc_half = interval([r["accuracy"] for r in rows if r["arm"] == arm])
        lines.append(f"| {arm} | `{' '.join(flags)}` | {fd:.2f} ± {fd_half:.2f} | {acc:.1%} ± {acc_half:.1%} |")
    return {"rows": rows, "arms": EPSILON_ARMS}, lines


HETEROGENEOUS_ARMS = {"flow": "every expert flow, from scratch (the scaling study's ensemble)",
                      "ddpm+flow": "the first --ddpm-experts experts DDPM, the rest flow from scratch",
                      "ddpm+converted": "the first --ddpm-experts experts DDPM, the rest flow converted from a DDPM monolith "
                                        "of all digits (not charged, as in --part conversion)"}


def heterogeneous_part(args):
    """HDDM's mixed ensembles: a few DDPM (epsilon) experts among flow experts, against all-flow, at equal budget.

    Builds on the scaling study's runs (same folders, so finished ones are reused): their flow
    experts and router are the homogeneous arm. The DDPM experts take the same steps, batch and
    seed as the flow experts they replace; the router is shared, since it never sees an expert."""
    root = os.path.join(args.out, "heterogeneous")
    rows = []
    for model in args.models:
        source = os.path.join(root, f"source-ddpm-{model.replace('/', '')}")
        for k in args.k:
            if not 0 < args.ddpm_experts < k:
                raise UsageError(f"--ddpm-experts {args.ddpm_experts} must leave at least one of the {k} experts flow")
            if args.batch_size % k:
                raise UsageError(f"--batch-size {args.batch_size} must split evenly over {k} experts")
            for budget in args.budgets:
                for seed in args.train_seeds:
                    run, flops = scaling_run(args, model, k, budget, seed)
                    name = os.path.basename(run)
                    # the source sees all data, so the first run's clusters are as good as any for it
                    if "ddpm+converted" in args.arms and not trained_to(source, args.source_steps):
                        stage(train_expert, "--cluster", "all", "--objective", "ddpm", "--model", model, "--steps", args.source_steps,
                              "--batch-size", args.batch_size, "--seed", 0, "--run-dir", run, "--out-dir", source)
                    common = ["--model", model, "--seed", seed, "--run-dir", run, "--steps", flops["expert_steps"],
                              "--batch-size", args.batch_size // k]
                    experts = {arm: {} for arm in HETEROGENEOUS_ARMS if arm == "flow" or arm in args.arms}
                    for j in range(k):
                        flow = experts["flow"][j] = os.path.join(run, "experts", str(j))
                        if j < args.ddpm_experts:
                            folder, flags = os.path.join(root, name, f"ddpm-{j}"), ["--objective", "ddpm"]
                        elif "ddpm+converted" in experts:
                            folder = os.path.join(root, name, f"converted-{j}")
                            flags = ["--objective", "fm", "--init", os.path.join(source, "ckpt.pt"), "--time-map", "snr"]
                        else:
                            folder = None
                        for arm in experts.keys() - {"flow"}:
                            experts[arm][j] = folder if j < args.ddpm_experts or arm == "ddpm+converted" else flow
                        if folder and not trained_to(folder, flops["expert_steps"]):
                            stage(train_expert, "--cluster", j, "--out-dir", folder, *common, *flags)
                    for arm, folders in experts.items():
                        view = run if arm == "flow" else link_run(os.path.join(root, name, arm), run, folders, router_from=run)
                        share_eval(view, os.path.join(args.out, "scaling"))   # the scaling study's classifier: FDs comparable
                        for method in SCALING_METHODS:
                            if method == "monolith" and arm != "flow":
                                continue
                            r = routed_sample(args, view, method)
                            rows.append({"model": model, "k": k, "budget": budget, "seed": seed, "method": method,
                                         "arm": "monolith" if method == "monolith" else arm,
                                         "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"]})
    methods = [m for m in SCALING_METHODS if m != "monolith"]
    lines = [f"Heterogeneous ensembles, digits: {args.ddpm_experts} DDPM experts of K, the rest flow, at the scaling study's FLOP "
             f"match (batch {args.batch_size}/K per expert); flow experts from scratch or converted from a DDPM monolith of all "
             f"digits ({args.source_steps} steps, not charged). Training seeds {args.train_seeds}; N = {args.n}, {args.solver} x "
             f"{args.sample_steps} steps, sampling seed 0. FD-classifier: mean ± 95 % t-interval over training seeds.", "",
             "| model | K | budget | monolith | arm | " + " | ".join(methods) + " |", "|---|---|---|---|---|" + "---|" * len(methods)]
    key = lambda r: (r["model"], r["k"], r["budget"])
    def cell(point, arm, method):
        fd, half = interval([r["fd"] for r in rows if key(r) == point and (r["arm"], r["method"]) == (arm, method)])
        return f"{fd:.2f} ± {half:.2f}"
    for point in sorted({key(r) for r in rows}):
        model, k, budget = point
        for arm in [a for a in HETEROGENEOUS_ARMS if a == "flow" or a in args.arms]:
            label = arm if arm == "flow" else f"{args.ddpm_experts} {arm.replace('+', ' + ')}"
            lines.append(f"| {model} | {k} | x{budget:g} | {cell(point, 'monolith', 'monolith')} | {label} | "
                         + " | ".join(cell(point, arm, m) for m in methods) + " |")
    # the arms share seeds (clusters, router, flow experts), so the per-seed difference is the sharper comparison
    lines += ["", "Paired by training seed: FD of the mixed arm minus FD of the all-flow arm, mean ± 95 % t-interval "
              "(negative: the mixed arm is better).", "", "| model | K | budget | arm | " + " | ".join(methods) + " |",
              "|---|---|---|---|" + "---|" * len(methods)]
    for point in sorted({key(r) for r in rows}):
        model, k, budget = point
        fd = {(r["arm"], r["method"], r["seed"]): r["fd"] for r in rows if key(r) == point}
        for arm in [a for a in HETEROGENEOUS_ARMS if a != "flow" and a in args.arms]:
            cells = []
            for m in methods:
                diff, half = interval([fd[arm, m, seed] - fd["flow", m, seed] for seed in args.train_seeds])
                cells.append(f"{diff:+.2f} ± {half:.2f}")
            lines.append(f"| {model} | {k} | x{budget:g} | {args.ddpm_experts} {arm.replace('+', ' + ')} | " + " | ".join(cells) + " |")
    return {"rows": rows, "arms": HETEROGENEOUS_ARMS, "ddpm_experts": args.ddpm_experts}, lines


def run_part(args):
    """One named study: its raw numbers in OUT/PART.json, its table in OUT/PART.md."""
    if args.part in ("scaling", "conversion") and args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("the plots need matplotlib: pip install -r requirements-repro.txt (or pass --no-plots)")
    results, lines = {"guidance": guidance_part, "distill": distill_part, "solvers": solvers_part,
                      "precision": precision_part, "scaling": scaling_part,
                      "conversion": conversion_part, "epsilon": epsilon_part, "heterogeneous": heterogeneous_part}[args.part](args)
    os.makedirs(args.out, exist_ok=True)
    atomic_json(results, os.path.join(args.out, f"{args.part}.json"))
    with atomic_path(os.path.join(args.out, f"{args.part}.md")) as tmp, open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# the studies that need nothing but digits; guidance, distill and solvers study an existing run (--run-dir)
FULL_PARTS = ["main", "scaling", "conversion", "epsilon", "heterogeneous"]


def main(args):
    if args.full:   # one after another, each resumable: a rerun skips every finished network and measured batch
        for part in FULL_PARTS:
            main(argparse.Namespace(**{**vars(args), "part": part, "full": False}))
        return
    return main_part(args) if args.part == "main" else run_part(args)


def main_part(args):
    """The short default: the comparisons of the module docstring, one seed, into OUT/results.json and results.md."""
    root = args.out
    n, seed, K = args.n, args.seed, 4
    results = {"settings": vars(args)}
    common = ["--seed", seed, "--model", args.model]
    if args.batch_size % K:
        raise UsageError(f"--batch-size {args.batch_size} must split evenly over {K} experts")
    expert_batch = args.batch_size // K

    # --- 1. FLOP-matched ------------------------------------------------------------------------------
    A = os.path.join(root, "kmeans")
    stage(cluster, "--k", K, "--seed", seed, "--run-dir", A)
    stage(train_router, "--seed", seed, "--run-dir", A)
    router_flops = torch.load(os.path.join(A, "router", "ckpt.pt"), weights_only=True)["config"]["flops"]
    stage(train_expert, "--cluster", "all", "--steps", args.monolith_steps, "--batch-size", args.batch_size, "--run-dir", A, *common)
    monolith_per_step = torch.load(os.path.join(A, "experts", "all", "ckpt.pt"), weights_only=True)["config"]["flops_per_step"]
    per_step = monolith_per_step / K      # every FLOP of a step scales with the batch
    expert_steps = matched_expert_steps(args.monolith_steps, monolith_per_step, router_flops)
    if expert_steps < 1:
        raise UsageError(f"--monolith-steps {args.monolith_steps} buys less than the router's FLOPs; give the monolith more steps")
    common += ["--batch-size", expert_batch]
    for k in range(K):
        stage(train_expert, "--cluster", k, "--objective", "fm", "--steps", expert_steps, "--run-dir", A, *common)
    # the budget assumed FLOPs linear in the batch; what is reported is what the experts counted
    per_step = torch.load(os.path.join(A, "experts", "0", "ckpt.pt"), weights_only=True)["config"]["flops_per_step"]
    flops = {"monolith": args.monolith_steps * monolith_per_step, "experts": K * expert_steps * per_step, "router": router_flops}
    results["flops"] = {**flops, "expert_steps": expert_steps, "monolith_steps": args.monolith_steps,
                        "monolith_batch": args.batch_size, "expert_batch": expert_batch}
    print(f"FLOP budget: monolith {flops['monolith'] / 1e12:.2f} TFLOPs ({args.monolith_steps} steps at batch {args.batch_size}); "
          f"DDM {K} experts x {expert_steps} steps at batch {expert_batch} + router = {(flops['experts'] + flops['router']) / 1e12:.2f} TFLOPs")

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
    owner = [int(np.bincount(clusters["assignments"].numpy()[labels == c], minlength=K).argmax()) for c in range(10)]
    parts = [draw(f"oracle-part-{c}", A, "--class", c, "--routing", f"oracle:{owner[c]}") for c in range(10)]
    files["ddm-oracle"] = os.path.join(samples, "ddm-oracle.npz")
    per_class = -(-n // 10)
    with atomic_path(files["ddm-oracle"]) as tmp:
        loaded = [np.load(p) for p in parts]
        np.savez(tmp, arr_0=np.concatenate([b["arr_0"][:per_class] for b in loaded])[:n],
                 arr_1=np.concatenate([b["arr_1"][:per_class] for b in loaded])[:n])
    for p in parts:
        del files[os.path.basename(p)[:-4]]
    results["oracle_owner_of_class"] = owner

    # --- 4 (part). a label-blind router with the same experts ---------------------------------------------
    blind = link_run(os.path.join(root, "blind-router"), A, {k: os.path.join(A, "experts", str(k)) for k in range(K)})
    stage(train_router, "--seed", seed, "--run-dir", blind, "--condition", "none")
    draw("ddm-top1-label-blind-router", blind, "--routing", "top1")

    # --- 2. heterogeneous ------------------------------------------------------------------------------
    ddpm_dirs = {k: os.path.join(root, "ddpm", str(k)) for k in (0, 1)}
    for k, folder in ddpm_dirs.items():
        stage(train_expert, "--cluster", k, "--objective", "ddpm", "--steps", expert_steps, "--run-dir", A, "--out-dir", folder, *common)
    het = link_run(os.path.join(root, "hetero"), A, {**ddpm_dirs, **{k: os.path.join(A, "experts", str(k)) for k in (2, 3)}}, router_from=A)
    draw("hetero-2ddpm-2fm-top1", het, "--routing", "top1")
    draw("hetero-2ddpm-2fm-full", het, "--routing", "full")

    # --- 5. clustering vs a random partition ---------------------------------------------------------------
    R = os.path.join(root, "random")
    stage(cluster, "--k", K, "--seed", seed, "--run-dir", R, "--partition", "random")
    stage(train_router, "--seed", seed, "--run-dir", R)
    for k in range(K):
        stage(train_expert, "--cluster", k, "--objective", "fm", "--steps", expert_steps, "--run-dir", R, *common)
    draw("random-partition-top1", R, "--routing", "top1")
    draw("random-partition-full", R, "--routing", "full")

    results["samples"] = {name: row for name, row in zip(files, measure(A, list(files.values())))}

    # --- 3. conversion ------------------------------------------------------------------------------------
    results["conversion"] = conversion_curve(args, root, A, os.path.join(ddpm_dirs[1], "ckpt.pt"), expert_steps, common)

    # --- 4. router accuracy --------------------------------------------------------------------------------
    aware = torch.load(os.path.join(A, "router", "ckpt.pt"), weights_only=True)["config"]
    blind_cfg = torch.load(os.path.join(blind, "router", "ckpt.pt"), weights_only=True)["config"]
    results["router"] = {"t_bins": aware["t_bins"], "label_aware_with_label": aware["accuracy"]["with_condition"],
                         "label_aware_without_label": aware["accuracy"]["without_condition"],
                         "label_blind": blind_cfg["accuracy"]["without_condition"]}

    atomic_json(results, os.path.join(root, "results.json"))
    table = report(results)
    with atomic_path(os.path.join(root, "results.md")) as tmp, open(tmp, "w") as f:
        f.write(table)
    print(table)


def report(results):
    fmt = lambda v, f: "-" if v is None else f.format(v)
    lines = [f"FLOPs: monolith {results['flops']['monolith'] / 1e12:.2f} T ({results['flops']['monolith_steps']} steps at batch "
             f"{results['flops']['monolith_batch']}); DDM 4 experts x {results['flops']['expert_steps']} steps at batch "
             f"{results['flops']['expert_batch']} + router = "
             f"{(results['flops']['experts'] + results['flops']['router']) / 1e12:.2f} T. "
             f"N = {results['settings']['n']} samples each, 50 Euler steps, no guidance.", "",
             "| samples | FD-classifier | class accuracy | precision | recall | diversity | experts used (%) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["samples"].items():
        lines.append(f"| {name} | {r['fd_classifier']:.2f} | {fmt(r.get('conditional_accuracy'), '{:.1%}')} | {r['precision']:.2f} | "
                     f"{r['recall']:.2f} | {r['diversity']:.2f} | {(r.get('routing') or {}).get('expert_share_percent') or '-'} |")
    c = results["conversion"]
    lines += ["", "Conversion (cluster 0; FD against cluster 0's own images):", "",
              "| step | loss scratch | loss converted | FD scratch | FD converted |", "|---|---|---|---|---|"]
    for s, v in zip(c["curve"]["scratch"], c["curve"]["converted"]):
        lines.append(f"| {s['step']} | {s['loss']:.4f} | {v['loss']:.4f} | {s['fd_classifier_vs_cluster0']:.2f} | {v['fd_classifier_vs_cluster0']:.2f} |")
    lines += ["", f"Converted run reaches the scratch run's final FD ({c['scratch_final_fd']:.2f}) at step "
                  f"{c['converted_steps_to_reach_it'] if c['converted_steps_to_reach_it'] is not None else 'never (within the budget)'}.",
              "", "Router accuracy (held out) per t-bin:", "", "| t | label-aware, with label | label-aware, label hidden | label-blind |",
              "|---|---|---|---|"]
    r = results["router"]
    for i, b in enumerate(r["t_bins"]):
        lines.append(f"| {b} | {r['label_aware_with_label'][i]:.3f} | {r['label_aware_without_label'][i]:.3f} | {r['label_blind'][i]:.3f} |")
    return "\n".join(lines) + "\n"


def build_parser():
    p = Parser(prog="reproduce.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/repro", help="where every run, sample batch and result goes")
    p.add_argument("--monolith-steps", type=int, default=2000, help="the monolith's steps; experts get the same FLOPs in total")
    p.add_argument("--batch-size", type=int, default=64, help="the monolith's batch; each of the 4 experts trains at a quarter of it")
    p.add_argument("--model", default="DiT-T/2")
    p.add_argument("--n", type=int, default=500, help="samples per comparison (FDs are comparable only at equal N)")
    p.add_argument("--curve-points", type=int, default=5, help="evaluations along the conversion runs")
    p.add_argument("--curve-n", type=int, default=200, help="samples per conversion evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--part", default="main", choices=["main", "guidance", "distill", "solvers", "precision", "scaling", "conversion", "epsilon",
                                                 "heterogeneous"],
                   help="main: the comparisons above; guidance: FD of guided ensembles (top-1/top-2/full x shared/independent "
                        "unconditional routing x scales 1.5, 2, 3) on the experts of --run-dir; distill: distill.py's student "
                        "of --run-dir's ensemble against that ensemble and a monolith of equal training FLOPs; solvers: "
                        "FD against network evaluations for Euler and Heun (monolith, top-1, full); precision: fp32 vs bf16 "
                        "training of a DiT-S/2 on 16-px digits; scaling: FD against training FLOPs, monolith vs ensemble, "
                        "--budgets x --models x --train-seeds, with 95 %% intervals and a plot; conversion: flow experts converted "
                        "from a DDPM monolith of all digits (time maps linear and snr) vs from scratch, per cluster and seed; "
                        "epsilon: flow vs DDPM monoliths (beta schedule, lr, EMA) at --monolith-steps, --batch-size, --n; "
                        "heterogeneous: --ddpm-experts DDPM experts among flow ones (from scratch or converted) against the "
                        "scaling study's all-flow ensembles, at every --models x --k x --budgets x --train-seeds point")
    p.add_argument("--full", action="store_true", help=f"run the parts {', '.join(FULL_PARTS)} in turn (hours on 2 CPU cores; resumable)")
    p.add_argument("--run-dir", default="runs", help="--part guidance/distill/solvers: the run whose experts and router are used")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="--part guidance/distill/solvers: sampling seeds")
    p.add_argument("--distill-steps", type=int, default=1000, help="--part distill: the student's steps")
    p.add_argument("--precision-steps", type=int, default=300, help="--part precision: training steps per run")
    g = p.add_argument_group("--part scaling")
    g.add_argument("--budgets", type=float, nargs="+", default=[0.5, 1, 2, 4], help="multiples of --monolith-steps")
    g.add_argument("--k", type=int, nargs="+", default=[4], help="clusters (experts); several for the K sweep, e.g. --k 2 4 8 --budgets 1")
    g.add_argument("--models", nargs="+", default=["DiT-T/2", "DiT-M/2"])
    g.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    g.add_argument("--router-steps", type=int, default=500, help="the router's steps at budget x1, scaled with the budget")
    g.add_argument("--classifier-steps", type=int, default=1500, help="the evaluation classifier's training steps (eval.py's default)")
    g.add_argument("--solver", default="euler", choices=["euler", "heun"])
    g.add_argument("--sample-steps", type=int, default=16,
                   help="solver steps per sample (heun: 2 network evaluations each); 16 Euler steps cost a third of the default 50 "
                        "and raise FD by 7-16 %% (docs/solvers.md), least for the full ensemble")
    g.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write the PNG plot (needs matplotlib: pip install -r requirements-repro.txt)")
    g = p.add_argument_group("--part conversion (also uses --model, --batch-size (/K per expert), --train-seeds, --curve-points, "
                             "--curve-n, --sample-steps, --classifier-steps and the first --k)")
    g.add_argument("--source-steps", type=int, default=2000, help="the DDPM source monolith's steps (a public checkpoint: not charged)")
    g.add_argument("--conversion-steps", type=int, default=1000, help="each flow expert's fine-tuning steps")
    g = p.add_argument_group("--part heterogeneous (also uses the scaling flags and --source-steps)")
    g.add_argument("--ddpm-experts", type=int, default=2, help="how many of the K experts are DDPM (HDDM: 2 of 8)")
    g.add_argument("--arms", nargs="+", default=["ddpm+flow", "ddpm+converted"], choices=["ddpm+flow", "ddpm+converted"],
                   help="the mixed arms to build beside the all-flow one (ddpm+converted trains K - --ddpm-experts more experts)")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
