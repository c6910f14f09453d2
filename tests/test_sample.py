"""The router and the ensemble sampler: analytic Gaussian-mixture experts first, then a tiny real run."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from plumbing import ensemble
import model
import routing
import sample
import train_expert
import train_router
from plumbing.condition import ClassCondition, NoCondition
from diffusion import DDPM, RectifiedFlow
from gmm import AnalyticExpert, ClassConditionalMixture, ConditionalAnalyticExpert, GaussianMixture
from helpers import ROOT, free_port, run_script, run_stage

GMM = GaussianMixture([0.4, 0.3, 0.2, 0.1], [[0.6, 0.6], [-0.6, 0.6], [0.6, -0.6], [-0.6, -0.6]], [0.15, 0.1, 0.12, 0.1])


def analytic_router(gmm):
    def router(x, t, ids):
        return gmm.log_likelihoods(x.flatten(1).double(), 1 - t.double(), t.double())
    return router


def run(experts, router, rule, z, steps, **options):
    """routing.sample on unconditional analytic experts over the 4 clusters of GMM."""
    guidance = {key: options.pop(key) for key in ("cfg_scale", "cfg_routing") if key in options}
    ensemble = routing.Ensemble(experts, router, rule, NoCondition(), 4, **guidance)
    return routing.sample(ensemble, z, torch.zeros(len(z), dtype=torch.long), steps, **options)


def noise(n=3000, seed=0):
    return torch.randn(n, 2, 1, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_matches_mixture(x, gmm, mass_tol=0.03, mean_tol=0.03):
    x = x.flatten(1)
    nearest = ((x[:, None] - gmm.means[None]) ** 2).sum(-1).argmin(1)
    for k in range(len(gmm.weights)):
        assert abs((nearest == k).double().mean() - gmm.weights[k]) < mass_tol
        assert (x[nearest == k].mean(0) - gmm.means[k]).abs().max() < mean_tol
        assert abs(x[nearest == k].std(0).mean() - gmm.stds[k]) < 0.03


@pytest.mark.parametrize("objectives", [("fm",) * 4, ("ddpm", "fm", "ddpm", "fm")])
def test_full_routing_with_the_analytic_posterior_samples_the_mixture(objectives):
    experts = {k: AnalyticExpert(GMM, k, o) for k, o in enumerate(objectives)}
    x, usage = run(experts, analytic_router(GMM), ("full", None), noise(), steps=100)
    assert_matches_mixture(x, GMM)
    # full routing runs every expert with any weight: all of them at high noise; near t = 0 far
    # clusters' posteriors underflow to exactly 0 and those experts are skipped
    assert torch.all(usage[4] == 21 * 3000) and torch.all(usage[0] <= 19 * 3000)


@pytest.mark.parametrize("solver", ["euler", "heun", "ab2"])
def test_every_solver_routes_exactly_at_every_evaluation(solver):
    """With the analytic posterior as router, the full ensemble's velocity is the mixture's at every
    point a solver evaluates, so each solver's routed trajectory is its trajectory of the exact
    mixture flow (to 1e-5: the router's softmax is float32), and ab2 converges at second order on it."""
    from diffusion import sample_flow
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(200)

    def mixture(x, t):
        tt = torch.as_tensor(t, dtype=torch.float64).expand(len(x))
        post = GMM.posterior(x.flatten(1), tt)
        return sum(post[:, k, None] * GMM.cluster_velocity(x.flatten(1), tt, k) for k in range(4)).reshape(x.shape)
    routed, _ = run(experts, analytic_router(GMM), ("full", None), z, steps=12, solver=solver)
    torch.testing.assert_close(routed, sample_flow(mixture, z, 12, solver=solver), atol=1e-5, rtol=0)
    if solver == "ab2":
        exact = sample_flow(mixture, z, 1024, solver="heun")
        errors = [(sample_flow(mixture, z, n, solver="ab2") - exact).flatten(1).norm(dim=1).mean().item()
                  for n in (16, 32, 64)]
        assert all(3.3 < errors[i] / errors[i + 1] < 4.7 for i in range(2)), errors


def test_top1_is_not_the_exact_mixture_it_favours_the_cluster_that_wins_at_high_noise():
    """At t ~ 1 the posterior is the prior, so top-1 sends every sample along the largest
    cluster's flow first; mass drifts towards it. Full routing (above) is exact."""
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    x, usage = run(experts, analytic_router(GMM), ("topk", 1), noise(), steps=100)
    assert usage.sum() == 100 * 3000          # top-1: one expert per sample per step
    assert torch.all(usage[4, 1:] < usage[4, 0] / 10)
    nearest = ((x.flatten(1)[:, None] - GMM.means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == 0).double().mean() > GMM.weights[0] + 0.1


def test_top1_with_a_certain_router_is_oracle_sampling():
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(40)
    owner = torch.arange(40) % 4            # each sample belongs, with certainty, to one cluster
    def certain_router(x, t, ids):
        return torch.nn.functional.one_hot(owner[: x.shape[0]], 4).double() * 50
    routed, _ = run(experts, certain_router, ("topk", 1), z, steps=20)
    for k in range(4):
        oracle, _ = run(experts, None, ("oracle", k), z, steps=20)
        assert torch.equal(routed[owner == k], oracle[owner == k])


def test_a_missing_expert_renormalises_to_the_remaining_mixture():
    present = {0: AnalyticExpert(GMM, 0, "fm"), 2: AnalyticExpert(GMM, 2, "ddpm")}
    x, usage = run(present, analytic_router(GMM), ("full", None), noise(200), steps=50)
    assert usage[:, [1, 3]].sum() == 0
    w = GMM.weights[[0, 2]]
    sub = GaussianMixture(w / w.sum(), GMM.means[[0, 2]], GMM.stds[[0, 2]])
    expected = noise(200).flatten(1)
    ts = torch.linspace(1, 0, 51, dtype=torch.float64)
    for t, t_next in zip(ts[:-1], ts[1:]):
        tt = t.expand(200)
        post = sub.posterior(expected, tt)
        v = sum(post[:, i, None] * sub.cluster_velocity(expected, tt, i) for i in range(2))
        expected = RectifiedFlow.euler_step(v, expected, t, t_next)
    torch.testing.assert_close(x.flatten(1), expected, atol=1e-4, rtol=0)


def test_ddpm_and_fm_experts_of_one_cluster_give_the_same_trajectory():
    z = noise(100)
    for k in range(4):
        fm, _ = run({k: AnalyticExpert(GMM, k, "fm")}, None, ("oracle", k), z, steps=50)
        ddpm, _ = run({k: AnalyticExpert(GMM, k, "ddpm", DDPM(beta_schedule="cosine"))}, None, ("oracle", k), z, steps=50)
        torch.testing.assert_close(ddpm, fm, atol=1e-4, rtol=0)


# --- a tiny real run -------------------------------------------------------------------------------

def test_router_checkpoint_and_accuracy_table(tiny_ensemble):
    ckpt = torch.load(tiny_ensemble / "router" / "ckpt.pt", weights_only=True)
    clusters = torch.load(tiny_ensemble / "clusters.pt", weights_only=True)
    c = ckpt["config"]
    assert c["k"] == 4 and c["cluster_fingerprint"] == clusters["fingerprint"] and c["condition"]["kind"] == "class"
    assert len(c["accuracy"]["with_condition"]) == 5 and len(c["accuracy"]["without_condition"]) == 5
    with open(tiny_ensemble / "router" / "accuracy.json") as f:
        assert json.load(f)["with_condition"] == c["accuracy"]["with_condition"]


def test_the_router_is_sized_by_the_rule_and_its_cost_recorded(tiny_ensemble):
    from model import forward_flops, router_for
    c = torch.load(tiny_ensemble / "router" / "ckpt.pt", weights_only=True)
    size, args = c["config"]["size"], c["model_args"]
    expert = torch.load(tiny_ensemble / "experts" / "0" / "ckpt.pt", weights_only=True)["model_args"]
    assert size["expert_model"] == "DiT-M/2" and size["expert_forward_flops"] == forward_flops(model.DiT, expert)
    chosen, flops = router_for(size["expert_forward_flops"], 8, 1, num_classes=10, num_experts=4)
    assert c["config"]["flags"]["model"] == size["model"] == chosen == model.registry_name(args)
    assert size["router_forward_flops"] == flops == forward_flops(model.Router, args)
    assert size["share_of_expert"] == pytest.approx(flops / size["expert_forward_flops"])


def test_a_router_trained_before_its_experts_is_sized_by_expert_model(digits_run, tmp_path):
    import shutil
    shutil.copy(digits_run / "clusters.pt", tmp_path / "clusters.pt")
    run_stage(train_router, ["--steps", "2", "--expert-model", "DiT-T/2", "--run-dir", str(tmp_path)])
    size = torch.load(tmp_path / "router" / "ckpt.pt", weights_only=True)["config"]["size"]
    assert size["expert_model"] == "DiT-T/2" and size["model"] == "DiT-M/4" and size["share_of_expert"] <= 0.05
    run_stage(train_expert, ["--cluster", "0", "--model", "DiT-N/4", "--steps", "1", "--run-dir", str(tmp_path)])
    code, _, err = run_script("train_router.py", "--steps", "2", "--expert-model", "DiT-T/2",
                              "--run-dir", str(tmp_path))
    assert code == 2 and "the run's experts are DiT-N/4" in err
    code, _, err = run_script("train_router.py", "--steps", "2", "--model", "DiT-M/4", "--downsample", "4",
                              "--run-dir", str(tmp_path))
    assert code == 2 and "does not tile the router's 8-px input pooled 4x" in err


def test_the_cluster_conditioned_monolith_samples_through_its_routed_cluster_views(digits_run, tmp_path):
    """The information control: one network told each image's cluster, sampled with the router's top-1
    cluster at every step. Its ids carry both labels; dropping one drops both; a view of cluster k feeds
    the network (class, k), and (null, null) for guidance's unconditional rows."""
    import shutil
    from plumbing.condition import ClusterCondition, ClusterView
    condition = ClusterCondition(10, 4, labels=np.array([3, 7, 9]), clusters=np.array([2, 0, 3]))
    ids = condition.ids(np.arange(3))
    assert condition.expert_input(ids).tolist() == [[3, 2], [7, 0], [9, 3]] and condition.labels(ids).tolist() == [3, 7, 9]
    dropped = condition.drop(ids, 1.0, torch.Generator().manual_seed(0))
    assert condition.expert_input(dropped).tolist() == [[10, 4]] * 3
    shutil.copy(digits_run / "clusters.pt", tmp_path / "clusters.pt")
    run_stage(train_expert, ["--cluster", "all", "--condition", "class+cluster", "--model", "DiT-N/4", "--steps", "3",
                             "--run-dir", str(tmp_path)])
    ckpt = torch.load(tmp_path / "experts" / "all" / "ckpt.pt", weights_only=True)
    assert ckpt["config"]["condition"] == {"kind": "class+cluster", "num_classes": 10, "k": 4}
    assert ckpt["model_args"]["cluster_classes"] == 4
    monolith = ensemble.load_experts(str(tmp_path), "all")["all"]
    seen = []
    monolith.objective = type("Recording", (), {"velocity": lambda self, net, x, t, y: seen.append(y) or x})()
    ClusterView(monolith, 2).velocity(torch.zeros(2, 1, 8, 8), torch.rand(2), torch.tensor([5, 10]))
    assert seen[0].tolist() == [[5, 2], [10, 4]]
    run_stage(train_router, ["--steps", "3", "--run-dir", str(tmp_path)])
    run_stage(sample, ["--run-dir", str(tmp_path), "--experts", "all", "--routing", "top1", "--n", "12", "--steps", "3",
                       "--cfg-scale", "2", "--out", str(tmp_path / "control.npz")])
    record = json.load(open(tmp_path / "control.json"))
    assert record["routing"] == "top1" and np.sum(record["usage_per_t_bin"]["counts"]) == 12 * 3
    code, _, err = run_script("train_expert.py", "--cluster", "1", "--condition", "class+cluster", "--steps", "1",
                              "--run-dir", str(tmp_path))
    assert code == 2 and "the monolith (--cluster all)" in err


def test_end_to_end_writes_npz_png_and_usage(tiny_ensemble):
    out = tiny_ensemble / "samples" / "mixed.npz"
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "20", "--steps", "5", "--routing", "top2", "--cfg-scale", "2",
                       "--out", str(out)])
    batch = np.load(out)
    assert batch["arr_0"].shape == (20, 8, 8, 1) and batch["arr_0"].dtype == np.uint8
    assert batch["arr_1"].shape == (20,) and batch["arr_1"].max() < 10
    assert os.path.isfile(tiny_ensemble / "samples" / "mixed.png")
    with open(tiny_ensemble / "samples" / "mixed.json") as f:
        usage = json.load(f)
    assert usage["objectives"] == {"0": "fm", "1": "ddpm", "2": "fm", "3": "ddpm"} and usage["missing"] == []
    assert np.sum(usage["usage_per_t_bin"]["counts"]) == 5 * 20 * 2   # top-2: two experts per sample per step
    # reproducible with --seed; the monolith goes through the same sampler
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "20", "--steps", "5", "--routing", "top2", "--cfg-scale", "2",
                       "--out", str(tiny_ensemble / "samples" / "again.npz")])
    assert np.array_equal(np.load(tiny_ensemble / "samples" / "again.npz")["arr_0"], batch["arr_0"])
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--experts", "all", "--n", "8", "--steps", "3"])
    assert np.load(tiny_ensemble / "samples" / "monolith.npz")["arr_0"].shape == (8, 8, 8, 1)


