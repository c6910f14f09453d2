"""The reproduction's own logic at a tiny scale: FLOP matching, seeds, intervals,
resuming, the plot. The study is a command."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import reproduce
from studies import common, conversion, epsilon
from plumbing.command_line import UsageError


def test_interval_is_the_student_t_interval():
    mean, half = common.interval([1.0, 2.0, 3.0])
    # t(0.975, 2) * s / sqrt(n), s = 1
    assert mean == 2.0 and half == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)
    assert np.isnan(common.interval([5.0])[1])


def test_a_mean_is_written_with_its_interval_or_alone_when_there_is_none():
    assert common.plus_minus(-1.234, 0.567, "+.2f") == "-1.23 ± 0.57"
    assert common.plus_minus(0.5, 0.025, ".1%") == "50.0% ± 2.5%"
    assert common.plus_minus(1.234, common.interval([5.0])[1]) == "1.23"
    assert common.plus_minus(1.234, None) == "1.23"   # as standard JSON writes a nan


def test_a_study_trains_in_fp32_unless_it_names_a_precision(monkeypatch):
    import train_expert, train_router
    ran = []
    for module in (train_expert, train_router):
        def record(args, module=module):
            ran.append((module.__name__, getattr(args, "precision", None)))
        monkeypatch.setattr(module, "main", record)
    # auto would measure each run folder and could flip to bf16
    common.stage(train_expert, "--cluster", "all")
    common.stage(train_expert, "--cluster", "all", "--precision", "bf16")
    common.stage(train_router, "--steps", 1)
    assert ran == [("train_expert", "fp32"), ("train_expert", "bf16"), ("train_router", None)]


def test_flop_matching_gives_the_experts_the_monolith_budget_minus_the_router():
    # (100 * 1000 - 5500) // 1000, at a quarter of the batch x 4
    assert common.matched_expert_steps(100, 1000, 5500) == 94


def args_for(out, *extra):
    return reproduce.build_parser().parse_args(
        ["--part", "scaling", "--out", str(out), "--models", "DiT-M/2", "--k", "2",
         "--budgets", "0.5", "1", "--train-seeds", "0", "1",
         "--monolith-steps", "40", "--batch-size", "16", "--router-steps", "2",
         "--n", "16", "--sample-steps", "1",
         "--classifier-steps", "30", *extra])


def test_scaling_study_at_tiny_scale_matches_flops_keeps_seeds_and_resumes(tmp_path):
    # matplotlib is optional (requirements-repro.txt)
    plots = ["--plots"] if _has_matplotlib() else ["--no-plots"]
    reproduce.run_part(args_for(tmp_path, *plots))
    with open(tmp_path / "scaling.json") as f:
        # standard JSON: the monolith's router share, which it has none of, is null
        results = json.load(f, parse_constant=lambda constant: pytest.fail(constant))
    assert len(results["runs"]) == 2 * 2 * 4
    assert all(r["router_share"] is None for r in results["runs"] if r["method"] == "monolith")
    for budget, steps in ((0.5, 20), (1, 40)):
        for seed in (0, 1):
            run = tmp_path / "scaling" / f"DiT-M2-k2-x{budget:g}-seed{seed}"
            monolith = torch.load(run / "experts" / "all" / "ckpt.pt", weights_only=True)
            expert = torch.load(run / "experts" / "1" / "ckpt.pt", weights_only=True)
            assert monolith["step"] == steps
            assert monolith["config"]["flags"]["seed"] == seed == expert["config"]["flags"]["seed"]
            assert expert["config"]["flags"]["batch_size"] == 8
            rows = {r["method"]: r for r in results["runs"]
                    if (r["budget"], r["seed"]) == (budget, seed)}
            # the ensemble never spends more than the monolith, and less by under one
            # monolith step
            gap = rows["monolith"]["flops"] - rows["top-1"]["flops"]
            assert 0 <= gap < monolith["config"]["flops_per_step"]
    clusters = [torch.load(tmp_path / "scaling" / f"DiT-M2-k2-x1-seed{s}" / "clusters.pt",
                           weights_only=True)["fingerprint"] for s in (0, 1)]
    # the training seed reaches the clustering too
    assert clusters[0] != clusters[1]
    summary = {(s["budget"], s["method"]): s for s in results["summary"] if s["k"] == 2}
    fds = [r["fd"] for r in results["runs"] if (r["budget"], r["method"]) == (1, "full")]
    assert (summary[(1, "full")]["fd_mean"] == pytest.approx(np.mean(fds))
            and summary[(1, "full")]["seeds"] == 2)

    # a killed study: one batch lost its metrics; the rerun remakes only that one and
    # changes no number
    lost = tmp_path / "scaling" / "DiT-M2-k2-x0.5-seed1" / "samples" / "top-2.eval.json"
    kept = tmp_path / "scaling" / "DiT-M2-k2-x1-seed0" / "samples" / "full.eval.json"
    os.remove(lost)
    before = os.stat(kept).st_mtime_ns
    reproduce.run_part(args_for(tmp_path, *plots))
    with open(tmp_path / "scaling.json") as f:
        again = json.load(f)
    assert (again["runs"] == results["runs"] and lost.exists()
            and os.stat(kept).st_mtime_ns == before)
    if plots == ["--plots"]:
        with open(tmp_path / "scaling.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_steps_to_reach_is_the_first_converted_point_at_or_below_scratchs_final_fd():
    rows = [{"arm": "scratch", "cluster": 0, "seed": 0, "step": s, "fd": fd}
            for s, fd in ((5, 30.0), (10, 20.0))] + \
           [{"arm": "converted-linear", "cluster": 0, "seed": 0, "step": s, "fd": fd}
            for s, fd in ((5, 19.0), (10, 25.0))] + \
           [{"arm": "converted-snr", "cluster": 0, "seed": 0, "step": s, "fd": fd}
            for s, fd in ((5, 21.0), (10, 20.5))]
    assert conversion.steps_to_reach(rows, 10) == {"converted-linear": {
        (0, 0): 5}, "converted-snr": {(0, 0): None}}


def test_conversion_study_at_tiny_scale_converts_from_the_ddpm_source_and_resumes(tmp_path):
    plots = ["--plots"] if _has_matplotlib() else ["--no-plots"]
    argv = ["--part", "conversion", "--out", str(tmp_path), "--model", "DiT-M/2",
            "--k", "2", "--train-seeds", "0", "1",
            "--source-steps", "10", "--conversion-steps", "4", "--curve-points", "2",
            "--batch-size", "8", "--curve-n", "8",
            "--sample-steps", "1", "--classifier-steps", "20", *plots]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    with open(tmp_path / "conversion.json") as f:
        results = json.load(f)
    # clusters x seeds x arms x curve points
    assert len(results["rows"]) == 2 * 2 * 3 * 2
    root = tmp_path / "conversion"
    assert torch.load(root / "source-ddpm" / "ckpt.pt",
                      weights_only=True)["config"]["objective"]["name"] == "ddpm"
    for arm, init in (("scratch", "scratch"), ("converted-linear", "convert_ddpm_to_fm"),
                      ("converted-snr", "convert_ddpm_to_fm")):
        ckpt = torch.load(root / f"cluster1-{arm}-seed1" / "ckpt.pt", weights_only=True)
        assert (ckpt["step"] == 4 and ckpt["config"]["init"].startswith(init)
                and ckpt["config"]["flags"]["seed"] == 1)
    assert torch.load(root / "cluster0-converted-snr-seed0" / "ckpt.pt",
                      weights_only=True)["config"]["objective"]["time_map"] == "snr"
    before = os.stat(root / "cluster0-scratch-seed0" / "ckpt.pt").st_mtime_ns
    # finished: nothing is trained or sampled again
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    with open(tmp_path / "conversion.json") as f:
        assert json.load(f)["rows"] == results["rows"]
    assert os.stat(root / "cluster0-scratch-seed0" / "ckpt.pt").st_mtime_ns == before


def test_epsilon_study_at_tiny_scale_trains_every_arm_per_seed(tmp_path):
    argv = ["--part", "epsilon", "--out", str(tmp_path), "--model", "DiT-M/2", "--k", "2",
            "--train-seeds", "0", "--monolith-steps", "3",
            "--batch-size", "8", "--n", "8", "--sample-steps", "1", "--classifier-steps", "20"]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    with open(tmp_path / "epsilon.json") as f:
        rows = json.load(f)["rows"]
    assert [r["arm"] for r in rows] == list(epsilon.EPSILON_ARMS)
    # one training seed: every mean alone, no '± nan'
    assert "nan" not in (tmp_path / "epsilon.md").read_text()
    cosine = torch.load(tmp_path / "epsilon" / "ddpm-cosine-seed0" / "ckpt.pt",
                        weights_only=True)["config"]
    assert cosine["objective"] == {"name": "ddpm", "num_timesteps": 1000,
                                   "beta_schedule": "cosine"}
    assert cosine["flags"]["ema_decay"] == 0.995 and all(np.isfinite(r["fd"]) for r in rows)
    mixed = torch.load(tmp_path / "epsilon" / "fm-ddpm-inputs-seed0" / "ckpt.pt",
                       weights_only=True)["config"]["objective"]
    assert mixed["name"] == "fm" and mixed["time_map"] == "snr"


def test_heterogeneous_study_at_tiny_scale_swaps_ddpm_experts_into_the_scaling_runs(tmp_path):
    argv = ["--part", "heterogeneous", "--out", str(tmp_path), "--models", "DiT-M/2",
            "--k", "3", "--budgets", "1", "--train-seeds",
            "1", "--monolith-steps", "12", "--batch-size", "12", "--router-steps", "2",
            "--source-steps", "3", "--n", "8",
            "--sample-steps", "1", "--classifier-steps", "20", "--no-plots"]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    with open(tmp_path / "heterogeneous.json") as f:
        rows = json.load(f)["rows"]
    # monolith + arms x routing rules
    assert len(rows) == 1 + 3 * 3
    run = tmp_path / "scaling" / "DiT-M2-k3-x1-seed1"
    flow = torch.load(run / "experts" / "2" / "ckpt.pt", weights_only=True)
    for arm, objectives in (("ddpm+flow", ["ddpm", "ddpm", "fm"]),
                            ("ddpm+converted", ["ddpm", "ddpm", "fm"])):
        view = tmp_path / "heterogeneous" / "DiT-M2-k3-x1-seed1" / arm
        # one router for every arm
        assert os.path.realpath(view / "router") == os.path.realpath(run / "router")
        ckpts = [torch.load(view / "experts" / str(j) / "ckpt.pt", weights_only=True)
                 for j in range(3)]
        assert [c["config"]["objective"]["name"] for c in ckpts] == objectives
        # the same budget: every expert takes the flow expert's steps at its batch, with
        # the run's seed
        assert {(c["step"], c["config"]["flags"]["batch_size"],
                 c["config"]["flags"]["seed"]) for c in ckpts} == \
               {(flow["step"], 4, 1)}
    converted = (tmp_path / "heterogeneous" / "DiT-M2-k3-x1-seed1" / "ddpm+converted" / "experts"
                 / "2" / "ckpt.pt")
    mixed = torch.load(converted, weights_only=True)
    assert (mixed["config"]["init"].startswith("convert_ddpm_to_fm")
            and mixed["config"]["objective"]["time_map"] == "snr")
    assert os.path.realpath(
        tmp_path / "heterogeneous" / "DiT-M2-k3-x1-seed1" / "ddpm+flow" / "experts" / "2") == \
           os.path.realpath(run / "experts" / "2")
    with open(tmp_path / "heterogeneous.md") as f:
        # the arms, then the mixed ones paired with flow
        assert f.read().count("| DiT-M/2 | 3 | x1 |") == 3 + 2
    with pytest.raises(UsageError, match="at least one"):
        reproduce.run_part(reproduce.build_parser().parse_args(argv + ["--ddpm-experts", "3"]))
    # K = 2 with the mixed-from-scratch arm only: no converted expert and no source are trained
    k2 = argv[:argv.index("--k")] + ["--k", "2", "--budgets", "1",
                                     "--train-seeds", "0"] + argv[argv.index("--monolith-steps"):]
    reproduce.run_part(reproduce.build_parser().parse_args(
        k2 + ["--arms", "ddpm+flow", "--ddpm-experts", "1"]))
    assert not (tmp_path / "heterogeneous" / "DiT-M2-k2-x1-seed0" / "converted-1").exists()
    assert os.path.realpath(
        tmp_path / "heterogeneous" / "DiT-M2-k2-x1-seed0" / "ddpm+flow" / "experts" / "1") == \
           os.path.realpath(tmp_path / "scaling" / "DiT-M2-k2-x1-seed0" / "experts" / "1")


def test_full_runs_every_digits_part_in_turn(monkeypatch):
    ran = []
    monkeypatch.setattr(reproduce, "main_part", lambda args: ran.append(args.part))
    monkeypatch.setattr(reproduce, "run_part", lambda args: ran.append(args.part))
    reproduce.main(reproduce.build_parser().parse_args(["--full"]))
    assert ran == ["main", "scaling", "conversion", "epsilon", "heterogeneous"]


PRESPLIT_SCALING = ["--part", "scaling", "--models", "DiT-M/2", "--k", "2",
                    "--budgets", "1", "--train-seeds", "0",
                    "--monolith-steps", "30", "--batch-size", "8", "--router-steps", "1",
                    "--n", "8", "--sample-steps", "1",
                    "--classifier-steps", "20", "--no-plots"]
PRESPLIT_EPSILON = ["--part", "epsilon", "--model", "DiT-M/2", "--k", "2",
                    "--train-seeds", "0", "--monolith-steps", "2",
                    "--batch-size", "8", "--n", "8", "--sample-steps", "1",
                    "--classifier-steps", "20"]


def test_a_study_resumed_from_records_written_before_the_split_reruns_nothing(
        tmp_path, monkeypatch):
    """The studies left reproduce.py for studies/; a resumed study must still find what
    the old layout wrote.

    tests/data/presplit_records.json lists the records (checkpoints, cluster files,
    measured batches) that reproduce.py wrote at 9a3bf08, before the split, for these two
    tiny studies. The split code must write exactly those, and a rerun over them must call
    no stage at all."""
    with open(os.path.join(os.path.dirname(__file__), "data", "presplit_records.json")) as f:
        presplit = set(json.load(f)["records"])
    for argv in (PRESPLIT_SCALING, PRESPLIT_EPSILON):
        reproduce.run_part(reproduce.build_parser().parse_args([*argv, "--out", str(tmp_path)]))
    records = {os.path.relpath(os.path.join(root, f), tmp_path)
               for root, _, files in os.walk(tmp_path) for f in files
               if (f in ("ckpt.pt", "clusters.pt") or f.endswith(".eval.json"))
               and "-view" not in root}
    assert records == presplit
    results = {part: json.load(open(tmp_path / f"{part}.json"))
               for part in ("scaling", "epsilon")}

    import cluster, eval as evaluate, sample, train_expert, train_router   # noqa: E401
    def refuse(*_):
        raise AssertionError("a finished piece was run again")
    for stage in (cluster, evaluate, sample, train_expert, train_router):
        monkeypatch.setattr(stage, "main", refuse)
    for argv in (PRESPLIT_SCALING, PRESPLIT_EPSILON):
        reproduce.run_part(reproduce.build_parser().parse_args([*argv, "--out", str(tmp_path)]))
    assert {part: json.load(open(tmp_path / f"{part}.json"))
            for part in ("scaling", "epsilon")} == results


def test_the_plateau_is_two_successive_doublings_neither_a_fall_by_the_paired_test():
    from studies.common import plateau_budget
    # seeds 20 apart, so every unpaired interval overlaps its neighbours; each seed falls
    # by 3-5 per doubling
    falling = [(1, {0: 100.0, 1: 140.0, 2: 120.0}), (2, {0: 96.0, 1: 137.0, 2: 115.0}),
               (4, {0: 91.0, 1: 133.0, 2: 111.0}),
               (8, {0: 88.0, 1: 129.0, 2: 106.0})]
    # the unpaired rule would have stopped at x4
    assert plateau_budget(falling) is None
    # +2/-2/+2, then -3/+1/+1
    flat = falling + [(16, {0: 90.0, 1: 127.0, 2: 108.0}), (32, {0: 87.0, 1: 128.0, 2: 109.0})]
    assert plateau_budget(flat) == 32
    worse = [(1, {0: 50.0, 1: 51.0, 2: 52.0}), (2, {0: 55.0, 1: 56.5, 2: 57.0}),
             (4, {0: 60.0, 1: 61.0, 2: 62.0})]
    # rising is not improving either
    assert plateau_budget(worse) == 4
    # 2 -> 8
    assert plateau_budget([(1, {0: 50.0, 1: 51.0}), (2, {0: 50.0, 1: 52.0}),
                           (8, {0: 50.0, 1: 51.0})]) is None
    # one seed: no interval, never stops
    assert plateau_budget([(1, {0: 50.0}), (2, {0: 50.0}), (4, {0: 50.0})]) is None
    # one shared seed
    assert plateau_budget([(1, {0: 50.0, 1: 51.0}), (2, {0: 50.0, 2: 52.0}),
                           (4, {0: 50.0, 2: 51.0})]) is None


def test_until_plateau_doubles_the_budget_until_the_monolith_stops_improving(
        tmp_path, monkeypatch):
    from studies import scaling
    fd = {1: 200.0, 2: 100.0, 4: 80.0, 8: 78.0, 16: 77.0, 32: 76.5}
    noise = {0: {1: -1, 2: -1, 4: -1, 8: 1, 16: -1, 32: 0},
             1: {1: 1, 2: 1, 4: 1, 8: -1, 16: 1, 32: 0}}
    measured = []
    def fake_point(args, root, model, k, budget, seed):
        measured.append((budget, seed))
        return [{"model": model, "k": k, "budget": budget, "seed": seed, "method": m,
                 "split": "monolith" if m == "monolith" else "ddm",
                 "flops": budget, "router_share": 0.03, "fd": fd[budget]
                 + noise[seed][budget] + (5 if m != "monolith" else 0),
                 "accuracy": 0.9} for m in ("monolith", "top-1", "top-2", "full")]
    monkeypatch.setattr(scaling, "measure_point", fake_point)
    args = args_for(tmp_path, "--budgets", "1", "2", "--until-plateau",
                    "--max-budget", "16", "--no-plots")
    results, lines = scaling.run(args)
    # paired by seed: 100 -> 80 falls by 20 and 18 (a fall); 80 -> 78 changes 0 and -4, 78
    # -> 77 -3 and +1 (neither)
    assert (sorted({b for b, _ in measured}) == [1, 2, 4, 8, 16]
            and results["plateau"]["DiT-M/2 K=2"] == 16)
    assert "stopped improving at x16" in "\n".join(lines)
    results, _ = scaling.run(args_for(tmp_path, "--budgets", "1", "2", "--until-plateau",
                                      "--max-budget", "4", "--no-plots"))
    # stopped by --max-budget, and says so
    assert results["plateau"]["DiT-M/2 K=2"] is None


def test_the_routed_fd_is_paired_with_the_same_seeds_monolith(tmp_path, monkeypatch):
    from studies import scaling
    def fake_point(args, root, model, k, budget, seed):
        # seeds far apart: the unpaired intervals overlap widely
        monolith = 100.0 + 10.0 * seed
        return [{"model": model, "k": k, "budget": budget, "seed": seed, "method": m,
                 "split": "monolith" if m == "monolith" else "ddm",
                 "flops": budget, "router_share": 0.05, "fd": monolith
                 + {"monolith": 0.0, "top-1": -3.0, "top-2": -2.0, "full": 1.0 + seed}[m],
                 "accuracy": 0.9} for m in ("monolith", "top-1", "top-2", "full")]
    monkeypatch.setattr(scaling, "measure_point", fake_point)
    results, lines = scaling.run(args_for(tmp_path, "--budgets", "1", "--no-plots"))
    paired = {d["method"]: d for d in results["paired"]}
    assert (paired["top-1"]["diff_mean"] == pytest.approx(-3.0)
            and paired["top-1"]["diff_half"] == pytest.approx(0.0))
    # s = 1/sqrt(2), n = 2
    assert (paired["full"]["diff_mean"] == pytest.approx(1.5)
            and paired["full"]["diff_half"] == pytest.approx(12.706205 * 0.5, rel=1e-6))
    assert "| DiT-M/2 | 2 | x1 | ddm | -3.00 ± 0.00 | -2.00 ± 0.00 | +1.50 ± 6.35 |" in lines


def test_scaling_on_fashion_mnist_with_every_split_and_a_fixed_router_share(tmp_path):
    """Every split at one point, ddm not first: the monolith is still the point's own (a
    study of the arms alone, e.g.
    --splits equal-batch random, must not look for a monolith in an arm's folder)."""
    from helpers import fake_idx_set
    data = fake_idx_set(tmp_path / "fmnist", n_train=80, n_test=40)
    argv = ["--part", "scaling", "--out", str(tmp_path / "out"),
            "--data", f"fashion-mnist:{data}", "--models", "DiT-M/4", "--k", "2",
            "--budgets", "1", "--train-seeds", "0", "--monolith-steps", "60",
            "--batch-size", "16", "--router-model", "DiT-M/4",
            "--router-share", "0.2", "--splits", "equal-batch", "random", "ddm",
            "--n", "8", "--sample-steps", "1",
            "--classifier-steps", "20", "--no-plots"]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    results = json.load(open(tmp_path / "out" / "scaling.json"))
    root = tmp_path / "out" / "scaling"
    base = root / "fashion-mnist-DiT-M4-k2-x1-seed0-router0.2"
    monolith = torch.load(base / "experts" / "all" / "ckpt.pt", weights_only=True)
    per_step = monolith["config"]["flops_per_step"]
    ddm = torch.load(base / "experts" / "1" / "ckpt.pt", weights_only=True)
    equal = torch.load(root / (base.name + "-equal-batch") / "experts" / "1" / "ckpt.pt",
                       weights_only=True)
    assert (ddm["config"]["flags"]["batch_size"],
            equal["config"]["flags"]["batch_size"]) == (8, 16)
    assert (equal["step"] == ddm["step"] // 2
            and monolith["config"]["data"]["name"] == "fashion-mnist")
    random_clusters = torch.load(root / (base.name + "-random") / "clusters.pt",
                                 weights_only=True)
    assert random_clusters["clustering"] == "random"
    router = torch.load(base / "router" / "ckpt.pt", weights_only=True)
    router_step = router["config"]["flops"] / router["config"]["steps"]
    # 20 % of the budget
    assert (router["config"]["steps"] > 1 and abs(router["config"]["flops"]
                                                  - 0.2 * 60 * per_step) <= router_step / 2)
    rows = {(r["split"], r["method"]): r for r in results["runs"]}
    assert set(rows) == {("monolith", "monolith")} | {(s, m) for s in (
        "ddm", "equal-batch", "random") for m in ("top-1", "top-2", "full")}
    # every split spends the monolith's FLOPs, less by under two monolith steps
    for split in ("ddm", "equal-batch", "random"):
        assert 0 <= rows["monolith",
                         "monolith"]["flops"] - rows[split, "top-1"]["flops"] < 2 * per_step
    evaluation = json.load(open(base / "samples" / "monolith.eval.json"))
    # measured against the test split
    assert evaluation["reference"] == "test" and evaluation["n_real"] == 40


