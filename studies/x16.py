"""The x16 study's declared analysis (docs/x16-protocol.md) over the chunks it has so far.

The study runs in chunks (a seed's monolith arms, its experts' arms, each a `--part
scaling` run), and every finished chunk is kept as one JSON file (its scaling.json, the
metrics of every batch it measured, the command and commit). This part pools those files,
so the analysis can be run again whenever a seed is added, on any machine, without the run
folders.

Primary test (declared before any x16 result): best ensemble arm minus best monolith arm
at x16, classifier FD, each side's arm chosen by leave-one-seed-out (for the seed scored,
the arm with the lowest mean FD over the other seeds), paired over the seeds, 95 %
t-interval."""

import glob
import json
import os
import textwrap

import numpy as np

from plumbing.command_line import NUMBER, UsageError, checked_record
from plumbing.run_dir import atomic_path
from studies.common import PROJECT, interval, plus_minus

ROUTINGS = ("top-1", "top-2", "full")
# (split, method) of every declared candidate; splits are the scaling study's arm names
ENSEMBLE = [(split, m) for split in ("experts-b2", "ddm") for m in ROUTINGS]
AMENDED = ENSEMBLE + [("experts-b2-wsd0.2", m) for m in ROUTINGS]
MONOLITH = [
    ("monolith-b4", "monolith"),
    ("monolith-b8", "monolith"),
    ("monolith-b4-wsd0.2", "monolith"),
    ("monolith", "monolith"),
]
ARM_NAMES = {
    "monolith": "monolith, batch 64 (protocol)",
    "ddm": "experts, batch 16 (DDM's split)",
}


# what every run row of a chunk must hold, and the metrics read from its batch's record
RUN_ROW = {"budget": NUMBER, "seed": int, "split": str, "method": str, "fd": NUMBER}
EVAL_FIELDS = {"precision": (*NUMBER, type(None)), "recall": (*NUMBER, type(None))}
EXTRA_FIELDS = {k: (*NUMBER, type(None)) for k in ("fid", "kid", "fd_classifier")}


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not readable JSON ({type(e).__name__}: {e})")


def arm_label(split, method):
    name = ARM_NAMES.get(
        split, split.replace("-b", ", batch ").replace("-wsd0.2", ", wsd")
    )
    return name if method == "monolith" else f"{name}, {method}"


def load_chunks(folder):
    """Every chunk file of FOLDER: {(budget, seed, split, method): row}, each row with the
    precision and recall of its batch, the list of chunks read, and the protocol
    monoliths measured twice with different FDs (trained again on another machine)."""
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        raise UsageError(
            f"--results {folder}: no chunk files (*.json) of the x16 study there"
        )
    rows, chunks, repeats = {}, [], {}
    for path in paths:
        chunk = read_json(path)
        checked_record(chunk, {"scaling": dict, "evals": dict}, path)
        checked_record(chunk["scaling"], {"runs": list}, f"{path} (scaling)")
        runs, evals = chunk["scaling"]["runs"], chunk["evals"]
        for i, r in enumerate(runs):
            checked_record(r, RUN_ROW, f"{path} (run {i})")
        chunks.append(
            {
                "file": os.path.basename(path),
                "commit": chunk.get("commit"),
                "command": chunk.get("command"),
            }
        )
        for r in runs:
            key = (float(r["budget"]), int(r["seed"]), r["split"], r["method"])
            folder_name = arm_folder(r["budget"], r["seed"], r["split"])
            name = f"scaling/{folder_name}/samples/{r['method']}.eval.json"
            metrics = checked_record(evals.get(name, {}), EVAL_FIELDS, f"{path} ({name})")
            row = {
                **r,
                "precision": metrics.get("precision"),
                "recall": metrics.get("recall"),
                "judge": metrics.get("classifier_digest"),
            }
            if key in rows and abs(rows[key]["fd"] - row["fd"]) > 1e-6:
                # Both sides of a seed train the protocol monolith (every --part scaling
                # run trains its base folder), so it is the one batch made twice by
                # design; on two machines the float kernels differ and so do the weights.
                # The first file read keeps it; the repeat is reported, a measured
                # reproducibility figure. Any other batch made twice is an error.
                if r["split"] != "monolith":
                    raise UsageError(
                        f"{path}: {key} measured twice with different FDs "
                        f"({rows[key]['fd']:.3f} and {row['fd']:.3f})"
                    )
                # one entry per distinct repeated FD, naming every file that holds it
                entry = repeats.setdefault(
                    (key[0], key[1], row["fd"]),
                    {
                        "budget": key[0],
                        "seed": key[1],
                        "kept": {"fd": rows[key]["fd"], "file": rows[key]["file"]},
                        "repeat": {"fd": row["fd"], "files": []},
                    },
                )
                entry["repeat"]["files"].append(os.path.basename(path))
            rows.setdefault(key, {**row, "file": os.path.basename(path)})
    return rows, chunks, list(repeats.values())


