"""Reproduce the papers' comparisons at small scale, one study (`--part`) at a time;
results in docs/results.md.

    python reproduce.py                  # --part main: every comparison once, one seed (16 min on 2 CPU cores)
    python reproduce.py --part scaling   # one of the studies below; --full runs the digits ones in turn

Each part lives in its own module of studies/ (listed in PARTS below) and writes
OUT/PART.json (raw numbers) and OUT/PART.md (its table); the main part writes
OUT/results.json and results.md. Everything goes through the stage scripts' own flags,
and every finished network and measured batch is found again by its path, so a killed
or repeated study resumes where it stopped."""
import argparse
import os

from studies import (attribution, bf16, confirm, contribution, control, conversion, distillation, epsilon,
                     guidance, heterogeneous, overview, router_cost, scaling, solvers, x16)
from studies.common import PROJECT, SCALING_ARMS
from plumbing.command_line import (Distinct, Parser, UsageError, class_list, float_in,
                                   int_at_least, run_main, seed_type)
from plumbing.run_dir import atomic_json, atomic_path

PARTS = {"main": overview, "guidance": guidance, "distill": distillation, "solvers": solvers,
         "precision": bf16,
         "scaling": scaling, "conversion": conversion, "epsilon": epsilon,
         "heterogeneous": heterogeneous,
         "contribution": contribution, "router-cost": router_cost, "control": control,
         "x16": x16, "confirm": confirm, "attribution": attribution}
# the studies that need nothing but digits; guidance, distill and solvers study an
# existing run (--run-dir)
FULL_PARTS = ["main", "scaling", "conversion", "epsilon", "heterogeneous"]


def main(args):
    # one after another, each resumable: a rerun skips every finished network and measured
    # batch
    if args.full:
        for part in FULL_PARTS:
            main(argparse.Namespace(**{**vars(args), "part": part, "full": False}))
        return
    return main_part(args) if args.part == "main" else run_part(args)


def main_part(args):
    """The short default, which writes its own OUT/results.json and results.md
    (studies/overview.py)."""
    overview.run(args)


