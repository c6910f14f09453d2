"""What the confirmatory lead is made of (`--part attribution`), declared in
docs/attribution-protocol.md before any of its runs.

Two uses of one part, as --part confirm:

    python reproduce.py --part attribution --train-seeds 10 --sides experts monolith-b2 \\
        --out RUNS --results CHUNKS --inception-weights W
        trains and measures the named sides of each seed; each finished side is kept as
        CHUNKS/seedN-SIDE.json (every number it measured, the command, the commit)
    python reproduce.py --part attribution --results docs/attribution
        the declared analysis, from the kept chunk files alone

The confirmatory test (studies/confirm.py) found the experts ahead of a batch-4 monolith.
Its monolith made 1.9x fewer optimizer updates than the experts on the same images, the
information control ran on half the seeds, top-1 routing is mode-seeking, and every arm
was drawn from one noise. This test pits the same experts against the monolith at their
update count (batch 2), brackets that monolith's batch and learning rate, tells it the
clusters on all ten seeds, samples the experts by the exact draw rule and the full
mixture beside top-1, and draws every arm from two noises. Everything it fixes is a
constant below."""
import glob
import os
import time

import numpy as np

import train_expert
from plumbing.command_line import NUMBER, UsageError, checked_record
from studies.common import (PROJECT, config_of, ensure_clusters, ensure_experts, interval,
                            link_run, sample_and_measure, sampling_flops, share_eval, stage,
                            trained, trained_to)
from studies.confirm import (BUDGET, DATA, EXPERT_BATCH, JUDGE, K, MODEL, PROTOCOL_BATCH,
                             PROTOCOL_STEPS, SCHEDULE, budget_flops, chunk_files, folder,
                             inception_metrics, keep_chunk, post_hoc, router_record,
                             train_router_at_share)
from studies.provenance import check_chunks, report_line

PROTOCOL = "docs/attribution-protocol.md"
# Each amendment and its bridge, kept under the chunks' folder: it must measure exactly
# what its original chunk measured before any chunk of the amendment's commit is read
AMENDMENTS = {
    "docs/attribution-amendment.md": os.path.join("bridge", "seed10-experts.json"),
}
SEEDS = tuple(range(10, 20))
BRACKET_SEEDS = (10, 11, 12)     # the monolith's optimum is bracketed on these
SAMPLING_SEEDS = (0, 1)          # every arm drawn from two noises; compared on their mean
N, SAMPLE_STEPS, SOLVER = 1000, 16, "euler"
EVAL_FLAGS = ["--classifier-steps", 1500]
LR = 1e-3                        # train_expert.py's default, the confirmatory test's
ROUTINGS = {"top-1": "top1", "draw": "draw", "full": "full"}

# Each monolith arm: (batch, learning rate). Every one spends the whole budget, so its
# steps are budget images / batch: batch 2 makes the experts' update count.
MONOLITHS = {
    "monolith-b2": (2, LR),
    "monolith-b4": (4, LR),          # the confirmatory test's monolith, trained again
    "monolith-b1": (1, LR),          # bracketing: the batch below the best
    "monolith-b2-lr0.5": (2, LR / 2),
    "monolith-b2-lr2": (2, LR * 2),
}
BRACKETING = ("monolith-b1", "monolith-b2-lr0.5", "monolith-b2-lr2")
SIDES = ("experts", "monolith-b2", *BRACKETING, "control-b2", "monolith-b4")


def run(args):
    results = args.results or os.path.join(PROJECT, "docs", "attribution")
    if args.sides:
        return run_chunks(args, results)
    return analyse(load_chunks(results), results)


# ---- running: one chunk per seed and side ---------------------------------------------

