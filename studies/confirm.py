"""The confirmatory test of Fashion DiT-M/4 at x16 (`--part confirm`), declared in
docs/confirm-protocol.md before any of its arms was sampled.

Two uses of one part:

    python reproduce.py --part confirm --train-seeds 10 --sides experts monolith \\
        --out RUNS --results CHUNKS [--inception-weights W]
        trains and measures the named sides of each seed; each finished side is kept as
        CHUNKS/seedN-SIDE.json (every number it measured, the command, the commit)
    python reproduce.py --part confirm --results docs/confirm
        the declared analysis, from the kept chunk files alone

Everything the protocol fixes is a constant below, not a flag: a confirmatory test has no
arms to choose. Every network and batch is found again by its path, so a killed chunk
resumes where it stopped (train_expert.py resumes exactly; a batch already measured with
the same settings is reused)."""
import datetime
import glob
import itertools
import json
import math
import os
import shlex
import shutil
import sys
import time

import numpy as np

import train_expert
import train_router
from plumbing.command_line import NUMBER, UsageError, checked_record
from plumbing.run_dir import atomic_json
from studies.common import (PROJECT, SCALING_METHODS, config_of, ensure_clusters, ensure_experts,
                            ensure_monolith, interval, link_run, sample_and_measure,
                            sampling_flops, share_eval, stage, trained, trained_to)
from studies.provenance import check_chunks, commit, report_line

PROTOCOL = "docs/confirm-protocol.md"
DATA, MODEL, K = "fashion-mnist", "DiT-M/4", 4
BUDGET, PROTOCOL_STEPS, PROTOCOL_BATCH = 16, 400, 64   # x16 = 16 x 400 steps at batch 64
ROUTER_SHARE = 0.05            # each router's training FLOPs, as a share of the budget
MONOLITH_BATCH, EXPERT_BATCH = 4, 2
SCHEDULE = ("wsd", 0.2)        # the decay over the last 20 % of every run, both sides
OLD_ROUTER = "DiT-M/4"         # the x16 study's router, secondary
N, SAMPLE_STEPS, SOLVER, SAMPLING_SEED = 1000, 16, "euler", 0
JUDGE = "eecfdc969647"         # plumbing/evaluation/judges: the shipped evaluation classifier
SEEDS = tuple(range(10, 20))
CONTROL_SEEDS = tuple(range(10, 15))   # at least these; all ten if the CPU allows
SIDES = ("experts", "monolith", "control")
PRIMARY_ARMS = ("experts", "monolith")
EVAL_FLAGS = ["--classifier-steps", 1500]


def run(args):
    results = args.results or os.path.join(PROJECT, "docs", "confirm")
    if args.sides:
        return run_chunks(args, results)
    return analyse(load_chunks(results), results)


# ---- running: one chunk per seed and side ---------------------------------------------

def run_chunks(args, results):
    foreign = [side for side in args.sides if side not in SIDES]
    if foreign:
        raise UsageError(f"--sides {foreign[0]}: the confirmatory test's sides are "
                         f"{', '.join(SIDES)}")
    unknown = [s for s in args.train_seeds if s not in SEEDS]
    if unknown:
        raise UsageError(f"--train-seeds {unknown[0]}: the protocol's seeds are "
                         f"{SEEDS[0]}-{SEEDS[-1]}")
    if args.inception_weights and not os.path.isfile(args.inception_weights):
        raise UsageError(f"--inception-weights {args.inception_weights}: no such file")
    root = os.path.join(args.out, "confirm")
    written = []
    for seed in args.train_seeds:
        for side in args.sides:
            path = os.path.join(results, f"seed{seed}-{side}.json")
            if os.path.isfile(path):
                print(f"{path}: kept already, skipped")
                continue
            started = time.time()
            arms = SIDE_RUNNERS[side](root, seed)
            if args.inception_weights:   # the primary arms only: a pass costs minutes
                for arm in (a for name, a in arms.items() if name in PRIMARY_ARMS):
                    arm["inception"] = inception_metrics(
                        arm["file"], args.inception_weights
                    )
            keep_chunk(path, PROTOCOL, seed, side, arms, started)
            written.append(path)
    return {"chunks": written}, [f"wrote {p}" for p in written] or ["nothing left to run"]


