"""The expert stage: both objectives, the monolith, resume, torchrun, FLOPs, and bad inputs."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import train_expert
from plumbing import training
from plumbing.training import precision
from plumbing.command_line import UsageError
from diffusion import RectifiedFlow
from helpers import free_port, ROOT, cli, run_script, run_stage
from plumbing.checkpoint import CheckpointError, load
from model import DiT, count_flops

TINY = ["--model", "DiT-M/2", "--batch-size", "16", "--log-every", "5"]


def read_log(folder):
    with open(os.path.join(folder, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("objective,cluster", [("fm", "1"), ("ddpm", "3"), ("fm", "all")])
def test_short_runs_write_a_complete_checkpoint(digits_run, tmp_path, objective, cluster):
    out = tmp_path / "expert"
    run_stage(train_expert, ["--cluster", cluster, "--objective", objective,
                             "--steps", "10", "--run-dir", str(digits_run),
                             "--out-dir", str(out), *TINY])
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ({"model", "ema", "opt", "step", "rng", "model_args", "config"} <= set(ckpt)
            and ckpt["step"] == 10)
    c = ckpt["config"]
    clusters = torch.load(digits_run / "clusters.pt", weights_only=True)
    assert (c["objective"]["name"] == objective and c["cluster"] == cluster
            and c["cluster_fingerprint"] == clusters["fingerprint"])
    assert c["data"] == clusters["data"] and c["image_size"] == 8 and c["channels"] == 1
    assert (c["condition"] == {"kind": "class", "num_classes": 10} and c["format"] == 2
            and c["network"] == "dit")
    assert c["flops"] == 10 * c["flops_per_step"] > 0
    assert c["cluster_size"] == (1797 if cluster == "all" else clusters["sizes"][int(cluster)])
    expert = load(str(out / "ckpt.pt"))
    assert (expert.objective.name == objective and (objective != "ddpm"
                                                    or expert.objective.num_timesteps == 1000))
    assert expert.condition.spec() == {"kind": "class", "num_classes": 10}
    log = read_log(out)
    assert ([r["step"] for r in log] == [5, 10] and len(log[0]["loss_per_t_bin"]) == 5
            and log[-1]["images_per_s"] > 0)
    assert os.path.isfile(out / "samples_0000010.png")


def test_loss_goes_down(digits_run, tmp_path):
    run_stage(train_expert, ["--cluster", "0", "--steps", "150",
                             "--run-dir", str(digits_run), "--out-dir", str(tmp_path),
                             "--model", "DiT-M/2", "--log-every", "25"])
    log = read_log(tmp_path)
    assert log[-1]["loss"] < 0.75 * log[0]["loss"]


def test_resume_is_exact(digits_run, tmp_path):
    common = ["--cluster", "2", "--run-dir", str(digits_run), *TINY, "--ckpt-every", "1000"]
    run_stage(train_expert, [*common, "--steps", "16", "--out-dir", str(tmp_path / "straight")])
    run_stage(train_expert, [*common, "--steps", "8", "--out-dir", str(tmp_path / "resumed")])
    run_stage(train_expert, [*common, "--steps", "16",
                             "--out-dir", str(tmp_path / "resumed"), "--resume"])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=True)
    for key in ("model", "ema"):
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    for sa, sb in zip(a["opt"]["state"].values(), b["opt"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["config"]["flops"] == b["config"]["flops"]
    code, _, err = run_script("train_expert.py", *common, "--steps", "20",
                              "--out-dir", tmp_path / "resumed", "--t-sampling", "logit-normal")
    assert (code == 2 and "--t-sampling uniform -> logit-normal" in err
            and "resume with the same flags" in err)
    code, _, err = run_script("train_expert.py", *common, "--steps", "20",
                              "--out-dir", tmp_path / "resumed", "--lr", "3e-4")
    assert code == 2 and "--lr 0.001 -> 0.0003" in err


@pytest.mark.parametrize("stop", ["SIGUSR1", "SIGTERM"])
def test_a_stop_request_saves_at_its_step_exits_75_and_resumes_exactly(
        digits_run, tmp_path, stop):
    """A scheduler's time-limit warning (SIGUSR1, sbatch --signal) or a requeue's SIGTERM
    stops training at the next step with the checkpoint saved there, not at the last
    periodic one, and exits 75 (STOPPED_TO_RESUME), on which ./ddm slurm's expert job
    requeues; the same command resumes it to weights equal to a straight run's."""
    import signal
    import time
    common = ["--cluster", "2", "--run-dir", str(digits_run), *TINY, "--ckpt-every", "1000"]
    stopped = tmp_path / "stopped"
    # far more steps than it can reach: the stop request, not the end, ends it
    proc = subprocess.Popen([sys.executable, "train_expert.py", *common, "--steps", "100000",
                             "--out-dir", str(stopped)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
    log = stopped / "log.jsonl"
    deadline = time.time() + 300
    # until the loop has begun (the stop request's handler is in place) or the run has ended
    while proc.poll() is None and not (log.exists() and log.read_text().strip()) \
            and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, stop))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    step = torch.load(stopped / "ckpt.pt", weights_only=True)["step"]
    assert f"stopped by {stop} at step {step}, checkpoint saved" in out
    assert 5 <= step < 1000   # saved where it stopped, with no periodic checkpoint behind it
    run_stage(train_expert, [*common, "--steps", str(step + 4), "--out-dir", str(stopped)])
    run_stage(train_expert, [*common, "--steps", str(step + 4),
                             "--out-dir", str(tmp_path / "straight")])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(stopped / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == step + 4
    for key in ("model", "ema"):
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)