def loso(rows, budget, candidates, seeds):
    """{seed: (arm, row)}: for each seed, the candidate with the lowest mean FD over the
    other seeds that have it (seeds where no candidate has another seed are left out)."""
    chosen = {}
    for seed in seeds:
        means = {}
        for arm in candidates:
            others = [
                rows[(budget, s, *arm)]["fd"]
                for s in seeds
                if s != seed and (budget, s, *arm) in rows
            ]
            if others and (budget, seed, *arm) in rows:
                means[arm] = np.mean(others)
        if means:
            arm = min(means, key=means.get)
            chosen[seed] = (arm, rows[(budget, seed, *arm)])
    return chosen


def paired(ensemble, monolith, field="fd"):
    """Mean and 95 % half-width of ensemble - monolith over the seeds where both arms
    measured `field` (FID and a second sampling seed exist for some seeds only); `seeds`
    names exactly the seeds behind `per_seed`."""
    seeds = [
        s for s in sorted(set(ensemble) & set(monolith))
        if ensemble[s][1].get(field) is not None and monolith[s][1].get(field) is not None
    ]
    diffs = [ensemble[s][1][field] - monolith[s][1][field] for s in seeds]
    mean, half = interval(diffs) if diffs else (float("nan"), float("nan"))
    return {"seeds": seeds, "per_seed": diffs, "mean": mean, "half": half}


def complete_seeds(rows, budget, arms, seeds):
    """(the seeds that hold every candidate arm some seed holds at this budget, {seed: the
    arms it lacks}): a seed with a chunk missing is left out and named, never scored on
    whichever arms its other chunks happen to hold."""
    present = [arm for arm in arms if any((budget, s, *arm) in rows for s in seeds)]
    lacking = {s: [arm for arm in present if (budget, s, *arm) not in rows] for s in seeds}
    held = [s for s in seeds if any((budget, s, *arm) in rows for arm in present)]
    return ([s for s in held if not lacking[s]],
            {s: [arm_label(*a) for a in lacking[s]] for s in held if lacking[s]})


# Post hoc, after the primary was read: the declared choice set the wsd-decayed monolith
# against constant-rate experts. Fixed arms (no choice), the same schedule on both sides.
POST_HOC = {
    "constant_x16": ((16.0, "experts-b2", "top-1"), (16.0, "monolith-b4", "monolith")),
    "wsd_x16": ((16.0, "experts-b2-wsd0.2", "top-1"), (16.0, "monolith-b4-wsd0.2", "monolith")),
    "decay_experts": ((16.0, "experts-b2-wsd0.2", "top-1"), (16.0, "experts-b2", "top-1")),
    "decay_monolith": ((16.0, "monolith-b4-wsd0.2", "monolith"),
                       (16.0, "monolith-b4", "monolith")),
}


def same_schedule(rows, seeds):
    """POST_HOC's paired differences, and the constant-schedule change from x8 to x16."""
    def per_seed(a, b):
        return {s: rows[(a[0], s, *a[1:])]["fd"] - rows[(b[0], s, *b[1:])]["fd"]
                for s in seeds if (a[0], s, *a[1:]) in rows and (b[0], s, *b[1:]) in rows}

    got = {name: per_seed(*arms) for name, arms in POST_HOC.items()}
    x8 = per_seed((8.0, "experts-b2", "top-1"), (8.0, "monolith-b4", "monolith"))
    got["constant_x8_to_x16"] = {s: d - x8[s] for s, d in got["constant_x16"].items()
                                 if s in x8}
    out = {}
    for name, diffs in got.items():
        mean, half = interval(list(diffs.values())) if len(diffs) > 1 else (float("nan"),) * 2
        out[name] = {"seeds": sorted(diffs), "per_seed": [diffs[s] for s in sorted(diffs)],
                     "mean": mean, "half": half}
    return out