def keep_chunk(path, protocol, seed, side, arms, started):
    """One finished side of one seed as its chunk file: every number it measured, the
    command and the commit it ran at, and the wall time of the run that finished it (a side
    resumed after a stop kept its earlier runs' work, whose time is not in `seconds`)."""
    chunk = {"chunk": f"seed{seed}-{side}", "protocol": protocol, "seed": seed, "side": side,
             "commit": commit(), "command": "python reproduce.py " + shlex.join(sys.argv[1:]),
             "finished": datetime.datetime.now().isoformat(timespec="seconds"),
             "seconds": round(time.time() - started), "arms": arms}
    atomic_json(chunk, path)
    print(f"wrote {path} ({chunk['seconds']} s)")


def folder(root, seed, arm):
    return os.path.join(
        root, f"{DATA}-{MODEL.replace('/', '')}-k{K}-x{BUDGET}-seed{seed}-{arm}"
    )


def budget_flops(root, seed):
    """The budget's FLOPs: x16 protocol steps of the monolith at the protocol batch, its
    per-step cost measured by one step (as the x16 study's base monolith measured it)."""
    probe = folder(root, seed, "probe")
    ensure_clusters(probe, K, seed, DATA)
    per_step = ensure_monolith(probe, MODEL, 1, PROTOCOL_BATCH, seed)
    return BUDGET * PROTOCOL_STEPS * per_step, per_step


def train_router_at_share(run, seed, budget, model=None):
    """RUN/router trained with ROUTER_SHARE of the budget's FLOPs: by train_router.py's size
    rule for DiT-M/4 experts (model None), or the named model. A one-step run measures
    its FLOPs per step first."""
    size = ["--model", model] if model else ["--expert-model", MODEL]
    path = os.path.join(run, "router", "ckpt.pt")
    steps = None
    if os.path.isfile(path):
        config = config_of(os.path.join(run, "router"))
        steps = max(1, round(ROUTER_SHARE * budget * config["steps"] / config["flops"]))
        if config["steps"] == steps:
            return config
    stage(train_router, "--seed", seed, "--steps", 1, *size, "--run-dir", run)
    config = config_of(os.path.join(run, "router"))
    steps = max(1, round(ROUTER_SHARE * budget * config["steps"] / config["flops"]))
    stage(train_router, "--seed", seed, "--steps", steps, *size, "--run-dir", run)
    return config_of(os.path.join(run, "router"))


def measured(run, root, name, *flags):
    """The batch RUN/samples/NAME.npz (N images, sampling seed 0, 16 Euler steps) and its
    metrics, judged by the shipped classifier."""
    share_eval(run, root)
    batch = os.path.join(run, "samples", f"{name}.npz")
    sampler = [*flags, "--solver", SOLVER, "--steps", SAMPLE_STEPS]
    record = sample_and_measure(run, batch, *sampler, "--n", N, "--seed", SAMPLING_SEED,
                                eval_flags=EVAL_FLAGS)
    if record.get("classifier_digest") != JUDGE:
        raise UsageError(
            f"{batch}: judged by classifier {record.get('classifier_digest')}, not "
            f"the protocol's {JUDGE}"
        )
    keys = (
        "fd_classifier",
        "kid_classifier",
        "kid_classifier_std",
        "conditional_accuracy",
        "precision",
        "recall",
        "classifier_digest",
    )
    cost = sampling_flops(run, *sampler)
    return {
        **{key: record.get(key) for key in keys},
        "file": batch,
        "sampling_flops": cost,
    }


def router_record(config):
    return {"model": config["size"]["model"], "chosen_by": config["size"]["chosen_by"],
            "share_of_expert": config["size"].get("share_of_expert"),
            "steps": config["steps"], "flops": config["flops"]}