def test_torchrun_two_processes(digits_run, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}",
           os.path.join(ROOT, "train_expert.py"), "--cluster", "1", "--steps", "6",
           "--run-dir", str(digits_run),
           "--out-dir", str(tmp_path), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["config"]["world_size"] == 2 and len(ckpt["rng"]) == 2 and ckpt["step"] == 6
    # same format as a single process
    assert not any(k.startswith("module.") for k in ckpt["model"])
    load(str(tmp_path / "ckpt.pt"))


def test_flop_count_matches_a_hand_count():
    B, T, D, depth, C, p = 4, 16, 64, 2, 1, 2
    model = DiT(input_size=8, patch_size=p, in_channels=C, hidden_size=D, depth=depth,
                num_heads=4, num_classes=10,
                learn_sigma=False, modulation="adaln-single")
    mm = lambda m, k, n: 2 * m * k * n
    patch = mm(B * T, C * p * p, D)                             # the patch-embedding convolution
    t_first, t_second, t_block = mm(B, 256, D), mm(B, D, D), mm(B, D, 6 * D)
    blocks = depth * (mm(B * T, D, 3 * D) + mm(B * T, D, D) + 2 * mm(B * T, D, 4 * D))
    attention = depth * 2 * mm(B * T, T, D)                     # QK^T and AV
    final = mm(B * T, D, p * p * C)
    forward = patch + t_first + t_second + t_block + blocks + attention + final
    # backward: twice the forward for every layer, except layers whose input needs no gradient
    # (the patch embedding and the first time-MLP layer: weight gradient only); attention's
    # backward is 5 matmuls (scores recomputed) against 2 forward
    backward = patch + t_first + 2 * (t_second + t_block + blocks + final) + 2.5 * attention
    step = precision.probe_step(model, RectifiedFlow(), (B, C, 8, 8),
                               torch.zeros(B, dtype=torch.long), "cpu")
    assert count_flops(step) == forward + backward