def comparison(rows, budget, ensemble_arms, seeds):
    complete, incomplete = complete_seeds(rows, budget, ensemble_arms + MONOLITH, seeds)
    ens, mono = loso(rows, budget, ensemble_arms, complete), loso(
        rows, budget, MONOLITH, complete
    )
    return {
        "budget": budget,
        "left_out": incomplete,
        "chosen": {
            s: {
                "ensemble": list(ens[s][0]) if s in ens else None,
                "monolith": list(mono[s][0]) if s in mono else None,
            }
            for s in seeds
        },
        **{
            field: paired(ens, mono, field)
            for field in (
                "fd",
                "accuracy",
                "precision",
                "recall",
                "fid",
                "kid",
                "fd_seed1",
            )
        },
    }


def arm_folder(budget, seed, split):
    return f"fashion-mnist-DiT-M4-k4-x{budget:g}-seed{seed}-router0.05" + (
        "" if split in ("monolith", "ddm") else f"-{split}"
    )


def load_extras(folder):
    """The kept Inception measurements ({(budget, seed, split, method): metrics}, from
    inception/seedN.json) and information-control rows (control/seedN.json)."""
    inception, floor, control = {}, {}, []
    for kind, found in (("inception", inception), ("floor", floor)):
        for path in sorted(glob.glob(os.path.join(folder, kind, "*.json"))):
            for key, metrics in checked_record(read_json(path), {}, path).items():
                schema = {"fd_classifier": NUMBER} if kind == "floor" else EXTRA_FIELDS
                found[batch_key(key, path)] = checked_record(metrics, schema, f"{path} ({key})")
    for path in sorted(glob.glob(os.path.join(folder, "control", "*.json"))):
        rows = checked_record(read_json(path), {"rows": list}, path)["rows"]
        for i, row in enumerate(rows):
            checked_record(row, {"budget": NUMBER, "seed": int, "control": dict, "ensemble": dict,
                                 "monolith": dict}, f"{path} (row {i})")
            for arm in ("control", "ensemble", "monolith"):
                checked_record(row[arm], {"fd": NUMBER}, f"{path} (row {i}, {arm})")
        control += rows
    return inception, floor, control


def batch_key(key, path):
    """'FOLDER/METHOD' of a batch -> (budget, seed, split, method)."""
    try:
        folder_name, method = key.split("/")
        _, _, rest = folder_name.partition("-x")
        budget, _, rest = rest.partition("-seed")
        seed, _, split = rest.partition("-router0.05")
        return float(budget), int(seed), split.lstrip("-") or "ddm", method
    except ValueError:
        raise UsageError(f"{path}: {key!r} names no batch of the study (FOLDER/METHOD)")


def with_inception(rows, inception, floor):
    """Each row with the FID, KID and memorisation of its batch, and its FD at sampling
    seed 1, where they were measured."""
    for key, row in rows.items():
        m = inception.get(key, {})
        row.update(
            fid=m.get("fid"),
            kid=m.get("kid"),
            kid_std=m.get("kid_std"),
            memorisation=m.get("memorisation"),
            fd_seed1=floor.get(key, {}).get("fd_classifier"),
        )
        if m.get("fd_classifier") is not None and abs(m["fd_classifier"] - row["fd"]) > 1e-3:
            raise UsageError(
                f"{key}: the Inception pass's classifier FD {m['fd_classifier']:.3f} "
                f"is not the study's {row['fd']:.3f}: another batch or judge"
            )


def control_summary(control):
    """Per budget: told - monolith and experts - told, paired by seed."""
    out = {}
    for budget in sorted({r["budget"] for r in control}):
        rows = [r for r in control if r["budget"] == budget]
        out[f"x{budget:g}"] = {
            "seeds": [r["seed"] for r in rows],
            **{
                arm: float(np.mean([r[arm]["fd"] for r in rows]))
                for arm in ("control", "ensemble", "monolith")
            },
            **{
                f"{arm}_accuracy": float(
                    100 * np.mean([r[arm]["accuracy"] for r in rows])
                )
                for arm in ("control", "ensemble", "monolith")
            },
            "told_minus_monolith": interval(
                [r["control"]["fd"] - r["monolith"]["fd"] for r in rows]
            ),
            "experts_minus_told": interval(
                [r["ensemble"]["fd"] - r["control"]["fd"] for r in rows]
            ),
        }
    return out


