"""bench/gpu.py, the one prepared GPU check, cannot rot: its dry run (tiny sizes, CPU)
runs every check here."""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT


def test_the_gpu_check_runs_every_check_at_tiny_sizes_and_writes_its_table(tmp_path):
    # the throughput rows' peer (bench/requirements.txt; ./ddm test installs it)
    pytest.importorskip("diffusers")
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run",
                           "--out", str(tmp_path), "--budget", "900"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.load(open(tmp_path / "gpu.json"))
    rows = {r["check"]: r for r in report["checks"]}
    assert list(rows) == ["pipeline", "ddp", "compile", "resume", "quality", "throughput",
                          "loader", "sampling", "compiled"]
    assert all(r["ok"] for r in rows.values()), rows
    assert ("auto -> " in rows["pipeline"]["result"] and "2 processes, gloo"
            in rows["ddp"]["result"])
    # on a CPU, killed + resumed is bit-identical to straight; and it was killed mid-run (a run
    # that finished first would match whether resuming works or not)
    killed = re.search(r"killed \(SIGKILL\) at step (\d+) of (\d+)", rows["resume"]["result"])
    assert killed and int(killed[1]) < int(killed[2]) and "0.00e+00" in rows["resume"]["result"]
    # each row reports its script's result, never its warnings; a speed not measured is "-"
    assert "loader, 2 workers" in rows["loader"]["result"]
    assert not any("Warning" in r["result"] or "nan" in r["result"] for r in rows.values())
    assert "CPU (dry run" in report["device"]


def test_without_a_gpu_it_says_how_to_check_the_script_instead(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real check would run")
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "--dry-run" in proc.stderr and "Traceback" not in proc.stderr


def test_a_checks_result_is_its_scripts_standard_output_not_its_warnings(monkeypatch):
    """A library's warning on stderr (DataLoader's worker-count advice, say) once became the
    loader row's result."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu
    monkeypatch.setitem(gpu.TIMEOUT, "seconds", 60)
    code, tail = gpu.command("-c", "import sys; print('loader, 2 workers  95.0');"
                             "print('UserWarning: fewer cores', file=sys.stderr)")
    assert code == 0 and tail.strip() == "loader, 2 workers  95.0"
    with pytest.raises(RuntimeError, match="exited 3: UserWarning: fewer cores"):
        gpu.command("-c", "import sys; print('UserWarning: fewer cores', file=sys.stderr); "
                    "sys.exit(3)")


def test_a_timing_that_failed_fails_the_benchmark_not_only_its_row():
    """A child that cannot time its step (here: zero steps to divide by) used to drop out of
    the table while the script exited 0, so gpu.py's throughput check read "ok"."""
    proc = subprocess.run([sys.executable, "bench/train_step.py", "--config", "dry",
                           "--steps", "0", "--kinds", "ours-adaln-single",
                           "--precisions", "fp32"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "bench/train_step.py: 1 run(s) failed: DiT-M/2 ours-adaln-single fp32")