def test_a_rerun_with_other_sampler_settings_draws_its_batches_anew(tmp_path):
    """A measured batch is reused only if it was drawn as now asked; otherwise an --n or
    --solver change would be ignored."""
    argv = [*PRESPLIT_EPSILON, "--out", str(tmp_path)]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    batch = tmp_path / "epsilon" / "fm-seed0" / "samples.eval.json"
    assert json.load(open(batch))["n"] == 8
    reproduce.run_part(reproduce.build_parser().parse_args(argv[:argv.index("--n")] + [
        "--n", "12"] + argv[argv.index("--n") + 2:]))
    assert json.load(open(batch))["n"] == 12
    before = os.stat(batch).st_mtime_ns
    reproduce.run_part(reproduce.build_parser().parse_args(argv[:argv.index("--n")] + [
        "--n", "12"] + argv[argv.index("--n") + 2:]))
    # the same settings again: found, not redrawn
    assert os.stat(batch).st_mtime_ns == before
    drawn_from = json.load(open(tmp_path / "epsilon" / "fm-seed0" / "samples.json"))["weights"]
    longer = argv[:argv.index("--n")] + ["--n", "12"] + argv[argv.index("--n") + 2:]
    # the same folders, each network one step further
    longer[longer.index("--monolith-steps") + 1] = "3"
    reproduce.run_part(reproduce.build_parser().parse_args(longer))
    # the same flags over other weights: drawn anew
    assert os.stat(batch).st_mtime_ns != before
    weights = json.load(open(tmp_path / "epsilon" / "fm-seed0" / "samples.json"))["weights"]
    assert weights.keys() == drawn_from.keys() == {"all"}
    assert json.load(
        open(tmp_path / "epsilon" / "fm-seed0" / "samples.json"))["weights"] != drawn_from