def run_chunks(args, results):
    for side in args.sides:
        if side not in SIDES:
            raise UsageError(f"--sides {side}: the attribution test's sides are "
                             f"{', '.join(SIDES)}")
        wrong = [s for s in args.train_seeds if s not in SEEDS]
        if wrong:
            raise UsageError(f"--train-seeds {wrong[0]}: the protocol's seeds are "
                             f"{SEEDS[0]}-{SEEDS[-1]}")
        # a bracketing arm runs past seeds 10-12 only once the bracketing rule promoted it
        beyond = [s for s in args.train_seeds if s not in BRACKET_SEEDS]
        if side in BRACKETING and beyond and promoted(by_arm(load_chunks(results))) != side:
            raise UsageError(f"--sides {side} --train-seeds {beyond[0]}: a bracketing arm "
                             "runs past seeds 10-12 only when the bracketing rule promotes "
                             f"it (the analysis of {results} says which)")
    if not args.inception_weights or not os.path.isfile(args.inception_weights):
        raise UsageError("--inception-weights FILE: every arm's Inception FID is declared "
                         f"(eval.py --convert-inception writes the file); got "
                         f"{args.inception_weights}")
    root = os.path.join(args.out, "attribution")
    written = []
    for seed in args.train_seeds:
        for side in args.sides:
            path = os.path.join(results, f"seed{seed}-{side}.json")
            if os.path.isfile(path):
                print(f"{path}: kept already, skipped")
                continue
            started = time.time()
            arms = SIDE_RUNNERS[side](root, seed, side)
            weights = args.inception_weights
            for arm in arms.values():
                for batch in arm["batches"].values():
                    batch["inception"] = inception_metrics(batch.pop("file"), weights)
            keep_chunk(path, PROTOCOL, seed, side, arms, started)
            written.append(path)
    return {"chunks": written}, [f"wrote {p}" for p in written] or ["nothing left to run"]


def measured(run, root, name, *flags):
    """{sampling seed: metrics} of RUN/samples/NAME-sS.npz at each of SAMPLING_SEEDS (N
    images, 16 Euler steps), judged by the shipped classifier, and the sampler's FLOPs per
    image (router included)."""
    share_eval(run, root)
    sampler = [*flags, "--solver", SOLVER, "--steps", SAMPLE_STEPS]
    batches = {}
    for seed in SAMPLING_SEEDS:
        batch = os.path.join(run, "samples", f"{name}-s{seed}.npz")
        record = sample_and_measure(run, batch, *sampler, "--n", N, "--seed", seed,
                                    eval_flags=EVAL_FLAGS)
        if record.get("classifier_digest") != JUDGE:
            raise UsageError(f"{batch}: judged by classifier "
                             f"{record.get('classifier_digest')}, not the protocol's {JUDGE}")
        batches[str(seed)] = {key: record.get(key) for key in JUDGE_METRICS} | {"file": batch}
    return {"batches": batches, "sampling_flops": sampling_flops(run, *sampler)}


JUDGE_METRICS = ("fd_classifier", "kid_classifier", "conditional_accuracy", "precision",
                 "recall", "classifier_digest")


