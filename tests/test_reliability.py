"""Bad inputs and faults, as a hostile user or a bad day would bring them, on a small
finished run.

Every bad input must end in exit code 2, exactly one line on stderr, no traceback, and no file of
the run changed. Faults (a SIGKILL mid-training, two trainers on one folder, a full disk, a
crafted data file) must neither run code, lose work, nor pass silently.
"""
import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import cluster
import distill
import eval as evaluate
import export
import sample
import import_dit
import train_expert
import train_router
from plumbing.command_line import Parser, UsageError
from helpers import ROOT, cli, fake_cifar10, fake_imagenet64, run_command, run_stage, snapshot
from plumbing.run_dir import load_checkpoint
from plumbing.training.plan import written_by

TINY = ["--model", "DiT-M/2", "--batch-size", "16"]
CACHES = {"features", "eval", "text"}   # folders of runs/ that hold recomputable caches only


@pytest.fixture(scope="module")
def finished_run(digits_run, tmp_path_factory):
    """K=4 digits: experts 0 (fm) and 1 (ddpm), a router, a sample batch; what every case
    must leave as it was."""
    run = tmp_path_factory.mktemp("finished")
    shutil.copy(digits_run / "clusters.pt", run / "clusters.pt")
    for k, objective in (("0", "fm"), ("1", "ddpm")):
        run_stage(train_expert, ["--cluster", k, "--objective", objective, "--steps", "6",
                                 "--log-every", "3", "--run-dir", str(run), *TINY])
    run_stage(train_router, ["--steps", "6", "--run-dir", str(run)])
    run_stage(sample, ["--run-dir", str(run), "--n", "8", "--steps", "3",
                       "--out", str(run / "samples" / "top1.npz")])
    return run


