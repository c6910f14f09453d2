"""The information control (`--part control`): does the ensemble win because it knows the
cluster, or because it splits the parameters?

Over a scaling study's folders (--run-dir: its scaling/ folder, only read), at every
--budgets x --train-seeds point: one monolith of the first --models at the first
--monolith-batches batch (the strongest monolith's), for the steps that spend the
budget's FLOPs, is given each image's k-means cluster as a second label (train_expert.py
--condition class+cluster; dropped with the class for guidance). It is sampled with the
point's router choosing the top-1 cluster at every step, exactly as top-1 routing chooses
an expert, so it differs from the ensemble only in sharing one network's parameters (and
from the plain monolith only in being told the cluster). Each is paired by seed with the
study's top-1 ensemble (experts at the first --expert-batches batch) and its monolith at
the same batch, all at the same N, sampling seed 0, solver and judge.

arXiv 2403.00570 reports FID 1.67 on CIFAR-10 from cluster conditioning alone."""
import json
import os
import shutil

import train_expert
from plumbing.command_line import UsageError
from studies.common import (config_of, interval, link_run, sample_and_measure,
                            smaller_budget_runs, stage, trained_to, warm_start)


def run(args):
    model, k = args.models[0], args.k[0]
    batch = (args.monolith_batches or [args.batch_size])[0]
    expert_batch = (args.expert_batches or [args.batch_size // k])[0]
    out = os.path.join(args.out, "control")
    copy_judge(args.run_dir, out)
    data = args.data.split(":")[0]
    rows = []
    for budget in args.budgets:
        for seed in args.train_seeds:
            name = (f"{'' if data == 'digits' else data + '-'}{model.replace('/', '')}-k{k}-"
                    f"x{budget:g}-seed{seed}" + (f"-router{args.router_share:g}"
                                                 if args.router_share else ""))
            base = os.path.join(args.run_dir, name)
            arms = {"ensemble": (f"{base}-experts-b{expert_batch}", "top-1"),
                    "monolith": (f"{base}-monolith-b{batch}", "monolith")}
            arms = {arm: os.path.join(folder, "samples", f"{file}.eval.json")
                    for arm, (folder, file) in arms.items()}
            needed = [os.path.join(base, "clusters.pt"), os.path.join(base, "router", "ckpt.pt"),
                      *arms.values()]
            missing = [path for path in needed if not os.path.isfile(path)]
            if missing:
                raise UsageError(f"--part control compares with the scaling study's point "
                                 f"x{budget:g} seed {seed}: {missing[0]} is missing")
            run_dir = link_run(os.path.join(out, name), base, {}, router_from=base)
            if not os.path.lexists(os.path.join(run_dir, "eval")):
                os.symlink(os.path.abspath(os.path.join(out, "eval")), os.path.join(run_dir, "eval"))
            steps = max(1, round(args.monolith_steps * budget * args.batch_size / batch))
            train_control(run_dir, model, steps, batch, seed, budget)
            measured = sample_and_measure(
                run_dir, os.path.join(run_dir, "samples", "top-1.npz"), "--experts", "all",
                "--routing", "top1", "--n", args.n, "--seed", 0, "--solver", args.solver,
                "--steps", args.sample_steps,
                eval_flags=["--classifier-steps", args.classifier_steps])
            row = {"budget": budget, "seed": seed, "steps": steps, "batch": batch,
                   "control": metrics_of(measured)}
            for arm, path in arms.items():
                with open(path) as f:
                    row[arm] = metrics_of(json.load(f))
            rows.append(row)
    results = {"study": args.run_dir, "model": model, "k": k, "n": args.n, "batch": batch,
               "expert_batch": expert_batch, "rows": rows}
    return results, table(results)


def copy_judge(study, out):
    """A copy of the study's evaluation folder: the same judge and reference, and nothing
    written into the study."""
    target = os.path.join(out, "eval")
    if not os.path.isdir(target) and os.path.isdir(os.path.join(study, "eval")):
        shutil.copytree(os.path.join(study, "eval"), target + ".partial", dirs_exist_ok=True)
        os.replace(target + ".partial", target)


def train_control(run_dir, model, steps, batch, seed, budget):
    """RUN/experts/all: the cluster-conditioned monolith, continuing a smaller budget's."""
    folder = os.path.join(run_dir, "experts", "all")
    if trained_to(folder, steps):
        return
    warm_start(folder, steps, [os.path.join(r, "experts", "all")
                               for r in smaller_budget_runs(run_dir, budget)], run_dir)
    stage(train_expert, "--cluster", "all", "--condition", "class+cluster", "--objective", "fm",
          "--model", model, "--steps", steps, "--batch-size", batch, "--seed", seed,
          "--run-dir", run_dir)
    assert config_of(folder)["condition"]["kind"] == "class+cluster"


def metrics_of(record):
    return {"fd": record["fd_classifier"], "accuracy": record.get("conditional_accuracy"),
            "kid": record.get("kid_classifier"), "file": record["file"]}


def table(results):
    lines = [f"The information control over {results['study']}: {results['model']}, K = "
             f"{results['k']}, N = {results['n']}, top-1. 'told' = one monolith at batch "
             f"{results['batch']} given each image's cluster, sampled with the router's top-1 "
             f"cluster; 'experts' = the top-1 ensemble at batch {results['expert_batch']}; "
             f"'monolith' = the plain monolith at batch {results['batch']}. Differences paired "
             "by seed, mean +/- 95 % t half-width.", "",
             "| budget | seeds | told FD | experts FD | monolith FD | told - monolith | "
             "experts - told | told acc. % | experts acc. % | monolith acc. % |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for budget in sorted({r["budget"] for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["budget"] == budget]

        def mean(arm, key="fd", scale=1):
            return f"{sum(scale * r[arm][key] for r in rows) / len(rows):.2f}"

        def paired(a, b):
            m, h = interval([r[a]["fd"] - r[b]["fd"] for r in rows])
            return f"{m:+.2f} +/- {h:.2f}"
        lines.append(f"| x{budget:g} | {', '.join(str(r['seed']) for r in rows)} | "
                     f"{mean('control')} | {mean('ensemble')} | {mean('monolith')} | "
                     f"{paired('control', 'monolith')} | {paired('ensemble', 'control')} | "
                     f"{mean('control', 'accuracy', 100)} | {mean('ensemble', 'accuracy', 100)} | "
                     f"{mean('monolith', 'accuracy', 100)} |")
    return lines