def experts_side(root, seed):
    """Experts at batch 2 with the wsd decay, routed top-1 by the size rule's router
    (primary), and by a DiT-M/4 router of the same training FLOPs (secondary)."""
    budget, per_step = budget_flops(root, seed)
    run = folder(root, seed, f"experts-b{EXPERT_BATCH}-wsd{SCHEDULE[1]:g}")
    ensure_clusters(run, K, seed, DATA)
    router = train_router_at_share(run, seed, budget)
    # an expert step at batch b costs b / 64 of a protocol step: the experts share what
    # the router leaves of the budget (the x16 study's accounting)
    steps = int(
        (budget - router["flops"]) * PROTOCOL_BATCH // (K * EXPERT_BATCH * per_step)
    )
    expert_flops = ensure_experts(run, MODEL, K, steps, EXPERT_BATCH, seed, (), SCHEDULE)
    names = [str(j) for j in range(K)]
    arms = {
        "experts": {
            **measured(run, root, "top-1", *SCALING_METHODS["top-1"]),
            "training_flops": expert_flops + router["flops"],
            "budget_flops": budget,
            "steps": steps,
            "batch": EXPERT_BATCH,
            **trained(run, names),
            "router": router_record(router),
        }
    }
    old = link_run(
        folder(root, seed, f"experts-b{EXPERT_BATCH}-wsd{SCHEDULE[1]:g}-router-M4"),
        run,
        {j: os.path.join(run, "experts", str(j)) for j in range(K)},
    )
    old_router = train_router_at_share(old, seed, budget, OLD_ROUTER)
    arms["experts-old-router"] = {
        **measured(old, root, "top-1", *SCALING_METHODS["top-1"]),
        "training_flops": expert_flops + old_router["flops"],
        "budget_flops": budget,
        "router": router_record(old_router),
    }
    return arms


def monolith_side(root, seed):
    """The monolith at batch 4 with the same wsd decay, for the steps that spend the budget."""
    budget, _ = budget_flops(root, seed)
    run = folder(root, seed, f"monolith-b{MONOLITH_BATCH}-wsd{SCHEDULE[1]:g}")
    ensure_clusters(run, K, seed, DATA)
    steps = BUDGET * PROTOCOL_STEPS * PROTOCOL_BATCH // MONOLITH_BATCH
    ensure_monolith(run, MODEL, steps, MONOLITH_BATCH, seed, (), SCHEDULE)
    return {
        "monolith": {
            **measured(run, root, "monolith", *SCALING_METHODS["monolith"]),
            "training_flops": config_of(os.path.join(run, "experts", "all"))["flops"],
            "budget_flops": budget,
            "steps": steps,
            "batch": MONOLITH_BATCH,
            **trained(run, ["all"]),
        }
    }


def control_side(root, seed):
    """The information control: the batch-4 wsd monolith told each image's cluster, sampled
    through its cluster views with the experts side's router choosing the top-1 cluster."""
    experts = folder(root, seed, f"experts-b{EXPERT_BATCH}-wsd{SCHEDULE[1]:g}")
    if not os.path.isfile(os.path.join(experts, "router", "ckpt.pt")):
        raise UsageError(
            f"the control of seed {seed} is routed by the experts side's router: "
            f"run --sides experts for seed {seed} first"
        )
    budget, _ = budget_flops(root, seed)
    run = link_run(folder(root, seed, f"control-b{MONOLITH_BATCH}-wsd{SCHEDULE[1]:g}"),
                   experts, {}, router_from=experts)
    steps = BUDGET * PROTOCOL_STEPS * PROTOCOL_BATCH // MONOLITH_BATCH
    network = os.path.join(run, "experts", "all")
    if not trained_to(network, steps):
        stage(train_expert, "--cluster", "all", "--condition", "class+cluster", "--objective",
              "fm", "--model", MODEL, "--steps", steps, "--batch-size", MONOLITH_BATCH,
              "--seed", seed, "--lr-schedule", SCHEDULE[0], "--decay-share", SCHEDULE[1],
              "--run-dir", run)
    if config_of(network)["condition"]["kind"] != "class+cluster":
        raise UsageError(f"{network}: not the cluster-conditioned monolith")
    return {
        "control": {
            **measured(run, root, "top-1", "--experts", "all", "--routing", "top1"),
            "training_flops": config_of(network)["flops"],
            "budget_flops": budget,
            "steps": steps,
            "batch": MONOLITH_BATCH,
            "router": router_record(config_of(os.path.join(run, "router"))),
        }
    }


SIDE_RUNNERS = {
    "experts": experts_side,
    "monolith": monolith_side,
    "control": control_side,
}