def run(args):
    results_dir = args.results or os.path.join(PROJECT, "docs", "x16")
    rows, chunks, repeats = load_chunks(results_dir)
    inception, floor, control = load_extras(results_dir)
    with_inception(rows, inception, floor)
    seeds = sorted({seed for _, seed, *_ in rows})
    judges = sorted({r["judge"] for r in rows.values() if r["judge"]})
    results = {
        "chunks": chunks,
        "repeats": repeats,
        "seeds": seeds,
        "judges": judges,
        "rows": [dict(r) for r in rows.values()],
    }
    results["primary"] = comparison(rows, 16.0, ENSEMBLE, seeds)
    results["amended"] = comparison(rows, 16.0, AMENDED, seeds)
    results["x8"] = comparison(rows, 8.0, ENSEMBLE, seeds)
    results["x4"] = comparison(rows, 4.0, ENSEMBLE, seeds)
    x8 = dict(zip(results["x8"]["fd"]["seeds"], results["x8"]["fd"]["per_seed"]))
    x16 = dict(
        zip(results["primary"]["fd"]["seeds"], results["primary"]["fd"]["per_seed"])
    )
    both = sorted(set(x8) & set(x16))
    mean, half = interval([x16[s] - x8[s] for s in both]) if both else (float("nan"),) * 2
    results["x8_to_x16"] = {
        "seeds": both,
        "per_seed": [x16[s] - x8[s] for s in both],
        "mean": mean,
        "half": half,
    }
    results["post_hoc"] = same_schedule(rows, seeds)
    results["control"] = control_summary(control)
    redrawn = [r for r in rows.values() if r.get("fd_seed1") is not None]
    results["sampling_floor"] = {
        "batches": len(redrawn),
        "mean_abs_change": (
            float(np.mean([abs(r["fd_seed1"] - r["fd"]) for r in redrawn]))
            if redrawn
            else None
        ),
        "max_abs_change": (
            float(max(abs(r["fd_seed1"] - r["fd"]) for r in redrawn)) if redrawn else None
        ),
    }
    results["forest"] = forest_entries(args.earlier, results, rows)
    lines = report(results, rows, seeds) + forest_lines(results["forest"])
    if args.plots:
        plot_forest(results["forest"], os.path.join(args.out, "x16-forest.png"))
        lines += ["", "![The forest plot: each setting's paired difference](x16-forest.png)"]
        if args.grid:
            plot_grid(args.grid, os.path.join(args.out, "x16-grid.png"))
            lines += ["", "![Samples of the same noise and classes](x16-grid.png)"]
    return results, lines


def pair(mean_half):
    """'+m ± h' of a (mean, half-width) pair; a bare '+m' for one seed (no interval)."""
    return plus_minus(*mean_half, "+.1f")


def forest_lines(entries):
    """The forest plot's settings as a table, the earlier ones also with each seed's arms
    chosen on the other seeds (what the in-sample choice of their best arms adds; a test
    whose arms were fixed in advance has no choice to hold out)."""
    lines = ["", "## Every setting: best ensemble − best monolith, FD", "",
             "| setting | chosen | FD | arms chosen leave-one-seed-out |", "|---|---|---|---|"]
    for e in entries:
        no_choice_held_out = e["chosen_by"] in ("leave-one-seed-out", "declared in advance")
        held_out = e["fd"] if no_choice_held_out else e.get("fd_leave_one_seed_out")
        lines.append(f"| {e['label']} | {e['chosen_by']} | {pair(e['fd'])} | "
                     f"{pair(held_out) if held_out else '–'} |")
    return lines


def fmt(c, digits=1):
    if not c["per_seed"]:
        return "–"
    return f"{plus_minus(c['mean'], c['half'], f'+.{digits}f')} (N = {len(c['per_seed'])})"


def mean_of(got, key, scale=1.0, digits=1):
    values = [scale * g[key] for g in got if g and g.get(key) is not None]
    return f"{np.mean(values):.{digits}f}" if values else "–"


def memorised(got, field, space):
    values = [
        100 * g["memorisation"][space][field]
        for g in got
        if g and g.get("memorisation") and space in g["memorisation"]
    ]
    return f"{np.mean(values):.1f}" if values else "–"


