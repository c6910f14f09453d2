"""FD against training FLOPs (`--part scaling`): monolith vs the FLOP-matched ensemble
(top-1, top-2, full) over data sets x model sizes x K x budgets x training seeds, with 95
% intervals and a plot.

Several --k make it the K sweep. --splits adds arms that test why the ensemble wins or
loses: DDM's split (experts at batch B/K), equal batch (experts at batch B for 1/K of the
steps, the same FLOPs) and a random partition; --router-share holds the router at one
share of every budget; --until-plateau keeps doubling the budget until the monolith's FD
has stopped improving (plateau_budget), the regime DDM's claim is about.

The strongest baseline. DDM's protocol gives each expert the monolith's steps at 1/K of its batch: equal FLOPs,
but K times the monolith's optimizer updates. --monolith-batches trains the monolith at other batches for the
steps that spend the same FLOPs (B/K for K x S steps makes as many updates as the experts together),
--expert-batches gives the experts the same sweep, and --lr-schedules trains every such arm with a constant
learning rate and with warmup-stable-decay (train_expert.py --lr-schedule wsd). Each point then reports every arm's
FLOPs, updates, images seen and sampling FLOPs per image (router included), the best monolith at that point, every
arm's FD minus it paired by seed, and the monolith sampled with as many FLOPs per image as top-1 routing spends."""
import os

import numpy as np
import torch

import distill
from studies.common import (CONSTANT, SCALING_ARMS, SCALING_METHODS, arm_name, arm_run,
                            check_budgets, fd_plot, interval, plateau_budget, plus_minus,
                            routed_sample, sample_and_measure, sampling_flops,
                            scaling_run, share_eval, stage, trained)
from plumbing.command_line import UsageError
from plumbing.run_dir import atomic_path


# what a point's entry averages over its seeds, where every row has it
MEAN_KEYS = ("fd", "accuracy", "flops", "updates", "images", "batch", "sampling_flops",
             "sample_steps")


def run(args):
    """FD against training FLOPs: monolith vs ensemble (top-1, top-2, full), K x model
    sizes x budgets x seeds x splits."""
    for k in args.k:
        if args.batch_size % k:
            raise UsageError(f"--batch-size {args.batch_size} must split evenly over {k} experts")
    if args.until_plateau and len(args.train_seeds) < 2:
        raise UsageError("--until-plateau compares each budget's FD with its interval: "
                         "give at least two --train-seeds")
    check_budgets(args, args.k, args.splits)
    for k in args.k:
        for batch in expert_batches(args, k):
            if batch > args.batch_size:
                raise UsageError(f"--expert-batches {batch} is above the monolith's "
                                 f"--batch-size {args.batch_size}: at equal FLOPs the "
                                 f"{k} experts would make fewer updates than one "
                                 "monolith")
    if args.distill:
        arms = [arm for k in args.k for arm in baseline_arms(args, k) if arm[0] == "experts"]
        teachers = ({"ddm"} & set(args.splits)) | {arm_name(*arm) for arm in arms}
        if args.distill_arm not in teachers:
            raise UsageError(f"--distill-arm {args.distill_arm} is not an ensemble this "
                             f"study trains; one of: {', '.join(sorted(teachers))}")
    root = os.path.join(args.out, "scaling")
    results = {"data": args.data, "k": args.k, "n": args.n, "solver": args.solver,
               "sample_steps": args.sample_steps,
               "train_seeds": args.train_seeds, "base_monolith_steps": args.monolith_steps,
               "batch_size": args.batch_size,
               "splits": args.splits, "router_model": args.router_model,
               "router_share": args.router_share, "runs": [],
               "plateau": {}, "monolith_batches": args.monolith_batches,
               "expert_batches": args.expert_batches,
               "lr_schedules": args.lr_schedules, "decay_share": args.decay_share}
    for model in args.models:
        for k in args.k:
            budgets = sorted(set(args.budgets))
            while budgets:
                budget = budgets.pop(0)
                for seed in args.train_seeds:
                    results["runs"] += measure_point(args, root, model, k, budget, seed)
                plateau = plateau_budget(fds_by_budget(results["runs"], model, k, "monolith"))
                results["plateau"][f"{model} K={k}"] = plateau
                if not budgets and args.until_plateau and plateau is None and 2 * budget <= args.max_budget:
                    budgets.append(2 * budget)
    for model in args.models:   # every other monolith arm's plateau, by the same paired rule
        for k in args.k:
            for arm in sorted({r["split"] for r in results["runs"]
                               if r["method"] == "monolith"} - {"monolith"}):
                fds = fds_by_budget(results["runs"], model, k, arm)
                results["plateau"][f"{model} K={k} {arm}"] = plateau_budget(fds)
    results["summary"] = summarise(results["runs"])
    results["paired"] = paired_differences(results["runs"])
    results["baseline"] = baseline_differences(results["runs"])
    lines = report(args, results)
    if args.plots:
        plot_scaling(results["summary"], os.path.join(args.out, f"{plot_name(args)}.png"))
        lines += ["", f"Plot: {os.path.join(args.out, plot_name(args) + '.png')}"]
        if plot_batches(results["baseline"],
                        os.path.join(args.out, f"{plot_name(args)}-batches.png")):
            lines += [f"Plot: {os.path.join(args.out, plot_name(args) + '-batches.png')}"]
    return results, lines