def test_a_larger_budget_continues_the_smaller_ones_monolith_exactly(tmp_path):
    """--monolith-only trains no router or expert; x1 continues x0.5's monolith and ends
    where a straight run ends."""
    from studies import scaling
    results, lines = scaling.run(
        args_for(tmp_path / "doubling", "--monolith-only", "--no-plots"))
    assert ({r["method"] for r in results["runs"]} == {"monolith"}
            and len(results["runs"]) == 2 * 2)
    table = "\n".join(lines)
    # no ensemble: no pairs
    assert ("| DiT-M/2 | 2 | x1 | " in table and "monolith only" in table and "Paired"
            not in table)
    # not 'still improving'
    assert "not judged for a plateau here (2 budgets; the rule needs three" in table
    run = tmp_path / "doubling" / "scaling" / "DiT-M2-k2-x1-seed1"
    assert not (run / "router").exists() and sorted(os.listdir(run / "experts")) == ["all"]
    scaling.run(args_for(tmp_path / "straight", "--budgets", "1", "--monolith-only",
                         "--no-plots"))
    continued = torch.load(run / "experts" / "all" / "ckpt.pt", weights_only=True)
    straight = torch.load(
        tmp_path / "straight" / "scaling" / run.name / "experts" / "all" / "ckpt.pt",
        weights_only=True)
    assert (continued["step"] == straight["step"] == 40
            and continued["config"]["flops"] == straight["config"]["flops"])
    for key in ("model", "ema"):
        assert all(torch.equal(continued[key][name], straight[key][name])
                   for name in straight[key])
    steps = [json.loads(line)["step"] for line in open(run / "experts" / "all" / "log.jsonl")]
    # the log carries the first half's line too
    assert steps == [20, 40]


def test_a_warm_start_takes_the_furthest_source_of_the_same_precision_and_clustering(tmp_path):
    torch.save({"fingerprint": "ours"}, tmp_path / "clusters.pt")
    sources = []
    for name, step, precision, fingerprint in (
            ("a", 10, "fp32", "ours"), ("b", 20, "bf16", "ours"), ("c", 30, "fp32", "theirs"),
            ("d", 60, "fp32", "ours"), ("e", 15, "fp32", "ours")):
        os.makedirs(tmp_path / name)
        torch.save({"step": step,
                    "config": {"precision": precision,
                               "cluster_fingerprint": fingerprint}}, tmp_path / name / "ckpt.pt")
        sources.append(str(tmp_path / name))
    common.warm_start(str(tmp_path / "new"), 50, sources, str(tmp_path))
    # not bf16, another clustering, or past 50
    assert torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)["step"] == 15
    common.warm_start(str(tmp_path / "none"), 10, sources, str(tmp_path))
    assert not (tmp_path / "none").exists()


