"""The fast paths give the same answers: bf16 autocast against fp32, torch.compile against
eager; and auto picks bf16 only where the CPU has it natively, by a bounded measurement."""
import json
import os

import pytest
import torch

import train_expert
from helpers import run_stage
from model import DiT


def tiny_model(modulation):
    torch.manual_seed(0)
    m = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=2,
            num_heads=4, num_classes=10,
            learn_sigma=False, modulation=modulation, t_scale=1000.0)
    for p in m.parameters():            # the zero-initialised layers would hide every difference
        torch.nn.init.normal_(p, std=0.05)
    return m.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 1, 8, 8, generator=g), torch.rand(
        8, generator=g), torch.randint(0, 11, (8,), generator=g)


@pytest.mark.parametrize("modulation", ["adaln-single", "adaln-zero"])
def test_bf16_autocast_matches_fp32(modulation):
    model, (x, t, y) = tiny_model(modulation), inputs()
    with torch.no_grad():
        reference = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x, t, y).float()
    relative = (low - reference).norm() / reference.norm()
    # bf16 keeps ~3 significant digits; not bitwise equal, but close
    assert 0 < relative < 2e-2


def test_compile_matches_eager():
    model, (x, t, y) = tiny_model("adaln-single"), inputs()
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t, y), model(x, t, y), rtol=1e-5, atol=1e-5)


def test_bf16_training_run(digits_run, tmp_path):
    run_stage(train_expert, ["--cluster", "1", "--steps", "6", "--precision", "bf16",
                             "--model", "DiT-M/2", "--batch-size", "16",
                             "--run-dir", str(digits_run), "--out-dir", str(tmp_path),
                             "--log-every", "3"])
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert (ckpt["config"]["precision"] == "bf16"
            and all(v.dtype == torch.float32 for v in ckpt["model"].values()))


