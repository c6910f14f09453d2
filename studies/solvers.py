"""Sampling steps (`--part solvers`): FD against network evaluations (NFE) for every solver,
paired by noise, on the experts and router of --run-dir (top-1) and the monolith of
--monolith-run.

The solvers: sample.py's Euler, Heun (2 evaluations per step) and ab2 (second-order
Adams-Bashforth, one evaluation per step), ab2 on SD3's shifted time grid, and diffusers'
two multistep schedulers configured for flows (UniPC and DPM-Solver++(2M), `use_flow_sigmas`,
`flow_prediction`) stepping on the same networks. Every batch of a sampling seed starts from
the same labels and noise (sample.py's: each image's noise from the seed and its index), and
routing is exact at every evaluation, so the rows differ only in where the solver asks for
the velocity."""
import json
import os

import numpy as np
import torch

import routing
import sample
from plumbing.command_line import UsageError
from plumbing.data import to_uint8
from plumbing.run_dir import atomic_json, atomic_path
from studies.common import interval, link_run, measure, sample_and_measure

NFES = (4, 8, 16, 32, 64)
# solver: (sample.py's flags, or (a diffusers scheduler, its flow_shift); evaluations per step).
# Shift 3 is SD3's time shift; diffusers' schedulers get it too, so that ab2 on the shifted
# grid meets the strongest baseline at equal cost, not the default configuration.
SOLVERS = {
    "euler": (["--solver", "euler"], 1),
    "heun": (["--solver", "heun"], 2),
    "ab2": (["--solver", "ab2"], 1),
    "ab2, shift 3": (["--solver", "ab2", "--time-shift", 3], 1),
    "diffusers UniPC": (("unipc", 1.0), 1),
    "diffusers DPM-Solver++(2M)": (("dpm", 1.0), 1),
    "diffusers UniPC, shift 3": (("unipc", 3.0), 1),
    "diffusers DPM-Solver++(2M), shift 3": (("dpm", 3.0), 1),
}


def run(args):
    monolith = os.path.join(args.monolith_run or args.run_dir, "experts", "all")
    if not os.path.isdir(monolith):
        raise UsageError(
            f"--part solvers samples a monolith too: none at {monolith} (--monolith-run)"
        )
    out = os.path.join(args.out, "solvers")
    # the experts and router of --run-dir and the monolith, in one folder of links
    view = link_run(
        os.path.join(out, "models"),
        args.run_dir,
        {
            name: os.path.join(args.run_dir, "experts", name)
            for name in os.listdir(os.path.join(args.run_dir, "experts"))
            if name != "all"
        }
        | {"all": monolith},
        router_from=args.run_dir,
    )
    models = {"top-1": ["--routing", "top1"], "monolith": ["--experts", "all"]}
    rows = []
    for model, flags in models.items():
        for solver, (how, evaluations) in SOLVERS.items():
            for nfe in NFES:
                fds = []
                for seed in args.seeds:
                    name = f"{model}-{solver}-{nfe}-seed{seed}".replace(" ", "").replace(
                        ",", ""
                    )
                    path = os.path.join(out, f"{name}.npz")
                    common = [
                        *flags,
                        "--steps",
                        nfe // evaluations,
                        "--n",
                        args.n,
                        "--seed",
                        seed,
                    ]
                    if isinstance(how, list):
                        record = sample_and_measure(view, path, *common, *how)
                    else:
                        record = diffusers_batch(view, path, how, common)
                    fds.append(record["fd_classifier"])
                rows.append(
                    {
                        "model": model,
                        "solver": solver,
                        "nfe": nfe,
                        "seeds": args.seeds,
                        "fd": fds,
                    }
                )
    results = {
        "run_dir": args.run_dir,
        "monolith": monolith,
        "n": args.n,
        "seeds": args.seeds,
        "rows": rows,
        "verdict": verdict(rows),
    }
    return results, table(results)