def test_sampling_bad_inputs(tiny_ensemble, tmp_path):
    run = tiny_ensemble
    (tmp_path / "experts").mkdir()
    cases = [(["--run-dir", tmp_path], "no experts"),
             (["--run-dir", run, "--experts", "0,7"], "no expert 7"),
             (["--run-dir", run, "--routing", "topk:5"], "only 4 are available"),
             (["--run-dir", run, "--experts", "0,1", "--routing", "top3"], "unknown routing"),
             (["--run-dir", run, "--experts", "0,1", "--routing", "topk:3"], "only 2 are available"),
             (["--run-dir", run, "--router", tmp_path / "none.pt"], "no router"),
             (["--run-dir", run, "--experts", "all,1"], "does not mix with other experts"),
             (["--run-dir", run, "--experts", "distilled"], "run distill.py first")]
    for argv, message in cases:
        code, _, err = run_script("sample.py", *argv, "--n", "2", "--steps", "2")
        assert code == 2 and message in err and "Traceback" not in err, (argv, err[-1500:])
    # an incompatible expert: same checkpoint, other image size
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    ckpt = torch.load(bad / "experts" / "2" / "ckpt.pt", weights_only=True)
    ckpt["config"]["image_size"] = 16
    torch.save(ckpt, bad / "experts" / "2" / "ckpt.pt")
    code, _, err = run_script("sample.py", "--run-dir", bad, "--n", "2", "--steps", "2")
    assert code == 2 and "expert 2 does not match expert 0: image_size 16 vs 8" in err


