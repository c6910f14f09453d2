"""The ensemble sampler on a tiny real run: sample.py's files, bad inputs, the recorded
sampling cost and sampling under torchrun (the routing maths: test_routing.py; the router's
training: test_train_router.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from plumbing import ensemble
import sample
import train_expert
import train_router
from helpers import ROOT, free_port, run_script, run_stage


# --- a tiny real run

def test_the_cluster_conditioned_monolith_samples_through_its_routed_cluster_views(
        digits_run, tmp_path):
    """The information control: one network told each image's cluster, sampled with the
    router's top-1 cluster at every step. Its ids carry both labels; dropping one drops
    both; a view of cluster k feeds the network (class, k), and (null, null) for
    guidance's unconditional rows."""
    import shutil
    from plumbing.condition import ClusterCondition, ClusterView
    condition = ClusterCondition(10, 4, labels=np.array([3, 7, 9]), clusters=np.array([2, 0, 3]))
    ids = condition.ids(np.arange(3))
    assert (condition.expert_input(ids).tolist() == [[3, 2], [7, 0], [9, 3]]
            and condition.labels(ids).tolist() == [3, 7, 9])
    dropped = condition.drop(ids, 1.0, torch.Generator().manual_seed(0))
    assert condition.expert_input(dropped).tolist() == [[10, 4]] * 3
    shutil.copy(digits_run / "clusters.pt", tmp_path / "clusters.pt")
    run_stage(train_expert, ["--cluster", "all", "--condition", "class+cluster",
                             "--model", "DiT-N/4", "--steps", "3",
                             "--run-dir", str(tmp_path)])
    ckpt = torch.load(tmp_path / "experts" / "all" / "ckpt.pt", weights_only=True)
    assert ckpt["config"]["condition"] == {"kind": "class+cluster", "num_classes": 10, "k": 4}
    assert ckpt["model_args"]["cluster_classes"] == 4
    monolith = ensemble.load_experts(str(tmp_path), "all")["all"]
    seen = []
    monolith.objective = type("Recording", (),
                              {"velocity": lambda self, net, x, t, y: seen.append(y) or x})()
    ClusterView(monolith, 2).velocity(torch.zeros(2, 1, 8, 8), torch.rand(2),
                                      torch.tensor([5, 10]))
    assert seen[0].tolist() == [[5, 2], [10, 4]]
    run_stage(train_router, ["--steps", "3", "--run-dir", str(tmp_path)])
    run_stage(sample, ["--run-dir", str(tmp_path), "--experts", "all",
                       "--routing", "top1", "--n", "12", "--steps", "3",
                       "--cfg-scale", "2", "--out", str(tmp_path / "control.npz")])
    record = json.load(open(tmp_path / "control.json"))
    assert record["routing"] == "top1" and np.sum(record["usage_per_t_bin"]["counts"]) == 12 * 3
    code, _, err = run_script("train_expert.py", "--cluster", "1",
                              "--condition", "class+cluster", "--steps", "1",
                              "--run-dir", str(tmp_path))
    assert code == 2 and "the monolith (--cluster all)" in err


def test_end_to_end_writes_npz_png_and_usage(tiny_ensemble):
    out = tiny_ensemble / "samples" / "mixed.npz"
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "20", "--steps", "5",
                       "--routing", "top2", "--cfg-scale", "2",
                       "--out", str(out)])
    batch = np.load(out)
    assert batch["arr_0"].shape == (20, 8, 8, 1) and batch["arr_0"].dtype == np.uint8
    assert batch["arr_1"].shape == (20,) and batch["arr_1"].max() < 10
    assert os.path.isfile(tiny_ensemble / "samples" / "mixed.png")
    with open(tiny_ensemble / "samples" / "mixed.json") as f:
        usage = json.load(f)
    assert (usage["objectives"] == {"0": "fm", "1": "ddpm", "2": "fm", "3": "ddpm"}
            and usage["missing"] == [])
    # top-2: two experts per sample per step
    assert np.sum(usage["usage_per_t_bin"]["counts"]) == 5 * 20 * 2
    # reproducible with --seed; the monolith goes through the same sampler
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "20", "--steps", "5",
                       "--routing", "top2", "--cfg-scale", "2",
                       "--out", str(tiny_ensemble / "samples" / "again.npz")])
    assert np.array_equal(np.load(tiny_ensemble / "samples" / "again.npz")["arr_0"],
                          batch["arr_0"])
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--experts", "all", "--n", "8",
                       "--steps", "3"])
    assert np.load(tiny_ensemble / "samples" / "monolith.npz")["arr_0"].shape == (8, 8, 8, 1)