def report(results, rows, seeds):
    lines = [
        "# The x16 study of Fashion DiT-M/4: what the chunks so far show",
        "",
        f"Seeds with any arm: {', '.join(map(str, seeds))}. Judge digest(s): "
        f"{', '.join(results['judges']) or 'unknown'}. Chunks: {len(results['chunks'])} "
        "(the commands are in x16.json). Classifier FD at N = 1000, sampling seed 0, "
        "16 Euler steps; ± is the 95 % t-interval over seeds.",
        "",
    ]
    lines += budget_tables(rows, seeds)
    lines += comparison_lines(results)
    if results["repeats"]:
        lines += [
            "",
            "## Batches trained twice",
            "",
            "Both sides of a seed train the batch-64 protocol monolith; where the two sides "
            "ran on different machines the two runs differ (float kernels), and the table "
            "above keeps the first file's:",
            "",
        ]
        lines += [
            f"- seed {r['seed']}, x{r['budget']:g}: FD {r['kept']['fd']:.1f} "
            f"({r['kept']['file']}) and {r['repeat']['fd']:.1f} "
            f"({', '.join(r['repeat']['files'])})"
            for r in results["repeats"]
        ]
    return lines


def budget_tables(rows, seeds):
    """Per budget: every arm's FD per seed, then the Inception and memorisation table."""
    lines = []
    arms = sorted({(r["split"], r["method"]) for r in rows.values()})
    for budget in (4.0, 8.0, 16.0):
        present = [arm for arm in arms if any((budget, s, *arm) in rows for s in seeds)]
        if not present:
            continue
        lines += [
            f"## x{budget:g}",
            "",
            "| arm | "
            + " | ".join(f"seed {s}" for s in seeds)
            + " | mean FD | class accuracy |",
            "|---|" + "---|" * len(seeds) + "---|---|",
        ]
        for arm in present:
            got = [rows.get((budget, s, *arm)) for s in seeds]
            lines.append(
                f"| {arm_label(*arm)} | "
                + " | ".join(f"{g['fd']:.1f}" if g else "–" for g in got)
                + f" | {mean_of(got, 'fd')} | {mean_of(got, 'accuracy', 100)} % |"
            )
        measured = [
            arm
            for arm in present
            if any(rows.get((budget, s, *arm), {}).get("fid") is not None for s in seeds)
        ]
        if measured:
            lines += [
                "",
                f"Inception FID and KID, and memorisation (% of samples), at "
                f"x{budget:g}, means over the seeds measured (FID floor at N = 1000: "
                f"{FASHION_FID_FLOOR}; docs/evaluation.md):",
                "",
                "| arm | seeds | classifier FD | FID | KID | memorised, pixels / "
                "features | nearer train than test, pixels / features |",
                "|---|---|---|---|---|---|---|",
            ]
            for arm in measured:
                got = [rows.get((budget, s, *arm)) for s in seeds]
                got = [g for g in got if g and g.get("fid") is not None]
                lines.append(
                    f"| {arm_label(*arm)} | {len(got)} | {mean_of(got, 'fd')} | "
                    f"{mean_of(got, 'fid')} | {mean_of(got, 'kid', digits=4)} | "
                    f"{memorised(got, 'memorised', 'pixels')} / "
                    f"{memorised(got, 'memorised', 'clf')} | "
                    f"{memorised(got, 'nearer_train_than_test', 'pixels')} / "
                    f"{memorised(got, 'nearer_train_than_test', 'clf')} |"
                )
        lines.append("")
    return lines