# --- guidance with routing, on a class-conditional mixture whose clusters are the components' groups ----------------

CGMM = ClassConditionalMixture(
    weights=[[0.20, 0.05, 0.10], [0.05, 0.25, 0.05], [0.10, 0.05, 0.15]],
    means=[[[0.8, 0.6], [0.6, 0.9], [1.0, 0.2]], [[-0.7, 0.5], [-0.5, 0.8], [-0.9, 0.1]], [[0.1, -0.8], [-0.3, -0.6], [0.4, -0.9]]],
    stds=[[0.15, 0.2, 0.1], [0.1, 0.15, 0.2], [0.2, 0.1, 0.15]])


def guided(rule, cfg_routing, x, t, ids, cfg_scale=2.5, router=None, experts=None):
    experts = experts or {k: ConditionalAnalyticExpert(CGMM, k) for k in range(3)}
    router = router or (lambda xs, ts, cids: CGMM.router_logits(xs.flatten(1).double(), ts.double(), cids))
    ensemble = routing.Ensemble(experts, router, rule, ClassCondition(3), 3, cfg_scale, cfg_routing)
    v, _ = routing.ensemble_velocity(ensemble, x, t, ids)
    return v.flatten(1)


@pytest.mark.parametrize("cfg_routing", ["shared", "independent"])
def test_full_routing_with_guidance_is_the_exact_guided_mixture(cfg_routing):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 2, 1, 1, generator=g, dtype=torch.float64)
    ids = torch.arange(60) % 3
    for t in (0.1, 0.4, 0.7, 0.95):
        tt = torch.full((60,), t, dtype=torch.float64)
        cond, uncond = CGMM.velocity(x.flatten(1), tt, ids), CGMM.velocity(x.flatten(1), tt, torch.full((60,), 3))
        torch.testing.assert_close(guided(("full", None), cfg_routing, x, t, ids), uncond + 2.5 * (cond - uncond), rtol=1e-5, atol=1e-5)


