"""Guidance with sparse routing (`--part guidance`): FD and class accuracy of guided
ensembles of --run-dir."""
import os

from studies.common import need_experts, sample_and_measure, spread


def run(args):
    """FD and class accuracy of guided ensembles: scale x routing x how the
    unconditional branch is routed, two seeds."""
    need_experts(args.run_dir)
    out = os.path.join(args.out, "guidance")
    results = {"run_dir": args.run_dir, "n": args.n, "seeds": args.seeds, "rows": []}
    for routing in ("top1", "top2", "full"):
        for cfg_routing in ("shared", "independent"):
            for scale in (1.5, 2.0, 3.0):
                # under full routing both choices are the same exact guided mixture
                # (tests/test_sample.py), so it is sampled once
                sampled_as = "shared" if routing == "full" else cfg_routing
                runs = [sample_and_measure(
                    args.run_dir,
                    os.path.join(out, f"{routing}-{sampled_as}-{scale}-seed{seed}.npz"),
                    "--routing", routing, "--cfg-scale", scale, "--cfg-routing",
                    sampled_as, "--n", args.n, "--seed", seed) for seed in args.seeds]
                row = {"routing": routing, "cfg_routing": cfg_routing, "cfg_scale": scale}
                results["rows"].append({**row, "fd": [r["fd_classifier"] for r in runs],
                                        "accuracy": [r["conditional_accuracy"] for r in runs]})
    lines = [f"Guided sampling, {args.run_dir}: N = {args.n} per batch, sampling seeds "
             f"{args.seeds}, 50 Euler steps. FD-classifier and class accuracy: mean over "
             "seeds (min-max).", "",
             "| routing | unconditional branch | FD @1.5 | FD @2 | FD @3 | acc @1.5 | "
             "acc @2 | acc @3 |",
             "|---|---|---|---|---|---|---|---|"]
    for i in range(0, len(results["rows"]), 3):
        rows = results["rows"][i:i + 3]
        fds = " | ".join(spread(r["fd"]) for r in rows)
        accuracies = " | ".join(spread([100 * a for a in r["accuracy"]]) for r in rows)
        lines.append(f"| {rows[0]['routing']} | {rows[0]['cfg_routing']} | {fds} | {accuracies} |")
    return results, lines