def comparison_lines(results):
    """The declared comparisons, the sampling floor, the chosen arms and the control."""
    lines = [
        "## The declared comparisons (leave-one-seed-out choice of each side's arm)",
        "",
        "| comparison | FD, ensemble − monolith | requested class, points | "
        "precision | recall | FID | KID |",
        "|---|---|---|---|---|---|---|",
    ]
    lines_left = []
    for name, key in (
        ("**primary**: x16, declared arms", "primary"),
        ("x16, amended (experts with wsd added)", "amended"),
        ("x8, declared arms", "x8"),
        ("x4 (continuity; not declared)", "x4"),
    ):
        c = results[key]
        for seed, arms in c.get("left_out", {}).items():
            lines_left.append(f"- {name.strip('*')}: seed {seed} left out, lacking {', '.join(arms)}")
        accuracy = {
            **c["accuracy"],
            "mean": 100 * c["accuracy"]["mean"],
            "half": 100 * c["accuracy"]["half"],
        }
        lines.append(
            f"| {name} | {fmt(c['fd'])} | {fmt(accuracy)} | {fmt(c['precision'], 3)} | "
            f"{fmt(c['recall'], 3)} | {fmt(c['fid'])} | {fmt(c['kid'], 4)} |"
        )
    if lines_left:
        lines += ["", "Seeds left out of a comparison (a chunk missing):", "", *lines_left]
    floor = results["sampling_floor"]
    if floor["batches"]:
        lines += [
            "",
            f"Sampling-noise floor: {floor['batches']} chosen-arm batches drawn again "
            f"at sampling seed 1 moved their FD by {floor['mean_abs_change']:.1f} on "
            f"average (at most {floor['max_abs_change']:.1f}); the primary difference "
            f"at sampling seed 1: {fmt(results['primary']['fd_seed1'])}; at x8: "
            f"{fmt(results['x8']['fd_seed1'])}.",
        ]
    post = results["post_hoc"]
    lines += [
        "",
        "Paired change of the primary difference from x8 to x16: "
        f"{fmt(results['x8_to_x16'])} (the wsd monolith exists only at x16, so this mixes "
        "the budget with the schedule).",
        "",
        "Post hoc, fixed arms with the same schedule on both sides (experts at batch 2, "
        f"top-1, against the batch-4 monolith): x16 constant {fmt(post['constant_x16'])}, "
        f"x16 wsd {fmt(post['wsd_x16'])}; change from x8 to x16 with constant schedules "
        f"{fmt(post['constant_x8_to_x16'])}. What the decay does at x16: monolith "
        f"{fmt(post['decay_monolith'])}, experts {fmt(post['decay_experts'])}.",
        "",
        "Arms chosen per seed (x16 primary): "
        + "; ".join(
            f"seed {s}: {arm_label(*c['ensemble']) if c['ensemble'] else '–'} against "
            f"{arm_label(*c['monolith']) if c['monolith'] else '–'}"
            for s, c in results["primary"]["chosen"].items()
        ),
    ]
    if results["control"]:
        lines += [
            "",
            "## The information control",
            "",
            "One DiT-M/4 at batch 4 told each image's cluster, routed by the seed's "
            "router exactly as top-1 routes experts ('told'), against the top-1 "
            "ensemble of experts at batch 2 and the plain batch-4 monolith "
            "(reproduce.py --part control).",
            "",
            "| budget | seeds | told FD | experts FD | monolith FD | told − monolith | "
            "experts − told | class accuracy, told / experts / monolith |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for budget, c in results["control"].items():
            lines.append(
                f"| {budget} | {', '.join(map(str, c['seeds']))} | {c['control']:.1f} | "
                f"{c['ensemble']:.1f} | {c['monolith']:.1f} | "
                f"{pair(c['told_minus_monolith'])} | "
                f"{pair(c['experts_minus_told'])} | {c['control_accuracy']:.1f} / "
                f"{c['ensemble_accuracy']:.1f} / {c['monolith_accuracy']:.1f} % |"
            )
    return lines


# The settings the README's verdicts rest on, from the earlier studies' raw numbers in
# docs/: (label, file, model, budget). Their best arms were chosen in-sample (the lowest
# mean FD of each side over the same seeds), not by leave-one-seed-out.
EARLIER = [
    ("Fashion DiT-M/4 x4", "fashion-baseline-b2-x8.json", "DiT-M/4", 4.0),
    ("Fashion DiT-M/4 x8", "fashion-baseline-b2-x8.json", "DiT-M/4", 8.0),
    ("Fashion DiT-N/7 x32", "fashion-n7-baseline.json", "DiT-N/7", 32.0),
    ("digits DiT-N/4 x16", "digits-n4-x16-baseline.json", "DiT-N/4", 16.0),
    ("digits DiT-N/4 x64", "digits-n4-baseline.json", "DiT-N/4", 64.0),
]
# 1000 real training images against the 10,000 test images, 5 draws, seed 0 (eval.py on
# any 1000-image batch with --inception-weights; docs/evaluation.md, "Measured floors")
FASHION_FID_FLOOR = "15.61 ± 0.15"
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def earlier_setting(path, model, budget):
    """The best ensemble arm against the best monolith arm of one earlier study's point,
    each the lowest mean FD of its side, paired by seed in FD and requested-class
    accuracy.
    """
    study = checked_record(read_json(path), {"runs": list}, path)
    for i, r in enumerate(study["runs"]):
        checked_record(r, {"model": str, "budget": NUMBER, "seed": int, "split": str,
                           "method": str, "fd": NUMBER, "accuracy": NUMBER}, f"{path} (run {i})")
    runs = [r for r in study["runs"] if r["model"] == model and r["budget"] == budget]
    if not runs:
        raise UsageError(f"{path}: no run of {model} at x{budget:g}, which the forest plot draws")
    by_arm = {}
    for r in runs:
        if r["method"] in ROUTINGS or r["method"] == "monolith":
            by_arm.setdefault((r["split"], r["method"]), {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in runs})
    complete = {arm: rows for arm, rows in by_arm.items() if sorted(rows) == seeds}

    def best(side, over):
        arms = [a for a in complete if (a[1] == "monolith") == (side == "monolith")]
        return min(arms, key=lambda a: np.mean([complete[a][s]["fd"] for s in over]))

    ens, mono = best("ensemble", seeds), best("monolith", seeds)
    pairs = [(complete[ens][s], complete[mono][s]) for s in seeds]
    # the same difference with each seed's arms chosen on the other seeds alone, as the x16
    # protocol chooses them: what the in-sample choice costs in optimism
    held_out = [
        complete[best("ensemble", [o for o in seeds if o != s])][s]["fd"]
        - complete[best("monolith", [o for o in seeds if o != s])][s]["fd"]
        for s in seeds
    ]
    return {
        "ensemble": list(ens),
        "monolith": list(mono),
        "seeds": seeds,
        "fd": interval([e["fd"] - m["fd"] for e, m in pairs]),
        "fd_leave_one_seed_out": interval(held_out) if len(seeds) > 2 else None,
        "accuracy": interval([100 * (e["accuracy"] - m["accuracy"]) for e, m in pairs]),
        "ensemble_accuracy": 100 * np.mean([e["accuracy"] for e, _ in pairs]),
        "monolith_accuracy": 100 * np.mean([m["accuracy"] for _, m in pairs]),
    }


def in_sample(rows, budget, key, seed):
    """Each side's candidate arm with the lowest FD on this seed alone."""
    chosen = {}
    for side, arms in (
        ("ensemble", AMENDED if key == "amended" else ENSEMBLE),
        ("monolith", MONOLITH),
    ):
        have = [a for a in arms if (budget, seed, *a) in rows]
        chosen[side] = (
            min(have, key=lambda a: rows[(budget, seed, *a)]["fd"]) if have else None
        )
    return chosen


def forest_entries(docs, results, rows):
    """Every setting's paired (best ensemble - best monolith) FD, the x16 study's last,
    then the declared tests' rows (confirmatory, attribution) once each is complete."""
    entries = [
        {
            "label": label,
            "chosen_by": "in-sample",
            **earlier_setting(os.path.join(docs, name), model, budget),
        }
        for label, name, model, budget in EARLIER
        if os.path.isfile(os.path.join(docs, name))
    ]
    for key, name in (("x4", "x4"), ("x8", "x8"), ("primary", "x16")):
        c = results[key]
        if len(c["fd"]["per_seed"]) >= 2:
            seeds, chosen, how = c["fd"]["seeds"], c["chosen"], "leave-one-seed-out"
        else:  # one seed: no choice out of sample and no interval, drawn as a bare point
            seeds = sorted({s for b, s, *_ in rows if b == c["budget"]})
            chosen = {s: in_sample(rows, c["budget"], key, s) for s in seeds}
            seeds = [s for s in seeds if chosen[s]["ensemble"] and chosen[s]["monolith"]]
            how = "one seed, in-sample"
        if not seeds:
            continue
        pairs = [
            (
                rows[(c["budget"], s, *chosen[s]["ensemble"])],
                rows[(c["budget"], s, *chosen[s]["monolith"])],
            )
            for s in seeds
        ]
        entries.append(
            {
                "label": f"Fashion DiT-M/4 {name}, seed{'s' if len(seeds) > 1 else ''} "
                f"{', '.join(map(str, seeds))}",
                "chosen_by": how,
                "seeds": seeds,
                "fd": interval([e["fd"] - m["fd"] for e, m in pairs]),
                "accuracy": interval(
                    [100 * (e["accuracy"] - m["accuracy"]) for e, m in pairs]
                ),
                "ensemble_accuracy": 100 * np.mean([e["accuracy"] for e, _ in pairs]),
                "monolith_accuracy": 100 * np.mean([m["accuracy"] for _, m in pairs]),
            }
        )
    for e in entries:
        if e["chosen_by"] == "in-sample":
            e["label"] += f", seeds {e['seeds'][0]}-{e['seeds'][-1]}"
    confirmatory = confirmatory_entry(os.path.join(docs, "confirm"))
    from studies import attribution

    return (entries + ([confirmatory] if confirmatory else [])
            + attribution.forest_entries(os.path.join(docs, "attribution")))


def confirmatory_entry(folder):
    """The confirmatory test's primary (docs/confirm-protocol.md: fresh seeds 10-19, its arms
    fixed in advance) as the forest's last row, once every declared seed has both arms:
    the protocol reports no interim result, so before then there is no row."""
    from studies import confirm

    if not glob.glob(os.path.join(folder, "seed*.json")):
        return None
    chunks = confirm.load_chunks(folder)
    arms = {}
    for chunk in chunks.values():
        for name, arm in chunk["arms"].items():
            arms.setdefault(name, {})[chunk["seed"]] = arm
    seeds = sorted(set(arms.get("experts", {})) & set(arms.get("monolith", {})))
    if seeds != list(confirm.SEEDS):
        return None
    comparisons = confirm.analyse(chunks)[0]["comparisons"]
    accuracy = {side: 100 * np.mean([arms[side][s]["conditional_accuracy"] for s in seeds])
                for side in ("experts", "monolith")}
    return {
        "label": f"Fashion DiT-M/4 x16 confirmatory, seeds {seeds[0]}-{seeds[-1]}",
        "chosen_by": "declared in advance",
        "seeds": seeds,
        "fd": (comparisons["primary"]["mean"], comparisons["primary"]["half"]),
        "accuracy": (comparisons["accuracy_points"]["mean"],
                     comparisons["accuracy_points"]["half"]),
        "ensemble_accuracy": accuracy["experts"],
        "monolith_accuracy": accuracy["monolith"],
    }


def plot_forest(entries, path):
    """Paired (best ensemble - best monolith) FD with 95 % intervals, one row per setting,
    the requested-class accuracy of each side written beside it. The settings' differences
    span digits' few FD to DiT-N/7's tens, so the axis is logarithmic beyond +/-4
    (symlog).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.55 * len(entries) + 1.4), dpi=100)
    for i, e in enumerate(reversed(entries)):
        mean, half = e["fd"]
        bare = bool(np.isnan(half))  # one seed: a hollow point, no interval
        ax.errorbar(
            [mean],
            [i],
            xerr=None if bare else [[half], [half]],
            fmt="o",
            mfc="none" if bare else None,
            color=(
                "0.4"
                if bare
                else "C0" if mean + half < 0 else "C3" if mean - half > 0 else "0.4"
            ),
            capsize=3,
        )
        ax.annotate(
            f"class acc. {e['ensemble_accuracy']:.0f} % vs {e['monolith_accuracy']:.0f} %"
            f"  (N = {len(e['seeds'])}, {e['chosen_by']})",
            (1.02, i),
            xycoords=("axes fraction", "data"),
            va="center",
            fontsize=8,
        )
    ax.axvline(0, color="0.5", lw=1)
    ax.set_xscale("symlog", linthresh=4)
    ticks = [-64, -16, -4, 0, 4, 16, 64]
    ax.set_xticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
    ax.set_yticks(range(len(entries)), [e["label"] for e in reversed(entries)])
    ax.set_xlabel(
        "FD, ensemble − monolith (each row's arms), paired by seed (95 % interval); "
        "< 0: ensemble ahead"
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)


def plot_grid(batches, path, per_class=6):
    """Batches drawn from the same noise and classes (sampling seed 0), side by side: a
    row per class, per_class samples of each batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = []
    for title, npz in batches:
        with np.load(npz, allow_pickle=False) as f:
            if "arr_1" not in f.files:
                raise UsageError(f"--grid {npz}: no class labels in the batch (arr_1)")
            loaded.append((title, f["arr_0"][..., 0], f["arr_1"]))
    if any(not np.array_equal(labels, loaded[0][2]) for _, _, labels in loaded):
        raise UsageError(
            "--grid: the batches asked for different classes: not drawn from the "
            "same sampling seed and N"
        )
    classes = np.unique(loaded[0][2])
    fig, axes = plt.subplots(
        1,
        len(loaded),
        figsize=(2.2 * len(loaded) + 1, 0.3 * len(classes) + 0.6),
        dpi=120,
        squeeze=False,
    )
    for ax, (title, images, labels) in zip(axes[0], loaded):
        rows = [
            np.concatenate(list(images[labels == c][:per_class]), axis=1) for c in classes
        ]
        ax.imshow(np.concatenate(rows, axis=0), cmap="gray", vmin=0, vmax=255)
        ax.set_title(textwrap.fill(title, 30), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks(
            [images.shape[1] * (i + 0.5) for i in range(len(classes))],
            (
                [FASHION_CLASSES[c] if len(classes) == 10 else str(c) for c in classes]
                if ax is axes[0][0]
                else []
            ),
            fontsize=7,
        )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
    plt.close(fig)