def test_sampling_bad_inputs(tiny_ensemble, tmp_path):
    run = tiny_ensemble
    (tmp_path / "experts").mkdir()
    cases = [(["--run-dir", tmp_path], "no experts"),
             (["--run-dir", run, "--experts", "0,7"], "no expert 7"),
             (["--run-dir", run, "--routing", "topk:5"], "only 4 are available"),
             (["--run-dir", run, "--experts", "0,1", "--routing", "top3"], "unknown routing"),
             (["--run-dir", run, "--experts", "0,1", "--routing", "topk:3"],
              "only 2 are available"),
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


# --- guidance with routing, on a class-conditional mixture whose clusters are the
#     components' groups


def test_the_recorded_sampling_cost_is_the_count_of_the_networks_run(tiny_ensemble, tmp_path):
    """Top-1 at 3 Euler steps: 3 router rows and 3 rows of one expert per image; M = 3 runs the
    router once."""
    from model import count_flops
    from plumbing.ensemble import load_experts, load_router
    expert, router = load_experts(str(tiny_ensemble), "0")["0"], load_router(
        str(tiny_ensemble), None)
    x, t, y = torch.zeros(1, 1, 8, 8), torch.full((1,), 0.5), torch.zeros(1, dtype=torch.long)
    one_expert = count_flops(lambda: expert.net(x, t * 1000, y))
    one_router = count_flops(lambda: router.net(x, t, y))
    for every, router_calls in ((1, 3), (3, 1)):
        out = tmp_path / f"every{every}.npz"
        run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "4", "--steps", "3",
                           "--routing", "top1",
                           "--experts", "0,2", "--router-every", str(every), "--out", str(out)])
        record = json.load(open(tmp_path / f"every{every}.json"))
        assert record["sampling_flops_per_image"] == 3 * one_expert + router_calls * one_router
        assert record["one_expert_flops_per_image"] == 3 * one_expert
        assert record["cost_vs_one_expert"] == pytest.approx(
            1 + router_calls * one_router / (3 * one_expert))
    # the draw rule reads the router once per image, at t = 1, then runs one expert a step
    out = tmp_path / "draw.npz"
    run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "4", "--steps", "3",
                       "--routing", "draw", "--experts", "0,2", "--out", str(out)])
    record = json.load(open(out.with_suffix(".json")))
    assert record["sampling_flops_per_image"] == 3 * one_expert + one_router
    # the batch's own rows, not one image's: full routing runs both experts on every row, and
    # threshold routing whichever its weights keep, which the record counts as run
    for rule in ("full", "threshold:0.3"):
        out = tmp_path / f"{rule.replace(':', '')}.npz"
        run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "4", "--steps", "3",
                           "--routing", rule,
                           "--experts", "0,2", "--out", str(out)])
        record = json.load(open(out.with_suffix(".json")))
        rows = sum(map(sum, record["usage_per_t_bin"]["counts"]))
        assert record["sampling_flops_per_image"] == (
            rows * one_expert + 4 * 3 * one_router) // 4
        assert rule != "full" or rows == 2 * 3 * 4


def test_the_draw_rule_gives_each_image_its_own_expert_whatever_the_batch(tiny_ensemble,
                                                                         tmp_path):
    """An image's expert comes from its own stream: batches of 3 and of 16 give the same
    images, and the experts drawn are not all one (top-1 at t = 1 would be)."""
    images = {}
    for batch in (3, 16):
        out = tmp_path / f"b{batch}.npz"
        run_stage(sample, ["--run-dir", str(tiny_ensemble), "--n", "16", "--steps", "2",
                           "--routing", "draw", "--batch-size", str(batch), "--out", str(out)])
        images[batch] = np.load(out)["arr_0"]
        counts = json.load(open(out.with_suffix(".json")))["usage_per_t_bin"]["counts"]
    assert images[3].tobytes() == images[16].tobytes()
    assert sum(1 for c in np.sum(counts, axis=0) if c > 0) > 1


@pytest.mark.parametrize("flags", [["--routing", "top1", "--cfg-scale", "2"],
                                   ["--routing", "full", "--cfg-scale", "2"],
                                   ["--routing", "draw", "--cfg-scale", "2"]])
def test_torchrun_draws_the_one_process_batch_byte_for_byte(tiny_ensemble, tmp_path, flags):
    """Two gloo processes split 37 images (5 batches of 8, one short) and write one batch: the
    same images, labels and expert usage as one process at the same threads per process."""
    common = ["--run-dir", str(tiny_ensemble), "--num-samples", "37", "--batch-size", "8",
              "--steps", "3", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = {"one": [sys.executable, "sample.py"],
                "two": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        f"--master_port={free_port()}", "sample.py"]}
    for name, launch in launches.items():
        done = subprocess.run([*launch, *common, "--out", str(tmp_path / f"{name}.npz")],
                              cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (np.load(tmp_path / f"{name}.npz") for name in launches)
    assert one["arr_0"].shape == (37, 8, 8, 1)
    assert (one["arr_0"].tobytes() == two["arr_0"].tobytes()
            and np.array_equal(one["arr_1"], two["arr_1"]))
    records = [json.loads((tmp_path / f"{name}.json").read_text()) for name in launches]
    assert records[0]["usage_per_t_bin"]["counts"] == records[1]["usage_per_t_bin"]["counts"]
    assert (records[0]["processes"], records[1]["processes"]) == (1, 2)