def test_bad_inputs(digits_run, tmp_path):
    base = ["--run-dir", digits_run, "--out-dir", tmp_path / "x", "--steps", "2", *TINY]
    (tmp_path / "bad.pt").write_bytes(b"junk")
    cases = [(["--cluster", "7"], "valid ones are 0, 1, 2, 3, all"),
             (["--cluster", "0", "--run-dir", tmp_path / "empty"], "run cluster.py first"),
             (["--cluster", "0", "--data", "digits", "--image-size", "16"], "another data set"),
             (["--cluster", "0", "--init", tmp_path / "bad.pt"],
              "cannot read --init checkpoint"),
             (["--cluster", "0", "--init", tmp_path / "missing.pt"], "no --init checkpoint at"),
             (["--cluster", "0", "--lr", "1e30", "--grad-clip", "0", "--log-every", "1"],
              "non-finite loss")]
    for argv, message in cases:
        code, _, err = run_script("train_expert.py", *base, *argv)
        assert code == 2 and message in err and "Traceback" not in err, (argv, err[-2000:])
    # the diverged run left no checkpoint behind
    assert not os.path.exists(tmp_path / "x" / "ckpt.pt")


def test_non_finite_training_images_are_named_as_the_cause_not_the_learning_rate(
        digits_run, tmp_path, monkeypatch):
    from plumbing.data import datasets
    monkeypatch.setattr(datasets.ImageSet, "batch",
                        lambda self, idx, rng=None: torch.full((len(idx), 1, 8, 8), float("nan")))
    with pytest.raises(UsageError, match="the training images themselves hold NaN or inf") as e:
        run_stage(train_expert, ["--run-dir", str(digits_run),
                                 "--out-dir", str(tmp_path / "x"), "--cluster", "0",
                                 "--steps", "2",
                                 *TINY[:4], "--log-every", "1"])
    assert "--lr" not in str(e.value) and not (tmp_path / "x" / "ckpt.pt").exists()


def test_tiny_cluster_is_refused(digits_run, tmp_path):
    run_dir = tmp_path / "runs"
    shutil.copytree(digits_run, run_dir)
    c = torch.load(run_dir / "clusters.pt", weights_only=True)
    c["assignments"][:] = 0
    c["assignments"][:3] = 1
    c["fingerprint"] = hashlib.sha1(c["assignments"].numpy().tobytes()).hexdigest()
    torch.save(c, run_dir / "clusters.pt")
    code, _, err = run_script("train_expert.py", "--cluster", "1", "--run-dir", run_dir,
                              "--steps", "2")
    assert code == 2 and "too few" in err


def test_init_from_a_ddpm_expert_converts(digits_run, tmp_path):
    run_stage(train_expert, ["--cluster", "0", "--objective", "ddpm", "--steps", "4",
                             "--run-dir", str(digits_run),
                             "--out-dir", str(tmp_path / "ddpm"), *TINY])
    run_stage(train_expert, ["--cluster", "0", "--objective", "fm", "--steps", "4",
                             "--run-dir", str(digits_run),
                             "--out-dir", str(tmp_path / "fm"),
                             "--init", str(tmp_path / "ddpm" / "ckpt.pt"), *TINY])
    ckpt = torch.load(tmp_path / "fm" / "ckpt.pt", weights_only=True)
    assert (ckpt["config"]["init"] == "convert_ddpm_to_fm:ckpt.pt"
            and ckpt["model_args"]["t_scale"] == 999.0)


