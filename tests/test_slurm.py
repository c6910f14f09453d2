"""`./ddm slurm` on a real scheduler: a single-node SLURM started on this machine
(slurm/start-single-node; skipped, with the reason, where it cannot be: no root, no
`apt-get install slurm-wlm munge`). The digits pipeline runs end to end as a job graph with
every expert its own array task; an expert requeued mid-training ends equal to one trained
straight through; a failed expert stops sampling and evaluation and the status names it;
an sbatch refused part-way leaves no half graph; and what cannot run is refused before
anything is submitted. The expert job's script, run by bash with a recording scontrol,
passes a stop on and requeues without a scheduler."""
import json
import os
import shutil
import subprocess
import time

import pytest
import torch

from helpers import ROOT

pytestmark = pytest.mark.xdist_group("slurm")   # one node: the graphs take turns

# a digits pipeline small enough to run in seconds a stage; expert 0 long enough to be
# requeued part-way
EXPERT = "--model DiT-N/4 --batch-size 8 --ckpt-every 25"
TINY = {"K": "2", "CPUS": "1", "ROUTER_FLAGS": "--steps 20 --batch-size 8",
        "EVAL_FLAGS": "--classifier-steps 20 --max-real 50",
        "SAMPLE_FLAGS": "--num-samples 16 --steps 4"}