def run_part(args):
    """One named study: its raw numbers in OUT/PART.json, its table in OUT/PART.md."""
    if args.part in ("scaling", "conversion", "router-cost", "x16", "solvers") and args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("the plots need matplotlib: pip install -r "
                             "requirements-repro.txt (or pass --no-plots)")
    results, lines = PARTS[args.part].run(args)
    os.makedirs(args.out, exist_ok=True)
    atomic_json(results, os.path.join(args.out, f"{args.part}.json"))
    with atomic_path(os.path.join(args.out, f"{args.part}.md")) as tmp, open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def add_scaling_flags(p):
    """The flags of --part scaling, which heterogeneous and contribution read too."""
    g = p.add_argument_group("--part scaling")
    g.add_argument("--budgets", type=float_in(0, 1e6, low_open=True), nargs="+", action=Distinct,
                   default=[0.5, 1, 2, 4],
                   help="multiples of --monolith-steps; a larger budget's monolith and "
                        "experts continue the same seed's furthest smaller-budget "
                        "checkpoint (same precision and clusters: identical to training "
                        "straight), so each doubling pays only for the steps it adds")
    g.add_argument("--k", type=int_at_least(2), nargs="+", action=Distinct, default=[4],
                   help="clusters (experts); several for the K sweep, e.g. --k 2 4 8 --budgets 1")
    g.add_argument("--models", nargs="+", default=["DiT-T/2", "DiT-M/2"])
    g.add_argument("--train-seeds", type=seed_type, nargs="+", action=Distinct, default=[0, 1, 2])
    g.add_argument("--data", default="digits",
                   help="the data set of every run (cluster.py's --data), e.g. "
                        "fashion-mnist; its runs are named after it, its plot is "
                        "scaling-DATA.png")
    g.add_argument("--splits", nargs="+", default=["ddm"], choices=list(SCALING_ARMS),
                   help="how the budget and the data are split over the experts: "
                        + "; ".join(f"{k}: {v}" for k, v in SCALING_ARMS.items()))
    g.add_argument("--router-steps", type=int_at_least(1), default=500,
                   help="the router's steps at budget x1, scaled with the budget")
    g.add_argument("--router-model", default="DiT-M/2",
                   help="the router's trunk (train_router.py --model)")
    g.add_argument("--router-share", type=float_in(
        0, 1, low_open=True, high_open=True), default=None,
                   help="instead of --router-steps: the router's FLOPs as this share of "
                        "each budget, for every model size (e.g. 0.03; the papers report "
                        "their router at about 4 %% of training FLOPs)")
    g.add_argument("--until-plateau", action="store_true",
                   help="after --budgets, keep doubling the budget until the monolith's "
                        "FD stops improving (two successive doublings each inside its "
                        "interval) or --max-budget is reached")
    g.add_argument("--monolith-only", action="store_true",
                   help="train and measure the monoliths alone (no router, no experts): "
                        "a cheap search for the budget where the monolith stops "
                        "improving (with --until-plateau), before the ensembles are "
                        "trained at it")
    g.add_argument("--monolith-batches", type=int_at_least(1), nargs="+", action=Distinct,
                   default=None, metavar="B",
                   help="the strongest baseline: monoliths at these batches too, each "
                        "for the steps that spend the budget's FLOPs (batch B/K for K x "
                        "S steps makes as many updates as the K experts together; "
                        "default: --batch-size alone)")
    g.add_argument("--expert-batches", type=int_at_least(1), nargs="+", action=Distinct,
                   default=None, metavar="B",
                   help="DDM's k-means experts at these batches each too (default: "
                        "--batch-size / K alone), for the steps that spend the budget "
                        "less the router")
    g.add_argument("--lr-schedules", nargs="+", action=Distinct, default=["constant"],
                   choices=["constant", "wsd"],
                   help="train every --monolith-batches and --expert-batches arm with "
                        "each: constant, or wsd (the learning rate decays linearly over "
                        "the last --decay-share of each run; a larger budget continues a "
                        "smaller one's checkpoint from where its decay began, so only "
                        "the decay is paid again)")
    g.add_argument("--decay-share", type=float_in(0, 1, low_open=True), default=0.2,
                   help="wsd: the decaying share of each run")
    g.add_argument("--equal-sampling-cost", action="store_true",
                   help="also sample every monolith with as many solver steps as make "
                        "its FLOPs per image equal top-1's (one expert and the router "
                        "per step), to compare at equal sampling cost as well as "
                        "training cost")
    g.add_argument("--distill", action="store_true",
                   help="also distill --distill-arm's ensemble under --distill-routing "
                        "into one network of the experts' size for --distill-steps at "
                        "--distill-batch, and report the student beside its teacher and "
                        "the monoliths")
    g.add_argument("--distill-arm", default="ddm",
                   help="--distill: the ensemble to distil, 'ddm' (DDM's split) or an "
                        "--expert-batches arm such as experts-b2 or experts-b4-wsd0.2")
    g.add_argument("--distill-batch", type=int_at_least(1), default=None,
                   help="--distill: the student's batch (default --batch-size; a student "
                        "is a monolith too, and as update-bound at the protocol's batch)")
    g.add_argument("--distill-routing", default="full", choices=["full", "top1", "top2"],
                   help="--distill: the teacher's routing (DDM distils the full mixture)")
    g.add_argument("--max-budget", type=float_in(0, low_open=True), default=64,
                   help="--until-plateau: the largest budget")
    g.add_argument("--classifier-steps", type=int_at_least(1), default=1500,
                   help="the evaluation classifier's training steps (eval.py's default)")
    g.add_argument("--solver", default="euler", choices=["euler", "heun"])
    g.add_argument("--sample-steps", type=int_at_least(1), default=16,
                   help="solver steps per sample (heun: 2 network evaluations each); 16 "
                        "Euler steps cost a third of the default 50 and raise FD by 7-16 "
                        "%% (docs/solvers.md), least for the full ensemble")
    g.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write the PNG plot (needs matplotlib: pip install -r "
                        "requirements-repro.txt)")