def test_the_strongest_baseline_arms_spend_equal_flops_and_count_updates_images_and_sampling(
        tmp_path):
    """Monoliths at B and B/2, experts at B/K and B/2K, each constant and wsd: equal
    training FLOPs, updates and images counted from the checkpoints, sampling FLOPs per
    image with the router, the monolith sampled again at top-1's cost, and every arm
    paired by seed against the best monolith."""
    from plumbing import checkpoint as networks
    import model
    from studies import scaling
    flags = ["--budgets", "1", "--monolith-batches", "16", "8", "--expert-batches", "8",
             "4", "--lr-schedules", "constant", "wsd",
             "--distill", "--distill-steps", "3", "--equal-sampling-cost", "--no-plots"]
    args = args_for(tmp_path, *flags)
    results, lines = scaling.run(args)
    root = tmp_path / "scaling"
    def load(run, name):
        return torch.load(root / run / "experts" / name / "ckpt.pt", weights_only=True)
    base = "DiT-M2-k2-x1-seed0"
    reference, small = load(base, "all"), load(base + "-monolith-b8", "all")
    assert (reference["step"], small["step"]) == (
        40, 80) and small["config"]["flags"]["batch_size"] == 8
    # half the batch, twice the steps
    assert small["config"]["flops"] == reference["config"]["flops"]
    ddm, halved = load(base, "1"), load(base + "-experts-b4", "1")
    assert halved["step"] == 2 * ddm["step"] and halved["config"]["flags"]["batch_size"] == 4
    wsd = load(base + "-monolith-b8-wsd0.2", "all")
    assert wsd["config"]["flags"]["lr_schedule"] == "wsd" and wsd["step"] == 80
    assert os.path.isfile(root / (base + "-experts-b4-wsd0.2") / "experts" / "0" / "stable.pt")
    rows = {(r["split"], r["method"]): r for r in results["runs"] if r["seed"] == 0}
    assert (rows["monolith-b8", "monolith"]["updates"] == 80
            and rows["monolith-b8", "monolith"]["images"] == 640)
    assert (rows["experts-b4", "top-1"]["updates"] == 2 * 2 * ddm["step"]
            and rows["experts-b4", "top-1"]["images"] == rows["ddm", "top-1"]["images"])
    for split, method in rows:
        if method != scaling.DISTILLED:
            assert abs(rows[split, method]["flops"]
                       - reference["config"]["flops"]) < reference["config"]["flops_per_step"]
    # sampling: the monolith one network a step; top-1 one expert and the router; full
    # every expert and the router
    router = networks.load(str(root / base / "router" / "ckpt.pt"))
    y = router.condition.router_input(torch.zeros(1, dtype=torch.long))
    x, t = torch.zeros(1, 1, 8, 8), torch.full((1,), 0.5)
    router_step = model.count_flops(lambda: router.net(x, t, y))
    mono, top1, full = (rows[s, m]["sampling_flops"]
                        for s, m in (("monolith", "monolith"), ("ddm", "top-1"), ("ddm", "full")))
    # one Euler step (--sample-steps 1)
    assert top1 == mono + router_step * 1 and full == 2 * mono + router_step
    student = torch.load(root / base / "experts" / "distilled" / "ckpt.pt", weights_only=True)
    # charged the ensemble's FLOPs and its own
    distilled = rows[scaling.DISTILLED, scaling.DISTILLED]
    assert (student["step"] == 3 and distilled["flops"] == rows["ddm", "top-1"]["flops"]
            + student["config"]["distillation_flops"])
    assert (distilled["sampling_flops"] == mono
            and distilled["updates"] == rows["ddm", "top-1"]["updates"] + 3)
    equal = rows["monolith", scaling.EQUAL_SAMPLING]
    assert (equal["sample_steps"] == round(top1 / mono)
            and equal["sampling_flops"] == mono * equal["sample_steps"])
    # the best monolith is the arm of lowest mean FD; every difference is the same seeds'
    # FD minus its FD
    entries = [e for e in results["baseline"] if e["budget"] == 1]
    means = {e["split"]: e["fd"] for e in entries if e["method"] == "monolith"}
    best = min(means, key=means.get)
    assert {e["best"] for e in entries} == {best}
    def fd(split, method):
        by_seed = sorted(results["runs"], key=lambda r: r["seed"])
        return [r["fd"] for r in by_seed if (r["split"], r["method"]) == (split, method)]
    top = next(e for e in entries if (e["split"], e["method"]) == ("experts-b4-wsd0.2", "top-1"))
    assert top["minus_best"] == pytest.approx(common.interval(
        np.subtract(fd("experts-b4-wsd0.2", "top-1"), fd(best, "monolith"))))
    assert top["minus_ddm"] == pytest.approx(common.interval(
        np.subtract(fd("experts-b4-wsd0.2", "top-1"), fd("ddm", "top-1"))))
    table = "\n".join(lines)
    assert ("| monolith-b8-wsd0.2 | wsd | monolith | 80 | 640 |" in table
            and "The strongest baseline" in table)
    # a student of another arm's top-1 ensemble, reusing every finished run; DDM's student
    # is untouched
    with pytest.raises(UsageError, match="experts-b3 is not an ensemble this study trains"):
        scaling.run(args_for(tmp_path, *flags, "--distill-arm", "experts-b3"))
    again = args_for(tmp_path, *flags, "--distill-arm", "experts-b4",
                     "--distill-routing", "top1", "--distill-batch", "8")
    results, lines = scaling.run(again)
    student = load(base + "-experts-b4", "distilled")
    assert (student["config"]["teacher"]["routing"] == "top1" and student["step"] == 3
            and student["config"]["flags"]["batch_size"] == 8)
    assert load(base, "distilled")["config"]["teacher"]["routing"] == "full"
    rows = {(r["split"], r["method"]): r for r in results["runs"] if r["seed"] == 0}
    distilled = rows[scaling.DISTILLED, scaling.DISTILLED]
    assert (distilled["teacher"] == "experts-b4:top1"
            and distilled["images"] == rows["experts-b4", "top-1"]["images"] + 3 * 8)
    assert distilled["flops"] == rows["experts-b4",
                                      "top-1"]["flops"] + student["config"]["distillation_flops"]
    assert "student of experts-b4's top1" in "\n".join(lines)
    # paired with its own teacher
    entry = next(e for e in results["baseline"] if e["method"] == scaling.DISTILLED)
    assert entry["minus_ddm"] == pytest.approx(common.interval(
        np.subtract(fd(scaling.DISTILLED, scaling.DISTILLED), fd("experts-b4", "top-1"))))
    changed = "is a student of other flags \\(routing top1 -> full; batch_size 8 -> 16\\)"
    with pytest.raises(UsageError, match=changed):
        scaling.run(args_for(tmp_path, *flags, "--distill-arm", "experts-b4"))
    with pytest.raises(UsageError, match="is a student of other flags \\(batch_size 8 -> 4\\)"):
        scaling.run(args_for(tmp_path, *flags, "--distill-arm", "experts-b4",
                             "--distill-routing", "top1", "--distill-batch", "4"))


def test_a_wsd_warm_start_takes_the_stable_checkpoint_at_or_before_this_runs_decay(tmp_path):
    torch.save({"fingerprint": "ours"}, tmp_path / "clusters.pt")
    sources = []
    for name, stable, final in (("x1", 8, 10), ("x2", 16, 20), ("x4", 32, 40)):
        os.makedirs(tmp_path / name)
        for file, step in (("stable.pt", stable), ("ckpt.pt", final)):
            torch.save({"step": step, "config": {
                "precision": "fp32", "cluster_fingerprint": "ours"}}, tmp_path / name / file)
        sources.append(str(tmp_path / name))
    # its decay starts at 24
    common.warm_start(str(tmp_path / "new"), 30, sources, str(tmp_path), ("wsd", 0.2))
    # x2's stable point, not a decayed ckpt
    assert torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)["step"] == 16
    common.warm_start(str(tmp_path / "constant"), 30, sources, str(tmp_path))
    assert torch.load(tmp_path / "constant" / "ckpt.pt", weights_only=True)["step"] == 20


def test_router_cost_pairs_each_router_with_the_reference_by_seed_and_counts_its_cost(
        tiny_ensemble, tmp_path):
    """Two routers and the reference held for 2 steps, two seeds, over the tiny ensemble's
    experts (no expert is trained): every router spends the run's router's training FLOPs,
    each row's cost is the sampler's own count, the reference's deltas are empty, and a
    rerun finds every router and batch again."""
    from studies import router_cost
    flags = ["--part", "router-cost", "--run-dir", str(tiny_ensemble),
             "--router-models", "DiT-N/4", "DiT-N/2@2", "DiT-N/4:7",
             "--router-every", "2", "--seeds", "0", "1", "--n", "8", "--sample-steps", "2",
             "--classifier-steps", "20", "--no-plots", "--out", str(tmp_path)]
    reproduce.main(reproduce.build_parser().parse_args(flags))
    results = json.load(open(tmp_path / "router-cost.json"))
    run_flops = torch.load(tiny_ensemble / "router" / "ckpt.pt",
                           weights_only=True)["config"]["flops"]
    rows = {(r["router"], r["seed"]): r for r in results["rows"]}
    assert set(rows) == {(name, seed)
                         for name in ("DiT-N/4", "DiT-N/2@2", "DiT-N/4:7", "DiT-N/4 every 2 steps")
                         for seed in (0, 1)}
    for (name, seed), row in rows.items():
        drawn = json.load(open(os.path.join(row["folder"], "top1.json"
                                            if "every" not in name else "top1-every2.json")))
        assert row["cost_vs_monolith"] == drawn["cost_vs_one_expert"] and drawn["seed"] == seed
        if name == "DiT-N/4:7":
            assert torch.load(os.path.join(row["folder"], "router", "ckpt.pt"),
                              weights_only=True)["config"]["steps"] == 7
        elif "every" not in name:
            # one step's FLOPs more than the run's router's at most: the steps are rounded
            # to spend it
            config = torch.load(os.path.join(row["folder"], "router", "ckpt.pt"),
                                weights_only=True)["config"]
            assert abs(config["flops"] - run_flops) <= config["flops"] / config["steps"]
            assert config["flags"]["seed"] == seed
    pooled = torch.load(os.path.join(rows[("DiT-N/2@2", 0)]["folder"], "router",
                                     "ckpt.pt"), weights_only=True)
    assert pooled["model_args"]["downsample"] == 2
    held = rows[("DiT-N/4 every 2 steps", 0)]
    assert held["router_share_of_expert"] == pytest.approx(
        rows[("DiT-N/4", 0)]["router_share_of_expert"] / 2)
    table = (tmp_path / "router-cost.md").read_text()
    assert "| DiT-N/4 |" in table and table.count("| - |") >= 2
    move = results["posterior_movement"]
    assert len(move["switch_share"]) == 5 and all(0 <= s <= 1 for s in move["switch_share"])
    mtimes = {r["folder"]: os.path.getmtime(os.path.join(
        r["folder"], "router", "ckpt.pt")) for r in results["rows"]}
    reproduce.main(reproduce.build_parser().parse_args(flags))
    assert mtimes == {f: os.path.getmtime(os.path.join(f, "router", "ckpt.pt")) for f in mtimes}