def inception_metrics(batch, weights):
    """FID and KID in Inception's features (secondary): eval.py --inception-weights on a
    copy of the batch, so the judge's record beside the batch stays as it is."""
    import eval as evaluate
    target = os.path.join(os.path.dirname(batch), "inception", os.path.basename(batch))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    for src in (batch, batch[:-4] + ".json"):
        dst = os.path.join(os.path.dirname(target), os.path.basename(src))
        if not os.path.isfile(dst):
            shutil.copyfile(src, dst)
    result = target[:-4] + ".eval.json"
    if not os.path.isfile(result):
        run = os.path.dirname(os.path.dirname(os.path.dirname(target)))
        stage(evaluate, target, "--run-dir", run, "--inception-weights", weights,
              *EVAL_FLAGS)
    with open(result) as f:
        record = json.load(f)
    keys = ("fid", "kid", "kid_std", "fid_network_digest", "fd_classifier")
    return {key: record.get(key) for key in keys}


# ---- the declared analysis, from the chunk files alone ---------------------------------

# what every chunk file holds, and every arm in it (the secondary Inception pass and the
# control's and old router's lack of it are optional)
CHUNK = {"chunk": str, "protocol": str, "seed": int, "side": str, "commit": str,
         "command": str, "seconds": NUMBER, "arms": dict}
ARM = {"fd_classifier": NUMBER, "conditional_accuracy": NUMBER, "precision": NUMBER,
       "recall": NUMBER, "classifier_digest": str, "sampling_flops": NUMBER,
       "inception": (dict, type(None))}
INCEPTION = {"fid": NUMBER, "kid": NUMBER}
SIDE_ARMS = {"experts": {"experts", "experts-old-router"}, "monolith": {"monolith"},
             "control": {"control"}}


def load_chunks(results):
    """{(seed, side): chunk} of every chunk file in RESULTS, each checked against the
    chunk schema (every number finite) and the protocol (a declared seed and side, the
    file named for them, the side's arms, the protocol's judge), and across files: one
    chunk per (seed, side), all run at one clean commit."""
    chunks = {}
    for path, chunk in chunk_files(results, "the confirmatory test"):
        seed, side = chunk["seed"], chunk["side"]
        if side not in SIDES or seed not in SEEDS:
            raise UsageError(f"{path}: side {side!r} of seed {seed} is not declared by the "
                             f"protocol (sides {', '.join(SIDES)}, seeds "
                             f"{SEEDS[0]}-{SEEDS[-1]})")
        if os.path.basename(path) != f"seed{seed}-{side}.json":
            raise UsageError(f"{path}: holds seed {seed}'s {side} side, which is kept as "
                             f"seed{seed}-{side}.json: one chunk per seed and side")
        if set(chunk["arms"]) != SIDE_ARMS[side]:
            raise UsageError(f"{path}: arms {sorted(chunk['arms'])}, not the {side} side's "
                             f"{sorted(SIDE_ARMS[side])}")
        for name, arm in chunk["arms"].items():
            checked_record(arm, ARM, f"{path} ({name})")
            if arm.get("inception") is not None:
                checked_record(arm["inception"], INCEPTION, f"{path} ({name}, inception)")
            if arm["classifier_digest"] != JUDGE:
                raise UsageError(f"{path} ({name}): judged by classifier "
                                 f"{arm['classifier_digest']}, not the protocol's {JUDGE}")
        chunks[(seed, side)] = chunk
    check_chunks(chunks, results, PROTOCOL)
    return chunks


def chunk_files(results, test):
    """[(path, chunk)] of every chunk file in RESULTS, each readable JSON that holds the
    fields every chunk holds (CHUNK)."""
    paths = sorted(glob.glob(os.path.join(results, "*.json")))
    if not paths:
        raise UsageError(f"--results {results}: no chunk files (seedN-SIDE.json) of {test} "
                         "there")
    found = []
    for path in paths:
        try:
            with open(path) as f:
                chunk = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: not readable as JSON ({type(e).__name__})")
        found.append((path, checked_record(chunk, CHUNK, path)))
    return found


