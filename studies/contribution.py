"""--part contribution: open contribution measured (routers from the experts' samples,
contributors' own partitions, an expert that joins later), each against the scaling
study's k-means ensemble and monolith.

Per training seed, at one (model, budget) point of the scaling study (its folder is reused):
  samples     the k-means experts routed by a router trained on --sample-budgets samples per expert
              (train_router.py --from-samples N) against one trained on the data, all for the same steps
              (--compare-router-steps; default the FLOP-matched router's): routing accuracy on held-out real
              images per t-bin, with and without the label, and FD and class accuracy of top-1 and full routing;
  contributors  K contributors each holding a group of classes (--contributor-classes), experts trained
              alone at the k-means experts' batch and steps (equal FLOPs), routed from their data;
  join        the first K-1 contributors with their own router; then the last one joins and only the
              router is fine-tuned (--init, --join-share of the router's steps), against the K trained together.
"""
import os
import shutil

import numpy as np
import torch

from diffusion import T_BIN_NAMES
from studies.common import (SCALING_METHODS, check_budgets, config_of, interval, link_run,
                            plus_minus, routed_sample, sample_and_measure, scaling_run, share_eval,
                            stage, trained_to)
import train_expert
import train_router
from plumbing.command_line import UsageError
from plumbing.condition import condition_for_data
from plumbing.data.datasets import load_dataset
from plumbing.ensemble import load_router
from plumbing.sources import load_clusters

ROUTED = ("top-1", "full")


def real_accuracy(run, base, seed):
    """Held-out accuracy per t-bin of RUN's router on real images of BASE's k-means
    clusters (the data router's held-out tenth, so every router is scored on images
    none of them trained on): {with the label, without it (the null)}."""
    clusters = load_clusters(base)
    dataset = load_dataset(clusters["data_spec"], clusters["data"]["shape"][-1])
    order = np.random.default_rng(seed).permutation(len(dataset))
    held_out = np.sort(order[:int(len(dataset) * 0.1)])
    router = load_router(run, None)
    condition = condition_for_data(router.condition.kind, dataset, run)
    given = lambda idx: condition.router_input(condition.ids(idx))
    hidden = lambda idx: condition.router_input(condition.null(len(idx)))
    assign, cpu = clusters["assignments"].numpy(), torch.device("cpu")
    return {"with the label": train_router.accuracy_per_t_bin(
        router.net, dataset, held_out, assign, cpu, given),
            "without it": train_router.accuracy_per_t_bin(
                router.net, dataset, held_out, assign, cpu, hidden)}


def router_done(run, steps, **expect):
    path = os.path.join(run, "router", "ckpt.pt")
    if not os.path.isfile(path):
        return False
    config = config_of(os.path.join(run, "router"))
    return config["steps"] == steps and all(config.get(k) == v for k, v in expect.items())


def measured(args, run, method, data):
    flags = SCALING_METHODS[method]
    judge = ["--classifier-steps", args.classifier_steps, "--data", data]
    return sample_and_measure(run, os.path.join(run, "samples", f"{method}.npz"), *flags,
                              "--n", args.n, "--seed", 0, "--solver", args.solver,
                              "--steps", args.sample_steps, eval_flags=judge)


def contributor_experts(args, model, seed, run, batch, steps):
    """Every contributor's expert, trained alone on their classes into
    RUN/experts/NAME; {name: folder}."""
    experts = {}
    for classes in args.contributor_classes:
        name = f"classes-{classes.replace(',', '')}"
        folder = os.path.join(run, "experts", name)
        if not trained_to(folder, steps):
            stage(train_expert, "--contribution", name, "--classes", classes, "--data", args.data,
                  "--steps", steps, "--batch-size", batch,
                  "--model", model, "--seed", seed, "--run-dir", run)
        experts[name] = folder
    return experts


