"""What the studies share: running a stage by its flags, borrowed run folders, the
FLOP-matched run, sampling and measuring with resume, Student-t intervals, and the FD
plot.

Every study drives the stage scripts through their command lines (`stage(module,
*flags)`), so each number in docs/ can be re-made by hand, and every finished network
or measured batch is found again by its path: a killed study resumes where it stopped."""
import contextlib
import json
import os
import re
import shutil

import numpy as np
import torch

import cluster
import eval as evaluate
from model import count_flops
import routing
import sample
import train_expert
import train_router
from plumbing import training
from plumbing.checkpoint import networks_digests
from plumbing.command_line import UsageError
from plumbing.release.reader import INDEX
from plumbing.run_dir import atomic_path

# the project's folder: the studies' declared records (docs/) are its files, found from any
# working folder
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every training run of a study is fp32 unless its call names a precision. --precision
# auto measures each run folder afresh, and on a CPU shared with other jobs that
# measurement flips: in one digits study 17 of 158 runs chose bf16, an uncontrolled
# difference between arms. (studies/bf16.py names the precisions it compares.)
STUDY_PRECISION = "fp32"
CONSTANT = ("constant", 0.2)   # a training run's (train_expert.py --lr-schedule, --decay-share)


# Studies run one-thread processes side by side, so a training run draws its batches in
# its own process: DataLoader workers contend for the same cores. `train_expert.py
# --cluster all --data fashion-mnist --model DiT-M/4 --batch-size 4 --steps 4000` took 56
# s with its default 2 workers and 39 s with none, one thread on 2 cores, with
# bit-identical weights (a batch depends on seed and step).
STUDY_WORKERS = 0

# The studies were measured with 50 Euler steps on the uniform grid, sample.py's defaults
# before docs/sampling-steps.md chose 16 ab2 steps on a shifted grid; they keep theirs, so
# that their documented tables rebuild. A study's own flags come after and win.
STUDY_SAMPLER = ("--solver", "euler", "--time-shift", 1.0, "--steps", 50)


def sample_args(*flags):
    """sample.py's parsed flags as a study asks for them (STUDY_SAMPLER, then `flags`)."""
    return sample.build_parser().parse_args([str(a) for a in (*STUDY_SAMPLER, *flags)])


def stage(module, *argv):
    argv = [str(a) for a in argv]
    if module.__name__ in ("train_expert", "distill") and "--precision" not in argv:
        argv += ["--precision", STUDY_PRECISION]
    if module.__name__ == "train_expert" and "--workers" not in argv:
        argv += ["--workers", str(STUDY_WORKERS)]
    if module.__name__ == "sample":
        argv = [str(a) for a in STUDY_SAMPLER] + argv
    module.main(module.build_parser().parse_args(argv))


def link_run(dst, src_run, experts, router_from=None):
    """A run folder that borrows another run's cluster file (none for src_run None) and
    a release's index where src_run is a release, these expert folders and a router
    (symlinks). A link made before is kept only if it names the same target: a study run
    again with other networks is refused, since the batches beside the links were drawn
    from the first ones."""
    os.makedirs(os.path.join(dst, "experts"), exist_ok=True)
    borrowed = [(name, os.path.join(src_run, name)) for name in ("clusters.pt", INDEX)
                if src_run and os.path.exists(os.path.join(src_run, name))]
    borrowed += [("router", os.path.join(router_from, "router"))] if router_from else []
    borrowed += [(os.path.join("experts", str(k)), folder) for k, folder in experts.items()]
    for name, target in borrowed:
        path, target = os.path.join(dst, name), os.path.abspath(target)
        if not os.path.lexists(path):
            os.symlink(target, path)
        elif not os.path.islink(path) or os.readlink(path) != target:
            raise UsageError(f"{path} links {os.readlink(path) if os.path.islink(path) else 'no'}"
                             f" network, not {target}: this study's folder was made from "
                             "other networks; give another --out, or remove it to start over")
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


def interval(values, level=0.95):
    """(mean, half-width) of a Student-t interval over seeds; the half-width is nan for
    a single value."""
    from scipy import stats
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    half = stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean()), float(half)