def plot_name(args):
    data = args.data.split(":")[0]
    return "scaling" if data == "digits" else f"scaling-{data}"


def expert_batches(args, k):
    return args.expert_batches or [args.batch_size // k]


def baseline_arms(args, k):
    """The (side, batch, schedule) arms beyond the point's own monolith and DDM split,
    in training order."""
    schedules = [CONSTANT if name == "constant" else (name, args.decay_share)
                 for name in args.lr_schedules]
    arms = [("monolith", b, s) for s in schedules for b in args.monolith_batches
            or [args.batch_size]]
    if not args.monolith_only:
        arms += [("experts", b, s) for s in schedules for b in expert_batches(args, k)]
    protocol = {("monolith", args.batch_size, CONSTANT)} | ({("experts", args.batch_size // k,
                                                              CONSTANT)} if "ddm" in args.splits else set())
    return [arm for arm in arms if arm not in protocol]


def measure_point(args, root, model, k, budget, seed):
    """The rows of one (model, K, budget, seed): the monolith once, from the point's
    own folder whatever --splits lists, every routing rule of every split (none with
    --monolith-only), every batch / schedule arm, and each monolith sampled again with
    top-1's sampling FLOPs per image."""
    base, flops = scaling_run(args, model, k, budget, seed, monolith_only=True)
    share_eval(base, root)
    routed = [m for m in SCALING_METHODS if m != "monolith"]
    reference = {"batch": args.batch_size, "schedule": "constant", **trained(base, ["all"])}
    measured = [("monolith", "monolith", base, flops["monolith"], np.nan, reference)]
    for split in [] if args.monolith_only else args.splits:
        run, flops = scaling_run(args, model, k, budget, seed, split)
        share_eval(run, root)
        names = [str(j) for j in range(k)]
        batch = args.batch_size if split == "equal-batch" else args.batch_size // k
        accounting = {"batch": batch, "schedule": "constant", **trained(run, names)}
        measured += [(method, split, run, flops["ensemble"], flops["router_share"], accounting)
                     for method in routed]
    for side, batch, schedule in baseline_arms(args, k):
        run, account = arm_run(args, model, k, budget, seed, side, batch, schedule)
        share_eval(run, root)
        accounting = {"batch": batch, "schedule": schedule[0], "updates": account["updates"],
                      "images": account["images"]}
        name = arm_name(side, batch, schedule)
        measured += [(method, name, run, account["flops"], np.nan, accounting)
                     for method in (["monolith"] if side == "monolith" else routed)]
    rows = []
    for method, split, run, spent, router_share, accounting in measured:
        r = routed_sample(args, run, method)
        rows.append({"model": model, "k": k, "budget": budget, "seed": seed, "method": method,
                     "split": split, "flops": spent,
                     "router_share": router_share, "fd": r["fd_classifier"],
                     "accuracy": r["conditional_accuracy"], **accounting,
                     "sample_steps": args.sample_steps,
                     "sampling_flops": sampling_flops(run, *SCALING_METHODS[method], "--steps",
                                                      args.sample_steps, "--solver", args.solver)})
    if args.distill and not args.monolith_only:
        teacher = next(run for method, split, run, *_ in measured if split == args.distill_arm)
        rows.append(distilled_row(args, teacher, model, rows))
    top1 = [r for r in rows if (r["split"], r["method"]) == ("ddm", "top-1")]
    for row in [r for r in rows if r["method"] == "monolith"] if top1 and args.equal_sampling_cost else []:
        # the monolith at top-1's sampling cost: more solver steps, since top-1 pays for
        # the router at every step
        steps = max(1, round(args.sample_steps * top1[0]["sampling_flops"] / row["sampling_flops"]))
        run = next(run for method, split, run, *_ in measured
                   if (method, split) == ("monolith", row["split"]))
        flags = [*SCALING_METHODS["monolith"], "--n", args.n, "--seed", 0, "--solver", args.solver,
                 "--steps", steps]
        r = sample_and_measure(run, os.path.join(
            run, "samples", f"monolith-steps{steps}.npz"), *flags,
                               eval_flags=["--classifier-steps", args.classifier_steps])
        rows.append({**row, "method": EQUAL_SAMPLING, "sample_steps": steps,
                     "fd": r["fd_classifier"],
                     "accuracy": r["conditional_accuracy"],
                     "sampling_flops": sampling_flops(run, *flags[:2], *flags[-4:])})
    return rows


EQUAL_SAMPLING = "monolith at top-1's sampling FLOPs"
DISTILLED = "distilled"


def distill_batch(args):
    return args.distill_batch or args.batch_size


def distilled_row(args, teacher, model, rows):
    """DDM's last step at this point: the ensemble of --distill-arm (DDM's split by default) under
    --distill-routing (the full mixture by default) distilled into one network of the experts'
    size for --distill-steps at --distill-batch (distill.py), charged the ensemble's FLOPs plus
    its own."""
    path = os.path.join(teacher, "experts", "distilled", "ckpt.pt")
    done = torch.load(path, weights_only=True) if os.path.isfile(path) else None
    # a finished student is reused, so it must be the one these flags ask for
    asked = {"routing": args.distill_routing, "batch_size": distill_batch(args), "model": model}
    changed = [f"{name} {done['config']['flags'][name]} -> {value}" for name, value in asked.items()
               if done is not None and done["config"]["flags"][name] != value]
    if changed:
        raise UsageError(f"{path} is a student of other flags ({'; '.join(changed)}): "
                         "move it aside to distil another")
    if done is None or done["step"] < args.distill_steps:
        stage(distill, "--run-dir", teacher, "--steps", args.distill_steps, "--model", model,
              "--batch-size", distill_batch(args), "--routing", args.distill_routing,
              "--seed", rows[0]["seed"])
    config = torch.load(path, weights_only=True)["config"]
    flags = ["--experts", "distilled", "--n", args.n, "--seed", 0, "--solver", args.solver,
             "--steps", args.sample_steps]
    r = sample_and_measure(teacher, os.path.join(teacher, "samples", "distilled.npz"), *flags,
                           eval_flags=["--classifier-steps", args.classifier_steps])
    ensemble = next(row for row in rows
                    if (row["split"], row["method"]) == (args.distill_arm, "top-1"))
    return {**ensemble, "method": DISTILLED, "split": DISTILLED,
            "teacher": f"{args.distill_arm}:{args.distill_routing}",
            "flops": ensemble["flops"] + config["distillation_flops"],
            "fd": r["fd_classifier"], "accuracy": r["conditional_accuracy"],
            "batch": distill_batch(args),
            "updates": ensemble["updates"] + args.distill_steps,
            "images": ensemble["images"] + args.distill_steps * distill_batch(args),
            "sampling_flops": sampling_flops(teacher, *flags[:2], *flags[-4:])}


def fds_by_budget(runs, model, k, split):
    """[(budget, {seed: FD})] of one monolith arm, as plateau_budget reads them."""
    out = {}
    for r in runs:
        if (r["model"], r["k"], r["split"], r["method"]) == (model, k, split, "monolith"):
            out.setdefault(r["budget"], {})[r["seed"]] = r["fd"]
    return sorted(out.items())


def report(args, results):
    """The study's table: one row per (model, K, budget, split), the monolith's FD
    beside the routed ensembles'."""
    router = f"router {args.router_model} at {args.router_share:.0%} of each budget" if args.router_share else \
        f"router {args.router_model} for {args.router_steps} steps per x1"
    arms = "monoliths only, no experts or router" if args.monolith_only else \
        f"splits: {', '.join(args.splits)}; {router}"
    lines = [f"Scaling, {args.data}, FLOP-matched (monolith at batch {args.batch_size}; "
             f"{arms}); training seeds {args.train_seeds}; N = {args.n}, {args.solver} x "
             f"{args.sample_steps} steps, sampling seed 0. FD-classifier (lower is "
             "better): mean ± 95 % t-interval over training seeds.", "",
             "| model | K | budget | TFLOPs | split | router share | monolith | top-1 | "
             "top-2 | full |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cell = lambda s: plus_minus(s["fd_mean"], s["fd_half"])
    groups = {}
    for s in results["summary"]:
        groups.setdefault((s["model"], s["k"], s["budget"]),
                          {}).setdefault(s["split"], {})[s["method"]] = s
    for (model, k, budget), by_split in sorted(groups.items()):
        monolith = by_split["monolith"]["monolith"]
        prefix = f"| {model} | {k} | x{budget:g} | {monolith['flops_mean'] / 1e12:.2f} |"
        routed = [s for s in args.splits if s in by_split]
        for split in routed:
            row = by_split[split]
            lines.append(f"{prefix} {split} | {row['top-1']['router_share_mean']:.1%} | "
                         f"{cell(monolith)} | "
                         + " | ".join(cell(row[m]) for m in SCALING_METHODS
                                      if m != "monolith") + " |")
        if not routed:   # --monolith-only
            dashes = " | ".join("–" for m in SCALING_METHODS if m != "monolith")
            lines.append(f"{prefix} monolith only | – | {cell(monolith)} | {dashes} |")
    rows = {}
    for d in results["paired"]:
        rows.setdefault((d["model"], d["k"], d["budget"], d["split"]), {})[d["method"]] = d
    if rows:   # none with --monolith-only
        lines += ["", "Paired by training seed (the same seed's clusters and monolith), "
                      "routed FD minus the monolith's: below zero, the ensemble is "
                      "ahead; an interval that includes zero is no difference.", "",
                  "| model | K | budget | split | "
                  + " | ".join(f"{m} − monolith" for m in SCALING_METHODS if m != "monolith") + " |",
                  "|---|---|---|---|" + "---|" * (len(SCALING_METHODS) - 1)]
    for (model, k, budget, split), row in sorted(rows.items()):
        lines.append(f"| {model} | {k} | x{budget:g} | {split} | "
                     + " | ".join(plus_minus(row[m]["diff_mean"], row[m]["diff_half"], "+.2f")
                                  for m in SCALING_METHODS if m in row) + " |")
    lines += baseline_report(results)
    for point, budget in results["plateau"].items():
        arm = point.split(" ")[2] if point.count(" ") == 2 else "monolith"
        measured = sum(f"{s['model']} K={s['k']}" == " ".join(point.split(" ")[:2])
                       and (s["method"], s["split"]) == ("monolith", arm)
                       for s in results["summary"])
        if budget:
            verdict = f"stopped improving at x{budget:g} (two doublings, neither a fall by the paired test)"
        elif measured >= 3:
            verdict = "was still improving at the largest budget"
        else:
            verdict = (f"is not judged for a plateau here ({measured} "
                       f"budget{'s' * (measured != 1)}; the rule needs three that "
                       "double)")
        lines.append(f"\n{point}: the monolith's FD {verdict}")
    return lines


def summarise(runs):
    """Per (model, K, budget, split, method): FD and accuracy means with their 95 %
    intervals over training seeds, mean FLOPs."""
    key = lambda r: (r["model"], r["k"], r["budget"], r.get("split", "ddm"), r["method"])
    out = []
    for point in sorted({key(r) for r in runs}):
        rows = [r for r in runs if key(r) == point]
        fd, fd_half = interval([r["fd"] for r in rows])
        acc, acc_half = interval([r["accuracy"] for r in rows])
        out.append({**dict(zip(("model", "k", "budget", "split", "method"), point)),
                    "seeds": len(rows), "fd_mean": fd,
                    "fd_half": fd_half, "accuracy_mean": acc, "accuracy_half": acc_half,
                    "flops_mean": float(np.mean([r["flops"] for r in rows])),
                    "router_share_mean": float(np.mean(
                        [r.get("router_share", np.nan) for r in rows]))})
    return out


def paired_differences(runs):
    """Per (model, K, budget, split, routing rule): the mean and 95 % interval over
    training seeds of its FD minus the same seed's monolith's. The seeds share clusters
    and a monolith run, so the seed-to-seed spread the unpaired intervals carry largely
    cancels."""
    run_of = lambda r: (r["model"], r["k"], r["budget"], r["seed"])
    monolith = {run_of(r): r["fd"] for r in runs if (r["method"],
                                                     r.get("split", "monolith")) == ("monolith", "monolith")}
    by_point = {}
    for r in runs:
        if r["method"] in SCALING_METHODS and r.get("split", "ddm") in SCALING_ARMS and run_of(r) in monolith:
            point = (r["model"], r["k"], r["budget"], r.get("split", "ddm"), r["method"])
            by_point.setdefault(point, []).append(r["fd"] - monolith[run_of(r)])
    out = []
    for point, diffs in sorted(by_point.items()):
        mean, half = interval(diffs)
        out.append({**dict(zip(("model", "k", "budget", "split", "method"), point)),
                    "seeds": len(diffs),
                    "diff_mean": mean, "diff_half": half})
    return out


def baseline_differences(runs):
    """Per (model, K, budget): the best monolith (the arm with the lowest mean FD over
    seeds, of every batch and schedule tried) and, for every arm and rule there, its FD
    minus the best monolith's, minus the protocol's monolith's, and (experts' arms)
    minus DDM's split under the same rule, each paired by training seed."""
    point_of = lambda r: (r["model"], r["k"], r["budget"])
    out = []
    for point in sorted({point_of(r) for r in runs}):
        rows = [r for r in runs if point_of(r) == point]
        fd = {}
        for r in rows:
            fd.setdefault((r["split"], r["method"]), {})[r["seed"]] = r["fd"]
        monoliths = {split: seeds for (split, method), seeds in fd.items() if method == "monolith"}
        if not any(r["split"] not in ("monolith", *SCALING_ARMS)
                   or r["method"] == EQUAL_SAMPLING for r in rows):
            continue   # a study without the baseline's arms: the paired table above says it all
        best = min(monoliths, key=lambda split: np.mean(list(monoliths[split].values())))
        for (split, method), seeds in sorted(fd.items()):
            same = [r for r in rows if (r["split"], r["method"]) == (split, method)]
            entry = {"model": point[0], "k": point[1], "budget": point[2], "split": split,
                     "method": method, "best": best,
                     "seeds": len(seeds), **{key: float(np.mean([r[key] for r in same]))
                                             for key in MEAN_KEYS if all(key in r for r in same)}}
            entry["fd_half"] = interval(list(seeds.values()))[1]
            entry["accuracy_half"] = interval([r["accuracy"] for r in same])[1]
            against = {"best": monoliths[best], "protocol": monoliths.get("monolith")}
            if method in SCALING_METHODS and method != "monolith" and split != "ddm":
                against["ddm"] = fd.get(("ddm", method))
            # does the student keep its teacher's win? against its teacher's top-1
            if method == DISTILLED:
                entry["teacher"] = same[0].get("teacher", "ddm:full")
                against["ddm"] = fd.get((entry["teacher"].split(":")[0], "top-1"))
            for name, other in against.items():
                shared = sorted(set(seeds) & set(other or {}))
                if other is not None and len(shared) >= 2 and other is not seeds:
                    entry[f"minus_{name}"] = interval([seeds[s] - other[s] for s in shared])
            out.append(entry)
    return out


def baseline_report(results):
    """The strongest-baseline table: each arm's cost three ways, its FD and accuracy,
    and its paired differences."""
    entries = results.get("baseline") or []
    if not entries:
        return []
    def paired(entry, name):
        if f"minus_{name}" not in entry:
            return "–"
        return plus_minus(*entry[f"minus_{name}"], "+.2f")

    lines = ["", "The strongest baseline: every arm at the point's training FLOPs. "
                 "updates and images: the experts' together (the router's are in its "
                 "FLOPs); sampling: matrix GFLOPs per image, router included. The best "
                 "monolith is the monolith arm with the lowest mean FD at that point "
                 "(chosen on these seeds, which favours the monolith). Differences are "
                 "paired by training seed, mean ± 95 % t-interval; below zero, the row "
                 "is ahead.", "",
             "| model | K | budget | arm | LR | rule | updates | images | TFLOPs | "
             "sampling GFLOPs | FD | accuracy | − best monolith | − protocol monolith | "
             "− DDM's split (the student: its teacher's top-1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def side(e):   # the monoliths (0), then the experts (1), then the student (2)
        routed = 2 if e["method"] == DISTILLED else e["method"] in SCALING_METHODS and e["method"] != "monolith"
        return (e["model"], e["k"], e["budget"], routed, "wsd" in e["split"], -e.get("batch", 0), e["split"],
                e["method"])

    # per point: the monoliths, then the experts, each by schedule and batch
    for e in sorted(entries, key=side):
        arm = {"monolith": f"monolith-b{e.get('batch', 0):.0f}",
               "ddm": f"experts-b{e.get('batch', 0):.0f} (DDM's split)"}.get(e["split"], e["split"])
        rule = {EQUAL_SAMPLING: f"monolith, {e['sample_steps']:.0f} steps",
                DISTILLED: teacher_name(e.get("teacher", "ddm:full"))}.get(e["method"], e["method"])
        best = " (best)" if e["split"] == e["best"] and e["method"] == "monolith" else ""
        cost = lambda key, scale, fmt: format(e[key] / scale, fmt) if key in e else "–"
        lines.append(f"| {e['model']} | {e['k']} | x{e['budget']:g} | {arm}{best} | "
                     f"{'wsd' if 'wsd' in e['split'] else 'constant'} | {rule} | "
                     f"{cost('updates', 1, ',.0f')} | {cost('images', 1, ',.0f')} | "
                     f"{cost('flops', 1e12, '.2f')} | "
                     f"{cost('sampling_flops', 1e9, '.3f')} | "
                     f"{plus_minus(e['fd'], e['fd_half'])} | "
                     f"{plus_minus(e['accuracy'], e['accuracy_half'], '.1%')} | "
                     f"{paired(e, 'best')} | {paired(e, 'protocol')} | {paired(e, 'ddm')} |")
    return lines


def teacher_name(teacher):
    """'ddm:full' -> 'student of the full mixture'; 'experts-b2:top1' -> 'student of
    experts-b2's top1'."""
    arm, routing = teacher.split(":", 1)
    rule = "the full mixture" if routing == "full" else routing
    return f"student of {rule}" if arm == "ddm" else f"student of {arm}'s {rule}"


def plot_scaling(summary, path):
    """FD against training FLOPs (log axes) with 95 % intervals: one line per model
    size, K, split and routing rule."""
    with fd_plot(path, "training FLOPs", "FD (classifier features)", xlog=True) as ax:
        for model, k, split in sorted({(s["model"], s["k"], s["split"]) for s in summary}):
            for method in SCALING_METHODS:
                points = sorted((s["flops_mean"], s["fd_mean"], s["fd_half"]) for s in summary
                                if (s["model"], s["k"], s["split"],
                                    s["method"]) == (model, k, split, method))
                if len(points) < 2:   # a single-budget arm (the K sweep) is a table row, not a line
                    continue
                x, y, err = zip(*points)
                monolith = f"{model} monolith" + ("" if split == "monolith" else f" {split}")
                label = monolith if method == "monolith" else f"{model} K={k} {split} {method}"
                ax.errorbar(x, y, yerr=[0 if np.isnan(e) else e for e in err], marker="o",
                            capsize=3, label=label,
                            linestyle="-" if method == "monolith" else "--")
            best = {}   # the best monolith of every batch and schedule tried, budget by budget
            for s in summary:
                mine = (s["model"], s["k"], s["method"]) == (model, k, "monolith")
                if mine and (s["budget"] not in best or s["fd_mean"] < best[s["budget"]]["fd_mean"]):
                    best[s["budget"]] = s
            if split == "monolith" and len(best) >= 2 and any(s["split"] != "monolith" for s in best.values()):
                points = sorted((s["flops_mean"], s["fd_mean"]) for s in best.values())
                ax.plot(*zip(*points), color="black", linewidth=2.5, alpha=0.5,
                        label=f"{model} best monolith (any batch, schedule)")


def plot_batches(entries, path):
    """Per point, against the batch of one optimizer update at equal training FLOPs: left,
    each arm's FD (the monolith's beside the experts' top-1, each schedule its own line);
    right, what the text relies on, each arm's FD minus the best monolith's paired by seed,
    with its interval. A line joins only batches a factor 2 apart, so none is drawn across
    batches never run. False when no point has a batch sweep."""
    lines = {}
    for e in entries:
        if "batch" in e and (e["method"] == "monolith" or (e["method"] == "top-1" and e["split"] != "random")):
            side = "monolith" if e["method"] == "monolith" else "experts, top-1"
            key = (e["model"], e["k"], e["budget"], side, "wsd" if "wsd" in e["split"]
                   else "constant")
            paired = e.get("minus_best") or (0.0, 0.0)   # the best monolith: itself
            lines.setdefault(key, []).append((e["batch"], e["fd"], e["fd_half"], *paired))
    lines = {key: sorted(points) for key, points in lines.items()
             if len({p[0] for p in points}) >= 2 or key[3] != "monolith"}
    if not any(len(points) >= 2 for points in lines.values()):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    batches = sorted({p[0] for points in lines.values() for p in points})
    for i, ((model, k, budget, side, schedule), points) in enumerate(sorted(lines.items())):
        style = dict(color=f"C{i % 10}", marker="o" if side == "monolith" else "s", capsize=3,
                     linestyle="-" if schedule == "constant" else ":")
        for ax, (value, half) in zip(axes, ((1, 2), (3, 4))):
            for j, run in enumerate(runs_of_doublings(points)):
                ax.errorbar([p[0] for p in run], [p[value] for p in run],
                            yerr=[0 if np.isnan(p[half]) else p[half] for p in run],
                            label=f"{model} x{budget:g} {side} ({schedule} lr)"
                            if j == 0 else None, **style)
    for ax, ylabel in zip(axes, ("FD (classifier features)",
                                 "FD − best monolith's, paired by seed (95 % interval)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [f"{b:g}" for b in batches])
        ax.invert_xaxis()
        ax.set_xlabel("batch per optimizer update, at equal training FLOPs (right: more updates)")
        ax.set_ylabel(ylabel)
    axes[0].set_yscale("log")
    axes[1].axhline(0, color="0.5", lw=1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def runs_of_doublings(points):
    """Points sorted by batch, cut wherever the next batch is not twice the last: the
    pieces a line may join."""
    runs = [[points[0]]]
    for point in points[1:]:
        if point[0] == 2 * runs[-1][-1][0]:
            runs[-1].append(point)
        else:
            runs.append([point])
    return runs