"""distill.py: a student regressing the routed ensemble's velocity. Analytic experts
first, then the stage on a tiny run."""
import contextlib
import json
import shutil

import numpy as np
import pytest
import torch

import distill
import sample
from plumbing.condition import NoCondition
from routing import Ensemble
from diffusion import RectifiedFlow
from gmm import AnalyticExpert, GaussianMixture
from helpers import cli, run_stage
from model import DiT


def three_gaussians(d=16):
    means = torch.randn(3, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return GaussianMixture([0.5, 0.3, 0.2], means, [0.5, 0.7, 0.4])


def test_a_student_learns_the_exact_mixture_velocity_from_heterogeneous_analytic_experts():
    """Experts: each cluster's optimal network (one epsilon-predicting DDPM expert, two
    flow experts); router: the exact posterior. Their full mixture is the whole data set's
    flow, known in closed form, so the student's error can be measured against the truth
    rather than against the teacher."""
    gmm = three_gaussians()
    experts = {0: AnalyticExpert(gmm, 0, "ddpm"), 1: AnalyticExpert(gmm, 1, "fm"),
               2: AnalyticExpert(gmm, 2, "fm")}
    def route(x, t, ids):
        return gmm.log_likelihoods(x.flatten(1).double(), 1 - t.double(), t.double()).float()
    teacher = distill.Teacher(Ensemble(experts, route, ("full", None), NoCondition(), 3),
                              ({0: 0, 1: 0, 2: 0}, 0))
    torch.manual_seed(0)
    student = DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=64, depth=2,
                  num_heads=4, learn_sigma=False,
                  num_classes=0, t_scale=1000.0)
    distiller = distill.Distiller(student, RectifiedFlow(), teacher,
                                  optim={"lr": 3e-3, "ema_decay": 0.99, "grad_clip": 1.0},
                                  condition_dropout=0.0, trajectory=(0.25, 4), seed=0)
    g = torch.Generator().manual_seed(99)   # held-out points on the data's noising path
    x0, _ = gmm.sample(512, g)
    t = torch.rand(512, generator=g, dtype=torch.float64) * 0.98 + 0.01
    x_t = RectifiedFlow.add_noise(x0, torch.randn(x0.shape, generator=g, dtype=torch.float64), t)
    exact = gmm.velocity(x_t, t)

    def error(net):
        with torch.no_grad():
            v = RectifiedFlow().velocity(net, x_t.float().view(-1, 1, 4, 4), t.float())
        return ((v.double().flatten(1) - exact) ** 2).mean().item()

    # the teacher itself is the exact flow (to float32 rounding): what the student is
    # taught is the truth
    v_teacher = teacher(x_t.float().view(-1, 1, 4, 4), t.float(),
                        torch.zeros(512, dtype=torch.long))
    assert torch.allclose(v_teacher.double().flatten(1), exact, atol=1e-3)
    before = error(student)
    data = torch.Generator().manual_seed(1)
    for _ in range(300):
        distiller.update(gmm.sample(128, data)[0].float().view(-1, 1, 4, 4),
                         torch.zeros(128, dtype=torch.long), contextlib.nullcontext())
    # measured: about 60x lower at 300 steps
    assert error(distiller.ema) < before / 20, (before, error(distiller.ema))


@pytest.fixture(scope="module")
def distill_run(tiny_ensemble, tmp_path_factory):
    run = tmp_path_factory.mktemp("distill") / "run"
    shutil.copytree(tiny_ensemble, run)
    return run


TINY = ["--model", "DiT-M/2", "--batch-size", "16", "--trajectory-fraction", "0.25",
        "--trajectory-steps", "4"]