def build_parser():
    p = Parser(prog="reproduce.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/repro",
                   help="where every run, sample batch and result goes")
    p.add_argument("--monolith-steps", type=int_at_least(1), default=2000,
                   help="the monolith's steps; experts get the same FLOPs in total")
    p.add_argument("--batch-size", type=int_at_least(1), default=64,
                   help="the monolith's batch; each of the 4 experts trains at a quarter of it")
    p.add_argument("--model", default="DiT-T/2")
    p.add_argument("--n", type=int_at_least(4), default=500,
                   help="samples per comparison (FDs are comparable only at equal N)")
    p.add_argument("--curve-points", type=int_at_least(1), default=5,
                   help="evaluations along the conversion runs")
    p.add_argument("--curve-n", type=int_at_least(4), default=200,
                   help="samples per conversion evaluation")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--part", default="main", choices=list(PARTS),
                   help="main: the comparisons above; guidance: FD of guided ensembles "
                        "(top-1/top-2/full x shared/independent unconditional routing x "
                        "scales 1.5, 2, 3) on the experts of --run-dir; distill: "
                        "distill.py's student of --run-dir's ensemble against that "
                        "ensemble and a monolith of equal training FLOPs; solvers: FD "
                        "against network evaluations for Euler, Heun, ab2 and diffusers' flow "
                        "multistep schedulers (top-1 of --run-dir, the monolith of "
                        "--monolith-run); precision: fp32 vs bf16 training of a DiT-S/2 on "
                        "16-px digits; scaling: FD against training FLOPs, monolith vs "
                        "ensemble, --budgets x --models x --train-seeds, with 95 %% "
                        "intervals and a plot; conversion: flow experts converted from a "
                        "DDPM monolith of all digits (time maps linear and snr) vs from "
                        "scratch, per cluster and seed; epsilon: flow vs DDPM monoliths "
                        "(beta schedule, lr, EMA) at --monolith-steps, --batch-size, "
                        "--n; heterogeneous: --ddpm-experts DDPM experts among flow ones "
                        "(from scratch or converted) against the scaling study's "
                        "all-flow ensembles, at every --models x --k x --budgets x "
                        "--train-seeds point; contribution: routers from the experts' "
                        "samples vs from data, contributors' class groups vs k-means, "
                        "and an expert that joins later, at the first --models and "
                        "--budgets point of the scaling study; router-cost: routers of "
                        "decreasing cost over --run-dir's experts, paired by seed against "
                        "the first of --router-models; control: the information control, a "
                        "monolith told each image's cluster and routed like top-1, over the "
                        "scaling study's folders in --run-dir; x16: the x16 study's declared "
                        "analysis over its kept chunk files (--results); confirm and "
                        "attribution: the declared tests of docs/confirm-protocol.md and "
                        "docs/attribution-protocol.md (--sides runs their chunks)")
    p.add_argument("--full", action="store_true",
                   help=f"run the parts {', '.join(FULL_PARTS)} in turn (hours on 2 CPU "
                        "cores; resumable)")
    p.add_argument("--run-dir", default="runs",
                   help="--part guidance/distill/solvers: the run whose experts and router are used")
    p.add_argument("--seeds", type=seed_type, nargs="+", action=Distinct, default=[0, 1],
                   help="--part guidance/distill/solvers: sampling seeds")
    p.add_argument("--distill-steps", type=int_at_least(1), default=1000,
                   help="--part distill and --part scaling --distill: the student's steps")
    p.add_argument("--precision-steps", type=int_at_least(1), default=300,
                   help="--part precision: training steps per run")
    p.add_argument("--precision-model", default="DiT-S/2",
                   help="--part precision: the monolith's size (a matmul-bound one: bf16 "
                        "pays only where the step is matrix work)")
    add_scaling_flags(p)
    g = p.add_argument_group("--part conversion (also uses --model, --batch-size (/K per "
                             "expert), --train-seeds, --curve-points, --curve-n, "
                             "--sample-steps, --classifier-steps and the first --k)")
    g.add_argument("--source-steps", type=int_at_least(1), default=2000,
                   help="the DDPM source monolith's steps (a public checkpoint: not charged)")
    g.add_argument("--conversion-steps", type=int_at_least(1), default=1000,
                   help="each flow expert's fine-tuning steps")
    g = p.add_argument_group("--part heterogeneous (also uses the scaling flags and --source-steps)")
    g.add_argument("--ddpm-experts", type=int_at_least(1), default=2,
                   help="how many of the K experts are DDPM (HDDM: 2 of 8)")
    g.add_argument("--arms", nargs="+", default=["ddpm+flow", "ddpm+converted"],
                   choices=["ddpm+flow", "ddpm+converted"],
                   help="the mixed arms to build beside the all-flow one (ddpm+converted "
                        "trains K - --ddpm-experts more experts)")
    g = p.add_argument_group("--part contribution (also uses the scaling flags: the "
                             "first --models and --budgets, --data, --router-model, "
                             "--router-share, --train-seeds)")
    g.add_argument("--sample-budgets", type=int_at_least(8), nargs="+", action=Distinct,
                   default=[64, 256, 1024],
                   help="samples per expert of each router trained from the experts' samples")
    g.add_argument("--contributor-classes", type=class_group, nargs="+",
                   default=["0,1,2", "3,4,5", "6,7", "8,9"],
                   help="the class groups the contributors hold, one expert each (also K "
                        "of the k-means run compared); the last one joins later")
    g.add_argument("--compare-router-steps", type=int_at_least(1), default=None,
                   help="steps of the routers compared from data and from samples "
                        "(default: the FLOP-matched router's; a router at a few %% of a "
                        "small budget may learn little beyond the label)")
    g.add_argument("--join-share", type=float_in(0, 1, low_open=True), default=0.25,
                   help="the joined router's fine-tuning steps as a share of the router's steps")
    add_router_cost_flags(p)
    add_confirm_flags(p)
    return p