def fake_step(fp32_seconds, bf16_seconds, calls, monkeypatch):
    """A 'training step' that takes a set time on precision's own clock, depending on
    whether bf16 autocast is on, and counts its calls. A fake clock: sleeps on a loaded
    machine overshoot, and a test must not depend on wall time."""
    import types
    from plumbing.training import precision
    clock = [0.0]
    monkeypatch.setattr(precision, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def step(autocast):
        with autocast:
            calls.append(1)
            clock[0] += bf16_seconds if torch.is_autocast_enabled("cpu") else fp32_seconds
    return step


@pytest.mark.parametrize("fp32,bf16,expected", [(0.010, 0.002, "bf16"),
                                                (0.002, 0.010, "fp32"), (0.004, 0.004, "fp32")])
def test_auto_precision_follows_the_measurement_and_caches_it(
        tmp_path, monkeypatch, fp32, bf16, expected):
    from plumbing.training import precision
    monkeypatch.setattr(precision, "fast_bf16", lambda device: True)
    calls = []
    key = {"model_args": {"depth": 2}, "batch": [4, 1, 8, 8]}
    chosen, evidence = precision.choose("auto", fake_step(
        fp32, bf16, calls, monkeypatch), torch.device("cpu"), tmp_path, key)
    assert chosen == expected
    # what was measured is recorded
    assert evidence["seconds_per_step"] == pytest.approx({"fp32": fp32, "bf16": bf16})
    measured = len(calls)
    assert measured > 0 and (tmp_path / "precision.json").exists()
    assert precision.choose("auto", fake_step(fp32, bf16, calls, monkeypatch),
                            torch.device("cpu"), tmp_path, key)[0] == expected
    assert len(calls) == measured                      # the second run reads the cache
    precision.choose("auto", fake_step(fp32, bf16, calls, monkeypatch),
                     torch.device("cpu"), tmp_path, {**key, "batch": [8, 1, 8, 8]})
    # another batch shape is another measurement
    assert len(calls) > measured


@pytest.mark.parametrize("entry", [{"fp32": "fast"}, {"fp32": 0.01}, [1, 2]])
def test_a_damaged_precision_entry_is_measured_again(tmp_path, monkeypatch, entry):
    """Before, an entry edited by hand stopped training with a KeyError or TypeError."""
    from plumbing.training import precision
    monkeypatch.setattr(precision, "fast_bf16", lambda device: True)
    calls, key = [], {"batch": [4, 1, 8, 8]}
    precision.choose("auto", fake_step(0.010, 0.002, calls, monkeypatch),
                     torch.device("cpu"), tmp_path, key)
    cache = json.loads((tmp_path / "precision.json").read_text())
    (stored,) = cache
    (tmp_path / "precision.json").write_text(json.dumps({stored: entry}))
    assert precision.choose("auto", fake_step(0.010, 0.002, calls, monkeypatch),
                            torch.device("cpu"), tmp_path, key)[0] == "bf16"
    assert json.loads((tmp_path / "precision.json").read_text()) == cache


def test_auto_precision_never_measures_without_native_bf16_and_asked_precisions_are_kept(
        tmp_path, monkeypatch):
    from plumbing.training import precision
    calls = []
    assert precision.choose("bf16", fake_step(1, 1, calls, monkeypatch),
                            torch.device("cpu"), tmp_path, {}) == ("bf16", {"requested": "bf16"})
    monkeypatch.setattr(precision, "fast_bf16", lambda device: False)
    chosen, evidence = precision.choose("auto", fake_step(
        1, 1, calls, monkeypatch), torch.device("cpu"), tmp_path, {})
    assert chosen == "fp32" and "no native bf16" in evidence["reason"] and calls == []


def test_the_chosen_precision_is_in_the_checkpoint_and_the_log(digits_run, tmp_path):
    run_stage(train_expert, ["--cluster", "1", "--steps", "2", "--model", "DiT-M/2",
                             "--batch-size", "16", "--run-dir", str(digits_run),
                             "--out-dir", str(tmp_path), "--log-every", "1"])
    config = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert (config["precision"] in ("fp32", "bf16")
            and config["precision_evidence"]["requested"] == "auto")
    import json
    assert {json.loads(line)["precision"] for line in open(tmp_path / "log.jsonl")} == {
        config["precision"]}


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "avx512f", "avx512_vnni"}, False), ({"avx512f", "avx512_bf16"}, True),
    ({"amx_bf16", "amx_tile"}, True), ({"asimd", "bf16"}, True), (set(), False)])
def test_a_cpu_is_bf16_capable_only_when_its_flags_say_it_multiplies_bf16_natively(
        monkeypatch, flags, native):
    """oneDNN says yes on any AVX-512 CPU (bf16 emulated there); the kernel's flags are
    what decide."""
    from plumbing.training import precision
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True,
                        raising=False)
    assert precision.fast_bf16(torch.device("cpu")) is (native
                                                        and torch.backends.mkldnn.is_available())


def test_the_cpu_flags_are_read_from_the_kernels_list():
    from plumbing.training import precision
    flags = precision.cpu_flags()
    assert isinstance(flags, set)
    if os.path.isfile("/proc/cpuinfo") and os.uname().machine == "x86_64":
        assert "sse2" in flags                       # every x86-64 CPU has it


@pytest.mark.parametrize("fp32, bf16, timed_calls", [(0.002, 0.012, 2), (0.004, 0.004, 2 + 4)])
def test_the_measurement_stops_once_one_precision_is_clearly_slower(
        tmp_path, monkeypatch, fp32, bf16, timed_calls):
    from plumbing.training import precision
    monkeypatch.setattr(precision, "fast_bf16", lambda device: True)
    calls = []
    precision.choose("auto", fake_step(fp32, bf16, calls, monkeypatch),
                     torch.device("cpu"), tmp_path, {"batch": [1]})
    warm_ups = 2 * (1 if timed_calls == 2 else 2)    # one warm-up call per precision and round
    # 6x slower: one round of one timed call each; equal: both rounds
    assert len(calls) == timed_calls + warm_ups
