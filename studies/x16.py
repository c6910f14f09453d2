"""The x16 study's declared analysis (docs/x16-protocol.md) over the chunks it has so far.

The study runs in chunks (a seed's monolith arms, its experts' arms, each a `--part scaling`
run), and every finished chunk is kept as one JSON file (its scaling.json, the metrics of every
batch it measured, the command and commit). This part pools those files, so the analysis can be
run again whenever a seed is added, on any machine, without the run folders.

Primary test (declared before any x16 result): best ensemble arm minus best monolith arm at x16,
classifier FD, each side's arm chosen by leave-one-seed-out (for the seed scored, the arm with the
lowest mean FD over the other seeds), paired over the seeds, 95 % t-interval."""
import glob
import json
import os

import numpy as np

from plumbing.command_line import UsageError
from studies.common import interval

ROUTINGS = ("top-1", "top-2", "full")
# (split, method) of every declared candidate; split names are the scaling study's arm names
ENSEMBLE = [(split, m) for split in ("experts-b2", "ddm") for m in ROUTINGS]
AMENDED = ENSEMBLE + [("experts-b2-wsd0.2", m) for m in ROUTINGS]
MONOLITH = [("monolith-b4", "monolith"), ("monolith-b8", "monolith"),
            ("monolith-b4-wsd0.2", "monolith"), ("monolith", "monolith")]
ARM_NAMES = {"monolith": "monolith, batch 64 (protocol)", "ddm": "experts, batch 16 (DDM's split)"}


def arm_label(split, method):
    name = ARM_NAMES.get(split, split.replace("-b", ", batch ").replace("-wsd0.2", ", wsd"))
    return name if method == "monolith" else f"{name}, {method}"