def add_router_cost_flags(p):
    """The flags of --part router-cost."""
    g = p.add_argument_group("--part router-cost (also uses --run-dir: the experts and their "
                             "router; --seeds: router and sampling seeds; --n, --sample-steps, "
                             "--solver, --classifier-steps)")
    g.add_argument("--router-models", nargs="+", action=Distinct,
                   default=["DiT-M/4", "DiT-M/14", "DiT-N/7", "DiT-N/14", "DiT-N/28", "DiT-M/7@2"],
                   metavar="MODEL[@F][:S]",
                   help="the routers to compare, the first the reference; MODEL@F reads x_t "
                        "pooled F x F (train_router.py --downsample F); MODEL:S trains S "
                        "steps, not the run's router's training FLOPs")
    g.add_argument("--router-every", type=int_at_least(2), nargs="*", default=[2, 4, 16],
                   metavar="M",
                   help="the reference router evaluated every M solver steps, held between "
                        "(M = the step count: routed once, by the condition and the noise)")
    g.add_argument("--monolith-samples", default=None, metavar="NPZ",
                   help="a monolith's measured batch (its .eval.json beside it), drawn as "
                        "the plot's reference line")
    g = p.add_argument_group("--part x16 (also uses --plots)")
    g.add_argument("--results", default=None, metavar="DIR",
                   help="the folder of a chunked study's files, one per finished chunk (a "
                        "seed's monolith or experts arms), pooled by the declared analysis "
                        "(default docs/x16, docs/confirm or docs/attribution for those "
                        "parts); --sides writes each chunk there")
    g.add_argument("--earlier", default=os.path.join(PROJECT, "docs"), metavar="DIR",
                   help="where the earlier studies' raw numbers lie (the forest plot's other "
                        "settings)")
    g.add_argument("--grid", nargs="+", type=titled_batch, default=None, metavar="TITLE=NPZ",
                   help="sample batches of one sampling seed to draw side by side, a row per "
                        "class (e.g. 'best monolith=A.npz' 'best ensemble=B.npz')")


def add_confirm_flags(p):
    """The flags of --part confirm and attribution (their protocols fix everything else)."""
    g = p.add_argument_group("--part confirm, attribution (also use --train-seeds, --out, "
                             "--results)")
    g.add_argument("--sides", nargs="+", action=Distinct, default=None,
                   choices=list(dict.fromkeys([*confirm.SIDES, *attribution.SIDES])),
                   help="train and measure these sides of every --train-seeds seed, one "
                        "chunk file each in --results; without it, the declared analysis "
                        "of the chunks in --results (confirm: experts, monolith, control; "
                        "attribution: " + ", ".join(attribution.SIDES) + ")")
    g.add_argument("--monolith-run", default=None, metavar="DIR",
                   help="--part solvers: the run whose experts/all is the monolith (default --run-dir)")
    g.add_argument("--inception-weights", default=None, metavar="FILE",
                   help="also the Inception FID and KID of every arm (eval.py "
                        "--inception-weights; secondary)")


def titled_batch(text):
    title, sep, path = text.partition("=")
    if not sep or not title or not path.endswith(".npz"):
        raise argparse.ArgumentTypeError(f"{text!r}: give TITLE=BATCH.npz")
    return title, path


def class_group(text):
    """A contributor's classes, e.g. 0,1,2 (validated as train_expert.py's --classes)."""
    return ",".join(map(str, class_list(text)))


if __name__ == "__main__":
    run_main(main, build_parser())