def measure_seed(args, root, model, seed):
    """The rows of one training seed: every arm's routers and routed samples."""
    k = len(args.contributor_classes)
    budget = args.budgets[0]
    base, flops = scaling_run(args, model, k, budget, seed)
    share_eval(base, root)
    data_router = config_of(os.path.join(base, "router"))
    steps, rows = data_router["steps"], []
    def row(arm, method, r, **extra):
        rows.append({"seed": seed, "arm": arm, "method": method, "fd": r["fd_classifier"],
                     "accuracy": r["conditional_accuracy"], **extra})
    row("monolith", "monolith", routed_sample(args, base, "monolith"))
    for method in ROUTED:
        row("k-means, router from data", method, routed_sample(args, base, method))

    # data against samples: every router of the comparison trained for
    # --compare-router-steps (default: the FLOP-matched router's), the data router in a
    # folder of its own when that differs from the matched one's
    compare = args.compare_router_steps or steps
    tag = "" if compare == steps else f" ({compare} steps)"
    data_run = base
    if compare != steps:
        data_run = base + f"-data{compare}"
        link_run(data_run, base, {j: os.path.join(base, "experts", str(j)) for j in range(k)})
        share_eval(data_run, root)
        if not router_done(data_run, compare, source="data"):
            stage(train_router, "--steps", compare, "--model", args.router_model, "--seed", seed,
                  "--run-dir", data_run)
        for method in ROUTED:
            row(f"k-means, router from data{tag}", method,
                measured(args, data_run, method, args.data))
    routing = {f"data router{tag}": real_accuracy(data_run, base, seed)}
    for n in args.sample_budgets:
        run = base + f"-samples{n}" + (f"-steps{compare}" if compare != steps else "")
        link_run(run, base, {j: os.path.join(base, "experts", str(j)) for j in range(k)})
        share_eval(run, root)
        drawn = router_done(run, compare) and config_of(os.path.join(run, "router"))["source"] != "data" and \
            {key: config_of(os.path.join(run, "router"))["source"][key]
             for key in ("samples_per_expert", "sample_steps")} == \
            {"samples_per_expert": n, "sample_steps": args.sample_steps}
        if not drawn:
            stage(train_router, "--from-samples", n, "--sample-steps", args.sample_steps, "--steps",
                  compare, "--model",
                  args.router_model, "--seed", seed, "--run-dir", run)
        sampled = config_of(os.path.join(run, "router"))
        routing[f"{n} samples per expert{tag}"] = real_accuracy(run, base, seed)
        for method in ROUTED:
            row(f"k-means, router from {n} samples per expert{tag}", method,
                measured(args, run, method, args.data), samples=n,
                sample_flops=sampled["source"]["sample_flops"], router_flops=sampled["flops"])

    # contributors holding class groups: alone, at the k-means experts' batch and steps
    folder = base + "-contributors"
    experts = contributor_experts(args, model, seed, folder, args.batch_size // k,
                                  flops["expert_steps"])
    share_eval(folder, root)
    if not router_done(folder, steps, source="data"):
        stage(train_router, "--steps", steps, "--model", args.router_model, "--seed", seed,
              "--run-dir", folder)
    for method in ROUTED:
        row("contributors, router from data", method, measured(args, folder, method, args.data))

    # the last contributor joins later: the first K-1 with their router, then only the
    # router fine-tuned
    join = base + "-join"
    names = list(experts)
    link_run(join, None, {name: experts[name] for name in names[:-1]})
    share_eval(join, root)
    first = os.path.join(join, "router-before")
    if not os.path.isfile(os.path.join(first, "ckpt.pt")):
        if not router_done(join, steps, source="data", k=k - 1):
            stage(train_router, "--steps", steps, "--model", args.router_model, "--seed", seed,
                  "--run-dir", join)
        shutil.copytree(os.path.join(join, "router"), first + ".tmp", dirs_exist_ok=True)
        os.replace(first + ".tmp", first)
    link_run(join, None, {names[-1]: experts[names[-1]]})
    fine_steps = max(1, round(args.join_share * steps))
    if not router_done(join, fine_steps, source="data", k=k, init="router-before"):
        stage(train_router, "--steps", fine_steps, "--model", args.router_model, "--seed", seed,
              "--run-dir", join, "--init", first)
    joined = config_of(os.path.join(join, "router"))
    expert_flops = config_of(experts[names[-1]])["flops"]
    for method in ROUTED:
        row(f"contributors, {names[-1]} joined later (router fine-tuned)", method,
            measured(args, join, method, args.data),
            router_flops=joined["flops"], router_share_of_expert=joined["flops"] / expert_flops)
    return rows, routing