def test_the_information_control_tells_a_monolith_the_cluster_and_pairs_it_with_the_studys_arms(
        tmp_path):
    """Over a tiny scaling study (read only): per seed, one monolith at the monolith arm's
    batch and steps is told the cluster, sampled through the study's router, and paired
    with that seed's top-1 ensemble and monolith; a rerun trains nothing again."""
    flags = ["--budgets", "1", "--monolith-batches", "8", "--expert-batches", "4", "--no-plots"]
    reproduce.run_part(args_for(tmp_path / "study", *flags))
    before = sorted(os.listdir(tmp_path / "study" / "scaling"))
    control = ["--part", "control", "--run-dir", str(tmp_path / "study" / "scaling"),
               "--out", str(tmp_path / "c"), "--models", "DiT-M/2", "--k", "2", "--budgets", "1",
               "--train-seeds", "0", "1", "--monolith-steps", "40", "--batch-size", "16",
               "--monolith-batches", "8", "--expert-batches", "4", "--n", "16",
               "--sample-steps", "1", "--classifier-steps", "30"]
    reproduce.main(reproduce.build_parser().parse_args(control))
    assert sorted(os.listdir(tmp_path / "study" / "scaling")) == before
    results = json.load(open(tmp_path / "c" / "control.json"))
    assert [(r["seed"], r["steps"], r["batch"]) for r in results["rows"]] == [
        (0, 80, 8), (1, 80, 8)]
    for row in results["rows"]:
        run = f"DiT-M2-k2-x1-seed{row['seed']}"
        ckpt = torch.load(tmp_path / "c" / "control" / run / "experts" / "all" / "ckpt.pt",
                          weights_only=True)
        assert ckpt["config"]["condition"]["kind"] == "class+cluster" and ckpt["step"] == 80
        samples = tmp_path / "study" / "scaling" / f"{run}-experts-b4" / "samples"
        study = json.load(open(samples / "top-1.eval.json"))
        assert row["ensemble"]["fd"] == study["fd_classifier"]
        drawn = json.load(open(row["control"]["file"][:-4] + ".json"))
        assert drawn["routing"] == "top1" and len(drawn["usage_per_t_bin"]["counts"][0]) == 2
    assert "| x1 | 0, 1 |" in (tmp_path / "c" / "control.md").read_text()
    stamp = os.path.getmtime(
        tmp_path / "c" / "control" / "DiT-M2-k2-x1-seed0" / "experts" / "all" / "ckpt.pt")
    reproduce.main(reproduce.build_parser().parse_args(control))
    assert os.path.getmtime(
        tmp_path / "c" / "control" / "DiT-M2-k2-x1-seed0" / "experts" / "all" / "ckpt.pt") == stamp


def _x16_chunk(folder, name, rows):
    """A chunk file as the x16 study keeps one: scaling.json's rows and its batches' metrics."""
    runs, evals = [], {}
    for budget, seed, split, method, fd in rows:
        runs.append({"budget": budget, "seed": seed, "split": split, "method": method, "fd": fd,
                     "accuracy": 0.7 + fd / 1000})
        arm = "" if split in ("monolith", "ddm") else f"-{split}"
        batch = f"fashion-mnist-DiT-M4-k4-x{budget:g}-seed{seed}-router0.05{arm}"
        evals[f"scaling/{batch}/samples/{method}.eval.json"] = {
            "precision": fd / 1000, "recall": 0.5, "classifier_digest": "eecfdc969647"}
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump({"chunk": name, "commit": "abc", "command": "python reproduce.py ...",
                   "scaling": {"runs": runs}, "evals": evals}, f)


def test_the_x16_analysis_chooses_each_sides_arm_by_leave_one_seed_out(tmp_path):
    # monolith-b8 is best on seeds 6 and 7 but not on 5: chosen for 6 and 7 (by the other
    # seeds' means, 5 included), while seed 5 is scored with the arm seeds 6-7 prefer
    # (batch 4, 123 against 130): an in-sample choice would pick batch 8 everywhere
    results = tmp_path / "x16"
    results.mkdir()
    for seed in (5, 6, 7):
        _x16_chunk(results, f"seed{seed}-mono", [
            (16, seed, "monolith-b4", "monolith", 110 + 2 * seed),
            (16, seed, "monolith-b8", "monolith", 50 if seed == 5 else 130),
            (16, seed, "monolith", "monolith", 300),
            (8, seed, "monolith-b4", "monolith", 150)])
        _x16_chunk(results, f"seed{seed}-experts", [
            (16, seed, "experts-b2", "top-1", 100 + seed), (16, seed, "experts-b2", "full", 180),
            (16, seed, "ddm", "top-1", 250), (16, seed, "monolith", "monolith", 300),
            (8, seed, "experts-b2", "top-1", 140)])
    # the Inception pass of two seeds' x16 batches, and the information control of seed 5
    (results / "inception").mkdir()
    for seed, fids in ((5, (60, 70)), (6, (61, 75))):
        batches = {f"fashion-mnist-DiT-M4-k4-x16-seed{seed}-router0.05-{split}/{method}": {
            "fid": fid, "kid": fid / 1e4, "fd_classifier": fd, "memorisation": {
                "pixels": {"memorised": 0.0, "nearer_train_than_test": 0.5}}}
            for split, method, fid, fd in (
                ("experts-b2", "top-1", fids[0], 100 + seed),
                ("monolith-b8", "monolith", fids[1], 50 if seed == 5 else 130))}
        (results / "inception" / f"seed{seed}.json").write_text(json.dumps(batches))
    (results / "floor").mkdir()
    (results / "floor" / "seed6.json").write_text(json.dumps({
        "fashion-mnist-DiT-M4-k4-x16-seed6-router0.05-experts-b2/top-1": {"fd_classifier": 110},
        "fashion-mnist-DiT-M4-k4-x16-seed6-router0.05-monolith-b8/monolith": {
            "fd_classifier": 128}}))
    (results / "control").mkdir()
    (results / "control" / "seed5.json").write_text(json.dumps({"rows": [{
        "budget": 8.0, "seed": 5, **{arm: {"fd": fd, "accuracy": 0.7} for arm, fd in
                                     (("control", 145), ("ensemble", 140),
                                      ("monolith", 150))}}]}))
    out = tmp_path / "out"
    reproduce.main(reproduce.build_parser().parse_args(
        ["--part", "x16", "--results", str(results), "--out", str(out)]))
    r = json.loads((out / "x16.json").read_text())
    # FID pairs the arms the classifier FD chose; seed 5's chosen monolith (batch 4) has none
    assert r["primary"]["fid"]["per_seed"] == [61 - 75]
    assert r["primary"]["fd_seed1"]["per_seed"] == [110 - 128]
    # each list names only the seeds behind its differences
    assert r["primary"]["fid"]["seeds"] == r["primary"]["fd_seed1"]["seeds"] == [6]
    assert r["sampling_floor"]["mean_abs_change"] == pytest.approx((4 + 2) / 2)
    assert r["control"]["x8"]["told_minus_monolith"][0] == -5
    assert r["control"]["x8"]["experts_minus_told"][0] == -5
    assert r["seeds"] == [5, 6, 7]
    chosen = r["primary"]["chosen"]
    assert [chosen[s]["monolith"] for s in ("5", "6", "7")] == [
        ["monolith-b4", "monolith"], ["monolith-b8", "monolith"], ["monolith-b8", "monolith"]]
    assert all(chosen[s]["ensemble"] == ["experts-b2", "top-1"] for s in chosen)
    assert r["primary"]["fd"]["per_seed"] == pytest.approx([105 - 120, 106 - 130, 107 - 130])
    mean, half = common.interval([-15, -24, -23])
    assert r["primary"]["fd"]["mean"] == pytest.approx(mean)
    assert r["primary"]["fd"]["half"] == pytest.approx(half)
    assert r["x8"]["fd"]["per_seed"] == pytest.approx([-10, -10, -10])
    assert r["x8_to_x16"]["per_seed"] == pytest.approx([-5, -14, -13])
    # post hoc, fixed arms: batch-2 top-1 experts against the batch-4 monolith, both constant
    assert r["post_hoc"]["constant_x16"]["per_seed"] == pytest.approx([-15, -16, -17])
    assert r["post_hoc"]["constant_x8_to_x16"]["per_seed"] == pytest.approx([-5, -6, -7])
    assert r["post_hoc"]["wsd_x16"]["seeds"] == []
    assert r["primary"]["precision"]["per_seed"] == pytest.approx([-0.015, -0.024, -0.023])
    assert "primary" in (out / "x16.md").read_text()