def analyse(chunks, folder=None):
    """The primary test and the secondary comparisons (the write-up's numbers): each a
    paired difference over the seeds that have both arms, its mean and 95 % t-interval.
    FOLDER, where the chunks were read: its provenance line names any not committed yet."""
    arms = {}
    for (seed, _), chunk in chunks.items():
        for name, arm in chunk["arms"].items():
            arms.setdefault(name, {})[seed] = arm

    def value(arm, key):
        if key.startswith("inception."):
            return (arm.get("inception") or {}).get(key.split(".", 1)[1])
        return arm.get(key)

    def paired(a, b, key="fd_classifier", scale=1.0):
        both = set(arms.get(a, {})) & set(arms.get(b, {}))
        seeds = sorted(s for s in both if None not in (value(arms[a][s], key),
                                                         value(arms[b][s], key)))
        diffs = [scale * (value(arms[a][s], key) - value(arms[b][s], key)) for s in seeds]
        mean, half = interval(diffs) if len(diffs) > 1 else (float("nan"), float("nan"))
        return {"a": a, "b": b, "metric": key, "seeds": seeds, "per_seed": diffs,
                "mean": mean, "half": half,
                "resolved": bool(len(diffs) > 1 and abs(mean) > half)}

    comparisons = {
        "primary": paired("experts", "monolith"),
        "fid": paired("experts", "monolith", "inception.fid"),
        "kid_x1000": paired("experts", "monolith", "inception.kid", 1000),
        "accuracy_points": paired("experts", "monolith", "conditional_accuracy", 100),
        "precision": paired("experts", "monolith", "precision"),
        "recall": paired("experts", "monolith", "recall"),
        "router_default_minus_old": paired("experts", "experts-old-router"),
        "control_minus_monolith": paired("control", "monolith"),
        "experts_minus_control": paired("experts", "control"),
    }
    flops = [arms["experts"][s]["sampling_flops"] / arms["monolith"][s]["sampling_flops"]
             for s in comparisons["primary"]["seeds"]]
    results = {"comparisons": comparisons,
               "arms": arm_summaries(arms, value),
               "primary_post_hoc": post_hoc(comparisons["primary"]["per_seed"]),
               # the old router's arm against the monolith: is the lead the router's?
               "old_router_minus_monolith": paired("experts-old-router", "monolith"),
               "top1_flops_vs_monolith": flops,
               "chunks": [{"file": f"seed{s}-{side}.json", "commit": c["commit"],
                           "command": c["command"], "seconds": c["seconds"]}
                          for (s, side), c in sorted(chunks.items())]}
    results["provenance"] = report_line(chunks, PROTOCOL, folder)
    lines = report(comparisons, flops, len(SEEDS)) + ["", results["provenance"]]
    old_router = results["old_router_minus_monolith"]
    return results, (lines + arm_lines(results["arms"])
                     + post_hoc_lines(results["primary_post_hoc"], old_router))


ARM_METRICS = (("fd_classifier", 1), ("conditional_accuracy", 100), ("precision", 1),
               ("recall", 1), ("inception.fid", 1), ("inception.kid", 1000),
               ("sampling_flops", 1e-6))


def arm_summaries(arms, value):
    """Each arm's own level over its seeds (mean and s.d. of every metric), so a reader
    sees what the paired differences are differences of."""
    summaries = {}
    for name in ("experts", "experts-old-router", "monolith", "control"):
        for key, scale in ARM_METRICS:
            got = [scale * value(arm, key) for arm in arms.get(name, {}).values()
                   if value(arm, key) is not None]
            if got:
                summaries.setdefault(name, {})[key] = {
                    "seeds": len(got), "mean": float(np.mean(got)),
                    "sd": float(np.std(got, ddof=1)) if len(got) > 1 else float("nan")}
    return summaries


def arm_lines(summaries):
    lines = ["", "Each arm over its seeds, mean (s.d.):", "",
             "| arm | seeds | judge FD | class acc. % | precision | recall | FID | KID x 1000 "
             "| sampling MFLOPs |", "|---|---|---|---|---|---|---|---|---|"]
    for name, got in summaries.items():
        cells = []
        for key, _ in ARM_METRICS:
            digits = decimals(key)
            cells.append(f"{got[key]['mean']:.{digits}f} ({got[key]['sd']:.{digits}f})"
                         if key in got else "-")
        lines.append(f"| {name} | {got['fd_classifier']['seeds']} | " + " | ".join(cells) + " |")
    return lines