def diffusers_batch(run_dir, path, how, flags):
    """A batch as sample.py draws it (its ensemble, labels and per-image noise) with one of
    diffusers' flow multistep schedulers stepping; measured by eval.py like every other."""
    if os.path.isfile(path[:-4] + ".eval.json"):
        with open(path[:-4] + ".eval.json") as f:
            return json.load(f)
    from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler
    parsed = sample.build_parser().parse_args(["--run-dir", run_dir, *map(str, flags)])
    experts, router, rule, names = sample.setup(
        run_dir, parsed.experts.strip(), None, parsed.routing
    )
    condition = next(iter(experts.values())).condition
    ensemble = routing.Ensemble(
        experts, routing.routing_function(router, condition), rule, condition, len(names)
    )
    ref = next(iter(experts.values())).config
    ids = condition.requests(parsed.n, torch.Generator().manual_seed(parsed.seed))
    images = []
    for start in range(0, parsed.n, parsed.batch_size):
        idx = np.arange(start, min(start + parsed.batch_size, parsed.n))
        x = sample.image_noise(
            parsed.seed, idx, (ref["channels"], ref["image_size"], ref["image_size"])
        )
        scheduler, shift = how
        stepper = (
            UniPCMultistepScheduler
            if scheduler == "unipc"
            else DPMSolverMultistepScheduler
        )(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
        stepper.set_timesteps(parsed.steps)
        with torch.no_grad():
            for i, t in enumerate(stepper.timesteps):
                v, _ = routing.ensemble_velocity(ensemble, x, stepper.sigmas[i], ids[idx])
                x = stepper.step(v, t, x).prev_sample
        images.append(to_uint8(x))
    with atomic_path(path) as tmp:
        np.savez(tmp, arr_0=np.concatenate(images), arr_1=condition.labels(ids).numpy())
    atomic_json(
        {
            "scheduler": type(stepper).__name__,
            "flow_shift": shift,
            "steps": parsed.steps,
            "n": parsed.n,
            "seed": parsed.seed,
        },
        path[:-4] + ".json",
    )
    return measure(run_dir, [path])[0]


def verdict(rows):
    """Per model, each solver's paired FD minus Euler's at 32 evaluations (the reference),
    and ab2 (either time grid) at 8 against the best diffusers scheduler at 8."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        fd = {(r["solver"], r["nfe"]): r["fd"] for r in rows if r["model"] == model}
        reference = fd[("euler", 32)]
        diffusers = [s for s, n in fd if n == 8 and s.startswith("diffusers")]
        best8 = min(diffusers, key=lambda s: np.mean(fd[(s, 8)]))
        out[model] = {
            "minus_euler32": {
                f"{s} {n}": interval(np.subtract(v, reference))
                for (s, n), v in fd.items()
            },
            "ab2_8_minus_best_diffusers_8": {
                "best": best8,
                "interval": interval(np.subtract(fd[("ab2", 8)], fd[(best8, 8)])),
            }
            | ({"interval_shift_3": interval(np.subtract(fd[("ab2, shift 3", 8)], fd[(best8, 8)]))}
               if ("ab2, shift 3", 8) in fd else {}),
        }
    return out


def table(results):
    lines = [
        f"Solvers: top-1 on the experts and router of {results['run_dir']}, and the monolith "
        f"{results['monolith']}; N = {results['n']}, sampling seeds {results['seeds']} (each "
        "seed the same noise and labels in every row), no guidance. FD in the judge's "
        "features, mean over seeds (min-max).",
        "",
        "| model | solver | " + " | ".join(f"NFE {n}" for n in NFES) + " |",
        "|---|---|" + "---|" * len(NFES),
    ]
    for model in ("top-1", "monolith"):
        for solver in SOLVERS:
            cells = [
                r for r in results["rows"] if (r["model"], r["solver"]) == (model, solver)
            ]
            lines.append(
                f"| {model} | {solver} | "
                + " | ".join(
                    f"{np.mean(r['fd']):.2f} ({min(r['fd']):.2f}-{max(r['fd']):.2f})"
                    for r in cells
                )
                + " |"
            )
    for model, v in results["verdict"].items():
        m, h = v["ab2_8_minus_best_diffusers_8"]["interval"]
        lines.append(
            f"\n{model}: ab2 at 8 evaluations minus {v['ab2_8_minus_best_diffusers_8']['best']} "
            f"at 8: {m:+.2f} +/- {h:.2f} (paired by seed, 95 % t)"
            + ("; ab2 shift 3 at 8 minus it: {:+.2f} +/- {:.2f}".format(
                *v["ab2_8_minus_best_diffusers_8"]["interval_shift_3"])
               if "interval_shift_3" in v["ab2_8_minus_best_diffusers_8"] else "")
            + "; against Euler at 32: "
            + ", ".join(
                f"{k} {m:+.2f} +/- {h:.2f}"
                for k, (m, h) in v["minus_euler32"].items()
                if k.startswith("ab2") and not k.endswith(" 32")
            )
        )
    return lines