def plus_minus(mean, half, spec=".2f"):
    """'mean ± half' in format SPEC (the half-width unsigned); the mean alone where one seed
    gives no interval, rather than '± nan'."""
    if half is None or not np.isfinite(half):
        return format(mean, spec)
    return f"{format(mean, spec)} ± {format(half, spec.lstrip('+'))}"


def spread(values):
    """'mean (min-max)' of a metric over seeds."""
    return f"{np.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


SAMPLER_SETTINGS = ("n", "steps", "solver", "seed", "routing", "experts", "cfg_scale",
                    "cfg_routing", "time_shift")


def drawn_as_asked(run_dir, path, flags):
    """Whether the batch at `path` was drawn with these sample.py flags (defaults
    included) from the networks now in `run_dir`, by the JSON beside it."""
    try:
        with open(path[:-4] + ".json") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    parsed = sample_args("--run-dir", run_dir, "--out", path, *flags)
    asked = dict(vars(parsed))
    asked["experts"] = sorted(e.strip() for e in asked["experts"].split(",")
                              if e.strip()) or record.get("experts")
    if not all(str(record.get(key)) == str(asked[key]) for key in SAMPLER_SETTINGS):
        return False
    # drawn before batches recorded their networks' weights: trusted, as it was then
    if "weights" not in record:
        return True
    # the same flags over other weights (a network retrained or continued since) is
    # another batch
    experts, router, _, names = sample.setup(
        run_dir, parsed.experts.strip(), parsed.router, parsed.routing)
    return record["weights"] == networks_digests(experts, router, names)


def measured_as_asked(path, eval_flags):
    """Whether NAME.eval.json beside the batch at `path` was measured with the
    classifier these eval.py flags ask for: an FD in one classifier's features is not
    comparable with one in another's."""
    try:
        with open(path[:-4] + ".eval.json") as f:
            record = json.load(f)
        with np.load(path, allow_pickle=False) as batch:
            image_size = batch["arr_0"].shape[1]
    except (OSError, ValueError, KeyError):
        return False
    if "fd_classifier" not in record:   # unlabelled data: no classifier was involved
        return True
    steps = evaluate.build_parser().parse_args([path, *map(str, eval_flags)]).classifier_steps
    return record.get("classifier") == evaluate.classifier_identity(image_size, steps)


def sample_and_measure(run_dir, path, *flags, eval_flags=()):
    """One sample batch and its metrics; a batch already measured with the same sampler
    settings is reused, so a killed study resumes, and a rerun with another --n or
    solver draws its batches anew (another classifier only measures them again)."""
    drawn_again = not drawn_as_asked(run_dir, path, flags)
    if drawn_again:
        stage(sample, "--run-dir", run_dir, "--out", path, *flags)
    if drawn_again or not measured_as_asked(path, eval_flags):
        measure(run_dir, [path], *eval_flags)
    with open(path[:-4] + ".eval.json") as f:
        return json.load(f)


def need_experts(run_dir):
    router = os.path.join(run_dir, "router", "ckpt.pt")
    if not os.path.isdir(os.path.join(run_dir, "experts")) or not os.path.isfile(router):
        raise UsageError(f"--part guidance/solvers sample the ensemble in --run-dir {run_dir}: run "
                         "./ddm pipeline (or the stages) first")


def share_eval(run, root):
    """run/eval -> root/eval: one evaluation classifier and one set of reference
    statistics for every arm of a study."""
    os.makedirs(os.path.join(root, "eval"), exist_ok=True)
    if not os.path.lexists(os.path.join(run, "eval")):
        os.symlink(os.path.abspath(os.path.join(root, "eval")), os.path.join(run, "eval"))


def trained_to(folder, steps):
    path = os.path.join(folder, "ckpt.pt")
    return os.path.isfile(path) and torch.load(path, weights_only=True)["step"] >= steps