@pytest.fixture(scope="module")
def partition():
    """The single-node cluster's partition, started here if none answers."""
    if shutil.which("sbatch") is None:
        pytest.skip("no SLURM here: apt-get install slurm-wlm munge (as root) to run these")
    if os.geteuid() != 0 and subprocess.run(["scontrol", "ping"], capture_output=True,
                                            text=True).returncode != 0:
        pytest.skip("no SLURM controller answers, and starting one needs root")
    done = subprocess.run([os.path.join(ROOT, "slurm", "start-single-node")],
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        pytest.skip("SLURM could not be started here: " + done.stderr.strip().splitlines()[-1])
    return done.stdout.strip()


def ddm_slurm(run_dir, *args, **env):
    return subprocess.run([os.path.join(ROOT, "ddm"), "slurm", *args], cwd="/",
                          env={**os.environ, **TINY, "RUN_DIR": str(run_dir), **env},
                          capture_output=True, text=True, timeout=600)


def jobs(run_dir):
    lines = (run_dir / "slurm" / "jobs.tsv").read_text().splitlines()
    return {name: job_id for name, job_id, _ in (line.split("\t") for line in lines)}


def job_fields(job_id):
    """scontrol's record of one job as a dict (JobState, Restarts, ...)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                           text=True, check=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def back_in_the_queue(job_id):
    """A requeued job is pending again, or (held briefly, or not at all) already past that:
    a poll could miss a short pending spell, never the restart count."""
    fields = job_fields(job_id)
    return fields["JobState"] == "PENDING" or (
        int(fields["Restarts"]) >= 1 and fields["JobState"] in ("RUNNING", "COMPLETED"))


def wait_for(job_id, timeout=900):
    """Block until the job has ended in any state: a job that depends on it ends then."""
    subprocess.run(["sbatch", "--wait", "--quiet", "--kill-on-invalid-dep=no",
                    f"--dependency=afterany:{job_id}", "--cpus-per-task=1",
                    "--output=/dev/null", "--wrap", "true"],
                   check=True, timeout=timeout)


def wait_until(condition, timeout=600, every=1.0):
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return
        time.sleep(every)
    raise AssertionError("timed out")


def test_the_pipeline_runs_as_a_job_graph_and_a_requeued_expert_resumes_to_the_same_weights(
        partition, tmp_path):
    # a folder name the job scripts must quote: sbatch refuses a bare space in --output,
    # and a shell would run the $(...)
    run = tmp_path / "run $(touch injected) 'q'"
    written = ddm_slurm(run, "--dry-run", EXPERT_FLAGS=f"{EXPERT} --steps 300")
    assert written.returncode == 0, written.stderr
    scripts = {p.name: p.read_text() for p in (run / "slurm").glob("*.sbatch")}
    assert set(scripts) == {"cluster.sbatch", "experts.sbatch", "router.sbatch",
                            "eval-networks.sbatch", "sample.sbatch", "eval.sbatch"}
    assert "#SBATCH --array=0-1" in scripts["experts.sbatch"] and not (run / "slurm" / "jobs.tsv").exists()

    submitted = ddm_slurm(run, EXPERT_FLAGS=f"{EXPERT} --steps 300")
    assert submitted.returncode == 0, submitted.stderr
    # the dry run's scripts are what ran
    assert {p.name: p.read_text() for p in (run / "slurm").glob("*.sbatch")} == scripts
    ids = jobs(run)
    assert "logs" in submitted.stdout and ids["expert-0"].endswith("_0")

    # requeue expert 0 part-way: its 300 steps take about a second, shorter than any poll
    # could be sure to catch, so the job is suspended as soon as its first checkpoint
    # appears, seen to stand short of the end, then let go and requeued at once
    ckpt = run / "experts" / "0" / "ckpt.pt"
    wait_until(ckpt.exists, every=0.005)
    suspended = subprocess.run(["scontrol", "suspend", ids["expert-0"]], capture_output=True,
                               text=True)
    if suspended.returncode != 0:   # an operator's right: root here, not on a shared cluster
        subprocess.run(["scancel", *ids.values()])
        pytest.skip("scontrol suspend was refused: " + suspended.stderr.strip())
    reached = torch.load(ckpt, weights_only=True)["step"]
    assert reached < 200, f"expert 0 reached step {reached} before it could be suspended"
    subprocess.run(["scontrol", "resume", ids["expert-0"]], check=True)
    subprocess.run(["scontrol", "requeue", ids["expert-0"]], check=True)
    # SLURM holds a requeued job back for a while (its begin time); here it may start now
    wait_until(lambda: back_in_the_queue(ids["expert-0"]))
    subprocess.run(["scontrol", "update", f"JobId={ids['expert-0']}", "StartTime=now"],
                   capture_output=True)   # refused if it has started already: no matter
    wait_for(ids["eval"])

    status = ddm_slurm(run, "--status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert all(line.split()[2] == "done" for line in status.stdout.splitlines()), status.stdout
    result = json.loads((run / "samples" / "top1.eval.json").read_text())
    assert result["job"]["job_id"] == ids["eval"]
    for k in (0, 1):
        record = torch.load(run / "experts" / str(k) / "ckpt.pt", weights_only=True)
        assert record["step"] == 300
        assert record["config"]["job"]["array_task_id"] == str(k)
        assert record["config"]["job"]["array_job_id"] == ids["expert-0"].split("_")[0]
    requeued = torch.load(ckpt, weights_only=True)
    assert requeued["config"]["job"]["restarts"] >= 1
    # the folder's name was never run as a command, and every log is where jobs.tsv says
    places = ["/injected", os.path.join(ROOT, "injected")]
    assert not list(tmp_path.rglob("injected")) and not any(map(os.path.exists, places))
    logs = [line.split("\t")[2] for line in (run / "slurm" / "jobs.tsv").read_text().splitlines()]
    assert all(os.path.isfile(log) for log in logs), logs

    # the same expert trained straight through, outside the scheduler, at the job's threads
    straight = subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "python"), "train_expert.py", "--cluster", "0",
         "--objective", "fm", *EXPERT.split(), "--steps", "300", "--run-dir", str(run),
         "--out-dir", str(tmp_path / "straight")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr[-2000:]
    reference = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    for part in ("model", "ema"):
        for name, value in reference[part].items():
            assert torch.equal(value, requeued[part][name]), (part, name)


def test_a_failed_expert_cancels_sampling_and_evaluation_and_the_status_names_it(
        partition, tmp_path):
    run = tmp_path / "run"
    (run / "experts").mkdir(parents=True)
    (run / "experts" / "1").write_text("a file where expert 1's folder goes")
    submitted = ddm_slurm(run, EXPERT_FLAGS=f"{EXPERT} --steps 20")
    assert submitted.returncode == 0, submitted.stderr
    ids = jobs(run)
    wait_for(ids["eval"])
    status = ddm_slurm(run, "--status")
    assert status.returncode != 0
    rows = {line.split()[0]: line for line in status.stdout.splitlines()}
    assert "FAILED" in rows["expert-1"] and f"expert-{ids['expert-1']}.out" in rows["expert-1"]
    assert "done" in rows["expert-0"]
    for dependent in ("sample", "eval"):
        assert "CANCELLED" in rows[dependent], rows[dependent]
    assert not (run / "samples").exists()


def test_an_sbatch_refused_part_way_leaves_no_half_graph(partition, tmp_path):
    """The expert jobs ask for a GPU this one-node cluster does not declare, so sbatch
    refuses them after the clustering job was submitted: that job is cancelled, no
    jobs.tsv claims a graph, and the refusal says what was cancelled."""
    run = tmp_path / "run"
    done = ddm_slurm(run, GPUS="1")
    assert done.returncode != 0 and "sbatch: error" in done.stderr, done.stderr
    cancelled = done.stderr.strip().splitlines()[-1]
    assert "so the jobs submitted before it are cancelled" in cancelled, done.stderr
    ids = cancelled.rsplit(": ", 1)[1].split()
    assert ids, cancelled   # the clustering job went in first
    for job_id in ids:
        wait_until(lambda: job_fields(job_id)["JobState"] == "CANCELLED")
    assert not (run / "slurm" / "jobs.tsv").exists()


# the time-limit warning and a requeue, to one trainer process and to torchrun over two
@pytest.mark.parametrize("stop, gpus", [(s, g) for g in ("0", "2") for s in ("USR1", "TERM")])
def test_an_expert_jobs_script_passes_a_stop_on_and_requeues_a_stopped_trainer(
        digits_run, tmp_path, stop, gpus):
    """The expert job's own script, run by bash outside SLURM with SLURM's variables and a
    scontrol that only records what it is asked: the time-limit warning (USR1, --signal's
    B:) is passed to the trainer, which saves and exits 75, and the script requeues its
    job; a requeue's SIGTERM is passed on and the script exits non-zero for SLURM to run
    it again, writing no exit status for --status to call a failure. With GPUS = 2 the
    trainer runs under torchrun (gloo on this CPU), which hears SIGTERM for both and
    reports its workers' 75 as 1. Needs no scheduler."""
    import signal
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(digits_run / "clusters.pt", run / "clusters.pt")
    written = ddm_slurm(run, "--dry-run", K="4", GPUS=gpus,
                        EXPERT_FLAGS="--model DiT-M/2 --batch-size 16 --steps 100000")
    assert written.returncode == 0, written.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n')
    (bin_dir / "scontrol").chmod(0o755)
    job = subprocess.Popen(
        ["bash", str(run / "slurm" / "experts.sbatch")], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "1"})
    log = run / "experts" / "0" / "log.jsonl"
    # training has begun (or the job has already ended, which the asserts below then show)
    wait_until(lambda: job.poll() is not None or log.exists() and log.read_text().strip(),
               every=0.05)
    job.send_signal(getattr(signal, f"SIG{stop}"))
    output, _ = job.communicate(timeout=300)
    stopped = torch.load(run / "experts" / "0" / "ckpt.pt", weights_only=True)["step"]
    heard = stop if gpus == "0" else "TERM"
    assert f"stopped by SIG{heard} at step {stopped}" in output, output[-2000:]
    calls = tmp_path / "scontrol.calls"
    if stop == "USR1":
        assert job.returncode == 0 and calls.read_text() == "requeue 4242\n"
    else:
        assert job.returncode == (75 if gpus == "0" else 1) and not calls.exists()
    assert not (run / "slurm" / "state" / "expert-0.exit").exists()


def test_what_cannot_run_is_refused_before_anything_is_submitted(partition, tmp_path):
    run = tmp_path / "run"
    cases = {"no such partition": {"PARTITION": "no-such-partition"},
             "MaxArraySize": {"K": "100000"},
             "no line break or double quote": {"RUN_DIR": str(tmp_path / 'say "run"')}}
    for expected, env in cases.items():
        done = ddm_slurm(run, **env)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
        assert not (run / "slurm" / "jobs.tsv").exists()
    # a PATH with every command of this one but SLURM's
    bare = tmp_path / "bin"
    bare.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name not in ("sbatch", "scontrol", "squeue", "sinfo") and \
                    not (bare / name).exists():
                (bare / name).symlink_to(os.path.join(folder, name))
    done = subprocess.run([os.path.join(ROOT, "ddm"), "slurm"], cwd=ROOT,
                          env={**os.environ, **TINY, "RUN_DIR": str(run), "PATH": str(bare)},
                          capture_output=True, text=True)
    assert done.returncode == 2 and "apt-get install slurm-wlm" in done.stderr, done.stderr