def test_distilled_student_resumes_exactly_and_samples_as_one_model(distill_run):
    run = str(distill_run)
    run_stage(distill, ["--run-dir", run, "--steps", "6", "--log-every", "3", *TINY])
    run_stage(distill, ["--run-dir", run, "--steps", "3", "--out-dir", f"{run}/half", *TINY])
    run_stage(distill, ["--run-dir", run, "--steps", "6", "--out-dir", f"{run}/half", *TINY])
    straight = torch.load(f"{run}/experts/distilled/ckpt.pt", weights_only=True)
    resumed = torch.load(f"{run}/half/ckpt.pt", weights_only=True)
    for key in ("model", "ema"):
        for name, value in straight[key].items():
            assert torch.equal(value, resumed[key][name]), (key, name)
    assert straight["config"]["flops"] == resumed["config"]["flops"]
    config = straight["config"]
    # the teacher's forwards count too
    assert config["distillation_flops"] == config["flops"] > 6 * config["flops_per_step"]
    router_flops = config["teacher"]["router_flops"]
    assert config["total_flops_with_teacher_training"] > config["distillation_flops"] + router_flops
    assert (set(config["teacher"]["experts"]) == {"0", "1", "2", "3"}
            and config["cluster"] == "distilled")
    lines = [json.loads(line) for line in open(f"{run}/experts/distilled/log.jsonl")]
    assert [line["step"] for line in lines] == [3, 6]

    run_stage(sample, ["--run-dir", run, "--experts", "distilled", "--n", "8", "--steps", "3"])
    with open(f"{run}/samples/distilled.json") as f:
        record = json.load(f)
    assert record["experts"] == ["distilled"] and record["missing"] == []
    assert record["models"] == "one model (no ensemble)"
    assert np.load(f"{run}/samples/distilled.npz")["arr_0"].shape == (8, 8, 8, 1)


def test_teacher_flops_count_every_expert_the_rule_runs(distill_run):
    """top-1 runs one expert per row, full runs all four: the counted teacher FLOPs differ
    accordingly."""
    run = str(distill_run)
    flops = {}
    for routing in ("full", "top1"):
        run_stage(distill, ["--run-dir", run, "--steps", "2", "--routing", routing,
                            "--out-dir", f"{run}/{routing}", *TINY[:4]])
        config = torch.load(f"{run}/{routing}/ckpt.pt", weights_only=True)["config"]
        flops[routing] = config["flops"] - 2 * config["flops_per_step"]
    assert 2.5 < flops["full"] / flops["top1"] < 4.5, flops


def test_distill_refuses_a_distilled_teacher_and_an_empty_run(distill_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(distill_run, run)
    run_stage(distill, ["--run-dir", str(run), "--steps", "1",
                        "--out-dir", str(tmp_path / "student"), *TINY[:4]])
    shutil.rmtree(run / "experts" / "3")
    shutil.copytree(tmp_path / "student", run / "experts" / "3")
    code, err = cli(distill, ["--run-dir", run, "--steps", "1", "--out-dir", tmp_path / "x"])
    assert code == 2 and "holds a distilled student, not the expert of cluster 3" in err
    code, err = cli(distill, ["--run-dir", run, "--experts", "distilled"])
    assert code == 2 and "the teacher is the ensemble's experts" in err
    router = torch.load(run / "router" / "ckpt.pt", weights_only=True)
    router["config"]["experts"][0]["trained_on"] = "another clustering's cluster 0"
    torch.save(router, tmp_path / "other-router.pt")
    code, err = cli(distill, ["--run-dir", run, "--experts", "0,1",
                              "--router", tmp_path / "other-router.pt",
                              "--out-dir", tmp_path / "y"])
    assert (code == 2
            and "expert 0 was trained on other data than when the router was trained" in err)
    assert not (tmp_path / "y" / "ckpt.pt").exists()
    # a router from before routers recorded their experts: never released, refused
    del router["config"]["experts"]
    torch.save(router, tmp_path / "other-router.pt")
    code, err = cli(distill, ["--run-dir", run, "--experts", "0,1",
                              "--router", tmp_path / "other-router.pt",
                              "--out-dir", tmp_path / "y"])
    assert (code == 2 and "records no expert set" in err and
            not (tmp_path / "y" / "ckpt.pt").exists())
    (tmp_path / "empty" / "experts").mkdir(parents=True)
    code, err = cli(distill, ["--run-dir", tmp_path / "empty"])
    assert code == 2 and "no experts" in err
