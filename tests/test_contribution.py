"""Open contribution: contributors' own partitions, a router from the experts' samples,
and experts that join later."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import distill
from plumbing import ensemble
import routing
import sample
import train_expert
from plumbing.router import samples as router_samples
import train_router
from plumbing.condition import NoCondition
from diffusion import RectifiedFlow
from gmm import AnalyticExpert, GaussianMixture
from helpers import cli, run_script, run_stage, snapshot

import cluster

EXPERT = ["--model", "DiT-M/2", "--steps", "20", "--batch-size", "32", "--log-every", "10"]
ROUTER = ["--model", "DiT-M/2", "--steps", "20", "--batch-size", "32", "--log-every", "10"]


def exact_router(gmm):
    return lambda x, t, ids: gmm.log_likelihoods(x.flatten(1).double(), 1 - t.double(), t.double())


def test_a_router_trained_on_the_analytic_experts_own_samples_approaches_the_exact_posterior(
        tmp_path, monkeypatch):
    """Two analytic experts draw the same number of samples each with the project's
    sampler; their shares (70/30) come only from the recorded sizes. The trained router's
    p(k | x_t, t) must match the mixture's exact posterior, prior included: at t ~ 1 the
    posterior is the prior, which balanced samples alone would put at 50/50."""
    gmm = GaussianMixture([0.7, 0.3], [[0.4, 0.4], [-0.4, -0.4]], [0.3, 0.3])
    g = torch.Generator().manual_seed(0)
    parts = []
    for k in range(2):
        expert = AnalyticExpert(gmm, k, "fm")
        ids = torch.zeros(4000, dtype=torch.long)
        x, flops = router_samples.draw_samples(lambda x, t, ids: expert.velocity(x, t),
                                               ids, (2, 1, 1), 50, g, 4000, "cpu", clamp=False)
        assert flops == 0   # an analytic expert does no matrix work
        # the sampler reproduces the expert's cluster
        assert (x.flatten(1).mean(0).double() - gmm.means[k]).abs().max() < 0.03
        parts.append((router_samples.Samples(x), np.full(len(x), k),
                      lambda local: torch.zeros(len(local), dtype=torch.long)))
    examples = router_samples.RoutingExamples(parts)
    members = [{"name": "a", "trained_on": "a" * 40, "size": 700},
               {"name": "b", "trained_on": "b" * 40, "size": 300}]
    args = train_router.build_parser().parse_args(
        ["--run-dir", str(tmp_path), "--model", "DiT-M/1", "--steps", "2400",
         "--batch-size", "256", "--lr", "1e-3", "--from-samples", "4000", "--no-paired-null",
         "--condition-dropout", "0"])
    seen = {"cluster_fingerprint": None, "data": None, "vae": None,
            "source": {"samples_per_expert": 4000}}
    # the analytic experts' samples stand in for the run's experts: the recipe is
    # train_router.main's own
    monkeypatch.setattr(train_router, "experts_to_sample",
                        lambda *a: (None, members, NoCondition()))
    monkeypatch.setattr(train_router, "examples_from_samples", lambda *a: (examples, seen))
    train_router.main(args)

    router = ensemble.load_router(str(tmp_path), None)
    assert (router.config["prior"] == pytest.approx([0.7, 0.3])
            and [m["name"] for m in router.config["experts"]] == ["a", "b"])
    g = torch.Generator().manual_seed(1)
    x0, _ = gmm.sample(4000, g)
    t = torch.rand(4000, generator=g, dtype=torch.float64)
    x_t = RectifiedFlow.add_noise(x0, torch.randn(x0.shape, generator=g, dtype=torch.float64), t)
    with torch.no_grad():
        learned = router.net(x_t.float()[:, :, None, None], t.float()).softmax(1).double()
    exact = gmm.posterior(x_t, t)
    assert (learned - exact).abs().mean() < 0.02
    # where the posterior is nearly the prior: 0.7 from the sizes, not 0.5 from the
    # balanced samples
    high = t > 0.9
    assert (abs(learned[high, 0].mean() - exact[high, 0].mean()) < 0.03
            and exact[high, 0].mean() > 0.65)


def test_a_joined_expert_changes_the_ensemble_velocity_exactly_as_the_closed_form_says():
    """Three experts with the exact posterior of their three clusters, then a fourth joins
    and the router is the exact posterior of all four: v_4 = (1 - p_new) v_3 + p_new
    v_new, which is the whole four-cluster mixture's velocity."""
    weights, means, stds = [0.4, 0.3, 0.2, 0.1], [[0.6, 0.6], [-0.6, 0.6],
                                                  [0.6, -0.6], [-0.6, -0.6]], [0.15, 0.1, 0.12, 0.1]
    four = GaussianMixture(weights, means, stds)
    three = GaussianMixture(np.array(weights[:3]) / sum(weights[:3]), means[:3], stds[:3])
    experts = {k: AnalyticExpert(four, k, "fm") for k in range(4)}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 2, 1, 1, generator=g, dtype=torch.float64)
    t = torch.rand(500, generator=g, dtype=torch.float64) * 0.98 + 0.01
    ids = torch.zeros(500, dtype=torch.long)
    first_three = {k: experts[k] for k in range(3)}
    before = routing.Ensemble(first_three, exact_router(three), ("full", None), NoCondition(), 3)
    after = routing.Ensemble(experts, exact_router(four), ("full", None), NoCondition(), 4)
    v3, _ = routing.ensemble_velocity(before, x, t, ids)
    v4, _ = routing.ensemble_velocity(after, x, t, ids)
    joined = four.posterior(x.flatten(1), t)[:, 3, None, None, None]
    assert torch.allclose(v4, (1 - joined) * v3 + joined * experts[3].velocity(x, t), atol=1e-6)
    assert torch.allclose(v4.flatten(1), four.velocity(x.flatten(1), t), atol=1e-6)
    assert (v4 - v3).abs().max() > 0.1   # the new expert does change the field