def experts_side(root, seed, side):
    """The confirmatory test's experts (batch 2, wsd) and the size rule's router, trained
    again at this commit, sampled top-1 (the declared arm), by the draw rule and by the
    full mixture."""
    budget, per_step = budget_flops(root, seed)
    run = folder(root, seed, f"experts-b{EXPERT_BATCH}-wsd{SCHEDULE[1]:g}")
    ensure_clusters(run, K, seed, DATA)
    router = train_router_at_share(run, seed, budget)
    # the confirmatory test's accounting: the experts share what the router leaves
    steps = int((budget - router["flops"]) * PROTOCOL_BATCH // (K * EXPERT_BATCH * per_step))
    expert_flops = ensure_experts(run, MODEL, K, steps, EXPERT_BATCH, seed, (), SCHEDULE)
    common = {"training_flops": expert_flops + router["flops"], "budget_flops": budget,
              "steps": steps, "batch": EXPERT_BATCH, **trained(run, [str(j) for j in range(K)]),
              "router": router_record(router)}
    return {f"experts-{name}": {**measured(run, root, name, "--routing", rule), **common}
            for name, rule in ROUTINGS.items()}


def monolith_steps(batch):
    """The steps that spend the whole budget at this batch: the budget's images / batch."""
    return BUDGET * PROTOCOL_STEPS * PROTOCOL_BATCH // batch


def train_monolith(run, seed, batch, lr, condition=()):
    """RUN/experts/all trained with the wsd decay for the budget at (batch, lr); resumes."""
    network = os.path.join(run, "experts", "all")
    steps = monolith_steps(batch)
    if not trained_to(network, steps):
        stage(train_expert, "--cluster", "all", *condition, "--objective", "fm",
              "--model", MODEL, "--steps", steps, "--batch-size", batch, "--lr", lr,
              "--seed", seed, "--lr-schedule", SCHEDULE[0], "--decay-share", SCHEDULE[1],
              "--run-dir", run)
    return network


def monolith_side(root, seed, side):
    """One monolith arm: all the data, the wsd decay, the budget's FLOPs at its batch."""
    batch, lr = MONOLITHS[side]
    budget, _ = budget_flops(root, seed)
    run = folder(root, seed, side)
    ensure_clusters(run, K, seed, DATA)
    network = train_monolith(run, seed, batch, lr)
    return {side: {**measured(run, root, "monolith", "--experts", "all"),
                   "training_flops": config_of(network)["flops"], "budget_flops": budget,
                   "steps": monolith_steps(batch), "batch": batch, "lr": lr,
                   **trained(run, ["all"])}}


def control_side(root, seed, side):
    """The information control at the primary monolith's batch: monolith-b2 told each
    image's cluster, sampled through its cluster views, the experts' router choosing the
    top-1 cluster at every step (as the confirmatory control)."""
    experts = folder(root, seed, f"experts-b{EXPERT_BATCH}-wsd{SCHEDULE[1]:g}")
    if not os.path.isfile(os.path.join(experts, "router", "ckpt.pt")):
        raise UsageError(f"the control of seed {seed} is routed by the experts side's "
                         f"router: run --sides experts for seed {seed} first")
    batch, lr = MONOLITHS["monolith-b2"]
    budget, _ = budget_flops(root, seed)
    run = link_run(folder(root, seed, side), experts, {}, router_from=experts)
    network = train_monolith(run, seed, batch, lr, ("--condition", "class+cluster"))
    if config_of(network)["condition"]["kind"] != "class+cluster":
        raise UsageError(f"{network}: not the cluster-conditioned monolith")
    return {side: {**measured(run, root, "top-1", "--experts", "all", "--routing", "top1"),
                   "training_flops": config_of(network)["flops"], "budget_flops": budget,
                   "steps": monolith_steps(batch), "batch": batch, "lr": lr,
                   "router": router_record(config_of(os.path.join(run, "router")))}}


SIDE_RUNNERS = {"experts": experts_side, "control-b2": control_side,
                **{name: monolith_side for name in MONOLITHS}}


# ---- the declared analysis, from the chunk files alone ---------------------------------

BATCH = {"fd_classifier": NUMBER, "kid_classifier": NUMBER, "conditional_accuracy": NUMBER,
         "precision": NUMBER, "recall": NUMBER, "classifier_digest": str, "inception": dict}
INCEPTION = {"fid": NUMBER, "kid": NUMBER}
ARM = {"batches": dict, "sampling_flops": NUMBER, "training_flops": NUMBER,
       "budget_flops": NUMBER}


def side_arms(side):
    if side == "experts":
        return [f"experts-{name}" for name in ROUTINGS]
    return [side]


def load_chunks(results):
    """{(seed, side): chunk} of every seedN-SIDE.json in RESULTS, each checked against the
    chunk schema and the protocol (checked_chunk); across chunks, clean commits that the
    history shows are the protocol's or an amendment's (AMENDMENTS), each after the
    protocol, the chunks of an amendment's commit read only beside its bridge."""
    chunks = {}
    for path, chunk in chunk_files(results, "the attribution test"):
        chunks[(chunk["seed"], chunk["side"])] = checked_chunk(path, chunk)
    check_chunks(chunks, results, PROTOCOL, load_bridges(results))
    return chunks


def checked_chunk(path, chunk):
    """CHUNK, read from PATH, if it holds a declared seed and side, is named for them, and
    has the declared arms with a finite number for every metric of both sampling seeds,
    judged by the protocol's judge."""
    seed, side = chunk["seed"], chunk["side"]
    if side not in SIDES or seed not in SEEDS:
        raise UsageError(f"{path}: side {side!r} of seed {seed} is not declared by "
                         f"{PROTOCOL}")
    if os.path.basename(path) != f"seed{seed}-{side}.json":
        raise UsageError(f"{path}: holds seed {seed}'s {side} side; a chunk file is "
                         f"named seed{seed}-{side}.json, one per seed and side")
    if chunk["chunk"] != f"seed{seed}-{side}":
        raise UsageError(f"{path}: its chunk field says {chunk['chunk']!r}, but its seed "
                         f"and side fields say seed{seed}-{side}")
    if sorted(chunk["arms"]) != sorted(side_arms(side)):
        raise UsageError(f"{path}: arms {sorted(chunk['arms'])}, the protocol's "
                         f"{side_arms(side)}")
    for name, arm in chunk["arms"].items():
        checked_record(arm, ARM, f"{path} ({name})")
        if sorted(arm["batches"]) != [str(s) for s in SAMPLING_SEEDS]:
            raise UsageError(f"{path} ({name}): sampling seeds {sorted(arm['batches'])}, "
                             f"the protocol's {list(SAMPLING_SEEDS)}")
        for s, batch in arm["batches"].items():
            where = f"{path} ({name}, sampling seed {s})"
            checked_record(batch, BATCH, where)
            checked_record(batch["inception"], INCEPTION, where + " inception")
            if batch["classifier_digest"] != JUDGE:
                raise UsageError(f"{where}: judged by {batch['classifier_digest']}, "
                                 f"not the protocol's {JUDGE}")
    return chunk


def load_bridges(results):
    """{amendment: (its bridge's path in RESULTS, the bridge, checked as a chunk, or None
    where it is not there yet)}."""
    bridges = {}
    for document, name in AMENDMENTS.items():
        path = os.path.join(results, name)
        bridge = None
        if os.path.isfile(path):
            kept = dict(chunk_files(os.path.dirname(path), "an amendment's bridge"))
            bridge = checked_chunk(path, kept[path])
        bridges[document] = (path, bridge)
    return bridges


def metric(arm, key, scale=1.0):
    """The arm's metric on the mean of its sampling seeds."""
    values = []
    for batch in arm["batches"].values():
        source = batch["inception"] if key in INCEPTION else batch
        values.append(scale * source[key])
    return float(np.mean(values))


# (key, scale, digits, label)
METRICS = (("fd_classifier", 1, 1, "judge FD"), ("fid", 1, 1, "Inception FID"),
           ("kid", 1000, 2, "Inception KID x 1000"),
           ("conditional_accuracy", 100, 1, "requested class (points)"),
           ("precision", 1, 3, "precision"), ("recall", 1, 3, "recall"))
PRIMARY = ("experts-top-1", "monolith-b2")


def paired(arms, a, b, key="fd_classifier", scale=1.0):
    seeds = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
    diffs = [metric(arms[a][s], key, scale) - metric(arms[b][s], key, scale) for s in seeds]
    mean, half = interval(diffs) if len(diffs) > 1 else (float("nan"), float("nan"))
    return {"a": a, "b": b, "metric": key, "seeds": seeds, "per_seed": diffs,
            "mean": mean, "half": half, "resolved": bool(len(diffs) > 1 and abs(mean) > half)}


def promoted(arms):
    """The bracketing rule, declared: an arm is promoted when its judge FD (mean of both
    sampling seeds) is below monolith-b2's on every one of BRACKET_SEEDS; of several, the
    lowest mean difference over them; monolith-b2 when none is. None until all three
    seeds of every bracketing arm and of monolith-b2 are in."""
    base = arms.get("monolith-b2", {})
    winners = []
    for name in BRACKETING:
        got = arms.get(name, {})
        if any(s not in got or s not in base for s in BRACKET_SEEDS):
            return None
        diffs = [metric(got[s], "fd_classifier") - metric(base[s], "fd_classifier")
                 for s in BRACKET_SEEDS]
        if all(d < 0 for d in diffs):
            winners.append((float(np.mean(diffs)), name))
    return min(winners)[1] if winners else "monolith-b2"


def by_arm(chunks):
    """{arm: {training seed: arm record}} of the chunks."""
    arms = {}
    for (seed, _), chunk in chunks.items():
        for name, arm in chunk["arms"].items():
            arms.setdefault(name, {})[seed] = arm
    return arms


def analyse(chunks, folder=None):
    """Every declared comparison over the seeds that have both its arms; FOLDER, where the
    chunks were read: its provenance line names any not committed yet."""
    arms = by_arm(chunks)
    comparisons = {"primary": paired(arms, *PRIMARY)}
    for key, scale, _, _ in METRICS[1:]:
        comparisons[f"primary {key}"] = paired(arms, *PRIMARY, key, scale)
    comparisons["experts - told"] = paired(arms, "experts-top-1", "control-b2")
    comparisons["told - monolith"] = paired(arms, "control-b2", "monolith-b2")
    for rule in ("draw", "full"):
        for key, scale, _, _ in METRICS:
            pair = (f"experts-{rule}", "experts-top-1")
            comparisons[f"{rule} - top-1 {key}"] = paired(arms, *pair, key, scale)
    comparisons["draw - monolith"] = paired(arms, "experts-draw", "monolith-b2")
    comparisons["b4 - b2"] = paired(arms, "monolith-b4", "monolith-b2")
    for name in BRACKETING:
        comparisons[f"{name} - b2"] = paired(arms, name, "monolith-b2")
    best = promoted(arms)
    if best not in (None, "monolith-b2"):
        comparisons["experts - promoted"] = paired(arms, "experts-top-1", best)
    complete = len(comparisons["primary"]["seeds"]) == len(SEEDS)
    results = {"comparisons": comparisons, "promoted": best, "complete": complete,
               "arms": summaries(arms),
               "primary_post_hoc": post_hoc(comparisons["primary"]["per_seed"]),
               "provenance": report_line(chunks, PROTOCOL, folder, bridges_of(folder)),
               "chunks": [{"file": f"seed{s}-{side}.json", "commit": c["commit"],
                           "command": c["command"], "seconds": c["seconds"]}
                          for (s, side), c in sorted(chunks.items())]}
    return results, report(results)


def bridges_of(folder):
    """The amendments' bridges as load_chunks read them, for the provenance line."""
    if folder is None:
        return {document: (name, None) for document, name in AMENDMENTS.items()}
    return load_bridges(folder)


# the forest plot's rows, ensemble - monolith each: (label, ensemble arm, monolith arm)
FOREST_ROWS = (("experts top-1 - monolith b2", "experts-top-1", "monolith-b2"),
               ("experts draw - monolith b2", "experts-draw", "monolith-b2"),
               ("experts top-1 - told monolith b2", "experts-top-1", "control-b2"))


def forest_entries(folder):
    """The attribution test's rows of the x16 study's forest plot (docs/x16-forest.png),
    each drawn only once it has every declared seed: the protocol reports no interim
    result. The promoted monolith, when the bracketing rule promotes one, gets its row
    against the experts too."""
    if not glob.glob(os.path.join(folder, "seed*.json")):
        return []
    arms = by_arm(load_chunks(folder))
    rows = list(FOREST_ROWS)
    best = promoted(arms)
    if best not in (None, "monolith-b2"):
        rows.append((f"experts top-1 - promoted {best}", "experts-top-1", best))
    levels, entries = summaries(arms), []
    for label, ensemble, monolith in rows:
        fd = paired(arms, ensemble, monolith)
        if fd["seeds"] != list(SEEDS):
            continue
        accuracy = paired(arms, ensemble, monolith, "conditional_accuracy", 100)
        level = {arm: levels[arm]["conditional_accuracy"]["mean"] for arm in (ensemble, monolith)}
        entries.append({"label": f"Fashion DiT-M/4 x16 attribution, {label}, seeds "
                                 f"{SEEDS[0]}-{SEEDS[-1]}",
                        "chosen_by": "declared in advance", "seeds": fd["seeds"],
                        "fd": (fd["mean"], fd["half"]),
                        "accuracy": (accuracy["mean"], accuracy["half"]),
                        "ensemble_accuracy": level[ensemble],
                        "monolith_accuracy": level[monolith]})
    return entries


def summaries(arms):
    out = {}
    for name, by_seed in arms.items():
        out[name] = {"seeds": sorted(by_seed)}
        for key, scale, _, _ in METRICS:
            got = [metric(arm, key, scale) for arm in by_seed.values()]
            out[name][key] = {"mean": float(np.mean(got)),
                              "sd": float(np.std(got, ddof=1)) if len(got) > 1 else None}
        out[name]["sampling_mflops"] = float(np.mean(
            [arm["sampling_flops"] for arm in by_seed.values()])) / 1e6
    return out


def report(results):
    comparisons = results["comparisons"]
    primary = comparisons["primary"]
    lines = ["# What the lead is made of: the declared analysis", "",
             f"Declared in {os.path.basename(PROTOCOL)}; computed by `python reproduce.py "
             "--part attribution --results docs/attribution` from the chunk files alone. "
             f"N = {N} images per batch, {SAMPLE_STEPS} Euler steps, every arm on the mean of "
             f"sampling seeds {SAMPLING_SEEDS[0]} and {SAMPLING_SEEDS[1]}; each row a paired "
             "difference over training seeds, mean and 95 % Student-t interval.", "",
             "| comparison | metric | seeds | mean | 95 % t-interval | verdict |",
             "|---|---|---|---|---|---|"]
    digits = {key: d for key, _, d, _ in METRICS}
    labels = {key: label for key, _, _, label in METRICS}
    for name, c in comparisons.items():
        d = digits[c["metric"]]
        if len(c["seeds"]) < 2:
            cell, verdict = "-", f"{len(c['seeds'])} seed(s)"
        else:
            cell = f"{c['mean'] - c['half']:+.{d}f} ... {c['mean'] + c['half']:+.{d}f}"
            verdict = "resolved" if c["resolved"] else "not resolved"
        mean = "-" if not c["seeds"] else f"{np.mean(c['per_seed']):+.{d + 1}f}"
        lines.append(f"| {c['a']} - {c['b']} | {labels[c['metric']]} | {len(c['seeds'])} | "
                     f"{mean} | {cell} | {verdict} |")
    verdict = (("resolved" if primary["resolved"] else "not resolved") if results["complete"]
               else f"incomplete: {len(primary['seeds'])} of {len(SEEDS)} declared seeds, "
                    "no verdict")
    lines += ["", f"Primary (experts top-1 - monolith at batch 2, judge FD): {verdict}.",
              "Bracketing rule: " + ("not yet decided (seeds 10-12 of every bracketing arm "
                                     "needed)" if results["promoted"] is None else
                                     f"the strongest monolith is {results['promoted']}."),
              results["provenance"],
              "", "Each arm over its seeds, mean (s.d.):", "",
              "| arm | seeds | " + " | ".join(labels[k] for k, *_ in METRICS)
              + " | sampling MFLOPs |", "|---|---|" + "---|" * (len(METRICS) + 1)]
    for name, got in sorted(results["arms"].items()):
        cells = []
        for key, _, d, _ in METRICS:
            sd = got[key]["sd"]
            cells.append(f"{got[key]['mean']:.{d}f}"
                         + (f" ({sd:.{d}f})" if sd is not None else ""))
        lines.append(f"| {name} | {len(got['seeds'])} | " + " | ".join(cells)
                     + f" | {got['sampling_mflops']:.1f} |")
    return lines