def decimals(metric):
    """Precision and recall are shares near 1, the rest FDs, points and FLOPs."""
    return 3 if metric in ("precision", "recall") else 1


PLANNED_SD = (12.4, 13.2)   # the protocol's expected s.d. of the paired difference


def post_hoc(diffs):
    """What a reader asks of the primary beyond its declared interval, labelled as not
    declared: its observed s.d. against the one the protocol planned on, how many seeds
    lean each way, and an exact sign-flip test, which assumes no normal distribution (the
    share of the 2^N sign patterns whose mean is at least as far from zero)."""
    diffs = np.asarray(diffs, dtype=float)
    if len(diffs) < 2:
        return None
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(diffs))))
    as_far = np.abs(flips @ diffs) >= abs(diffs.sum()) - 1e-9
    return {"sd": float(diffs.std(ddof=1)), "below_zero": int((diffs < 0).sum()),
            "seeds": len(diffs), "sign_flip_p": float(as_far.mean())}


def post_hoc_lines(stats, old_router):
    if stats is None:
        return []
    return ["", f"Post hoc (not declared): s.d. of the paired difference {stats['sd']:.1f} "
            f"(the protocol planned on {PLANNED_SD[0]}-{PLANNED_SD[1]}); "
            f"{stats['below_zero']} of {stats['seeds']} seeds below zero; "
            f"exact sign-flip test p = {stats['sign_flip_p']:.3f}; the experts routed by "
            f"the x16 study's DiT-M/4 router - monolith: {old_router['mean']:+.1f} "
            f"+/- {old_router['half']:.1f} (N = {len(old_router['seeds'])})."]


LABELS = {"primary": "PRIMARY judge FD, experts (top-1, size-rule router) - monolith",
          "fid": "Inception FID, experts - monolith",
          "kid_x1000": "Inception KID x 1000, experts - monolith",
          "accuracy_points": "requested-class accuracy (points), experts - monolith",
          "precision": "precision, experts - monolith",
          "recall": "recall, experts - monolith",
          "router_default_minus_old":
              "judge FD, size-rule router - the x16 study's DiT-M/4 router",
          "control_minus_monolith": "judge FD, information control (monolith told clusters) - monolith",
          "experts_minus_control": "judge FD, experts - information control"}


def report(comparisons, flops, declared):
    """The analysis as Markdown lines: one row per comparison; the primary resolves only
    when all declared seeds are in and its interval excludes zero."""
    lines = [
        "# The confirmatory test of Fashion DiT-M/4 at x16: the declared analysis", "",
        "Declared in confirm-protocol.md; computed by `python reproduce.py --part confirm "
        "--results docs/confirm` from the chunk files alone (their commands and commits: "
        "confirm.json). Judge FD at N = 1000, sampling seed 0, 16 Euler steps; each row "
        "a paired difference over training seeds, mean and 95 % Student-t interval.", "",
        "| comparison | seeds | mean | 95 % t-interval | per seed |",
        "|---|---|---|---|---|",
    ]
    for key, c in comparisons.items():
        digits = decimals(key)
        per_seed = ", ".join(f"{d:+.{digits}f}" for d in c["per_seed"])
        low, high = c["mean"] - c["half"], c["mean"] + c["half"]
        cell = "-" if math.isnan(c["mean"]) else f"{low:+.{digits}f} ... {high:+.{digits}f}"
        lines.append(f"| {LABELS[key]} | {len(c['seeds'])} | "
                     f"{c['mean']:+.{digits + 1}f} | {cell} | {per_seed} |")
    primary = comparisons["primary"]
    done = len(primary["seeds"]) == declared
    verdict = ("resolved" if primary["resolved"] else "not resolved") if done else \
        f"incomplete: {len(primary['seeds'])} of {declared} declared seeds, no verdict"
    lines += ["", f"Primary: {verdict}. Top-1 sampling FLOPs / the monolith's: "
              + (f"{min(flops):.3f}-{max(flops):.3f}" if flops else "-") + "."]
    return lines