@pytest.fixture(scope="module")
def grown_run(tmp_path_factory):
    """Digits, K = 2 k-means experts with their data router, then a contributor's expert
    of the eights joins."""
    run = tmp_path_factory.mktemp("contribution") / "run"
    run_stage(cluster, ["--k", "2", "--features", "pixels", "--run-dir", str(run)])
    for k in range(2):
        run_stage(train_expert, ["--cluster", str(k), *EXPERT, "--run-dir", str(run)])
    run_stage(train_router, [*ROUTER, "--run-dir", str(run)])
    shutil.copytree(run / "router", run.parent / "router-of-two")
    run_stage(train_expert, ["--contribution", "eights", "--classes", "8", *EXPERT,
                             "--run-dir", str(run)])
    return run


def test_an_expert_that_joined_later_is_refused_by_the_old_router_in_one_line(
        grown_run, tmp_path):
    out = tmp_path / "x.npz"
    code, err = cli(sample, ["--run-dir", grown_run, "--n", "4", "--steps", "2", "--out", out])
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists()
    assert ("trained for experts 0, 1; eights joined later" in err
            and "train_router.py --run-dir" in err and "--experts 0,1" in err)
    code, err = cli(distill, ["--run-dir", grown_run, "--steps", "1",
                              "--out-dir", tmp_path / "student"])
    assert code == 2 and "eights joined later" in err and not (tmp_path / "student").exists()
    # the two old experts still sample with their router
    code, err = cli(sample, ["--run-dir", grown_run, "--experts", "0,1", "--n", "4",
                             "--steps", "2", "--out", out])
    assert code == 0 and out.exists()


def test_a_contributed_expert_records_its_data_by_fingerprint_and_size(grown_run):
    config = torch.load(grown_run / "experts" / "eights" / "ckpt.pt",
                        weights_only=True)["config"]
    member = config["member"]
    assert (member["name"] == "eights" and member["origin"] == "contributed"
            and member["classes"] == [8])
    # digits has 174 eights
    assert (member["size"] == 174 and member["label_counts"][8] == 174
            and sum(member["label_counts"]) == 174)
    assert (config["cluster_fingerprint"] is None and config["k"] is None
            and len(member["trained_on"]) == 40)
    kmeans = [torch.load(grown_run / "experts" / k / "ckpt.pt",
                         weights_only=True)["config"]["member"] for k in ("0", "1")]
    assert (kmeans[0]["origin"] == "cluster" and kmeans[0]["name"] == "0"
            and kmeans[0]["size"] + kmeans[1]["size"] == 1797)