def test_top1_shared_with_a_certain_router_is_per_expert_guidance():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(30, 2, 1, 1, generator=g, dtype=torch.float64)
    ids, owner = torch.arange(30) % 3, torch.arange(30) // 10
    certain = lambda xs, ts, cids: torch.nn.functional.one_hot(torch.cat([owner, owner])[: xs.shape[0]], 3).double() * 50
    for t in (0.2, 0.8):
        tt = torch.full((30,), t, dtype=torch.float64)
        v = guided(("topk", 1), "shared", x, t, ids, router=certain)
        for k in range(3):
            rows = owner == k
            v_c = CGMM.expert_velocity(k, x.flatten(1)[rows], tt[rows], ids[rows])
            v_u = CGMM.expert_velocity(k, x.flatten(1)[rows], tt[rows], torch.full((int(rows.sum()),), 3))
            torch.testing.assert_close(v[rows], v_u + 2.5 * (v_c - v_u), rtol=1e-12, atol=1e-12)


def test_independent_top1_guidance_mixes_experts_when_the_branches_disagree():
    """The posterior given the class and the one without it pick different experts somewhere; there the two
    choices differ, and only the shared one is guidance of a single expert."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(400, 2, 1, 1, generator=g, dtype=torch.float64) * 0.8
    ids = torch.arange(400) % 3
    t = 0.6
    tt = torch.full((400,), t, dtype=torch.float64)
    both = torch.cat([ids, torch.full((400,), 3)])
    top = CGMM.router_logits(torch.cat([x, x]).flatten(1), torch.cat([tt, tt]), both).argmax(1)
    disagree = top[:400] != top[400:]
    assert disagree.any()
    shared, independent = guided(("topk", 1), "shared", x, t, ids), guided(("topk", 1), "independent", x, t, ids)
    assert torch.allclose(shared[~disagree], independent[~disagree])
    assert (shared[disagree] - independent[disagree]).abs().amax(1).mean() > 1e-3


def test_a_router_held_for_m_evaluations_is_called_once_per_m_and_m_1_is_todays_sampler():
    calls = []

    def router(x, t, ids):
        calls.append(float(t[0]))
        return analytic_router(GMM)(x, t, ids)
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(200)
    today, _ = run(experts, analytic_router(GMM), ("topk", 1), z, 12)
    every_1 = routing.sample(routing.Ensemble(experts, router, ("topk", 1), NoCondition(), 4, router_every=1),
                             z, torch.zeros(len(z), dtype=torch.long), 12)[0]
    assert torch.equal(every_1, today) and len(calls) == 12
    calls.clear()
    every_4 = routing.sample(routing.Ensemble(experts, router, ("topk", 1), NoCondition(), 4, router_every=4),
                             z, torch.zeros(len(z), dtype=torch.long), 12)[0]
    assert calls == pytest.approx([1.0, 1 - 4 / 12, 1 - 8 / 12])   # at steps 0, 4 and 8, held between
    assert not torch.equal(every_4, today) and (every_4 - today).abs().mean() < 0.05


def test_the_recorded_sampling_cost_is_the_count_of_the_networks_run(tiny_ensemble, tmp_path):
    """Top-1 at 3 Euler steps: 3 router rows and 3 rows of one expert per image; M = 3 runs the
    router once."""
    from model import count_flops
    from plumbing.ensemble import load_experts, load_router
    expert, router = load_experts(str(tiny_ensemble), "0")["0"], load_router(str(tiny_ensemble), None)
    x, t, y = torch.zeros(1, 1, 8, 8), torch.full((1,), 0.5), torch.zeros(1, dtype=torch.long)
    one_expert = count_flops(lambda: expert.net(x, t * 1000, y))
    one_router = count_flops(lambda: router.net(x, t, y))
    for every, router_calls in ((1, 3), (3, 1)):
        out = tmp_path / f"every{every}.npz"
        run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "4", "--steps", "3", "--routing", "top1",
                           "--experts", "0,2", "--router-every", str(every), "--out", str(out)])
        record = json.load(open(tmp_path / f"every{every}.json"))
        assert record["sampling_flops_per_image"] == 3 * one_expert + router_calls * one_router
        assert record["one_expert_flops_per_image"] == 3 * one_expert
        assert record["cost_vs_one_expert"] == pytest.approx(1 + router_calls * one_router / (3 * one_expert))


@pytest.mark.parametrize("flags", [["--routing", "top1", "--cfg-scale", "2"], ["--routing", "full"],
                                   ["--routing", "full", "--cfg-scale", "2"]])
def test_torchrun_draws_the_one_process_batch_byte_for_byte(tiny_ensemble, tmp_path, flags):
    """Two gloo processes split 37 images (5 batches of 8, one short) and write one batch: the
    same images, labels and expert usage as one process at the same threads per process."""
    common = ["--run-dir", str(tiny_ensemble), "--num-samples", "37", "--batch-size", "8", "--steps", "3", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = {"one": [sys.executable, "sample.py"],
                "two": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        f"--master_port={free_port()}", "sample.py"]}
    for name, launch in launches.items():
        done = subprocess.run([*launch, *common, "--out", str(tmp_path / f"{name}.npz")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (np.load(tmp_path / f"{name}.npz") for name in launches)
    assert one["arr_0"].shape == (37, 8, 8, 1)
    assert one["arr_0"].tobytes() == two["arr_0"].tobytes() and np.array_equal(one["arr_1"], two["arr_1"])
    records = [json.loads((tmp_path / f"{name}.json").read_text()) for name in launches]
    assert records[0]["usage_per_t_bin"]["counts"] == records[1]["usage_per_t_bin"]["counts"]
    assert (records[0]["processes"], records[1]["processes"]) == (1, 2)