def test_an_earlier_settings_arms_are_also_chosen_on_the_other_seeds(tmp_path):
    from studies import x16
    fds = {("a", "top-1"): (10, 100, 100), ("b", "top-1"): (50, 62, 72),
           ("monolith", "monolith"): (40, 40, 40)}
    runs = [{"model": "DiT-M/4", "budget": 8.0, "seed": seed, "split": split, "method": method,
             "fd": fd, "accuracy": 0.5}
            for (split, method), per_seed in fds.items() for seed, fd in enumerate(per_seed)]
    (tmp_path / "study.json").write_text(json.dumps({"runs": runs}))
    got = x16.earlier_setting(str(tmp_path / "study.json"), "DiT-M/4", 8.0)
    # in-sample: b has the lower mean (61.3 against 70) for every seed
    assert got["ensemble"] == ["b", "top-1"]
    assert got["fd"] == pytest.approx(common.interval([10, 22, 32]))
    # out of sample: seed 0 sees a at 100 and b at 67 (b); seeds 1 and 2 see a at 55 (a)
    assert got["fd_leave_one_seed_out"] == pytest.approx(common.interval([10, 60, 60]))


def test_the_x16_analysis_refuses_one_batch_measured_twice_with_two_fds(tmp_path):
    _x16_chunk(tmp_path, "a", [(16, 5, "monolith-b4", "monolith", 300)])
    _x16_chunk(tmp_path, "b", [(16, 5, "monolith-b4", "monolith", 301)])
    with pytest.raises(UsageError, match="measured twice"):
        reproduce.main(reproduce.build_parser().parse_args(
            ["--part", "x16", "--results", str(tmp_path), "--out", str(tmp_path / "out")]))


def test_the_x16_analysis_keeps_the_first_protocol_monolith_and_reports_its_repeat(tmp_path):
    # both sides of a seed train the batch-64 monolith; two machines give two FDs
    _x16_chunk(tmp_path, "seed5-experts", [(16, 5, "monolith", "monolith", 300)])
    _x16_chunk(tmp_path, "seed5-mono", [(16, 5, "monolith", "monolith", 301)])
    _x16_chunk(tmp_path, "seed5-mono-wsd", [(16, 5, "monolith", "monolith", 301)])
    reproduce.main(reproduce.build_parser().parse_args(
        ["--part", "x16", "--results", str(tmp_path), "--out", str(tmp_path / "out"),
         "--no-plots"]))
    got = json.loads((tmp_path / "out" / "x16.json").read_text())
    assert got["repeats"] == [{"budget": 16.0, "seed": 5,
                               "kept": {"fd": 300, "file": "seed5-experts.json"},
                               "repeat": {"fd": 301,
                                          "files": ["seed5-mono-wsd.json", "seed5-mono.json"]}}]
    assert [r["fd"] for r in got["rows"]] == [300]
    assert "300.0 (seed5-experts.json) and 301.0 (seed5-mono-wsd.json, seed5-mono.json)" in (
        tmp_path / "out" / "x16.md").read_text()


def test_the_x16_grid_draws_batches_of_one_seed_and_refuses_two_seeds(tmp_path):
    pytest.importorskip("matplotlib")
    from studies import x16
    labels = np.repeat(np.arange(10), 3)
    for name, seed in (("a", 0), ("b", 1)):
        images = np.random.default_rng(seed).integers(0, 256, (30, 28, 28, 1), dtype=np.uint8)
        np.savez(tmp_path / f"{name}.npz", arr_0=images, arr_1=labels)
    np.savez(tmp_path / "other.npz", arr_0=images, arr_1=labels[::-1].copy())
    x16.plot_grid([("a", str(tmp_path / "a.npz")), ("b", str(tmp_path / "b.npz"))],
                  str(tmp_path / "grid.png"))
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UsageError, match="different classes"):
        x16.plot_grid([("a", str(tmp_path / "a.npz")), ("o", str(tmp_path / "other.npz"))],
                      str(tmp_path / "bad.png"))


def test_the_solver_study_pairs_every_solver_by_noise_and_drives_diffusers_schedulers(
        tiny_ensemble, tmp_path, monkeypatch):
    """Every solver's batches of a seed start from the same labels and noise, diffusers'
    schedulers stepping the same networks; the verdict pairs ab2 at 8 with the best diffusers
    scheduler at 8."""
    pytest.importorskip("diffusers")
    from studies import solvers
    monkeypatch.setattr(solvers, "NFES", (8, 32))
    left_out = ("ab2", "diffusers UniPC, shift 3", "diffusers DPM-Solver++(2M), shift 3")
    kept = {k: v for k, v in solvers.SOLVERS.items() if k not in left_out}
    monkeypatch.setattr(solvers, "SOLVERS", kept)
    args = reproduce.build_parser().parse_args([
        "--part", "solvers", "--run-dir", str(tiny_ensemble), "--n", "8", "--seeds", "0", "1",
        "--out", str(tmp_path), "--no-plots"])
    results, lines = solvers.run(args)
    assert len(results["rows"]) == 2 * len(solvers.SOLVERS) * 2
    assert all(len(r["fd"]) == 2 and all(np.isfinite(r["fd"])) for r in results["rows"])
    first = {name: np.load(tmp_path / "solvers" / f"top-1-{name}-8-seed0.npz")["arr_1"]
             for name in ("euler", "ab2shift3", "diffusersUniPC")}
    # the same requests
    assert all(np.array_equal(first["euler"], labels) for labels in first.values())
    errors = {(r["model"], r["solver"], r["nfe"]): r["rms_to_reference"]
              for r in results["rows"]}
    # the reference
    assert errors[("top-1", "heun", 32)] == 0 and errors[("monolith", "heun", 32)] == 0
    assert all(e > 0 for key, e in errors.items() if key[1:] != ("heun", 32))
    assert "at 8: ab2, shift 3" in "\n".join(lines) and "integration error" in "\n".join(lines)


def test_the_confirmatory_analysis_pairs_by_seed_and_gives_no_verdict_before_every_declared_seed(
        tmp_path):
    """From chunk files alone: the primary is the paired experts - monolith difference with its
    95 % t-interval, and it is called resolved (and drawn in the forest plot) only with all
    ten declared seeds in."""
    from studies import confirm, x16

    def write(seed, side, arms):
        (tmp_path / f"seed{seed}-{side}.json").write_text(json.dumps(
            confirm_chunk(seed, side, arms)))

    gaps = [-12.0, -9.0, -15.0, -11.0, -10.0, -14.0, -8.0, -13.0, -12.0, -16.0]
    for i, (seed, gap) in enumerate(zip(confirm.SEEDS, gaps)):
        arm = confirm_arm(100.0 + i)
        write(seed, "experts", {"experts": arm,
                                "experts-old-router": dict(arm, fd_classifier=90.0 + i)})
        write(seed, "monolith",
              {"monolith": dict(arm, fd_classifier=100.0 + i - gap, sampling_flops=200.0)})
        results, lines = confirm.analyse(confirm.load_chunks(str(tmp_path)))
        primary = results["comparisons"]["primary"]
        assert primary["per_seed"] == pytest.approx(gaps[:i + 1])
        if i:
            sd = np.std(gaps[:i + 1], ddof=1)
            # a 4-digit table
            assert primary["half"] == pytest.approx(scipy_t(i) * sd / np.sqrt(i + 1), rel=1e-4)
        assert ("Primary: resolved" in "\n".join(lines)) == (i == 9)
        # the forest plot's confirmatory row: none before the declared N
        row = x16.confirmatory_entry(str(tmp_path))
        assert (row is None) == (i < 9)
    assert row["fd"] == pytest.approx((primary["mean"], primary["half"]))
    assert row["seeds"] == list(confirm.SEEDS) and row["ensemble_accuracy"] == pytest.approx(80)
    assert results["top1_flops_vs_monolith"] == pytest.approx([209 / 200] * 10)
    assert results["comparisons"]["router_default_minus_old"]["mean"] == pytest.approx(10.0)
    assert results["comparisons"]["control_minus_monolith"]["seeds"] == []
    # post hoc: every seed leans one way, so only the two one-sign patterns reach its mean
    assert results["primary_post_hoc"]["sign_flip_p"] == pytest.approx(2 / 2 ** 10)
    assert results["primary_post_hoc"]["below_zero"] == 10
    assert results["primary_post_hoc"]["sd"] == pytest.approx(np.std(gaps, ddof=1))
    # each arm's own level: the monolith's FD is the experts' minus the gap, seed by seed
    levels = results["arms"]
    assert levels["monolith"]["fd_classifier"]["mean"] == pytest.approx(104.5 - np.mean(gaps))
    assert levels["experts"]["inception.kid"]["mean"] == pytest.approx(30.0)
    assert "control" not in levels
    assert results["old_router_minus_monolith"]["mean"] == pytest.approx(np.mean(gaps) - 10)


def confirm_arm(fd):
    from studies import confirm
    return {"fd_classifier": fd, "sampling_flops": 209.0, "conditional_accuracy": 0.8,
            "precision": 0.9, "recall": 0.5, "classifier_digest": confirm.JUDGE,
            "inception": {"fid": 60.0, "kid": 0.03}}


def protocol_commit(protocol):
    """The commit a declared test's chunks ran at: the one that added its protocol where
    this checkout has its history, else any clean commit."""
    from studies import provenance
    return provenance.protocol_commit(protocol) or "c0ffee"


def confirm_chunk(seed, side, arms, commit=None):
    from studies import confirm
    commit = commit or protocol_commit(confirm.PROTOCOL)
    return {"chunk": f"seed{seed}-{side}", "protocol": "docs/confirm-protocol.md",
            "seed": seed, "side": side, "commit": commit, "command": "reproduce.py",
            "seconds": 1, "arms": arms}