def test_the_grown_ensemble_samples_and_distils_after_only_the_router_is_retrained(
        grown_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(grown_run, run)
    experts_before = snapshot(run / "experts")
    # from the experts' samples, fine-tuned from the router of two: nobody's data
    run_stage(train_router, [*ROUTER, "--run-dir", str(run), "--from-samples", "32",
                             "--sample-steps", "4",
                             "--init", str(grown_run.parent / "router-of-two")])
    config = torch.load(run / "router" / "ckpt.pt", weights_only=True)["config"]
    assert ([m["name"] for m in config["experts"]] == ["0", "1", "eights"]
            and config["init"] == "router-of-two")
    assert (config["source"]["samples_per_expert"] == 32
            and config["source"]["sample_flops"] > 0 and config["data"] is None)
    sizes = [m["size"] for m in config["experts"]]
    assert config["prior"] == pytest.approx([s / sum(sizes) for s in sizes]) and sizes[2] == 174
    cached = sorted(os.listdir(run / "router" / "samples"))
    assert [name.split("-")[0] for name in cached] == ["0", "1", "eights"]
    stamps = {name: os.stat(run / "router" / "samples" / name).st_mtime_ns for name in cached}
    run_stage(train_router, [*ROUTER, "--run-dir", str(run), "--from-samples", "32",
                             "--sample-steps", "4", "--seed", "0"])
    # drawn once
    assert {name: os.stat(run / "router" / "samples" / name).st_mtime_ns
            for name in cached} == stamps
    # a cache that cannot be read is drawn again, the same draws (before: the stage
    # stopped on it); the others are kept
    damaged = run / "router" / "samples" / cached[0]
    drawn = torch.load(damaged, weights_only=True)["x"]
    damaged.write_bytes(b"not a checkpoint")
    run_stage(train_router, [*ROUTER, "--run-dir", str(run), "--from-samples", "32",
                             "--sample-steps", "4", "--seed", "0"])
    assert torch.equal(torch.load(damaged, weights_only=True)["x"], drawn)
    assert all(os.stat(run / "router" / "samples" / name).st_mtime_ns == stamps[name]
               for name in cached[1:])
    assert snapshot(run / "experts") == experts_before   # no expert was touched

    run_stage(sample, ["--run-dir", str(run), "--n", "6", "--steps", "2", "--routing", "full"])
    record = json.loads((run / "samples" / "full.json").read_text())
    assert record["experts"] == record["router_outputs"] == ["0", "1", "eights"] and record["k"] == 3
    run_stage(distill, ["--run-dir", str(run), "--steps", "1", "--batch-size", "8",
                        "--model", "DiT-M/2"])
    teacher = torch.load(run / "experts" / "distilled" / "ckpt.pt",
                         weights_only=True)["config"]["teacher"]
    assert set(teacher["experts"]) == {"0", "1", "eights"}

    # from data, where this machine holds the contributor's data too: the same three outputs
    run_stage(train_router, [*ROUTER, "--run-dir", str(run)])
    config = torch.load(run / "router" / "ckpt.pt", weights_only=True)["config"]
    assert ([m["name"] for m in config["experts"]] == ["0", "1", "eights"]
            and config["source"] == "data")
    assert config["prior"][2] == pytest.approx(174 / (1797 + 174))
    code, err = cli(sample, ["--run-dir", run, "--n", "4", "--steps", "2",
                             "--out", tmp_path / "d.npz"])
    assert code == 0, err


def test_refusals_are_one_line_and_write_nothing(grown_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(grown_run, run)
    before = snapshot(run)
    cases = [
        # resuming one's own expert with other classes is a change of flags, said before
        # anything else
        (train_expert, ["--contribution", "eights", "--classes", "7", *EXPERT],
         "other flags (--classes [8] -> [7])"),
        # the same flags over other data: the name is someone else's
        (train_expert, ["--contribution", "eights", "--classes", "8",
                        "--data", "digits-captions", *EXPERT],
         "contribution eights is taken"),
        # collides
        (train_expert, ["--contribution", "more-eights", "--classes", "8", *EXPERT],
         "trained on exactly these data"),
        (train_expert, ["--contribution", "x", "--cluster", "0", *EXPERT], "give one"),
        (train_expert, ["--cluster", "0", "--classes", "1", *EXPERT], "use it with --contribution"),
        (train_expert, ["--contribution", "x", "--classes", "12", *EXPERT], "has classes 0..9"),
        (train_expert, ["--contribution", "3", *EXPERT], "not a contribution name"),
        (train_expert, ["--contribution", "all", *EXPERT], "not a contribution name"),
        (train_router, ["--from-samples", "16", "--experts", "0", *ROUTER],
         "at least two experts"),
        (train_router, ["--from-samples", "16", "--experts", "0,all", *ROUTER], "does not mix"),
        (train_router, ["--experts", "0,1", *ROUTER], "--experts chooses whose samples"),
    ]
    for module, argv, message in cases:
        code, err = cli(module, [*argv, "--run-dir", run])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert snapshot(run) == before

    # two experts of one ensemble trained on the same data (a folder copied under another name)
    shutil.copytree(run / "experts" / "eights", run / "experts" / "copy")
    ckpt = torch.load(run / "experts" / "copy" / "ckpt.pt", weights_only=True)
    ckpt["config"]["member"]["name"] = "copy"
    torch.save(ckpt, run / "experts" / "copy" / "ckpt.pt")
    code, err = cli(train_router, ["--from-samples", "16", *ROUTER, "--run-dir", run])
    assert (code == 2 and "experts copy and eights were trained on the same data" in err
            and not (run / "router" / "samples").exists())
    shutil.rmtree(run / "experts" / "copy")

    # a contributor's folder under a cluster's number, and the other way round
    shutil.copytree(run / "experts" / "eights", run / "experts" / "5")
    code, err = cli(sample, ["--run-dir", run, "--experts", "0,5", "--n", "4",
                             "--out", tmp_path / "y.npz"])
    assert code == 2 and "holds expert 'eights', not '5'" in err
    shutil.rmtree(run / "experts" / "5")

    # the contributor retrains on other data under the same name: the router no longer
    # knows that expert
    run_stage(train_router, [*ROUTER, "--run-dir", str(run), "--from-samples", "16",
                             "--sample-steps", "2"])
    shutil.rmtree(run / "experts" / "eights")
    run_stage(train_expert, ["--contribution", "eights", "--classes", "7,8", *EXPERT,
                             "--run-dir", str(run)])
    code, err = cli(sample, ["--run-dir", run, "--n", "4", "--out", tmp_path / "z.npz"])
    assert (code == 2
            and "expert eights was trained on other data than when the router was trained"
            in err)
    assert not (tmp_path / "z.npz").exists()
    code, err = cli(train_router, [*ROUTER, "--run-dir", run, "--from-samples", "16",
                                   "--init", run / "router"])
    assert code == 2 and "retrained on other data since" in err

    # a contributor's data that this machine cannot read: the data router says how to do without
    ckpt = torch.load(run / "experts" / "eights" / "ckpt.pt", weights_only=True)
    ckpt["config"]["data_spec"] = f"folder:{tmp_path / 'elsewhere'}"
    torch.save(ckpt, run / "experts" / "eights" / "ckpt.pt")
    code, err = cli(train_router, [*ROUTER, "--run-dir", run])
    assert (code == 2 and "cannot be read here" in err and "--from-samples" in err
            and len(err.strip().splitlines()) == 1)


def test_the_contribution_study_at_tiny_scale_compares_every_arm_and_resumes(tmp_path):
    import reproduce
    argv = ["--part", "contribution", "--out", str(tmp_path), "--models", "DiT-M/2",
            "--budgets", "1", "--train-seeds", "0",
            "--monolith-steps", "40", "--batch-size", "16", "--router-steps", "2",
            "--n", "8", "--sample-steps", "1",
            "--classifier-steps", "20", "--sample-budgets", "8", "16",
            "--contributor-classes", "0,1,2", "3,4,5,6", "7,8,9",
            "--join-share", "0.5", "--no-plots"]
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    results = json.loads((tmp_path / "contribution.json").read_text())
    arms = {(r["arm"], r["method"]) for r in results["rows"]}
    # the monolith, then top-1 and full of five routers
    assert len(results["rows"]) == 1 + 2 * (1 + 2 + 1 + 1) == len(arms)
    base = tmp_path / "scaling" / "DiT-M2-k3-x1-seed0"
    steps = torch.load(base / "router" / "ckpt.pt", weights_only=True)["config"]["steps"]
    # the same experts (links), each router from n samples per expert, for the data
    # router's steps
    for n in (8, 16):
        reused = tmp_path / "scaling" / f"DiT-M2-k3-x1-seed0-samples{n}" / "experts" / "1"
        assert os.path.realpath(reused) == os.path.realpath(base / "experts" / "1")
        config = torch.load(
            tmp_path / "scaling" / f"DiT-M2-k3-x1-seed0-samples{n}" / "router" / "ckpt.pt",
            weights_only=True)["config"]
        assert config["source"]["samples_per_expert"] == n and config["steps"] == steps
    contributors = torch.load(
        base.parent / "DiT-M2-k3-x1-seed0-contributors" / "experts" / "classes-789" / "ckpt.pt",
        weights_only=True)
    kmeans = torch.load(base / "experts" / "1" / "ckpt.pt", weights_only=True)
    assert contributors["step"] == kmeans["step"]
    assert contributors["config"]["flags"]["batch_size"] == kmeans["config"]["flags"]["batch_size"]
    joined = torch.load(base.parent / "DiT-M2-k3-x1-seed0-join" / "router" / "ckpt.pt",
                        weights_only=True)["config"]
    assert [m["name"] for m in joined["experts"]] == ["classes-012", "classes-3456", "classes-789"]
    assert joined["init"] == "router-before"
    assert joined["steps"] == max(1, round(0.5 * steps))
    share = [r["router_share_of_expert"] for r in results["rows"]
             if "router_share_of_expert" in r]
    assert len(share) == 2 and 0 < share[0] < 1
    accuracy = results["routing_accuracy_real"]["0"]
    assert set(accuracy) == {"data router", "8 samples per expert", "16 samples per expert"}
    assert (set(accuracy["data router"]) == {"with the label", "without it"}
            and len(accuracy["data router"]["without it"]) == 5)

    stamps = {p: os.stat(p).st_mtime_ns for p in tmp_path.glob("scaling/*/router/ckpt.pt")}
    # a rerun finds every router and batch
    reproduce.run_part(reproduce.build_parser().parse_args(argv))
    assert {p: os.stat(p).st_mtime_ns
            for p in tmp_path.glob("scaling/*/router/ckpt.pt")} == stamps
    assert json.loads((tmp_path / "contribution.json").read_text())["rows"] == results["rows"]

    # the routing comparison with routers of their own length: a data router beside the
    # FLOP-matched one
    reproduce.run_part(reproduce.build_parser().parse_args(
        argv + ["--compare-router-steps", "3"]))
    longer = json.loads((tmp_path / "contribution.json").read_text())
    assert len(longer["rows"]) == len(results["rows"]) + 2
    for folder in ("data3", "samples8-steps3", "samples16-steps3"):
        assert torch.load(
            base.parent / f"DiT-M2-k3-x1-seed0-{folder}" / "router" / "ckpt.pt",
            weights_only=True)["config"]["steps"] == 3
    assert set(longer["routing_accuracy_real"]["0"]) == {
        "data router (3 steps)", "8 samples per expert (3 steps)",
        "16 samples per expert (3 steps)"}


def test_experts_from_before_open_contribution_are_refused_in_one_line_by_a_router_from_samples(
        grown_run, tmp_path):
    """Experts that record no membership were never released, so their reader was dropped
    (#37): one clear line."""
    run = tmp_path / "run"
    shutil.copytree(grown_run, run)
    # as train_expert.py wrote them before experts recorded what they were trained on
    for k in ("0", "1"):
        ckpt = torch.load(run / "experts" / k / "ckpt.pt", weights_only=True)
        ckpt["config"].pop("member")
        torch.save(ckpt, run / "experts" / k / "ckpt.pt")
    code, _, err = run_script("train_router.py", *ROUTER, "--run-dir", run,
                              "--from-samples", "16", "--sample-steps", "2")
    assert (code == 2 and len(err.strip().splitlines()) == 1
            and "expert 0 records no training-set size" in err)
    assert (not (run / "router" / "samples").exists() or
            not any((run / "router" / "samples").glob("*.pt")))
    # they still sample as they are, with the router they were trained beside
    code, err = cli(sample, ["--run-dir", run, "--experts", "0,1", "--n", "4",
                             "--steps", "2", "--out", tmp_path / "x.npz"])
    assert code == 0, err


def test_a_damaged_sample_cache_is_drawn_again_and_a_damaged_size_refused(
        tiny_ensemble, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    router = ["--from-samples", "8", "--sample-steps", "2", "--steps", "3",
              "--run-dir", str(run)]
    run_stage(train_router, router)
    cache = sorted((run / "router" / "samples").glob("0-*.pt"))[0]
    cached = torch.load(cache, weights_only=True)
    first = cached["x"].clone()
    cached["x"] = cached["x"][:2] * float("nan")                 # cut to 2 rows, and not finite
    torch.save(cached, cache)
    run_stage(train_router, router)
    assert torch.equal(torch.load(cache, weights_only=True)["x"], first)   # the same draws again
    path = run / "experts" / "2" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["member"]["size"] = -5
    torch.save(ckpt, path)
    code, err = cli(train_router, router)
    assert code == 2 and "positive count" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("counts", [[0] * 10, [3, -1, 0, 0, 0, 0, 0, 0, 0, 0], [1.5] * 10, []])
def test_label_counts_a_router_cannot_draw_from_are_refused_in_one_line(
        tiny_ensemble, tmp_path, counts):
    """An expert's labels are drawn from its recorded counts: counts no distribution can
    be made of are a damaged record, said before anything is drawn."""
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    path = run / "experts" / "2" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["member"]["label_counts"] = counts
    torch.save(ckpt, path)
    code, err = cli(train_router, ["--from-samples", "8", "--sample-steps", "2", "--steps", "3",
                                   "--run-dir", str(run)])
    assert code == 2 and "label counts" in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "router" / "samples").exists()