def test_the_users_exact_command(digits_run, tmp_path):
    """`python train_expert.py --cluster 2 --objective fm` after `python cluster.py`, no
    other flag, from a folder with runs/."""
    shutil.copytree(digits_run, tmp_path / "runs", ignore=shutil.ignore_patterns(
        "experts", "router", "samples", "eval"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_expert.py"),
                           "--cluster", "2", "--objective", "fm"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = torch.load(tmp_path / "runs" / "experts" / "2" / "ckpt.pt", weights_only=True)
    assert (ckpt["step"] == 1000 and ckpt["model_args"]["modulation"] == "adaln-single"
            and ckpt["config"]["objective"]["name"] == "fm")
    log = read_log(tmp_path / "runs" / "experts" / "2")
    assert log[-1]["loss"] < 0.6 * log[0]["loss"]


def as_format_1(ckpt):
    """The same checkpoint as the previous version wrote it: free-text objective and
    condition, `conditioning` = AdaLN variant."""
    config, args = dict(ckpt["config"]), dict(ckpt["model_args"])
    objective = config.pop("objective")
    config.update(objective=objective.pop("name"),
                  schedule={k: v for k, v in objective.items() if k != "time_map"},
                  conditioning=config.pop("condition")["kind"], num_classes=args["num_classes"])
    for key in ("format", "network", "flags"):
        config.pop(key)
    args["conditioning"] = args.pop("modulation")
    return {**ckpt, "config": config, "model_args": args}


def test_a_previous_format_checkpoint_is_refused_in_one_line_by_loading_and_resuming(
        digits_run, tmp_path):
    """Format 1 was never released, so its reader was dropped (#37): such a file is one
    clear line, not a traceback."""
    run_stage(train_expert, ["--cluster", "1", "--objective", "ddpm", "--steps", "2",
                             "--run-dir", str(digits_run),
                             "--out-dir", str(tmp_path / "new"), *TINY])
    new = torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)
    (tmp_path / "old").mkdir()
    torch.save(as_format_1(new), tmp_path / "old" / "ckpt.pt")
    with pytest.raises(CheckpointError, match="older version of this project") as refused:
        load(str(tmp_path / "old" / "ckpt.pt"))
    assert "\n" not in str(refused.value)
    code, _, err = run_script("train_expert.py", "--cluster", "1", "--objective", "ddpm",
                              "--steps", "4", "--run-dir", digits_run,
                              "--out-dir", tmp_path / "old", *TINY)
    assert (code == 2 and "older version" in err and "retrain" in err
            and len(err.strip().splitlines()) == 1)


def test_init_from_a_router_is_refused(digits_run, tmp_path):
    import train_router
    run_dir = tmp_path / "runs"
    shutil.copytree(digits_run, run_dir, ignore=shutil.ignore_patterns(
        "experts", "router", "samples", "eval"))
    run_stage(train_router, ["--steps", "2", "--run-dir", str(run_dir)])
    code, _, err = run_script("train_expert.py", "--cluster", "0", "--steps", "2",
                              "--run-dir", run_dir, "--init",
                              run_dir / "router" / "ckpt.pt", *TINY)
    assert code == 2 and "router checkpoint, not an expert" in err and "Traceback" not in err


def test_batches_are_a_function_of_seed_and_step_whatever_the_workers(tmp_path):
    """The DataLoader's workers may make batches in any order; what the step sees must not
    change, flips included."""
    from plumbing.data.datasets import TrainingBatches, load_dataset
    from helpers import fake_cifar10
    fake_cifar10(tmp_path / "cifar")
    dataset = load_dataset(f"cifar10:{tmp_path / 'cifar'}")
    indices = np.arange(7, 97)
    batches = TrainingBatches(dataset, indices, 16, seed=3, hflip=True)
    # crosses an epoch boundary (5 steps per epoch)
    by_hand = [batches[step] for step in range(2, 14)]
    for workers in (0, 2):
        loaded = list(TrainingBatches(dataset, indices, 16, seed=3, hflip=True).loader(
            2, 14, workers, pin_memory=False))
        assert len(loaded) == 12
        for (idx, x), (idx_ref, x_ref) in zip(loaded, by_hand):
            assert np.array_equal(idx.numpy(), idx_ref) and torch.equal(x, x_ref)
    idx, flipped = by_hand[0]
    plain = dataset.batch(idx)
    mirrored = [torch.equal(a, b.flip(-1)) and not torch.equal(a, b)
                for a, b in zip(flipped, plain)]
    assert (2 <= sum(mirrored) <= 14 and all(m or torch.equal(a, b)
                                             for m, a, b in zip(mirrored, flipped, plain)))
    epoch = [np.sort(batches[step][0]) for step in range(5)]
    # an epoch visits distinct images
    assert len(np.unique(np.concatenate(epoch))) == 80


def test_flips_are_refused_for_digits(digits_run, tmp_path):
    code, err = cli(train_expert, ["--cluster", "0", "--hflip", "--run-dir", digits_run,
                                   "--out-dir", tmp_path / "x", *TINY])
    assert code == 2 and "a mirrored digit is not a digit" in err


def test_the_wsd_schedule_holds_then_decays_linearly_over_its_share():
    lrs = [training.learning_rate(i, 1e-3, "wsd", 10, 0.2) for i in range(10)]
    # decay over the last 2 of 10 updates
    assert lrs[:8] == [1e-3] * 8 and lrs[8:] == pytest.approx([1e-3, 5e-4])
    # 1.4 rounds to one update
    assert training.decay_start(10, 0.2) == 8 and training.decay_start(7, 0.2) == 6
    assert [training.learning_rate(i, 1e-3, "constant", 10, 0.2)
            for i in range(10)] == [1e-3] * 10


def test_a_longer_wsd_run_continues_a_shorter_ones_stable_checkpoint_exactly(
        digits_run, tmp_path):
    """x2 continues x1 from where x1's decay began (stable.pt): the same weights as 20
    steps straight, while a continuation from x1's decayed ckpt.pt is refused in one line."""
    common = ["--cluster", "1", "--run-dir", str(digits_run), *TINY,
              "--ckpt-every", "1000", "--lr-schedule", "wsd"]
    run_stage(train_expert, [*common, "--steps", "20", "--out-dir", str(tmp_path / "straight")])
    run_stage(train_expert, [*common, "--steps", "10", "--out-dir", str(tmp_path / "short")])
    short = torch.load(tmp_path / "short" / "stable.pt", weights_only=True)
    assert short["step"] == 8 and short["config"]["flags"]["lr_schedule"] == "wsd"
    code, _, err = run_script("train_expert.py", *common, "--steps", "20",
                              "--out-dir", tmp_path / "short")
    assert (code == 2
            and "past the start of its learning-rate decay (step 10 of 10, decay from 8)" in err)
    os.makedirs(tmp_path / "continued")
    shutil.copyfile(tmp_path / "short" / "stable.pt", tmp_path / "continued" / "ckpt.pt")
    run_stage(train_expert, [*common, "--steps", "20", "--out-dir", str(tmp_path / "continued")])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "continued" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 20
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][name], b[key][name]) for name in a[key])
    lrs = [r["lr"] for r in read_log(tmp_path / "straight")]
    # log every 5: steps 5..15 at lr, 20 after the decay
    assert lrs[-1] == pytest.approx(1e-3 / 4) and lrs[0] == 1e-3
    code, _, err = run_script("train_expert.py", *common[:-2], "--steps", "20",
                              "--out-dir", tmp_path / "continued")
    assert code == 2 and "--lr-schedule wsd -> constant" in err


def test_a_resume_compares_the_flags_that_mean_something_under_the_others(digits_run,
                                                                         tmp_path):
    """--decay-share shapes only the wsd schedule: with a constant rate another share
    resumes; under wsd it is another run, refused in one line."""
    common = ["--cluster", "2", "--run-dir", str(digits_run), *TINY, "--out-dir",
              str(tmp_path / "x")]
    run_stage(train_expert, [*common, "--steps", "4", "--decay-share", "0.2"])
    run_stage(train_expert, [*common, "--steps", "6", "--decay-share", "0.5"])
    assert torch.load(tmp_path / "x" / "ckpt.pt", weights_only=True)["step"] == 6
    wsd = ["--lr-schedule", "wsd", "--out-dir", str(tmp_path / "w")]
    run_stage(train_expert, [*common[:-2], *wsd, "--steps", "4", "--decay-share", "0.2"])
    code, err = cli(train_expert, [*common[:-2], *wsd, "--steps", "4", "--decay-share", "0.5"])
    assert code == 2 and "--decay-share 0.2 -> 0.5" in err, err