def bad_files(folder):
    """Files a user might pass by mistake, made once."""
    folder.mkdir(exist_ok=True)
    (folder / "empty.pt").write_bytes(b"")
    torch.save([1, 2, 3], folder / "list.pt")          # loadable, but not a checkpoint
    torch.save(torch.zeros(3), folder / "tensor.pt")
    (folder / "text.npz").write_text("not a zip\n")
    (folder / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (folder / "a-file").write_text("x")
    np.savez(folder / "fractional.npz", arr_0=np.zeros((4, 8, 8, 1), dtype=np.uint8),
             arr_1=np.array([0.5, 1, 2, 3]))
    with open(folder / "huge.txt", "wb") as f:   # sparse: 17 MiB on paper, nothing on disk
        f.truncate(17 * 2 ** 20)
    np.savez(folder / "three.npz", arr_0=np.zeros((3, 8, 8, 1), dtype=np.uint8),
             arr_1=np.array([0, 1, 2]))
    return folder


CASES = [
    # (stage, argv after --run-dir RUN, what stderr must say)
    (cluster, ["--k", "1"], "must be at least 2"),
    (cluster, ["--k", "5000"], "--k must be between"),
    (cluster, ["--k", "3"], "--recluster"),
    (cluster, ["--pca-dim", "0"], "must be at least 1"),
    (cluster, ["--pca-dim", "65"], "--pca-dim 65 is more than a PCA of these images can keep"),
    (cluster, ["--batch-size", "0"], "must be at least 1"),
    (cluster, ["--min-size", "-1"], "must be at least 0"),
    (cluster, ["--fine-k", "2"], "--fine-k must be larger"),
    (cluster, ["--device", "bogus"], "unknown device"),
    (cluster, ["--data", "svhn"], "unknown data set"),
    (train_expert, ["--steps", "0"], "must be at least 1"),
    (train_expert, ["--steps", "-1"], "must be at least 1"),
    (train_expert, ["--batch-size", "0"], "must be at least 1"),
    (train_expert, ["--batch-size", "-4"], "must be at least 1"),
    (train_expert, ["--lr", "-1"], "finite number in (0"),
    (train_expert, ["--lr", "nan"], "finite number in (0"),
    (train_expert, ["--weight-decay", "-1"], "finite number in [0"),
    (train_expert, ["--grad-clip", "-1"], "finite number in [0"),
    (train_expert, ["--ema-decay", "1.5"], "finite number in [0, 1]"),
    (train_expert, ["--condition-dropout", "2"], "finite number in [0, 1]"),
    (train_expert, ["--log-every", "0"], "must be at least 1"),
    (train_expert, ["--ckpt-every", "0"], "must be at least 1"),
    (train_expert, ["--model", "DiT-Q/9"], "invalid choice"),
    (train_expert, ["--image-size", "3"], "made from another data set"),
    (train_expert, ["--image-size", "1"], "must be at least 2"),
    (train_expert, ["--cluster", "01"], "unknown cluster '01'"),
    (train_expert, ["--cluster", "9"], "unknown cluster '9'"),
    (train_expert, ["--cluster", "0", "--lr", "3e-4"], "--lr 0.001 -> 0.0003"),
    (train_expert, ["--cluster", "1", "--objective", "fm", "--steps", "8"],
     "--objective ddpm -> fm"),
    (train_expert, ["--cluster", "0", "--model", "DiT-T/2", "--steps", "8"],
     "--model DiT-M/2 -> DiT-T/2"),
    (train_expert, ["--cluster", "2", "--out-dir", "{RUN}/experts/0", "--steps", "8"],
     "--cluster 0 -> 2"),
    (train_expert, ["--cluster", "2", "--out-dir", "{BAD}/a-file"], "is a file"),
    (train_expert, ["--cluster", "2", "--init", "{BAD}/empty.pt", "--out-dir", "{TMP}/x"],
     "cannot read --init checkpoint"),
    (train_expert, ["--cluster", "2", "--init", "{BAD}/list.pt", "--out-dir", "{TMP}/x"],
     "holds a list, not a checkpoint"),
    (import_dit, ["{BAD}/tensor.pt", "--cluster", "all", "--out-dir", "{TMP}/x"],
     "holds a Tensor, not a checkpoint"),
    (sample, ["--router", "{BAD}/list.pt"], "holds a list, not a checkpoint"),
    (distill, ["--init", "{BAD}/tensor.pt", "--out-dir", "{TMP}/x"],
     "holds a Tensor, not a checkpoint"),
    (train_expert, ["--cluster", "2", "--init", "{RUN}/router/ckpt.pt",
                    "--out-dir", "{TMP}/x"], "router checkpoint, not an expert"),
    (import_dit, ["{RUN}/router/ckpt.pt", "--cluster", "2", "--out-dir", "{TMP}/x"],
     "router checkpoint, not an expert"),
    (train_expert, ["--cluster", "2", "--init", "{RUN}/experts/0/ckpt.pt",
                    "--model", "DiT-S/2", "--out-dir", "{TMP}/x"],
     "would not be what trains"),
    (train_router, ["--steps", "0"], "must be at least 1"),
    (train_router, ["--vae", "{TMP}/some-vae"], "are in pixels"),
    (train_router, ["--steps", "-1"], "must be at least 1"),
    (train_router, ["--batch-size", "0"], "must be at least 1"),
    (train_router, ["--val-fraction", "0"], "finite number in (0"),
    (train_router, ["--val-fraction", "-0.5"], "finite number in (0"),
    (train_router, ["--val-fraction", "1"], "finite number in (0"),
    (train_router, ["--lr", "nan"], "finite number"),
    (train_router, ["--condition-dropout", "1.5"], "finite number in [0, 1]"),
    (train_router, ["--model", "DiT-Q/9"], "invalid choice"),
    (train_router, ["--device", "bogus"], "unknown device"),
    (sample, ["--steps", "0"], "must be at least 1"),
    (sample, ["--steps", "-1"], "must be at least 1"),
    (sample, ["--cfg-scale", "nan"], "finite number"),
    (sample, ["--cfg-scale", "inf"], "finite number"),
    (sample, ["--n", "0"], "must be at least 1"),
    (sample, ["--n", "1000000000000"], "GiB"),
    (sample, ["--batch-size", "0"], "must be at least 1"),
    (sample, ["--class", "10"], "is not a class"),
    (sample, ["--class", "-1"], "must be at least 0"),
    (sample, ["--experts", "01"], "no expert 01"),
    (sample, ["--routing", "top3"], "unknown routing"),
    (sample, ["--routing", "oracle:3"], "not available"),
    (sample, ["--out", "{RUN}/samples"], "--out must be a file name"),
    (sample, ["--out", "{BAD}/a-file/x.npz"], "is a file"),
    (sample, ["--router", "{RUN}/experts/0/ckpt.pt"], "is an expert checkpoint, not a router"),
    (sample, ["--router", "{BAD}/empty.pt"], "cannot read router"),
    (sample, ["--prompts", "{BAD}/binary.txt"], "cannot read prompt file"),
    (sample, ["--prompt", "a seven"], "need text-conditional experts"),
    (sample, ["--device", "bogus"], "unknown device"),
    (distill, ["--routing", "oracle:1"], "is one expert alone"),
    (distill, ["--routing", "topk:3"], "only 2 are available"),
    (distill, ["--init", "0", "--model", "DiT-M/2"], "give --init or --model"),
    (distill, ["--init", "0", "--modulation", "adaln-zero", "--out-dir", "{TMP}/x"],
     "keeps its own modulation, adaln-single"),
    (train_expert, ["--cluster", "2", "--init", "{RUN}/experts/0/ckpt.pt",
                    "--modulation", "adaln-zero", "--out-dir", "{TMP}/x"],
     "keeps its own modulation, adaln-single"),
    (distill, ["--experts", "all"], "the teacher is the ensemble's experts"),
    (distill, ["--experts", "distilled"], "the teacher is the ensemble's experts"),
    (distill, ["--router", "{RUN}/experts/0/ckpt.pt"], "is an expert checkpoint, not a router"),
    (distill, ["--init", "{BAD}/empty.pt", "--out-dir", "{TMP}/x"],
     "cannot read --init checkpoint"),
    (distill, ["--init", "{RUN}/router/ckpt.pt", "--out-dir", "{TMP}/x"],
     "router checkpoint, not an expert"),
    (distill, ["--trajectory-fraction", "2"], "finite number in [0, 1]"),
    (distill, ["--out-dir", "{BAD}/a-file"], "is a file"),
    (evaluate, [], "or --prepare"),
    (evaluate, ["{BAD}/text.npz"], "is not an .npz file"),
    (evaluate, ["{BAD}/fractional.npz"], "one integer label"),
    (evaluate, ["{BAD}/missing.npz"], "no sample file"),
    (evaluate, ["{RUN}/samples/top1.npz", "--classifier-steps", "0"], "must be at least 1"),
    (evaluate, ["{RUN}/samples/top1.npz", "--max-real", "0"], "must be at least 2"),
    (evaluate, ["{RUN}/samples/top1.npz", "--cluster", "7"],
     "the cluster file has clusters 0..3"),
    # second battery (#27): seeds in every generator's range, ASCII cluster ids, bounded
    # guidance, k-NN's minimum
    (cluster, ["--seed", "-5"], "a seed must be an integer in 0..4294967295"),
    (train_expert, ["--seed", "-1"], "a seed must be an integer in 0..4294967295"),
    (train_expert, ["--seed", "99999999999999999999"],
     "a seed must be an integer in 0..4294967295"),
    (train_router, ["--seed", "4294967296"], "a seed must be an integer in 0..4294967295"),
    (sample, ["--seed", "-1"], "a seed must be an integer in 0..4294967295"),
    (evaluate, ["{RUN}/samples/top1.npz", "--seed", "-1"],
     "a seed must be an integer in 0..4294967295"),
    (distill, ["--seed", "1e3"], "a seed must be an integer in 0..4294967295"),
    (train_expert, ["--cluster", "\u0663"], "ASCII digits"),
    (sample, ["--cfg-scale", "1e300"], "finite number in [0, 100]"),
    (sample, ["--cfg-scale", "-3"], "finite number in [0, 100]"),
    (evaluate, ["{BAD}/three.npz"], "needs at least 4 images"),
    (sample, ["--prompts", "{BAD}/huge.txt"], "may hold at most 16 MiB"),
    (sample, ["--experts", ","], "names no expert"),
    (sample, ["--experts", " , "], "names no expert"),
    # a rule of one expert per image has no unconditional branch of its own to route
    (sample, ["--routing", "draw", "--cfg-routing", "independent", "--cfg-scale", "2"],
     "--routing draw runs one expert per image"),
    (sample, ["--routing", "oracle:1", "--cfg-routing", "independent"],
     "--routing oracle runs one expert per image"),
    (sample, ["--routing", "draw", "--router-every", "4"], "reads the router once per image"),
    (sample, ["--routing", "oracle:0", "--router-every", "2"], "reads the router never"),
    (distill, ["--experts", ","], "names no expert"),
    # an --out-dir that names another stage's network is not a run to resume
    (train_expert, ["--cluster", "0", "--out-dir", "{RUN}/router"],
     "holds a network that train_router.py trained, not a run of train_expert.py to resume"),
    (distill, ["--steps", "2", "--out-dir", "{RUN}/experts/0"],
     "holds a network that train_expert.py trained, not a run of distill.py to resume"),
]


@pytest.mark.parametrize("module,argv,message", CASES,
                         ids=[f"{m.__name__}{' '.join(a)}" for m, a, _ in CASES])
def test_bad_input_is_one_line_and_changes_nothing(
        finished_run, tmp_path, module, argv, message):
    bad = bad_files(tmp_path / "bad")
    argv = [a.replace("{RUN}", str(finished_run)).replace("{BAD}", str(bad)).replace(
        "{TMP}", str(tmp_path)) for a in argv]
    if module is not evaluate or "--run-dir" not in argv:
        argv = [*argv, "--run-dir", str(finished_run)]
    if module in (train_expert,) and "--model" not in argv:
        argv = [*argv, *TINY]
    before = snapshot(finished_run)
    code, err = cli(module, argv)
    assert code == 2 and message in err, (argv, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    after = snapshot(finished_run)
    assert {k: after.get(k) for k in before} == before          # no file changed or removed
    # at most a cache was filled
    assert all(k.split(os.sep)[0] in CACHES for k in set(after) - set(before))


def test_a_crafted_cifar_batch_is_refused_without_running_code(tmp_path):
    folder = fake_cifar10(tmp_path / "cifar")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(folder, "data_batch_3"), "wb") as f:
        pickle.dump({b"data": Payload(), b"labels": [0]}, f)
    code, err = cli(cluster, ["--data", f"cifar10:{tmp_path / 'cifar'}",
                              "--run-dir", tmp_path / "runs"])
    assert (code == 2 and "posix.system" in err and "refused without running it" in err
            and len(err.strip().splitlines()) == 1)
    assert not marker.exists() and not (tmp_path / "runs" / "clusters.pt").exists()


def test_imagenet64_labels_are_one_based(tmp_path):
    root = fake_imagenet64(tmp_path / "in64", n=6, batches=1, side=8)
    path = root / "train_data_batch_1.npz"
    with np.load(path) as z:
        data = z["data"]
    np.savez(path, data=data, labels=np.zeros(6, dtype=np.int64))
    code, err = cli(cluster, ["--data", f"imagenet64:{root}", "--run-dir", tmp_path / "runs"])
    assert code == 2 and "1-based" in err


@pytest.mark.parametrize("bad", ["float", "1-d", "ragged"])
def test_imagenet64_data_that_are_not_rows_of_pixel_bytes_are_refused(tmp_path, bad):
    """Floats in [0, 1] would read as near-black bytes, a 1-D array as one huge image:
    both are one line."""
    root = fake_imagenet64(tmp_path / "in64", n=6, batches=1, side=8)
    path = root / "train_data_batch_1.npz"
    with np.load(path) as z:
        data, labels = z["data"], z["labels"]
    data = {"float": data / 255.0, "1-d": data.reshape(-1), "ragged": data[:, :-1]}[bad]
    np.savez(path, data=data, labels=labels)
    code, err = cli(cluster, ["--data", f"imagenet64:{root}", "--run-dir", tmp_path / "runs"])
    assert (code == 2 and "not a usable downsampled-ImageNet file" in err
            and len(err.strip().splitlines()) == 1)
    assert not (tmp_path / "runs" / "clusters.pt").exists()


def test_reclustering_over_trained_experts_needs_the_flag(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert cli(cluster, ["--k", "3", "--run-dir", run])[0] == 2
    # the same clustering again is harmless
    assert cli(cluster, ["--run-dir", run])[0] == 0
    assert cli(cluster, ["--k", "3", "--recluster", "--run-dir", run])[0] == 0
    code, err = cli(train_expert, ["--cluster", "0", "--steps", "8", "--run-dir", run, *TINY])
    assert code == 2 and "another clustering" in err


def test_a_full_disk_replaces_nothing_and_says_so(finished_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device",
                      str(run / "router" / "ckpt.tmp.pt"))

    monkeypatch.setattr(torch, "save", full)
    code, err = cli(train_router, ["--steps", "3", "--run-dir", run])
    assert code == 2 and "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert snapshot(run) == before


def test_a_log_never_lists_a_step_twice_after_kills_and_no_temporary_file_remains(
        finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(
        "experts", "router", "samples"))
    out = run / "experts" / "2"
    # the killed runs aim far beyond where they are killed: a run that finished between two
    # polls would never be caught past a checkpoint (on a fast CPU 200 steps take a second)
    cmd = [sys.executable, os.path.join(ROOT, "train_expert.py"), "--cluster", "2",
           "--steps", "100000", "--ckpt-every", "20",
           "--log-every", "10", "--run-dir", str(run), *TINY]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    for _ in range(2):   # killed twice, each time after at least one checkpoint and past it
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        start = load_checkpoint(out / "ckpt.pt", "checkpoint")["step"] if (
            out / "ckpt.pt").exists() else 0
        deadline = time.time() + 240
        while time.time() < deadline:
            time.sleep(0.5)
            if (out / "ckpt.pt").exists() and load_checkpoint(
                out / "ckpt.pt", "checkpoint")["step"] > start and \
                    sum(1 for _ in open(out / "log.jsonl")) * 10 > load_checkpoint(
                        out / "ckpt.pt", "checkpoint")["step"]:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # what a kill during a save leaves
    (out / f"ckpt.tmp-{dead_writer()}.pt").write_bytes(b"half a checkpoint")
    final = load_checkpoint(out / "ckpt.pt", "checkpoint")["step"] + 40
    cmd[cmd.index("100000")] = str(final)
    assert subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True).returncode == 0
    steps = [json.loads(line)["step"] for line in open(out / "log.jsonl")]
    assert steps == list(range(10, final + 1, 10)) and final > 60
    assert not [f for f in os.listdir(out) if ".tmp" in f or f == "lock"]


def test_two_trainers_on_one_folder_the_second_refuses_and_a_stale_lock_is_taken_over(
        finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(
        "experts", "router", "samples"))
    cmd = [sys.executable, os.path.join(ROOT, "train_expert.py"), "--cluster", "3",
           "--run-dir", str(run), *TINY]
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*cmd, "--steps", "100000"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = run / "experts" / "3" / "lock"
    deadline = time.time() + 120
    while not lock.exists() and time.time() < deadline:
        time.sleep(0.2)
    second = subprocess.run([*cmd, "--steps", "4"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert second.returncode == 2 and "being written by another train_expert.py" in second.stderr
    # the killed trainer's lock stays behind, and does not block the next run
    assert lock.exists()
    third = subprocess.run([*cmd, "--steps", "4"], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    assert third.returncode == 0, third.stderr[-2000:]
    assert not lock.exists()


def test_eval_never_pairs_a_batch_with_another_runs_json(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    usage = json.load(open(run / "samples" / "top1.json"))
    usage["run_id"] = "an older run"
    json.dump(usage, open(run / "samples" / "top1.json", "w"))
    run_stage(evaluate, [str(run / "samples" / "top1.npz"), "--run-dir", str(run),
                         "--max-real", "50", "--classifier-steps", "20"])
    result = json.load(open(run / "samples" / "top1.eval.json"))
    assert ("routing" not in result and "belongs to another sampling run"
            in capsys.readouterr().out)


def strict_json(path):
    """JSON as RFC 8259 has it: NaN and Infinity, which Python writes and reads, refused."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_a_metric_with_no_value_is_written_as_json_null_and_shown_as_a_dash(
        finished_run, tmp_path, capsys):
    """Eight images of eight labels: no label has the two samples diversity needs."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    batch = np.load(run / "samples" / "top1.npz")
    np.savez(run / "samples" / "distinct.npz", batch["arr_0"], np.arange(8))
    run_stage(evaluate, [str(run / "samples" / "distinct.npz"), "--run-dir", str(run),
                         "--max-real", "50", "--classifier-steps", "20"])
    result = strict_json(run / "samples" / "distinct.eval.json")
    assert result["diversity"] is None and result["fd_classifier"] > 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("distinct.npz"))
    assert "nan" not in row and " - " in row
    for path in run.rglob("*.json"):
        strict_json(path)


def test_the_classifier_cache_is_keyed_by_its_training_steps(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    batch = str(run / "samples" / "top1.npz")
    for steps in ("5", "20"):
        run_stage(evaluate, [batch, "--run-dir", str(run), "--max-real", "50",
                             "--classifier-steps", steps])
    assert {f.rsplit("-", 1)[1] for f in os.listdir(run / "eval")
            if f.startswith("classifier-")} >= {"5.pt", "20.pt"}
    after_another = json.load(open(run / "samples" / "top1.eval.json"))
    assert after_another["classifier"] == "pooled-20"
    fresh = tmp_path / "fresh"
    shutil.copytree(finished_run, fresh)
    run_stage(evaluate, [str(fresh / "samples" / "top1.npz"), "--run-dir", str(fresh),
                         "--max-real", "50", "--classifier-steps", "20"])
    # the real images' features are the 20-step classifier's too, not those cached for the
    # 5-step one
    assert after_another["fd_classifier"] == pytest.approx(
        json.load(open(fresh / "samples" / "top1.eval.json"))["fd_classifier"])


def test_a_study_measures_a_batch_again_under_another_classifier_without_drawing_it_again(
        finished_run, tmp_path):
    from studies.common import sample_and_measure
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    batch, flags = str(run / "samples" / "study.npz"), ["--n", "8", "--steps", "3"]
    first = sample_and_measure(str(run), batch, *flags,
                               eval_flags=["--classifier-steps", "5", "--max-real", "50"])
    drawn = os.stat(batch).st_mtime_ns
    again = sample_and_measure(str(run), batch, *flags,
                               eval_flags=["--classifier-steps", "20", "--max-real", "50"])
    assert (first["classifier"], again["classifier"]) == (
        "pooled-5", "pooled-20") and first["fd_classifier"] != again["fd_classifier"]
    assert os.stat(batch).st_mtime_ns == drawn


@pytest.mark.parametrize("damage", ["garbage", "short mean", "nan covariance", "fewer rows"])
def test_a_damaged_reference_cache_is_rebuilt(finished_run, tmp_path, damage):
    """A cache readable as .npz is checked too: its arrays' shapes against each other and
    the reference's size, every number finite."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    batch = str(run / "samples" / "top1.npz")
    run_stage(evaluate, [batch, "--run-dir", str(run), "--max-real", "50",
                         "--classifier-steps", "20"])
    first = json.load(open(run / "samples" / "top1.eval.json"))["fd_classifier"]
    for name in os.listdir(run / "eval"):
        if name.startswith("ref-"):
            path = run / "eval" / name
            if damage == "garbage":
                path.write_bytes(b"garbage")
                continue
            ref = dict(np.load(path))
            if damage == "short mean":
                ref["mu"] = ref["mu"][:3]
            elif damage == "nan covariance":
                ref["sigma"][0, 0] = np.nan
            else:
                ref["features"] = ref["features"][:5]
            with open(path, "wb") as f:
                np.savez(f, **ref)
    run_stage(evaluate, [batch, "--run-dir", str(run), "--max-real", "50",
                         "--classifier-steps", "20"])
    assert json.load(
        open(run / "samples" / "top1.eval.json"))["fd_classifier"] == pytest.approx(first)


def test_the_floor_is_kept_per_n_and_checked_when_read_back(finished_run, tmp_path, capsys):
    """The floor's draws cost as much as five batches and the studies run eval.py once per
    batch: eval.py keeps the floor at each N beside the reference statistics. A second run
    reads it back (a planted figure shows it was not measured again); a damaged or foreign
    record is measured again, said in one line."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    flags = [str(run / "samples" / "top1.npz"), "--run-dir", str(run), "--max-real", "50",
             "--classifier-steps", "20"]
    run_stage(evaluate, flags)
    measured = json.load(open(run / "samples" / "top1.eval.json"))["floor"]
    [record] = [run / "eval" / f for f in os.listdir(run / "eval") if f.startswith("floor-")]
    assert record.name.endswith("-8.json") and json.load(open(record)) == measured
    planted = {**measured, "fd_classifier": 1234.5}
    another_n = {**measured, "n": 9}
    not_finite = {**measured, "kid_classifier_sd": float("nan")}
    huge = json.dumps(planted) + " " * (1 << 17)   # never read whole
    cases = [(json.dumps(planted), planted), ("{garbage", measured), (huge, measured),
             (json.dumps(another_n), measured), (json.dumps(not_finite), measured)]
    for stored, expected in cases:
        record.write_text(stored)
        capsys.readouterr()
        run_stage(evaluate, flags)
        assert json.load(open(run / "samples" / "top1.eval.json"))["floor"] == expected
        assert ("measuring it again" in capsys.readouterr().out) == (expected is measured)


def test_an_empty_checkpoint_file_is_one_line():
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        with pytest.raises(UsageError, match="cannot read checkpoint .*: EOFError"):
            load_checkpoint(f.name, "checkpoint")


def test_sixteen_bit_pngs_keep_their_grey_levels(tmp_path):
    from PIL import Image
    from plumbing.data.datasets import load_dataset
    for c in ("a", "b"):
        (tmp_path / "f" / c).mkdir(parents=True)
        for i, level in enumerate((0, 32768, 65535)):
            Image.fromarray(np.full((8, 8), level, dtype=np.uint16)).save(
                tmp_path / "f" / c / f"{i}.png")
    images = load_dataset(f"folder:{tmp_path / 'f'}", image_size=8).images
    assert sorted({int(v) for v in images[:3, :, 4, 4].ravel()}) == [0, 128, 255]


def test_a_corrupt_feature_cache_is_rebuilt(tmp_path):
    run = tmp_path / "runs"
    assert cli(cluster, ["--run-dir", run])[0] == 0
    first = torch.load(run / "clusters.pt", weights_only=True)["assignments"]
    (cache,) = (run / "features").iterdir()
    cache.write_bytes(b"not an array")
    assert cli(cluster, ["--run-dir", run])[0] == 0
    assert torch.equal(torch.load(run / "clusters.pt", weights_only=True)["assignments"], first)


REPRODUCE_CASES = [(["--budgets", "nan"], "finite number"),
                   (["--budgets", "inf"], "finite number"),
                   (["--budgets", "0"], "finite number"),
                   (["--budgets", "1", "1"], "1 is given twice"),
                   (["--k", "0"], "must be at least 2"), (["--k", "4", "4"], "given twice"),
                   (["--train-seeds", "0", "0"], "0 is given twice"),
                   (["--train-seeds", "-1"], "a seed must be"),
                   (["--seeds", "1", "1"], "1 is given twice"),
                   (["--n", "2"], "must be at least 4"),
                   (["--monolith-steps", "0"], "at least 1"),
                   (["--router-share", "1.5"], "finite number in (0, 1)"),
                   (["--max-budget", "nan"], "finite number"),
                   (["--monolith-steps", "10", "--budgets", "0.05"],
                    "is 0.5 of a monolith step"),
                   (["--monolith-steps", "10", "--budgets", "0.5", "0.52"],
                    "both round to 5 monolith steps"),
                   (["--budgets", "128", "--until-plateau", "--train-seeds", "0", "1"],
                    "--max-budget 64 is below"),
                   (["--monolith-steps", "1", "--budgets", "1", "--router-share", "0.5"],
                    "leaves no expert step for 4 experts (ddm)"),
                   (["--monolith-steps", "3", "--budgets", "1", "--router-share", "0.5",
                     "--splits", "ddm", "equal-batch"],
                    "leaves no expert step for 4 experts (equal-batch)")]


@pytest.mark.parametrize("argv,message", REPRODUCE_CASES,
                         ids=[" ".join(a) for a, _ in REPRODUCE_CASES])
def test_a_bad_study_flag_is_one_line_before_any_work(tmp_path, argv, message):
    import reproduce
    code, err = cli(reproduce, ["--part", "scaling", "--out", str(tmp_path / "out"), *argv])
    assert (code == 2 and message in err and len(err.strip().splitlines()) == 1
            and "Traceback" not in err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("groups,message", [
    (["11"], "a class group per contributor, two at least"),
    (["0,1", "1,2"], "class 1 is in two groups"),
    (["0,1", "2,11"], "class 11 is not one of digits's, 0..9"),
])
def test_contributors_class_groups_are_checked_before_any_training(tmp_path, groups, message):
    # each used to fail late, in the stage it reached: one group at cluster.py's --k;
    # groups sharing a class after every network was trained, with a router error that
    # named another cause; an unknown class at train_expert.py's --classes
    import reproduce
    code, err = cli(reproduce, ["--part", "contribution", "--out", str(tmp_path / "out"),
                                "--contributor-classes", *groups])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_second_cluster_run_on_the_same_folder_refuses(finished_run):
    import socket
    lock = finished_run / "lock"
    # a live process (this one) holds the folder, as a running cluster.py does
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")
    try:
        before = snapshot(finished_run)
        code, err = cli(cluster, ["--run-dir", str(finished_run), "--recluster", "--k", "3"])
        assert (code == 2 and "being written by another cluster.py" in err
                and len(err.strip().splitlines()) == 1), err
        assert snapshot(finished_run) == before
    finally:
        lock.unlink()


def test_a_failed_batch_write_replaces_none_of_the_previous_batchs_files(
        finished_run, monkeypatch):
    before = snapshot(finished_run / "samples")
    def full_disk(path, **arrays):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(np, "savez", full_disk)
    code, err = cli(sample, ["--run-dir", str(finished_run), "--n", "8", "--steps", "2",
                             "--out", str(finished_run / "samples" / "top1.npz")])
    assert code == 2 and "No space left on device" in err and "nothing was replaced" in err, err
    # NAME.json and NAME.png are the old batch's still
    assert snapshot(finished_run / "samples") == before


def test_import_never_replaces_a_trained_expert(finished_run, tmp_path):
    import torch
    from helpers import random_official_state_dict
    official = tmp_path / "DiT-official.pt"
    torch.save(random_official_state_dict(C=1, size=8), official)
    before = snapshot(finished_run)
    code, err = cli(import_dit, [str(official), "--cluster", "0",
                                 "--run-dir", str(finished_run)])
    assert (code == 2 and "already holds a network that train_expert.py trained (step 6" in err
            and len(err.strip().splitlines()) == 1), err
    code, err = cli(import_dit, [str(official), "--cluster", "0", "--run-dir", str(finished_run),
                                 "--out-dir", str(finished_run / "router")])
    assert code == 2 and "already holds a network that train_router.py trained" in err, err
    assert snapshot(finished_run) == before
    fresh = [str(official), "--cluster", "0", "--run-dir", str(finished_run),
             "--out-dir", str(tmp_path / "imported")]
    # the same file again replaces nothing new; another file replaces nothing
    assert cli(import_dit, fresh)[0] == 0 and cli(import_dit, fresh)[0] == 0
    torch.save(random_official_state_dict(C=1, size=8, seed=1), official)
    code, err = cli(import_dit, fresh)
    assert code == 2 and "already holds another imported checkpoint (step 0" in err, err


def test_an_npz_larger_than_memory_is_refused_before_it_is_unpacked(finished_run, monkeypatch):
    real = os.sysconf
    # no memory to spare
    monkeypatch.setattr(os, "sysconf", lambda name: 0 if name == "SC_PHYS_PAGES" else real(name))
    code, err = cli(evaluate, [str(finished_run / "samples" / "top1.npz"),
                               "--run-dir", str(finished_run)])
    assert (code == 2 and "more than half of this machine's" in err
            and len(err.strip().splitlines()) == 1), err


def test_cluster_removes_what_a_killed_cluster_run_left_half_written(tmp_path):
    (tmp_path / "latents").mkdir()
    left = [tmp_path / f"clusters.tmp-{dead_writer()}.pt",
            tmp_path / "latents" / f"abc.tmp-{dead_writer()}.npy"]
    for path in left:
        path.write_bytes(b"half")
    assert cli(cluster, ["--run-dir", str(tmp_path)])[0] == 0
    assert not any(path.exists() for path in left) and (tmp_path / "clusters.pt").exists()


def test_distills_follow_up_command_names_the_run_folder_sample_py_reads():
    said = distill.how_to_sample("/r/experts/distilled/ckpt.pt")
    assert said == "sample it with: python sample.py --experts distilled --run-dir /r"
    assert "ln -s /elsewhere/student RUN/experts/distilled" in distill.how_to_sample(
        "/elsewhere/student/ckpt.pt")
    # quoted for the shell, as pasted
    assert distill.how_to_sample("/my runs/experts/distilled/ckpt.pt").endswith(
        "--run-dir '/my runs'")


@pytest.mark.parametrize("stage, argv, limit_kib", [
    # numpy's feature cache: "N requested and M written"
    (cluster, ["--k", "3", "--recluster"], 8),
    (train_router, ["--steps", "2"], 64),        # torch.save's zip writer
])
def test_a_write_cut_short_by_a_file_size_limit_is_one_line_and_replaces_nothing(
        finished_run, tmp_path, stage, argv, limit_kib):
    import resource
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("features"))
    before = snapshot(run)
    # a real short write: the kernel writes up to the limit, then refuses with EFBIG
    # (Python ignores SIGXFSZ)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_kib * 1024, hard))
    try:
        code, err = cli(stage, [*argv, "--run-dir", run])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (code == 2 and "nothing was replaced" in err
            and len(err.strip().splitlines()) == 1), err
    assert snapshot(run) == before


def test_an_interrupt_or_a_sigterm_is_one_line_that_says_how_to_resume(monkeypatch, capsys):
    import signal
    import sys
    from plumbing.command_line import Parser, run_main

    def interrupted(args):
        raise KeyboardInterrupt

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sys, "argv", ["stage.py"])
    before = signal.getsignal(signal.SIGTERM)
    try:
        for main in (interrupted, terminated):
            with pytest.raises(SystemExit) as stopped:
                run_main(main, Parser(prog="stage.py"))
            err = capsys.readouterr().err
            assert stopped.value.code == 130 and len(err.strip().splitlines()) == 1
            assert "run the same command again" in err and "Traceback" not in err
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("env", [{"K": "0"}, {"K": "abc"}, {"JOBS": "0"}, {"JOBS": "-1"}])
def test_the_pipeline_checks_its_settings_before_any_work(env, tmp_path):
    """./ddm refuses a bad K or JOBS in one line before clustering anything."""
    import subprocess
    if not filecmp_same(os.path.join(ROOT, "requirements.txt"),
                        os.path.join(ROOT, ".venv", "requirements.txt.installed")):
        pytest.skip("./ddm would first install requirements.txt into .venv: run ./ddm test")
    proc = subprocess.run([os.path.join(ROOT, "ddm"), "pipeline"], capture_output=True,
                          text=True,
                          env={**os.environ, **env, "RUN_DIR": str(tmp_path / "runs")})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "runs").exists()


def filecmp_same(a, b):
    import filecmp
    return os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)


@pytest.mark.parametrize("damage", ["nan", "int64"])
def test_damaged_weights_are_refused_before_sampling(finished_run, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = run / "experts" / "0" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    name = next(iter(ckpt["ema"]))
    ckpt["ema"][name] = ckpt["ema"][name].fill_(
        float("nan")) if damage == "nan" else ckpt["ema"][name].long()
    torch.save(ckpt, path)
    code, err = cli(sample, ["--run-dir", run, "--n", "2", "--steps", "1",
                             "--out", tmp_path / "o.npz"])
    assert code == 2 and name in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.npz").exists()


def misfit(ckpt, part, damage):
    """One tensor of a checkpoint's weights (model and EMA) at another shape or gone, or
    one of its optimizer's moments at another shape; returns the name a refusal names."""
    if part == "opt":
        moments = ckpt["opt"]["state"][sorted(ckpt["opt"]["state"])[1]]
        moments["exp_avg"] = torch.zeros(3)
        return "exp_avg"
    weights = [key for key in ("model", "ema") if key in ckpt]   # a router keeps no EMA
    name = sorted(ckpt[weights[0]])[1]
    for key in weights:
        if damage == "missing":
            del ckpt[key][name]
        else:
            ckpt[key][name] = torch.zeros(3)
    return name


STEP = ["--n", "2", "--steps", "1", "--out", "{TMP}/o.npz"]
# every road by which a checkpoint's tensors reach a network: sampling (an expert, the
# router), resuming (weights, EMA, optimizer), --init (an expert, a router)
MISFITS = [(sample, "experts/0/ckpt.pt", "weights", "shape", STEP),
           (sample, "experts/0/ckpt.pt", "weights", "missing", STEP),
           (sample, "router/ckpt.pt", "weights", "shape", STEP),
           (train_expert, "experts/0/ckpt.pt", "weights", "shape", ["--cluster", "0", *TINY]),
           (train_expert, "experts/0/ckpt.pt", "weights", "missing", ["--cluster", "0", *TINY]),
           (train_expert, "experts/0/ckpt.pt", "opt", "shape", ["--cluster", "0", *TINY]),
           (train_expert, "init.pt", "weights", "shape",
            ["--cluster", "2", "--init", "{RUN}/init.pt", *TINY]),
           (train_router, "init.pt", "weights", "shape", ["--init", "{RUN}/init.pt"])]


@pytest.mark.parametrize("module,path,part,damage,argv", MISFITS,
                         ids=[f"{m.__name__}-{p}-{part}-{d}" for m, p, part, d, _ in MISFITS])
def test_tensors_that_do_not_fit_their_network_are_one_line_wherever_they_are_read(
        finished_run, tmp_path, module, path, part, damage, argv):
    """load_state_dict's refusal is many lines from inside the stage; the optimizer's
    moments it does not check at all (the first step would fail)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    source = "router" if module is train_router else "experts/1"
    original = run / (path if path != "init.pt" else f"{source}/ckpt.pt")
    ckpt = torch.load(original, weights_only=True)
    name = misfit(ckpt, part, damage)
    torch.save(ckpt, run / path)
    before = snapshot(run)
    argv = [a.replace("{RUN}", str(run)).replace("{TMP}", str(tmp_path)) for a in argv]
    code, err = cli(module, [*argv, "--steps", "9", "--run-dir", str(run)]
                    if module is not sample else [*argv, "--run-dir", str(run)])
    assert code == 2 and name in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and snapshot(run) == before


def edit_partition(clusters, edit):
    """A cluster file's assignments edited: cut short, or one image moved to cluster 7
    of 4 with its fingerprint written to match (as a careful hand would)."""
    if edit == "cut short":
        clusters["assignments"] = clusters["assignments"][:100].clone()
        return "not those its fingerprint records"
    clusters["assignments"][0] = 7
    clusters["fingerprint"] = hashlib.sha1(clusters["assignments"].numpy().tobytes()).hexdigest()
    return "outside 0..3"


@pytest.mark.parametrize("edit", ["cut short", "out of range"])
@pytest.mark.parametrize("module,argv", [
    (train_expert, ["--cluster", "2", "--steps", "2", *TINY]),
    (train_router, ["--steps", "2"]),
    (evaluate, ["{RUN}/samples/top1.npz", "--cluster", "0", "--classifier-steps", "5"])],
    ids=["train_expert", "train_router", "eval"])
def test_an_edited_cluster_file_is_refused_by_every_stage_that_reads_it(
        finished_run, tmp_path, module, argv, edit):
    """Before, each of them ran on either file to exit 0 (an expert trained on the first
    100 images' clusters); a file with many images moved out of range failed inside the
    router's loss with a traceback."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    clusters = torch.load(run / "clusters.pt", weights_only=True)
    says = edit_partition(clusters, edit)
    torch.save(clusters, run / "clusters.pt")
    before = snapshot(run)
    code, err = cli(module, [*[a.replace("{RUN}", str(run)) for a in argv], "--run-dir", str(run)])
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(run) == before


def test_a_pattern_naming_a_million_shards_is_refused_at_once(tmp_path):
    code, err = cli(cluster, ["--data", f"wds:{tmp_path}/{{0..999999}}.tar",
                              "--run-dir", tmp_path / "run"])
    assert code == 2 and "more than 100,000 shards" in err


# --- the fourth battery's root causes: numbers, records and caches read from files are
#     checked first

def one_line(module, argv, says):
    code, err = cli(module, argv)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (argv, err[-800:])


def test_constructor_arguments_read_from_a_file_are_checked_before_any_network_is_built(
        finished_run, tmp_path):
    """Every entry that builds a network from a file's numbers (import, --init, loading)
    checks them first: heads that do not divide the width, zero heads, a tensor with no
    elements claiming a huge side, an objective this project does not know."""
    from helpers import random_official_state_dict
    ckpt = torch.load(finished_run / "experts" / "0" / "ckpt.pt", weights_only=True)
    cases = {"heads3.pt": (
        {**ckpt, "model_args": {**ckpt["model_args"], "num_heads": 3, "hidden_size": 32}},
        "do not divide it"),
             "heads0.pt": ({**ckpt, "model_args": {**ckpt["model_args"], "num_heads": 0}},
                           "num_heads 0"),
             "bogus.pt": ({**ckpt, "config": {**ckpt["config"], "objective": {"name": "bogus"}}},
                          "objective or condition is not one this project knows")}
    for name, (bad, says) in cases.items():
        torch.save(bad, tmp_path / name)
        one_line(import_dit, [tmp_path / name, "--cluster", "all", "--run-dir", finished_run,
                              "--out-dir", tmp_path / "imported"], says)
        one_line(train_expert, ["--cluster", "0", "--init", tmp_path / name,
                                "--run-dir", finished_run,
                                "--out-dir", tmp_path / "x", "--steps", "2"], says)
    one_line(distill, ["--init", tmp_path / "heads0.pt", "--run-dir", finished_run,
                       "--out-dir", tmp_path / "d",
                       "--steps", "2"], "num_heads 0")
    state = random_official_state_dict(C=1, size=8)
    state["pos_embed"] = torch.zeros(1, 10 ** 10, 0)   # no elements, a side of 10^5 claimed
    torch.save(state, tmp_path / "empty-pos.pt")
    one_line(import_dit, [tmp_path / "empty-pos.pt", "--cluster", "all",
                          "--run-dir", finished_run,
                          "--out-dir", tmp_path / "imported"], "holds no elements")
    assert not (tmp_path / "imported").exists() and not (tmp_path / "x" / "ckpt.pt").exists()


def test_a_routers_pooling_must_divide_its_input(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    one_line(train_router, ["--steps", "2", "--downsample", "16", "--run-dir", run],
             "--downsample 16 does not divide")
    code, err = cli(train_router, ["--steps", "2", "--downsample", "3", "--run-dir", run])
    assert code == 2 and "--model DiT" not in err and "downsample" in err, err


def test_output_paths_are_probed_before_any_work(finished_run, tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for target, says in ((tmp_path / "dangling", "is a link"), ("", "an empty name")):
        one_line(cluster, ["--to-shards", target, "--run-dir", tmp_path / "c"], says)
    assert sorted(os.listdir(tmp_path)) == ["dangling"]
    (tmp_path / "a-folder").mkdir()
    one_line(evaluate, ["--convert-inception", tmp_path / "missing.pt",
                        tmp_path / "a-folder"], "is a folder")
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(finished_run), "--out", str(release)])
    before = snapshot(release)
    one_line(import_dit, [finished_run / "experts" / "0" / "ckpt.pt", "--cluster", "0",
                          "--run-dir", finished_run,
                          "--out-dir", release / "experts" / "0"], "holds a released network")
    assert snapshot(release) == before


def test_record_files_read_back_are_checked_field_by_field(finished_run, tmp_path):
    """A batch record whose number is a string, and the x16 study's chunks damaged field
    by field, are one line naming the file and the field; a NaN FD is no number."""
    import reproduce
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    run_stage(evaluate, [str(run / "samples" / "top1.npz"), "--run-dir", str(run),
                         "--classifier-steps", "20"])
    record = json.loads((run / "samples" / "top1.json").read_text())
    (run / "samples" / "top1.json").write_text(
        json.dumps({**record, "sampling_flops_per_image": "abc"}))
    one_line(export, ["--run-dir", run, "--out", tmp_path / "rel"],
             "field 'sampling_flops_per_image'")
    chunk = json.loads(open(os.path.join(ROOT, "docs", "x16", "seed6-mono-wsd.json")).read())
    row = chunk["scaling"]["runs"][0]
    damages = {"evals-list": {**chunk, "evals": []}, "seed-word": {**chunk, "scaling": {
        **chunk["scaling"], "runs": [{**row, "seed": "six"}]}}, "nan": {**chunk, "scaling": {
        **chunk["scaling"], "runs": [{**row, "fd": float("nan")}]}}}
    for name, damaged in damages.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "seed6-mono-wsd.json").write_text(json.dumps(damaged))
        one_line(reproduce, ["--part", "x16", "--results", folder,
                             "--out", tmp_path / "out", "--no-plots"],
                 "seed6-mono-wsd.json")


def test_the_shipped_judge_is_the_published_one(tmp_path, monkeypatch):
    from plumbing.evaluation import judge
    from plumbing.data.datasets import load_dataset
    dataset = load_dataset("fashion-mnist") if os.path.isdir(
        "/usr/share/datasets/fashion-mnist") else None
    if dataset is None:
        pytest.skip("Fashion-MNIST is not installed")
    name = next(iter(judge.PINNED))
    other = judge.Classifier(1, 10, 28)
    monkeypatch.setattr(judge, "JUDGES", str(tmp_path))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, tmp_path / name,
              metadata={"accuracy": "0.99"})
    with pytest.raises(UsageError, match="not the published"):
        judge.load_or_train_classifier(dataset, str(tmp_path), 1500)


def dead_writer():
    """HOST-PID of a writer of this host that is gone (above Linux's largest pid)."""
    from plumbing.run_dir import writer
    return writer().rpartition("-")[0] + "-4000000"


def test_a_dead_writers_temporary_is_removed_by_the_next_write(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    planted = run / "samples" / f"top1.tmp-{dead_writer()}.npz"
    planted.write_bytes(b"half")
    # another host's writer, on a folder shared between machines: its process id means
    # nothing here, and its temporary is not ours to delete
    theirs = [run / "samples" / "top1.tmp-other-host-4000000.npz",
              run / "samples" / f"top1.tmp-{dead_writer().rpartition('-')[0]}x-4000000.json"]
    for path in theirs:
        path.write_bytes(b"theirs, in progress")
    run_stage(sample, ["--run-dir", str(run), "--n", "4", "--steps", "2",
                       "--out", str(run / "samples" / "top1.npz")])
    assert not planted.exists() and all(path.exists() for path in theirs)


KILLED_WRITER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from plumbing.run_dir import save_safetensors
print("writing", flush=True)
save_safetensors({"big": torch.zeros(64, 2 ** 20)}, sys.argv[1])
"""


def test_a_killed_safetensors_write_leaves_only_what_the_next_writer_clears(tmp_path):
    """A writer killed while it writes tensors (an interrupted --convert-inception, a
    judge's classifier) leaves nothing but a temporary named by its host and process,
    which the next write to the folder removes; never safetensors' own .tmpXXXXXX."""
    import signal
    import time
    left = set()
    for delay in (0.05, 0.2, 0.5):   # whenever the kill lands, before or during the write
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER,
                                 str(tmp_path / "net.safetensors"), ROOT],
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left |= {p.name for p in tmp_path.iterdir()} - {"net.safetensors"}
    assert all(".tmp-" in name for name in left), left
    from plumbing.run_dir import save_safetensors
    save_safetensors({"small": torch.zeros(2)}, tmp_path / "other.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "net.safetensors") == \
        ["other.safetensors"]


@pytest.mark.parametrize("flags, says", [
    (["--steps", "3000000000"], "--steps: must be at most 100000"),
    (["--time-shift", "1e-17"], "--time-shift: must be a finite number in"),
    (["--time-shift", "1e9"], "--time-shift: must be a finite number in"),
    (["--device", "meta"], "runs on cpu or cuda"),
    (["--device", "xpu"], "runs on cpu or cuda"),
    (["--device", "cuda:7"], "CUDA device"),
])
def test_a_flag_is_bounded_by_what_it_drives(flags, says):
    """Accepted by type is not enough: a value the sampler would turn into an
    allocation, an overflowing grid or a device it cannot run on is refused where it is
    parsed, in one line."""
    code, err = cli(sample, ["--n", "4", *flags])
    assert code == 2 and says in err and len(err.strip().splitlines()) <= 2, err


def test_a_stray_rank_is_one_line_and_torchrun_is_offered_no_abbreviable_flag():
    code, _, err = run_command("sample.py", "--n", "4", env={"RANK": "1"})
    assert code == 2 and "RANK is set but not WORLD_SIZE" in err, err
    assert len(err.strip().splitlines()) == 1
    # torchrun's parser reads --n as an abbreviation of its own flags: --help offers
    # --num-samples only (--n stays accepted outside torchrun)
    _, out, _ = run_command("sample.py", "--help")
    assert "--num-samples" in out and "--n " not in out and "--n," not in out


def test_ddm_reached_through_a_link_runs_in_its_own_folder(tmp_path):
    """A link to ./ddm elsewhere (a PATH folder) sets up and runs the project where it is,
    making no .venv beside the link."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ddm").symlink_to(os.path.join(ROOT, "ddm"))
    done = subprocess.run([str(tmp_path / "bin" / "ddm")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2 and "usage: ./ddm pipeline" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path / "bin")) == ["ddm"]


def test_ddm_reads_the_paths_it_is_given_from_the_callers_folder(tmp_path):
    """Paths given to ./ddm from another folder are that folder's, as for any command: a
    reproduction's results folder and RUN_DIR (the refusal names the caller's folder)."""
    if not filecmp_same(os.path.join(ROOT, "requirements-repro.txt"),
                        os.path.join(ROOT, ".venv", "requirements-repro.txt.installed")):
        pytest.skip("./ddm would first install requirements-repro.txt into .venv: run ./ddm test")
    shutil.copytree(os.path.join(ROOT, "docs", "confirm"), tmp_path / "chunks")
    done = subprocess.run([os.path.join(ROOT, "ddm"), "reproduce", "--part", "confirm",
                           "--results", "chunks", "--out", "out"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "experts - monolith" in done.stdout, done.stderr[-2000:]
    done = subprocess.run([os.path.join(ROOT, "ddm"), "slurm", "--status"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RUN_DIR": "mine"})
    assert str(tmp_path / "mine") in done.stdout + done.stderr, (done.stdout, done.stderr)


@pytest.mark.parametrize("stranger", [3, "weights", {"nested": 1}])
def test_a_state_dict_entry_that_is_no_tensor_is_one_line(finished_run, tmp_path, stranger):
    import torch
    from helpers import random_official_state_dict
    official = random_official_state_dict(C=1, size=8)
    official["x_embedder.proj.weight"] = stranger
    torch.save(official, tmp_path / "odd.pt")
    code, err = cli(import_dit, [str(tmp_path / "odd.pt"), "--cluster", "all",
                                 "--out-dir", str(tmp_path / "x")])
    assert code == 2 and "not a tensor" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


@pytest.mark.fast
@pytest.mark.parametrize("allocate", [
    lambda: torch.empty(1 << 62, dtype=torch.uint8),   # torch's CPU allocator: a RuntimeError
    lambda: np.empty(1 << 62, dtype=np.uint8),         # numpy: MemoryError
    # CUDA's allocator, as torch raises it on a GPU this machine may not have
    lambda: (_ for _ in ()).throw(torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity")),
], ids=["torch-cpu", "numpy", "cuda"])
def test_memory_the_machine_does_not_have_is_one_line_naming_what_to_lower(allocate):
    # 2**62 bytes is beyond any address space, so the allocators refuse it at once, whatever
    # the kernel's overcommit policy (a batch that merely exceeds RAM may be killed instead)
    stage = types.SimpleNamespace(__name__="stage", main=lambda args: allocate(),
                                  build_parser=lambda: Parser(prog="stage.py"))
    code, err = cli(stage, [])
    assert code == 2 and "stage.py: error: out of memory (" in err and "--batch-size" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_stage_that_trained_a_checkpoint_is_told_where_older_ones_do_not_record_it(
        finished_run):
    for path, stage in ((finished_run / "experts" / "0" / "ckpt.pt", "train_expert.py"),
                        (finished_run / "router" / "ckpt.pt", "train_router.py")):
        config = torch.load(path, weights_only=True)["config"]
        unrecorded = {key: value for key, value in config.items() if key != "stage"}
        assert written_by(config) == written_by(unrecorded) == stage
    assert written_by({"network": "dit", "flags": {"experts": "0,1"}}) == "distill.py"
    assert written_by({"network": "dit", "imported": True}) is None   # not one of ours