def check_contributors(args):
    """The contributors' class groups, before any training: two at least (the k-means run
    compared has K = their number), no class held twice (no two experts of a run share
    data), every class one the data set has."""
    groups = [[int(c) for c in group.split(",")] for group in args.contributor_classes]
    if len(groups) < 2:
        raise UsageError("--contributor-classes: give a class group per contributor, two at "
                         f"least, e.g. 0,1,2 3,4,5 6,7 8,9 (got {len(groups)})")
    held = [c for group in groups for c in group]
    twice = sorted({c for c in held if held.count(c) > 1})
    if twice:
        raise UsageError(f"--contributor-classes: class {twice[0]} is in two groups; each "
                         "contributor holds classes of their own")
    classes = load_dataset(args.data).num_classes
    if max(held) >= classes:
        raise UsageError(f"--contributor-classes: class {max(held)} is not one of "
                         f"{args.data}'s, 0..{classes - 1}")


def run(args):
    check_contributors(args)
    check_budgets(args, [len(args.contributor_classes)])
    model = args.models[0]
    rows, routing = [], {}
    for seed in args.train_seeds:
        r, acc = measure_seed(args, args.out, model, seed)
        rows += r
        routing[seed] = acc
    results = {"data": args.data, "model": model, "budget": args.budgets[0], "n": args.n,
               "train_seeds": args.train_seeds,
               "contributor_classes": args.contributor_classes,
               "sample_budgets": args.sample_budgets, "join_share": args.join_share,
               "router_model": args.router_model, "router_share": args.router_share, "rows": rows,
               "routing_accuracy_real": {str(s): a for s, a in routing.items()},
               "t_bins": T_BIN_NAMES}
    return results, report(args, model, rows, routing)


def report(args, model, rows, routing):
    cell = lambda values: plus_minus(*interval(values))
    lines = [f"Open contribution, {args.data}, {model} at budget x{args.budgets[0]:g} of "
             f"the scaling study ({args.monolith_steps} monolith steps per x1, batch "
             f"{args.batch_size}; K = {len(args.contributor_classes)} experts at batch "
             f"{args.batch_size // len(args.contributor_classes)}; router "
             f"{args.router_model}); training seeds {args.train_seeds}; N = {args.n}, "
             f"{args.solver} x {args.sample_steps} steps, sampling seed 0. Mean ± 95 % "
             "t-interval over seeds.", "",
             "| arm | method | FD | class accuracy |", "|---|---|---|---|"]
    arms = list(dict.fromkeys((r["arm"], r["method"]) for r in rows))
    for arm, method in arms:
        sel = [r for r in rows if (r["arm"], r["method"]) == (arm, method)]
        lines.append(f"| {arm} | {method} | {cell([r['fd'] for r in sel])} | "
                     f"{cell([100 * r['accuracy'] for r in sel])} % |")
    shares = [r["router_share_of_expert"] for r in rows if "router_share_of_expert" in r]
    if shares:
        lines += ["", "Join later: the router's fine-tuning cost "
                      f"{100 * np.mean(shares):.1f} % of one expert's training FLOPs "
                      f"(mean over seeds; {args.join_share:.0%} of the router's steps)."]
    lines += ["", "Routing accuracy (top expert = the image's k-means cluster) on the "
                  "held-out tenth of the real images, per flow-time bin, mean ± 95 % "
                  "t-interval over seeds:", "",
              "| router | label | " + " | ".join(T_BIN_NAMES) + " |",
              "|---|---|" + "---|" * len(T_BIN_NAMES)]
    for name, by_label in next(iter(routing.values())).items():
        for label in by_label:
            per_bin = np.array([routing[s][name][label] for s in routing])
            cells = " | ".join(cell(per_bin[:, b]) for b in range(per_bin.shape[1]))
            lines.append(f"| {name} | {label} | {cells} |")
    return lines
