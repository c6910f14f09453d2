"""Sampling steps (`--part solvers`): FD against network evaluations (NFE) for every
solver, paired by noise, on the experts and router of --run-dir (top-1) and the
monolith of --monolith-run.

The solvers: sample.py's Euler, Heun (2 evaluations per step) and ab2 (second-order
Adams-Bashforth, one evaluation per step), ab2 on SD3's shifted time grid, and
diffusers' two multistep schedulers configured for flows (UniPC and DPM-Solver++(2M),
`use_flow_sigmas`, `flow_prediction`) stepping on the same networks. Every batch of a
sampling seed starts from the same labels and noise (sample.py's: each image's noise
from the seed and its index), and routing is exact at every evaluation, so the rows
differ only in where the solver asks for the velocity."""

import json
import os

import numpy as np
import torch

import routing
import sample
from plumbing.command_line import UsageError
from plumbing.data.datasets import to_uint8
from plumbing.run_dir import atomic_json, atomic_path
from studies.common import (
    fd_plot,
    interval,
    link_run,
    measure,
    sample_and_measure,
    sample_args,
)

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
                    path = files(out, model, solver, nfe, [seed])[0]
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
                        "files": files(out, model, solver, nfe, args.seeds),
                    }
                )
    add_integration_error(rows)
    results = {
        "run_dir": args.run_dir,
        "monolith": monolith,
        "n": args.n,
        "seeds": args.seeds,
        "rows": rows,
        "verdict": verdict(rows),
    }
    if args.plots:
        plot(results, os.path.join(args.out, "solvers.png"))
    return results, table(results)


def plot(results, path):
    """FD against NFE, one line per solver: solid the top-1 ensemble, dashed the monolith;
    the bars span the sampling seeds."""
    with fd_plot(
        path, "network evaluations per sample", "FD (judge features)", xlog=True
    ) as ax:
        for model, style in (("top-1", "-"), ("monolith", "--")):
            for i, solver in enumerate(SOLVERS):
                rows = [
                    r
                    for r in results["rows"]
                    if (r["model"], r["solver"]) == (model, solver)
                ]
                if not rows:
                    continue
                fd = np.array([r["fd"] for r in rows])
                mean = fd.mean(1)
                ax.errorbar(
                    [r["nfe"] for r in rows],
                    mean,
                    yerr=[mean - fd.min(1), fd.max(1) - mean],
                    linestyle=style,
                    color=f"C{i}",
                    marker="o",
                    markersize=3,
                    capsize=2,
                    label=f"{model}: {solver}",
                )


def files(out, model, solver, nfe, seeds):
    return [
        os.path.join(
            out,
            f"{model}-{solver}-{nfe}-seed{seed}".replace(" ", "").replace(",", "")
            + ".npz",
        )
        for seed in seeds
    ]


def reference():
    """The most accurate integration in the table: second order at the most evaluations."""
    return "heun", max(NFES)


def add_integration_error(rows):
    """Each row's RMS pixel distance (images in [-1, 1]) to the same model's reference() batch
    of the same seed, mean over seeds: how far the solver lands from the ODE's solution,
    which a feature-space FD need not reward. None where the table has no reference."""
    finest = {
        r["model"]: r["files"] for r in rows if (r["solver"], r["nfe"]) == reference()
    }
    for r in rows:
        if r["model"] not in finest:
            r["rms_to_reference"] = None
            continue
        r["rms_to_reference"] = float(
            np.mean(
                [
                    np.sqrt(
                        np.mean(
                            (
                                np.load(a)["arr_0"].astype(np.float64)
                                - np.load(b)["arr_0"]
                            )
                            ** 2
                        )
                    )
                    / 127.5
                    for a, b in zip(r["files"], finest[r["model"]])
                ]
            )
        )


def diffusers_batch(run_dir, path, how, flags):
    """A batch as sample.py draws it (its ensemble, labels and per-image noise) with one of
    diffusers' flow multistep schedulers stepping; measured by eval.py like every other."""
    if os.path.isfile(path[:-4] + ".eval.json"):
        with open(path[:-4] + ".eval.json") as f:
            return json.load(f)
    from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

    parsed = sample_args("--run-dir", run_dir, *flags)
    experts, router, rule, names = sample.setup(
        run_dir, parsed.experts.strip(), None, parsed.routing
    )
    condition = next(iter(experts.values())).condition
    ensemble = routing.Ensemble(
        experts,
        routing.routing_function(router, condition),
        rule,
        condition,
        len(names),
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
                v, _ = routing.ensemble_velocity(
                    ensemble, x, stepper.sigmas[i], ids[idx]
                )
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
    and ab2 (each time grid in the table) at 8 against the best diffusers scheduler at 8."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        fd = {(r["solver"], r["nfe"]): r["fd"] for r in rows if r["model"] == model}
        diffusers = [s for s, n in fd if n == 8 and s.startswith("diffusers")]
        best8 = min(diffusers, key=lambda s: np.mean(fd[(s, 8)]))
        out[model] = {
            "minus_euler32": {
                f"{s} {n}": interval(np.subtract(v, fd[("euler", 32)]))
                for (s, n), v in fd.items()
            },
            "best_diffusers_8": best8,
            "ab2_8_minus_best_diffusers_8": {
                s: interval(np.subtract(fd[(s, 8)], fd[(best8, 8)]))
                for s in ("ab2", "ab2, shift 3")
                if (s, 8) in fd
            },
        }
    return out


def grid(rows, cell):
    """A Markdown table: a line per model and solver, a column per NFE, cell(row) in it."""
    lines = ["| model | solver | " + " | ".join(f"NFE {n}" for n in NFES) + " |",
             "|---|---|" + "---|" * len(NFES)]
    for model in ("top-1", "monolith"):
        for solver in SOLVERS:
            cells = [cell(r) for r in rows if (r["model"], r["solver"]) == (model, solver)]
            lines.append(f"| {model} | {solver} | " + " | ".join(cells) + " |")
    return lines


def table(results):
    lines = [
        f"Solvers: top-1 on the experts and router of {results['run_dir']}, and the monolith "
        f"{results['monolith']}; N = {results['n']}, sampling seeds {results['seeds']} (each "
        "seed the same noise and labels in every row), no guidance. FD in the judge's "
        "features, mean over seeds (min-max).",
        "",
        *grid(results["rows"],
              lambda r: f"{np.mean(r['fd']):.2f} ({min(r['fd']):.2f}-{max(r['fd']):.2f})"),
    ]
    if any(r.get("rms_to_reference") is not None for r in results["rows"]):
        lines += ["", "RMS pixel distance (images in [-1, 1]) to {} at {} ".format(*reference())
                  + "evaluations on the same noise, mean over seeds: the integration error.",
                  "", *grid(results["rows"], lambda r: f"{r['rms_to_reference']:.4f}")]
    for model, v in results["verdict"].items():
        lines.append(
            f"\n{model}, paired by seed (95 % t): at 8 evaluations minus {v['best_diffusers_8']} at 8: "
            + ", ".join(
                f"{s} {m:+.2f} +/- {h:.2f}"
                for s, (m, h) in v["ab2_8_minus_best_diffusers_8"].items()
            )
            + "; minus Euler at 32: "
            + ", ".join(
                f"{k} {m:+.2f} +/- {h:.2f}"
                for k, (m, h) in v["minus_euler32"].items()
                if k.startswith("ab2") and not k.endswith(" 32")
            )
        )
    return lines