@pytest.mark.parametrize("case", ["second measurement", "infinite FD", "no arm", "another commit",
                                  "undeclared seed", "another judge", "quoted FD",
                                  "fractional seed"])
def test_the_confirmatory_analysis_refuses_chunks_that_break_the_schema_or_the_protocol(
        tmp_path, case):
    """A chunk is read against the schema (every number finite, every arm present) and the
    protocol (declared seeds, one file per seed and side, one commit, one judge): what
    would give a verdict from a damaged or foreign chunk is one line naming the file."""
    from plumbing.command_line import UsageError
    from studies import confirm
    for seed in confirm.SEEDS:
        for side, arms in (("experts", {"experts": confirm_arm(90.0),
                                        "experts-old-router": confirm_arm(95.0)}),
                           ("monolith", {"monolith": confirm_arm(100.0)})):
            (tmp_path / f"seed{seed}-{side}.json").write_text(json.dumps(
                confirm_chunk(seed, side, arms)))
    confirm.load_chunks(str(tmp_path))   # intact: read
    chunk = confirm_chunk(10, "monolith", {"monolith": confirm_arm(100.0)})
    name, expected = "seed10-monolith.json", "seed10-monolith.json"
    if case == "second measurement":
        chunk["arms"]["monolith"]["fd_classifier"] = 130.0
        name, expected = "seed10-monolith.rerun.json", "one chunk per seed and side"
    elif case == "infinite FD":
        chunk["arms"]["monolith"]["fd_classifier"] = float("inf")
        expected = "not a finite number"
    elif case == "no arm":
        chunk["arms"]["monolith"] = None
        expected = "not a record"
    elif case == "another commit":
        chunk["commit"] = "deadbeef"
        expected = "one clean commit"
    elif case == "undeclared seed":
        chunk = confirm_chunk(9, "monolith", {"monolith": confirm_arm(100.0)})
        name, expected = "seed9-monolith.json", "not declared"
    elif case == "quoted FD":   # each refusal names the kind in a JSON reader's words
        chunk["arms"]["monolith"]["fd_classifier"] = "100.0"
        expected = "is '100.0', not a number$"
    elif case == "fractional seed":
        chunk["seed"] = 10.5
        expected = "is 10.5, not an integer$"
    else:
        chunk["arms"]["monolith"]["classifier_digest"] = "0123456789ab"
        expected = "not the protocol's"
    (tmp_path / name).write_text(json.dumps(chunk))
    with pytest.raises(UsageError, match=expected):
        confirm.load_chunks(str(tmp_path))


def git_project(tmp_path, monkeypatch):
    """A git repository standing in for the project (provenance asks its history), with
    docs/chunks/ for a test's chunk files; returns (results folder, commit_files), where
    commit_files(message, **{path: text}) commits and returns the new HEAD."""
    from studies import provenance
    if shutil.which("git") is None:
        pytest.skip("no git here: the history cannot be asked")
    repo = tmp_path / "project"
    (repo / "docs" / "chunks").mkdir(parents=True)

    def git(*args):   # whatever the machine's git config asks of a commit
        command = ["git", "-c", "commit.gpgsign=false", "-C", str(repo), *args]
        return subprocess.run(command, check=True, text=True, capture_output=True).stdout.strip()

    git("init", "-q")
    for key, value in (("user.name", "t"), ("user.email", "t@t")):
        git("config", key, value)
    monkeypatch.setattr(provenance, "PROJECT", str(repo))

    def commit_files(message, **files):
        for name, text in files.items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
        git("add", "-A")
        git("commit", "-qm", message)
        return git("rev-parse", "HEAD")
    return repo / "docs" / "chunks", commit_files


def test_a_declared_tests_chunks_ran_at_and_were_kept_after_the_protocols_commit(
        tmp_path, monkeypatch):
    """Asked of the git history: chunks that ran at any commit but the one that added the
    protocol are refused, and so is a chunk file committed with the protocol or before
    it, or changed since it was committed; a checkout without its full history (a
    shallow clone) is said to be one."""
    from studies import provenance
    results, commit_files = git_project(tmp_path, monkeypatch)
    repo = results.parent.parent
    early = commit_files("a chunk before its test", **{"docs/chunks/seed2-a.json": "{}"})
    # a chunk committed with its own protocol does not follow it either
    with_protocol = {"docs/p.md": "the protocol", "docs/chunks/seed3-a.json": "{}"}
    declared = commit_files("declare", **with_protocol)
    commit_files("a chunk after it", **{"docs/chunks/seed1-a.json": "{}"})
    chunk = {"protocol": "docs/p.md", "commit": declared}
    provenance.check_chunks({(1, "a"): chunk}, str(results), "docs/p.md")
    line = provenance.report_line({(1, "a"): chunk}, "docs/p.md", str(results))
    assert "the commit that added docs/p.md" in line and "Not committed" not in line
    # a chunk the runner wrote and nobody committed yet: allowed, and named
    (results / "seed4-a.json").write_text("{}")
    line = provenance.report_line({(1, "a"): chunk, (4, "a"): chunk}, "docs/p.md", str(results))
    assert line.endswith("Not committed yet: 1 of 2 chunk files (seed4-a.json).")
    (results / "seed4-a.json").unlink()
    cases = [("not at", {(1, "a"): dict(chunk, commit=early)}),
             ("does not follow", {(1, "a"): chunk, (2, "a"): chunk}),   # committed before
             ("does not follow", {(1, "a"): chunk, (3, "a"): chunk}),   # with the protocol
             ("not of docs/p.md", {(1, "a"): dict(chunk, protocol="docs/q.md")})]
    for message, chunks in cases:
        with pytest.raises(UsageError, match=message):
            provenance.check_chunks(chunks, str(results), "docs/p.md")
    # a committed chunk edited, in the tree or in a later commit
    (results / "seed1-a.json").write_text('{"edited": 1}')
    with pytest.raises(UsageError, match="changed since it was committed"):
        provenance.check_chunks({(1, "a"): chunk}, str(results), "docs/p.md")
    commit_files("edit a measurement", **{"docs/chunks/seed1-a.json": '{"edited": 2}'})
    with pytest.raises(UsageError, match="changed since it was committed"):
        provenance.check_chunks({(1, "a"): chunk}, str(results), "docs/p.md")
    with pytest.raises(UsageError, match="not in this checkout's history"):
        provenance.protocol_commit("docs/never.md")

    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)],
                   check=True)
    monkeypatch.setattr(provenance, "PROJECT", str(shallow))
    assert provenance.protocol_commit("docs/p.md") is None
    assert "no full git history" in provenance.report_line({(1, "a"): chunk}, "docs/p.md")


def test_an_amendments_chunks_need_a_bridge_that_measured_the_same(tmp_path, monkeypatch):
    """An amendment committed after its protocol may move the remaining chunks to its own
    commit; they are read only if its bridge (one chunk run again at that commit) has arms
    equal to the original's, exactly. Refused: no bridge, a bridge of another commit or
    with one number changed, an amendment older than its protocol, and chunks of any third
    commit."""
    from studies import provenance
    results, commit_files = git_project(tmp_path, monkeypatch)
    declared = commit_files("declare", **{"docs/p.md": "the protocol"})
    arms = {"x": {"fd": 101.5, "flops": 7, "router": {"model": "DiT-N/7"}}}
    original = {"protocol": "docs/p.md", "commit": declared, "seed": 1, "side": "a",
                "arms": arms}
    commit_files("a chunk at the protocol's commit",
                 **{"docs/chunks/seed1-a.json": json.dumps(original)})
    amended = commit_files("amend", **{"docs/amend.md": "faster commit"})
    later = dict(original, commit=amended, seed=2, arms={"x": {"fd": 90.0}})
    bridge_path = str(results / "bridge" / "seed1-a.json")
    bridge = dict(original, commit=amended)
    chunks = {(1, "a"): original, (2, "a"): later}
    provenance.check_chunks(chunks, str(results), "docs/p.md",
                            {"docs/amend.md": (bridge_path, bridge)})
    line = provenance.report_line(chunks, "docs/p.md", None,
                                  {"docs/amend.md": (bridge_path, bridge)})
    both = f"1 at {declared[:12]}, the commit that added docs/p.md; 1 at {amended[:12]}"
    assert both in line
    assert "whose bridge (seed1-a.json, run again there) measured exactly" in line
    # without an amendment's commit among them, the line reads as it did before amendments
    assert "every chunk ran at" in provenance.report_line(
        {(1, "a"): original}, "docs/p.md", None, {"docs/amend.md": (bridge_path, None)})
    # 7 and 7.0 are two values to JSON's readers
    one_number = dict(bridge, arms={"x": dict(arms["x"], flops=7.0)})
    nested = dict(bridge, arms={"x": dict(arms["x"], router={"model": "DiT-N/4"})})
    cases = [("which is missing", None),
             ("ran at .*; the bridge of docs/amend.md runs at",
              dict(bridge, commit=declared)),
             ("differ from seed1-a's at arms.x.flops", one_number),
             ("differ from seed1-a's at arms.x.router.model", nested),
             ("no chunk here run before the amendment", dict(bridge, seed=3))]
    for message, candidate in cases:
        with pytest.raises(UsageError, match=message):
            provenance.check_chunks(chunks, str(results), "docs/p.md",
                                    {"docs/amend.md": (bridge_path, candidate)})
    # a bridge is kept as measured too: committed after its commit, never edited
    commit_files("the bridge", **{"docs/chunks/bridge/seed1-a.json": json.dumps(bridge)})
    provenance.check_chunks(chunks, str(results), "docs/p.md",
                            {"docs/amend.md": (bridge_path, bridge)})
    (results / "bridge" / "seed1-a.json").write_text("{}")
    with pytest.raises(UsageError, match="changed since it was committed"):
        provenance.check_chunks(chunks, str(results), "docs/p.md",
                                {"docs/amend.md": (bridge_path, bridge)})
    third = dict(later, commit=commit_files("another", **{"docs/other.md": "x"}), seed=4)
    with pytest.raises(UsageError, match="one clean commit or an amendment's"):
        provenance.check_chunks({**chunks, (4, "a"): third}, str(results), "docs/p.md",
                                {"docs/amend.md": (bridge_path, bridge)})
    # an amendment committed before the protocol it amends
    commit_files("a second protocol", **{"docs/q.md": "declared after the amendment"})
    older = {"docs/amend.md": (bridge_path, None)}
    with pytest.raises(UsageError, match="amend.md: committed in .* does not follow"):
        provenance.check_chunks({(1, "a"): dict(original, protocol="docs/q.md")},
                                str(results), "docs/q.md", older)


