"""What routing needs (`--part router-cost`): routers of decreasing cost over one set of
experts, each against today's router, paired by seed.

The experts of --run-dir stay fixed (no expert is trained). For every --router-models
entry and every --seeds seed, a router is trained with the training FLOPs of the run's own
router (a smaller router takes more steps for the same FLOPs), then top-1 samples are drawn
with sampling seed = router seed, so each small router is paired with the reference router
(the first entry) on the same noise and the same seed. An entry MODEL@F reads x_t
average-pooled F x F (train_router.py --downsample F); MODEL:S is trained for S steps
whatever they cost (a reference trained as long as a smaller one). --router-every samples the
reference router held for M solver steps at a time. The posterior's movement is measured
on the reference router's top-1 trajectories: how often the chosen expert changes from one
step to the next, per fifth of t.

Every cost is a count (model.count_flops), never a clock: the router's forward as a share
of one expert's, and top-1's sampling FLOPs per image as a multiple of the monolith's
(one network of the experts' size, run once per step)."""
import json
import os
import shutil

import numpy as np
import torch

import sample
import train_router
from diffusion import T_BIN_NAMES, T_BINS, t_bin
from model import count_flops
from plumbing.checkpoint import load
import routing
from plumbing.command_line import UsageError
from studies.common import (config_of, fd_plot, interval, link_run, sample_and_measure,
                            stage)


def parse_router(spec):
    """'DiT-N/7', 'DiT-N/7@2' (pooled 2x) or 'DiT-M/4:3682' (that many steps, whatever they
    cost) to (model, downsample, steps or None)."""
    spec, _, steps = spec.partition(":")
    model, _, pooled = spec.partition("@")
    return model, int(pooled) if pooled else 1, int(steps) if steps else None


def forward_flops(network, size, channels):
    """Matrix FLOPs of one forward on one image at a mid flow time."""
    x, t = torch.zeros(1, channels, size, size), torch.full((1,), 0.5)
    y = torch.zeros(1, dtype=torch.long) if network.num_classes else None
    return count_flops(lambda: network(x, t, y))


def run(args):
    experts_run = args.run_dir
    reference_router = os.path.join(experts_run, "router", "ckpt.pt")
    experts_dir = os.path.join(experts_run, "experts")
    names = sorted(n for n in os.listdir(experts_dir) if n != "all") \
        if os.path.isdir(experts_dir) else []
    if not names or not os.path.isfile(reference_router):
        raise UsageError(f"--part router-cost needs experts and a router in --run-dir "
                         f"{experts_run} (e.g. a scaling study's x8 experts-b2 folder)")
    train_flops = config_of(os.path.join(experts_run, "router"))["flops"]
    expert = load(os.path.join(experts_dir, names[0], "ckpt.pt"), "dit")
    size, channels = expert.config["image_size"], expert.config["channels"]
    expert_flops = forward_flops(expert.net, size, channels)
    out = os.path.join(args.out, "router-cost")
    # a copy of the run's evaluation folder (its classifier, its reference statistics):
    # every router is judged by the run's judge, and nothing is written into the run
    eval_dir = os.path.join(out, "eval")
    if os.path.isdir(os.path.join(experts_run, "eval")) and not os.path.isdir(eval_dir):
        shutil.copytree(os.path.join(experts_run, "eval"), eval_dir + ".partial",
                        dirs_exist_ok=True)
        os.replace(eval_dir + ".partial", eval_dir)
    top1 = ["--routing", "top1", "--n", args.n, "--steps", args.sample_steps,
            "--solver", args.solver]
    eval_flags = ["--classifier-steps", args.classifier_steps]

    def cell(name, seed):
        folder = link_run(os.path.join(out, f"{name.replace('/', '')}-seed{seed}"),
                          experts_run, {n: os.path.join(experts_dir, n) for n in names})
        if os.path.isdir(eval_dir) and not os.path.lexists(os.path.join(folder, "eval")):
            os.symlink(os.path.abspath(eval_dir), os.path.join(folder, "eval"))
        return folder

    rows = []
    for spec in args.router_models:
        model, pooled, steps = parse_router(spec)
        for seed in args.seeds:
            folder = cell(spec.replace("@", "-pool").replace(":", "-steps"), seed)
            router_flops_train = train_router_matched(folder, model, pooled, seed, train_flops,
                                                      steps)
            router = load(os.path.join(folder, "router", "ckpt.pt"), "router")
            measured = sample_and_measure(folder, os.path.join(folder, "top1.npz"), *top1,
                                          "--seed", seed, eval_flags=eval_flags)
            rows.append(row_of(spec, seed, folder, measured, router,
                               (expert_flops, size, channels), router_flops_train))
    reference = args.router_models[0]
    for every in args.router_every:
        for seed in args.seeds:
            folder = cell(reference.replace("@", "-pool"), seed)
            router = load(os.path.join(folder, "router", "ckpt.pt"), "router")
            measured = sample_and_measure(
                folder, os.path.join(folder, f"top1-every{every}.npz"), *top1, "--seed", seed,
                "--router-every", every, eval_flags=eval_flags)
            rows.append(row_of(f"{reference} every {every} steps", seed, folder, measured,
                               router, (expert_flops, size, channels), None, every))
    movement = posterior_movement(cell(reference.replace("@", "-pool"), args.seeds[0]),
                                  args.n, args.sample_steps, args.seeds[0])
    results = {"run_dir": experts_run, "n": args.n, "sample_steps": args.sample_steps,
               "solver": args.solver, "seeds": args.seeds, "reference": reference,
               "expert_forward_flops": expert_flops, "router_training_flops": train_flops,
               "rows": rows, "posterior_movement": movement}
    lines = table(results)
    if args.monolith_samples:
        with open(args.monolith_samples[:-4] + ".eval.json") as f:
            results["monolith"] = {"samples": args.monolith_samples,
                                   "fd": json.load(f)["fd_classifier"]}
        lines += ["", f"The monolith of equal training FLOPs ({args.monolith_samples}): FD "
                  f"{results['monolith']['fd']:.2f}, at 1.000x by definition."]
    if args.plots:
        plot(results, os.path.join(args.out, "router-cost.png"))
    return results, lines


