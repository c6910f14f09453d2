"""train_router.py on a tiny real run: the router's record, its accuracy table, and its
size (the size rule, --expert-model before any expert exists, a patch that must tile the
pooled input). The router's loss and the routing maths: test_routing.py."""
import json
import shutil

import pytest
import torch

import model
import train_expert
import train_router
from helpers import run_script, run_stage


def test_router_checkpoint_and_accuracy_table(tiny_ensemble):
    ckpt = torch.load(tiny_ensemble / "router" / "ckpt.pt", weights_only=True)
    clusters = torch.load(tiny_ensemble / "clusters.pt", weights_only=True)
    c = ckpt["config"]
    assert c["k"] == 4 and c["cluster_fingerprint"] == clusters["fingerprint"]
    assert c["condition"]["kind"] == "class"
    assert len(c["accuracy"]["with_condition"]) == len(c["accuracy"]["without_condition"]) == 5
    with open(tiny_ensemble / "router" / "accuracy.json") as f:
        assert json.load(f)["with_condition"] == c["accuracy"]["with_condition"]


def test_the_router_is_sized_by_the_rule_and_its_cost_recorded(tiny_ensemble):
    from model import forward_flops, router_for
    c = torch.load(tiny_ensemble / "router" / "ckpt.pt", weights_only=True)
    size, args = c["config"]["size"], c["model_args"]
    expert = torch.load(tiny_ensemble / "experts" / "0" / "ckpt.pt",
                        weights_only=True)["model_args"]
    assert size["expert_model"] == "DiT-M/2"
    assert size["expert_forward_flops"] == forward_flops(model.DiT, expert)
    chosen, flops = router_for(size["expert_forward_flops"], 8, 1, num_classes=10,
                               num_experts=4)
    assert c["config"]["flags"]["model"] == size["model"] == chosen == model.registry_name(args)
    assert size["router_forward_flops"] == flops == forward_flops(model.Router, args)
    assert size["share_of_expert"] == pytest.approx(flops / size["expert_forward_flops"])


def test_a_router_trained_before_its_experts_is_sized_by_expert_model(digits_run, tmp_path):
    shutil.copy(digits_run / "clusters.pt", tmp_path / "clusters.pt")
    run_stage(train_router, ["--steps", "2", "--expert-model", "DiT-T/2",
                             "--run-dir", str(tmp_path)])
    size = torch.load(tmp_path / "router" / "ckpt.pt", weights_only=True)["config"]["size"]
    assert size["expert_model"] == "DiT-T/2" and size["model"] == "DiT-M/4"
    assert size["share_of_expert"] <= 0.05
    run_stage(train_expert, ["--cluster", "0", "--model", "DiT-N/4", "--steps", "1",
                             "--run-dir", str(tmp_path)])
    code, _, err = run_script("train_router.py", "--steps", "2", "--expert-model", "DiT-T/2",
                              "--run-dir", str(tmp_path))
    assert code == 2 and "the run's experts are DiT-N/4" in err
    code, _, err = run_script("train_router.py", "--steps", "2", "--model", "DiT-M/4",
                              "--downsample", "4", "--run-dir", str(tmp_path))
    assert code == 2 and "does not tile the router's 8-px input pooled 4x" in err