def test_the_sign_flip_test_counts_the_sign_patterns_as_far_from_zero():
    from studies import confirm
    # |±1 ±1 +2| >= 2 for 6 of the 8 patterns (only ±(1, 1, -2) sum to 0)
    assert confirm.post_hoc([1.0, -1.0, 2.0])["sign_flip_p"] == pytest.approx(6 / 8)
    assert confirm.post_hoc([3.0]) is None


def scipy_t(df):
    """The two-sided 95 % Student t quantile, from a table (scipy is not a dependency)."""
    return {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469,
            7: 2.3646, 8: 2.3060,
            9: 2.2622}[df]


def attribution_chunk(seed, side, fd, commit=None):
    """A chunk of the attribution test whose arms measure judge FD `fd` at sampling seed 0
    and fd + 2 at seed 1 (every other metric fixed)."""
    from studies import attribution
    commit = commit or protocol_commit(attribution.PROTOCOL)
    batch = lambda value: {"fd_classifier": value, "kid_classifier": 0.01,
                           "conditional_accuracy": 0.8, "precision": 0.7, "recall": 0.5,
                           "classifier_digest": attribution.JUDGE,
                           "inception": {"fid": value / 2, "kid": 0.02}}
    arm = {"batches": {"0": batch(fd), "1": batch(fd + 2)}, "sampling_flops": 1e8,
           "training_flops": 1e12, "budget_flops": 1e12}
    return {"chunk": f"seed{seed}-{side}", "protocol": attribution.PROTOCOL, "seed": seed,
            "side": side, "commit": commit, "command": "python reproduce.py", "seconds": 1,
            "arms": {name: arm for name in attribution.side_arms(side)}}


def test_the_attribution_analysis_pairs_the_mean_of_two_noises_and_refuses_foreign_chunks(
        tmp_path):
    """Each arm's figure is the mean of its two sampling seeds; the primary pairs the
    experts' top-1 with monolith-b2 by training seed and gives no verdict before all ten
    seeds; the chunks are checked against the schema and the protocol, one per (seed,
    side), all of one clean commit."""
    from plumbing.command_line import UsageError
    from studies import attribution

    def write(chunk, name=None):
        name = name or f"{chunk['chunk']}.json"
        (tmp_path / name).write_text(json.dumps(chunk))
    gaps = [-3.0, -1.0, -2.0, -4.0, 0.5, -2.5, -1.5, -3.5, -2.0, -1.0]
    for i, (seed, gap) in enumerate(zip(attribution.SEEDS, gaps)):
        write(attribution_chunk(seed, "monolith-b2", 100.0 + i))
        write(attribution_chunk(seed, "experts", 100.0 + i + gap))
        results, lines = attribution.analyse(attribution.load_chunks(str(tmp_path)))
        primary = results["comparisons"]["primary"]
        assert primary["per_seed"] == pytest.approx(gaps[:i + 1])
        assert results["complete"] == (i == 9)
        assert ("incomplete" in "\n".join(lines)) == (i < 9)
        # the forest plot's rows: none before the declared N
        rows = attribution.forest_entries(str(tmp_path))
        assert len(rows) == (2 if i == 9 else 0)
    assert primary["resolved"] and primary["mean"] == pytest.approx(np.mean(gaps))
    # top-1 and draw measured alike here; no information control ran
    assert [row["fd"] for row in rows] == [pytest.approx((primary["mean"], primary["half"]))] * 2
    assert "top-1" in rows[0]["label"] and "draw" in rows[1]["label"]
    assert rows[0]["seeds"] == list(attribution.SEEDS) and rows[0]["ensemble_accuracy"] == \
        pytest.approx(80)
    assert results["arms"]["monolith-b2"]["fd_classifier"]["mean"] == pytest.approx(105.5)
    assert results["promoted"] is None   # no bracketing arm yet
    for name in attribution.BRACKETING:
        for seed in attribution.BRACKET_SEEDS:
            better = -1.0 if name == "monolith-b2-lr2" else 1.0
            write(attribution_chunk(seed, name, 100.0 + seed - 10 + better))
    results, _ = attribution.analyse(attribution.load_chunks(str(tmp_path)))
    assert results["promoted"] == "monolith-b2-lr2"
    assert "experts - promoted" in results["comparisons"]
    # promoted on seeds 10-12, its row waits for the rest of the ten
    assert len(attribution.forest_entries(str(tmp_path))) == 2
    for seed in attribution.SEEDS[3:]:
        write(attribution_chunk(seed, "monolith-b2-lr2", 100.0 + seed - 10 - 1.0))
    promoted_row = attribution.forest_entries(str(tmp_path))[-1]
    assert "promoted monolith-b2-lr2" in promoted_row["label"]
    assert promoted_row["fd"][0] == pytest.approx(np.mean(gaps) + 1.0)

    bad = attribution_chunk(10, "monolith-b4", 100.0)
    bad["arms"]["monolith-b4"]["batches"]["1"]["fd_classifier"] = float("inf")
    dirty = protocol_commit(attribution.PROTOCOL) + "+uncommitted"
    cases = {
        "not a finite number": (bad, None),
        "not declared": (attribution_chunk(9, "monolith-b4", 100.0), None),
        "one per seed and side": (attribution_chunk(10, "experts", 90.0),
                                  "seed10-experts.rerun.json"),
        "its chunk field says 'seed11-monolith-b4'": (
            dict(attribution_chunk(10, "monolith-b4", 100.0), chunk="seed11-monolith-b4"),
            "seed10-monolith-b4.json"),
        "one clean commit": (attribution_chunk(10, "monolith-b4", 100.0, dirty), None),
        "not of docs/attribution-protocol.md": (dict(attribution_chunk(10, "monolith-b4", 100.0),
                                                     protocol="docs/confirm-protocol.md"), None),
    }
    for message, (chunk, name) in cases.items():
        write(chunk, name)
        with pytest.raises(UsageError, match=message):
            attribution.load_chunks(str(tmp_path))
        (tmp_path / (name or f"{chunk['chunk']}.json")).unlink()
    from studies import provenance
    if provenance.protocol_commit(attribution.PROTOCOL) is not None:   # a full history
        check_the_amendments_wiring(tmp_path, write)


def check_the_amendments_wiring(tmp_path, write):
    """With the project's history: a chunk of an undeclared commit is refused, and one of
    the amendment's commit is read only beside its bridge, which must equal seed 10's
    experts chunk run at the protocol's commit in every number."""
    from plumbing.command_line import UsageError
    from studies import attribution, provenance
    amended = provenance.protocol_commit(next(iter(attribution.AMENDMENTS)))
    undeclared = ("b" * 40, "ran at bbbbbbbbbbbb, not at")
    for commit, message in (undeclared, (amended, "is missing")):
        write(attribution_chunk(10, "monolith-b4", 100.0, commit))
        with pytest.raises(UsageError, match=message):
            attribution.load_chunks(str(tmp_path))
    original = json.loads((tmp_path / "seed10-experts.json").read_text())
    bridge = dict(original, commit=amended)
    (tmp_path / "bridge").mkdir()
    write(bridge, os.path.join("bridge", "seed10-experts.json"))
    chunks = attribution.load_chunks(str(tmp_path))
    results, _ = attribution.analyse(chunks, str(tmp_path))
    assert "whose bridge (seed10-experts.json, run again there)" in results["provenance"]
    bridge["arms"]["experts-draw"]["batches"]["1"]["recall"] += 1e-9
    write(bridge, os.path.join("bridge", "seed10-experts.json"))
    where = "arms.experts-draw.batches.1.recall"
    with pytest.raises(UsageError, match=f"differ .* at {where}"):
        attribution.load_chunks(str(tmp_path))


def test_a_studys_links_are_verified_against_the_networks_asked_for(tmp_path):
    """A study folder of links made from one set of networks is refused for another (its
    batches were drawn from the first); a release's index is borrowed with its networks."""
    for run in ("a", "b"):
        (tmp_path / run / "experts" / "all").mkdir(parents=True)
    (tmp_path / "a" / "model_index.json").write_text("{}")
    view = tmp_path / "view"
    common.link_run(str(view), str(tmp_path / "a"), {"all": str(tmp_path / "a" / "experts" / "all")})
    assert os.readlink(view / "model_index.json") == str(tmp_path / "a" / "model_index.json")
    # the same networks again: kept
    common.link_run(str(view), str(tmp_path / "a"), {"all": str(tmp_path / "a" / "experts" / "all")})
    with pytest.raises(UsageError, match="made from other networks"):
        common.link_run(str(view), str(tmp_path / "a"),
                        {"all": str(tmp_path / "b" / "experts" / "all")})