def train_router_matched(folder, model, pooled, seed, train_flops, steps=None):
    """FOLDER/router as `model` (pooled), trained for `steps`, or for the steps that spend
    `train_flops` (a one-step run measures a step's FLOPs). Returns the FLOPs spent."""
    path = os.path.join(folder, "router", "ckpt.pt")
    flags = ["--model", model, "--downsample", pooled, "--seed", seed, "--run-dir", folder]
    if os.path.isfile(path):
        done = config_of(os.path.join(folder, "router"))
        asked = {"model": model, "downsample": pooled, "seed": seed}
        if done.get("steps", 0) > 1 and all(done["flags"].get(k) == v for k, v in asked.items()) \
                and steps in (None, done["steps"]):
            return done["flops"]
    if steps is not None:
        stage(train_router, *flags, "--steps", steps)
        return config_of(os.path.join(folder, "router"))["flops"]
    # the probe's held-out accuracy is not read: measure it on a handful of images
    stage(train_router, *flags, "--steps", 1, "--val-fraction", 0.002)
    probe = config_of(os.path.join(folder, "router"))
    steps = max(1, round(train_flops * probe["steps"] / probe["flops"]))
    stage(train_router, *flags, "--steps", steps)
    return config_of(os.path.join(folder, "router"))["flops"]


def row_of(name, seed, folder, measured, router, expert, train_flops, every=1):
    """One router's row; expert = (one expert's forward FLOPs, image size, channels)."""
    expert_flops, size, channels = expert
    with open(os.path.join(folder, "top1.json" if every == 1 else
                           f"top1-every{every}.json")) as f:
        drawn = json.load(f)
    router_flops = forward_flops(router.net, size, channels)
    return {"router": name, "seed": seed, "folder": folder,
            "router_share_of_expert": router_flops / expert_flops / every,
            "router_forward_flops": router_flops, "router_every": every,
            "sampling_flops_per_image": drawn["sampling_flops_per_image"],
            "cost_vs_monolith": drawn["cost_vs_one_expert"],
            "router_training_flops": train_flops,
            "router_parameters": sum(p.numel() for p in router.net.parameters()),
            "accuracy_per_t_bin": router.config.get("accuracy", {}).get("with_condition"),
            "fd": measured["fd_classifier"], "kid": measured.get("kid_classifier"),
            "class_accuracy": measured["conditional_accuracy"]}