def matched_expert_steps(monolith_steps, monolith_flops_per_step, router_flops):
    """DDM's FLOP matching: K experts at 1/K of the monolith's batch, for the monolith's
    FLOPs minus the router's.

    A step's FLOPs scale with the batch, so an expert step costs
    monolith_flops_per_step / K."""
    return int((monolith_steps * monolith_flops_per_step - router_flops) // monolith_flops_per_step)


def config_of(folder):
    return torch.load(os.path.join(folder, "ckpt.pt"), weights_only=True)["config"]


def ensure_clusters(run, k, seed, data="digits", clustering="kmeans"):
    if not os.path.isfile(os.path.join(run, "clusters.pt")):
        stage(cluster, "--k", k, "--seed", seed, "--data", data, "--clustering", clustering,
              "--run-dir", run)


def warm_start(folder, steps, sources, run, schedule=CONSTANT):
    """Give FOLDER, when it has no checkpoint yet, the furthest-trained checkpoint of
    `sources` (the same network in a smaller budget's run folder of the same seed) that
    stops short of `steps`. train_expert.py resumes data order and random stream
    exactly (S steps resumed to 2S equal 2S straight; tests/test_train_expert.py), so a
    budget doubling pays only for the steps it adds. A source in another precision or
    on another clustering is passed over, and train_expert.py refuses one trained with
    other flags. Under wsd the source is the checkpoint written where its decay began
    (stable.pt), and only one at or before this run's decay start: the decay itself is
    paid again."""
    if os.path.isfile(os.path.join(folder, "ckpt.pt")):
        return
    fingerprint = torch.load(os.path.join(run, "clusters.pt"), weights_only=True)["fingerprint"]
    name, limit = ("stable.pt",
                   training.decay_start(steps, schedule[1]) + 1) if schedule[0] == "wsd" else ("ckpt.pt", steps)
    best = None
    for source in sources:
        path = os.path.join(source, name)
        if not os.path.isfile(path):
            continue
        ckpt = torch.load(path, weights_only=True, mmap=True)
        config = ckpt["config"]
        if ckpt["step"] < limit and config.get("precision") == STUDY_PRECISION and \
                config.get("cluster_fingerprint") == fingerprint and (best is None or ckpt["step"] > best[0]):
            best = (ckpt["step"], source)
    if best is None:
        return
    step, source = best
    # the checkpoint last: a folder with one is taken as started
    for src, dst in (("log.jsonl", "log.jsonl"), (name, "ckpt.pt")):
        if os.path.isfile(os.path.join(source, src)):
            with atomic_path(os.path.join(folder, dst)) as tmp:
                shutil.copyfile(os.path.join(source, src), tmp)
    print(f"{folder}: continuing {source} from step {step}")


def smaller_budget_runs(base, budget):
    """The run folders beside BASE that differ from it only in a smaller budget, the
    largest first."""
    parent, name = os.path.split(base)
    pattern = re.compile(re.escape(name).replace(
        re.escape(f"-x{budget:g}-"), "-x([0-9.e+-]+)-") + "$")
    found = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        match = pattern.match(entry)
        if match and float(match.group(1)) < budget:
            found.append((float(match.group(1)), os.path.join(parent, entry)))
    return [path for _, path in sorted(found, reverse=True)]


def schedule_flags(schedule):
    if schedule[0] == "constant":
        return []
    return ["--lr-schedule", schedule[0], "--decay-share", schedule[1]]


def ensure_monolith(run, model, steps, batch, seed, warm_from=(), schedule=CONSTANT):
    """RUN/experts/all trained to `steps` (continuing the furthest of `warm_from`'s
    monoliths); returns the FLOPs of one step."""
    folder = os.path.join(run, "experts", "all")
    if not trained_to(folder, steps):
        warm_start(folder, steps, [os.path.join(r, "experts", "all")
                                   for r in warm_from], run, schedule)
        stage(train_expert, "--cluster", "all", "--steps", steps, "--batch-size", batch, "--model",
              model, "--seed", seed,
              "--run-dir", run, *schedule_flags(schedule))
    return config_of(os.path.join(run, "experts", "all"))["flops_per_step"]


def ensure_router(run, seed, steps=None, model="DiT-M/2", share_of=None):
    """RUN/router trained for `steps`, or for the steps whose FLOPs are `share_of` =
    (share, FLOPs of the budget).

    A router's FLOPs per step depend on its model, batch and the data's shape only, so
    a one-step run measures them; train_router.py does not resume, so the real run then
    starts afresh."""
    folder = os.path.join(run, "router")
    if share_of is not None:
        if not os.path.isfile(os.path.join(folder, "ckpt.pt")):
            stage(train_router, "--seed", seed, "--steps", 1, "--model", model, "--run-dir", run)
        share, budget_flops = share_of
        probe = config_of(folder)
        steps = max(1, round(share * budget_flops * probe["steps"] / probe["flops"]))
    done = os.path.isfile(os.path.join(folder, "ckpt.pt")) and config_of(folder)["steps"] == steps
    if not done:
        stage(train_router, "--seed", seed, "--steps", steps, "--model", model, "--run-dir", run)
    return config_of(folder)["flops"]


def ensure_experts(run, model, k, steps, batch, seed, warm_from=(), schedule=CONSTANT):
    """K flow experts of RUN trained to `steps` at `batch` (continuing the furthest of
    `warm_from`'s); returns their total FLOPs."""
    for j in range(k):
        folder = os.path.join(run, "experts", str(j))
        if not trained_to(folder, steps):
            warm_start(folder, steps, [os.path.join(r, "experts", str(j))
                                       for r in warm_from], run, schedule)
            stage(train_expert, "--cluster", j, "--objective", "fm", "--steps", steps,
                  "--batch-size", batch, "--model", model,
                  "--seed", seed, "--run-dir", run, *schedule_flags(schedule))
    return sum(config_of(os.path.join(run, "experts", str(j)))["flops"] for j in range(k))


def check_budgets(args, ks, arms=("ddm",)):
    """Refuse, before anything is trained, a --budgets list that cannot buy the runs it
    names: a budget below one monolith step, two budgets that round to the same steps
    (one folder, counted twice), a --max-budget below the budgets, and (with
    --router-share, whose FLOPs are known in advance) a router that leaves an arm no
    expert step."""
    by_steps = {}
    for budget in sorted(args.budgets):
        exact = args.monolith_steps * budget
        if exact < 1:
            raise UsageError(f"--budgets {budget:g} at --monolith-steps {args.monolith_steps} is "
                             f"{exact:g} of a monolith step; every budget must buy at least one: "
                             "raise --monolith-steps or the budget")
        steps = round(exact)
        if steps in by_steps:
            raise UsageError(f"--budgets {by_steps[steps]:g} and {budget:g} both round to {steps} "
                             f"monolith steps at --monolith-steps {args.monolith_steps}: the same "
                             "run, counted twice")
        by_steps[steps] = budget
    if args.until_plateau and args.max_budget < max(args.budgets):
        raise UsageError(f"--max-budget {args.max_budget:g} is below the largest of --budgets "
                         f"({max(args.budgets):g}): --until-plateau could never double past it")
    if args.router_share:
        steps, budget = min(by_steps.items())
        for k in ks:
            for arm in arms:
                if matched_steps(steps, 1.0, args.router_share * steps, k, arm)[0] < 1:
                    raise UsageError(f"budget x{budget:g} ({steps} monolith steps at "
                                     f"--monolith-steps {args.monolith_steps}) leaves no expert "
                                     f"step for {k} experts ({arm}) once the router takes "
                                     f"--router-share {args.router_share:g}; raise "
                                     "--monolith-steps")


def matched_steps(monolith_steps, per_step, router_flops, k, arm):
    """(expert steps, expert batch divisor) that spend the monolith's FLOPs less the
    router's, for an arm of the study.

    ddm and random: DDM's split, K experts at 1/K of the batch for (about) the
    monolith's steps. equal-batch: K experts at the monolith's batch for 1/K of those
    steps: the same FLOPs, but each expert's gradient as good as the monolith's and
    fewer passes over its cluster."""
    steps = matched_expert_steps(monolith_steps, per_step, router_flops)
    return (steps // k, 1) if arm == "equal-batch" else (steps, k)


SCALING_METHODS = {"monolith": ["--experts", "all"], "top-1": ["--routing", "top1"],
                   "top-2": ["--routing", "top2"],
                   "full": ["--routing", "full"]}
SCALING_ARMS = {"ddm": "DDM's split: K k-means experts at batch B/K for the monolith's steps less "
                       "the router's",
                "equal-batch": "the same clusters and router, experts at the monolith's batch B "
                               "for 1/K of those steps",
                "random": "a random partition of equal sizes (its own router), experts as in ddm"}


def scaling_run(args, model, k, budget, seed, arm="ddm", monolith_only=False):
    """The run folder of one point of the scaling study and its FLOPs, every missing piece
    trained first (with monolith_only, the monolith alone).

    One folder per (data set, model, K, budget, seed, router share) holds clusters,
    router, monolith and DDM's experts; the other arms are folders beside it
    (equal-batch borrows its clusters and router), compared with the same monolith.
    Finished pieces are skipped: a killed study resumes. Monolith and experts continue
    from the same networks of a smaller budget's folder where one exists (warm_start);
    the router starts afresh."""
    # the data set's name, not where it lies (its fingerprint is checked by every stage)
    data = args.data.split(":")[0]
    name = f"{'' if data == 'digits' else data + '-'}{model.replace('/', '')}-k{k}-x{budget:g}-seed{seed}"
    name += f"-router{args.router_share:g}" if args.router_share else ""
    base = os.path.join(args.out, "scaling", name)
    monolith_steps = max(1, round(args.monolith_steps * budget))
    ensure_clusters(base, k, seed, args.data)
    per_step = ensure_monolith(base, model, monolith_steps, args.batch_size, seed,
                               smaller_budget_runs(base, budget))
    if monolith_only:
        return base, {"monolith": monolith_steps * per_step}
    # the router grows with the budget (or is held at --router-share of it), so it costs
    # the same share at every budget
    router = dict(share_of=(args.router_share,
                            monolith_steps * per_step)) if args.router_share else \
        dict(steps=max(1, round(args.router_steps * budget)))
    run = base if arm == "ddm" else base + f"-{arm}"
    if arm == "random":
        ensure_clusters(run, k, seed, args.data, clustering="random")
        router_flops = ensure_router(run, seed, model=args.router_model, **router)
    else:
        router_flops = ensure_router(base, seed, model=args.router_model, **router)
        if arm == "equal-batch":
            link_run(run, base, {}, router_from=base)
    expert_steps, divisor = matched_steps(monolith_steps, per_step, router_flops, k, arm)
    if expert_steps < 1:
        raise UsageError(f"budget x{budget:g} ({monolith_steps} monolith steps of {model}) leaves "
                         f"no expert step for {k} experts ({arm}) once the router "
                         f"({router_flops:.3g} FLOPs) is paid; raise --monolith-steps or lower "
                         "--router-steps / --router-share")
    expert_flops = ensure_experts(run, model, k, expert_steps, args.batch_size // divisor, seed,
                                  smaller_budget_runs(run, budget))
    return run, {"monolith": monolith_steps * per_step, "ensemble": expert_flops + router_flops,
                 "expert_steps": expert_steps,
                 "router_share": router_flops / (expert_flops + router_flops)}


def improved(before, after):
    """Whether FD fell from `before` to `after` ({seed: FD} each), by the paired test:
    the 95 % interval of the same seed's change lies below zero. None with fewer than
    two shared seeds (no interval)."""
    seeds = sorted(set(before) & set(after))
    if len(seeds) < 2:
        return None
    mean, half = interval([after[s] - before[s] for s in seeds])
    return mean + half < 0


def arm_name(side, batch, schedule):
    """The name of a batch / schedule arm, also its folder's suffix: e.g. monolith-b16,
    experts-b8-wsd0.2."""
    suffix = "" if schedule[0] == "constant" else f"-{schedule[0]}{schedule[1]:g}"
    return f"{side}-b{batch}{suffix}"


def arm_run(args, model, k, budget, seed, side, batch, schedule):
    """(run folder, accounting) of one arm of the strongest-baseline comparison at one
    point of the scaling study.

    side 'monolith': one network of all the data at `batch` for the steps that spend
    the budget's FLOPs (batch B/K for K x S steps makes as many updates as the K
    experts together). side 'experts': DDM's k-means experts at `batch` each, for the
    steps that spend the budget less the router. The arm at the protocol's own batch
    (B, or B/K per expert) with a constant learning rate is the point's base folder;
    every other arm is a folder beside it that borrows its clusters (and, for experts,
    its router), so arms differ only in batch, steps and schedule."""
    base, _ = scaling_run(args, model, k, budget, seed, monolith_only=side == "monolith")
    reference = args.batch_size if side == "monolith" else args.batch_size // k
    run = base if (batch, schedule) == (reference, CONSTANT) else base + "-" + arm_name(side, batch, schedule)
    monolith_steps = max(1, round(args.monolith_steps * budget))
    per_step = config_of(os.path.join(base, "experts", "all"))["flops_per_step"]   # at batch B
    if side == "monolith":
        link_run(run, base, {})
        ensure_monolith(run, model,
                        max(1, round(monolith_steps * args.batch_size / batch)), batch, seed,
                        smaller_budget_runs(run, budget), schedule)
        return run, {"flops": config_of(os.path.join(run, "experts", "all"))["flops"],
                     **trained(run, ["all"])}
    link_run(run, base, {}, router_from=base)
    router_flops = config_of(os.path.join(base, "router"))["flops"]
    # an expert step at batch b costs b/B of a monolith step: the experts share what the
    # router leaves of the budget
    steps = int((monolith_steps * per_step - router_flops) * args.batch_size // (k * batch * per_step))
    if steps < 1:
        raise UsageError(f"budget x{budget:g} leaves no step for {k} experts at batch {batch} once "
                         "the router is paid")
    expert_flops = ensure_experts(run, model, k, steps, batch, seed,
                                  smaller_budget_runs(run, budget), schedule)
    return run, {"flops": expert_flops + router_flops, **trained(run, [str(j) for j in range(k)])}


def trained(run, names):
    """Optimizer updates and training images the networks `names` of RUN/experts made
    together."""
    updates = images = 0
    for name in names:
        path = os.path.join(run, "experts", name, "ckpt.pt")
        ckpt = torch.load(path, weights_only=True, mmap=True)
        updates += ckpt["step"]
        images += ckpt["step"] * ckpt["config"]["flags"]["batch_size"]
    return {"updates": updates, "images": images}


def plateau_budget(points):
    """The first budget at which the monolith's FD has stopped improving, or None.

    `points`: (budget, {training seed: FD}) at budgets that double. Stopped means that
    in two successive doublings the FD did not fall by the paired test (`improved`):
    the seeds share clusters and data order, so their spread, which an unpaired
    interval carries, cancels in each seed's own change. A single seed never stops."""
    points = sorted(points, key=lambda p: p[0])
    for (b0, f0), (b1, f1), (b2, f2) in zip(points, points[1:], points[2:]):
        doubling = b1 == 2 * b0 and b2 == 2 * b1
        if doubling and improved(f0, f1) is False and improved(f1, f2) is False:
            return b2
    return None


def sampling_flops(run, *flags):
    """The matrix FLOPs sample.py spends on one image with these flags, router included
    (top-1 runs the router at every solver step; each routed row runs only the experts
    it selects, so one image's count is every image's)."""
    parsed = sample_args("--run-dir", run, "--n", 1, *flags)
    experts, router, rule, names = sample.setup(
        run, parsed.experts.strip(), parsed.router, parsed.routing)
    ref = next(iter(experts.values()))
    condition = ref.condition
    ensemble = routing.Ensemble(experts, routing.routing_function(router, condition), rule,
                                condition, len(names),
                                parsed.cfg_scale, parsed.cfg_routing)
    ids = condition.requests(1, torch.Generator().manual_seed(0))
    noise = torch.randn(1, ref.config["channels"], ref.config["image_size"],
                        ref.config["image_size"])
    return count_flops(lambda: routing.sample(
        ensemble, noise, ids, parsed.steps, solver=parsed.solver,
        time_shift=parsed.time_shift, draws=sample.expert_draws(0, [0])))


def routed_sample(args, run, method):
    """The metrics of RUN/samples/METHOD.npz, one of SCALING_METHODS at the study's N,
    solver and steps (sampling seed 0)."""
    return sample_and_measure(run, os.path.join(run, "samples", f"{method}.npz"),
                              *SCALING_METHODS[method], "--n", args.n,
                              "--seed", 0, "--solver", args.solver, "--steps", args.sample_steps,
                              eval_flags=["--classifier-steps", args.classifier_steps])


@contextlib.contextmanager
def fd_plot(path, xlabel, ylabel, xlog=False):
    """Axes to draw FD curves on (log FD axis), written atomically as a PNG at `path`
    on exit."""
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