def load_chunks(folder):
    """Every chunk file of FOLDER: {(budget, seed, split, method): row}, each row with the
    precision and recall of its batch, and the list of chunks read."""
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        raise UsageError(f"--results {folder}: no chunk files (*.json) of the x16 study there")
    rows, chunks = {}, []
    for path in paths:
        try:
            with open(path) as f:
                chunk = json.load(f)
            runs, evals = chunk["scaling"]["runs"], chunk["evals"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: not a chunk file of the x16 study ({e})")
        chunks.append({"file": os.path.basename(path), "commit": chunk.get("commit"),
                       "command": chunk.get("command")})
        for r in runs:
            key = (float(r["budget"]), int(r["seed"]), r["split"], r["method"])
            folder_name = (f"fashion-mnist-DiT-M4-k4-x{r['budget']:g}-seed{r['seed']}-router0.05"
                           + ("" if r["split"] in ("monolith", "ddm") else f"-{r['split']}"))
            metrics = evals.get(f"scaling/{folder_name}/samples/{r['method']}.eval.json", {})
            row = {**r, "precision": metrics.get("precision"), "recall": metrics.get("recall"),
                   "judge": metrics.get("classifier_digest")}
            if key in rows and abs(rows[key]["fd"] - row["fd"]) > 1e-6:
                raise UsageError(f"{path}: {key} measured twice with different FDs "
                                 f"({rows[key]['fd']:.3f} and {row['fd']:.3f})")
            rows.setdefault(key, row)
    return rows, chunks


def loso(rows, budget, candidates, seeds):
    """{seed: (arm, row)}: for each seed, the candidate with the lowest mean FD over the
    other seeds that have it (seeds where no candidate has another seed are left out)."""
    chosen = {}
    for seed in seeds:
        means = {}
        for arm in candidates:
            others = [rows[(budget, s, *arm)]["fd"] for s in seeds
                      if s != seed and (budget, s, *arm) in rows]
            if others and (budget, seed, *arm) in rows:
                means[arm] = np.mean(others)
        if means:
            arm = min(means, key=means.get)
            chosen[seed] = (arm, rows[(budget, seed, *arm)])
    return chosen


def paired(ensemble, monolith, field="fd"):
    """Mean and 95 % half-width of ensemble - monolith over the seeds both have."""
    seeds = sorted(set(ensemble) & set(monolith))
    diffs = [ensemble[s][1][field] - monolith[s][1][field] for s in seeds
             if ensemble[s][1].get(field) is not None and monolith[s][1].get(field) is not None]
    mean, half = interval(diffs) if diffs else (float("nan"), float("nan"))
    return {"seeds": seeds, "per_seed": diffs, "mean": mean, "half": half}


def comparison(rows, budget, ensemble_arms, seeds):
    ens, mono = loso(rows, budget, ensemble_arms, seeds), loso(rows, budget, MONOLITH, seeds)
    return {"budget": budget,
            "chosen": {s: {"ensemble": list(ens[s][0]) if s in ens else None,
                           "monolith": list(mono[s][0]) if s in mono else None} for s in seeds},
            **{field: paired(ens, mono, field)
               for field in ("fd", "accuracy", "precision", "recall")}}


def run(args):
    rows, chunks = load_chunks(args.results)
    seeds = sorted({seed for _, seed, *_ in rows})
    judges = sorted({r["judge"] for r in rows.values() if r["judge"]})
    results = {"chunks": chunks, "seeds": seeds, "judges": judges,
               "rows": [dict(r) for r in rows.values()]}
    results["primary"] = comparison(rows, 16.0, ENSEMBLE, seeds)
    results["amended"] = comparison(rows, 16.0, AMENDED, seeds)
    results["x8"] = comparison(rows, 8.0, ENSEMBLE, seeds)
    x8 = dict(zip(results["x8"]["fd"]["seeds"], results["x8"]["fd"]["per_seed"]))
    x16 = dict(zip(results["primary"]["fd"]["seeds"], results["primary"]["fd"]["per_seed"]))
    both = sorted(set(x8) & set(x16))
    mean, half = interval([x16[s] - x8[s] for s in both]) if both else (float("nan"),) * 2
    results["x8_to_x16"] = {"seeds": both, "per_seed": [x16[s] - x8[s] for s in both],
                            "mean": mean, "half": half}
    return results, report(results, rows, seeds)


def fmt(c, digits=1):
    if not c["per_seed"]:
        return "– (needs two seeds)"
    half = "" if np.isnan(c["half"]) else f" ± {c['half']:.{digits}f}"
    return f"{c['mean']:+.{digits}f}{half} (N = {len(c['per_seed'])})"


def report(results, rows, seeds):
    lines = ["# The x16 study of Fashion DiT-M/4: what the chunks so far show", "",
             f"Seeds with any arm: {', '.join(map(str, seeds))}. Judge digest(s): "
             f"{', '.join(results['judges']) or 'unknown'}. Chunks: {len(results['chunks'])} "
             "(the commands are in x16.json). Classifier FD at N = 1000, sampling seed 0, "
             "16 Euler steps; ± is the 95 % t-interval over seeds.", ""]
    arms = sorted({(r["split"], r["method"]) for r in rows.values()})
    for budget in (8.0, 16.0):
        lines += [f"## x{budget:g}", "",
                  "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean FD | class accuracy |",
                  "|---|" + "---|" * len(seeds) + "---|---|"]
        for arm in arms:
            got = [rows.get((budget, s, *arm)) for s in seeds]
            if not any(got):
                continue
            fds = [g["fd"] for g in got if g]
            accs = [g["accuracy"] for g in got if g]
            lines.append(f"| {arm_label(*arm)} | "
                         + " | ".join(f"{g['fd']:.1f}" if g else "–" for g in got)
                         + f" | {np.mean(fds):.1f} | {100 * np.mean(accs):.1f} % |")
        lines.append("")
    lines += ["## The declared comparisons (leave-one-seed-out choice of each side's arm)", "",
              "| comparison | FD, ensemble − monolith | requested class, points | precision | recall |",
              "|---|---|---|---|---|"]
    for name, key in (("**primary**: x16, declared arms", "primary"),
                      ("x16, amended (experts with wsd added)", "amended"),
                      ("x8, declared arms", "x8")):
        c = results[key]
        scaled = {f: {**c[f], "mean": 100 * c[f]["mean"], "half": 100 * c[f]["half"]}
                  for f in ("accuracy",)}
        lines.append(f"| {name} | {fmt(c['fd'])} | {fmt(scaled['accuracy'])} | "
                     f"{fmt(c['precision'], 3)} | {fmt(c['recall'], 3)} |")
    lines += ["", f"Paired change of the primary difference from x8 to x16: {fmt(results['x8_to_x16'])}.",
              "", "Arms chosen per seed (x16 primary): " + "; ".join(
                  f"seed {s}: {arm_label(*c['ensemble']) if c['ensemble'] else '–'} against "
                  f"{arm_label(*c['monolith']) if c['monolith'] else '–'}"
                  for s, c in results["primary"]["chosen"].items())]
    return lines