@torch.no_grad()
def posterior_movement(folder, n, steps, seed):
    """On the reference router's top-1 trajectories: per fifth of t, the share of (image,
    step) pairs whose chosen expert differs from the previous step's, and the mean total
    variation between consecutive posteriors."""
    experts, router, rule, names = sample.setup(folder, "", None, "top1")
    ref = next(iter(experts.values()))
    condition = ref.condition
    trace = []
    route = routing.routing_function(router, condition)

    def recording(x, t, ids):
        logits = route(x, t, ids)
        trace.append((float(t.flatten()[0]), logits.float().softmax(1)))
        return logits
    ensemble = routing.Ensemble(experts, recording, rule, condition, len(names))
    g = torch.Generator().manual_seed(seed)
    ids = condition.requests(n, g)
    noise = torch.randn(n, ref.config["channels"], ref.config["image_size"],
                        ref.config["image_size"], generator=g)
    routing.sample(ensemble, noise, ids, steps)
    switches, variation = np.zeros(T_BINS), np.zeros(T_BINS)
    counts = np.zeros(T_BINS)
    for (_, before), (t, after) in zip(trace, trace[1:]):
        b = int(t_bin(torch.tensor([t]))[0])
        switches[b] += (before.argmax(1) != after.argmax(1)).float().sum().item()
        variation[b] += 0.5 * (before - after).abs().sum(1).sum().item()
        counts[b] += n
    return {"t_bins": T_BIN_NAMES, "steps": steps, "n": n, "seed": seed,
            "switch_share": (switches / np.maximum(counts, 1)).tolist(),
            "total_variation": (variation / np.maximum(counts, 1)).tolist()}


def table(results):
    rows, reference = results["rows"], results["reference"]
    by_name = {}
    for r in rows:
        by_name.setdefault(r["router"], {})[r["seed"]] = r
    base = by_name[reference]
    lines = [f"Routers of decreasing cost over the experts of {results['run_dir']}: top-1, "
             f"N = {results['n']}, {results['sample_steps']} {results['solver']} steps, router "
             f"seeds = sampling seeds {results['seeds']}; every router trained with "
             f"{results['router_training_flops'] / 1e12:.3f} TFLOPs (the run's own router's). "
             f"Delta = router - {reference}, paired by seed, mean +/- 95 % t half-width.", "",
             "| router | forward / expert's | top-1 FLOPs / monolith | accuracy per fifth of t "
             "(t=0 first) | FD | delta FD | class acc. % | delta acc. |",
             "|---|---|---|---|---|---|---|---|"]
    for name, by_seed in by_name.items():
        seeds = sorted(set(by_seed) & set(base))
        fd = [by_seed[s]["fd"] for s in seeds]
        acc = [100 * by_seed[s]["class_accuracy"] for s in seeds]
        d_fd = interval([by_seed[s]["fd"] - base[s]["fd"] for s in seeds])
        d_acc = interval([100 * (by_seed[s]["class_accuracy"] - base[s]["class_accuracy"])
                          for s in seeds])
        first = by_seed[seeds[0]]
        per_bin = first["accuracy_per_t_bin"]
        if per_bin is not None:
            per_bin = np.mean([by_seed[s]["accuracy_per_t_bin"] for s in seeds], axis=0)
        bins = " / ".join(f"{a:.2f}" for a in per_bin) if per_bin is not None else "-"
        delta = "-" if name == reference else f"{d_fd[0]:+.2f} +/- {d_fd[1]:.2f}"
        delta_acc = "-" if name == reference else f"{d_acc[0]:+.2f} +/- {d_acc[1]:.2f}"
        lines.append(f"| {name} | {100 * first['router_share_of_expert']:.2f} % | "
                     f"{first['cost_vs_monolith']:.3f}x | {bins} | {np.mean(fd):.2f} "
                     f"({min(fd):.2f}-{max(fd):.2f}) | {delta} | {np.mean(acc):.1f} | "
                     f"{delta_acc} |")
    move = results["posterior_movement"]
    lines += ["", f"How fast p(k | x_t, t, y) moves along top-1 trajectories ({reference}, seed "
              f"{move['seed']}, N = {move['n']}, {move['steps']} steps): per fifth of t from t=0",
              "",
              "| | " + " | ".join(move["t_bins"]) + " |", "|---" * (T_BINS + 1) + "|",
              "| chosen expert changes, share of steps | "
              + " | ".join(f"{s:.3f}" for s in move["switch_share"]) + " |",
              "| total variation between steps | "
              + " | ".join(f"{s:.3f}" for s in move["total_variation"]) + " |"]
    return lines


def plot(results, path):
    by_name = {}
    for r in results["rows"]:
        by_name.setdefault(r["router"], []).append(r)
    with fd_plot(path, "top-1 sampling FLOPs per image / the monolith's", "FD (classifier)") as ax:
        for name, rows in by_name.items():
            cost = rows[0]["cost_vs_monolith"]
            mean, half = interval([r["fd"] for r in rows])
            ax.errorbar([cost], [mean], yerr=[half if np.isfinite(half) else 0], fmt="o",
                        capsize=3, label=name)
        ax.axvline(1.0, color="grey", linestyle=":", label="the monolith's cost")
        if "monolith" in results:
            ax.axhline(results["monolith"]["fd"], color="black", linestyle="--",
                       label="the monolith's FD")
        ax.legend(fontsize=7)
