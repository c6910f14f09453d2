"""What a training step costs: its FLOPs, counted once before training, and the precision
it runs in (fp32, or bf16 autocast where this machine measures it faster)."""
import contextlib
import json
import os
import platform
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from model import count_flops
from plumbing.run_dir import atomic_json


# The precision a step runs in: --precision fp32 | bf16 | auto. bf16 autocast is not free
# on a CPU: it pays where the step is matrix work (DiT-S/2 and larger) and costs where it
# is framework overhead (the digits DiT's matmuls are 16 tokens wide). So `auto` measures:
#   * CUDA: bf16 where the GPU supports it (Ampere or newer; DiT and PixArt train so).
#   * CPU without native bf16 matmuls (its /proc/cpuinfo flags: avx512_bf16, amx_bf16, or
#     bf16 on ARM): fp32, unmeasured. oneDNN's own check answers yes on any AVX-512 CPU,
#     where bf16 is emulated and several times slower.
#   * CPU with them: forward + backward of the real model and batch shape in each
#     precision, interleaved so a busy neighbour slows both alike; bf16 only if at least
#     10 % faster, cached in RUN_DIR/precision.json by CPU, threads, torch, model and shape.
# The optimizer step is not timed: its fp32 master-weight work is the same in both.
# bf16 must beat fp32 by this factor; below it the measurement's noise could decide
SPEED_UP_NEEDED = 1.1
CLEARLY_SLOWER = 1.5    # a first-round gap this wide is no measurement noise: the choice is made
# x86's AVX512-BF16 and AMX, ARM's BF16 (BFMMLA) extension
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def precision_autocast(device, precision):
    """The context a training step runs in: bf16 autocast, or nothing for fp32."""
    return torch.autocast(device.type,
                          dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def cpu_flags():
    """The instruction-set flags the kernel reports for this CPU (x86 'flags', ARM
    'Features'); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":")[0].strip() in ("flags", "Features")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def fast_bf16(device):
    """Does this device multiply bf16 matrices natively?"""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(NATIVE_BF16_FLAGS & cpu_flags()) and torch.backends.mkldnn.is_available()
    return False


def seconds_per_step(step, device, precision, repeats):
    """Median wall time of `repeats` calls of step(autocast context), after one warm-up
    call."""
    step(precision_autocast(device, precision))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(precision_autocast(device, precision))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(step, device, rounds=2, repeats=2):
    """{precision: seconds per step}, fp32 and bf16 alternating up to `rounds` times; each
    precision's fastest round.

    The first round times one call each; if one precision is then CLEARLY_SLOWER, that
    settles it."""
    best = {"fp32": float("inf"), "bf16": float("inf")}
    for round_ in range(rounds):
        for precision in best:
            best[precision] = min(best[precision],
                                  seconds_per_step(
                                      step, device, precision, repeats if round_ else 1))
        if max(best.values()) > CLEARLY_SLOWER * min(best.values()):
            break
    return best


def step_cost(net, model_args, objective, condition, batch_shape, device, requested, cache_dir):
    """(FLOPs of one training step over every torchrun rank, the Precision it runs in): one
    forward and backward of `net` on a fixed batch of this rank's shape, measured before
    training (train_expert.py's experts and distill.py's student alike)."""
    null = condition.expert_input(condition.null(batch_shape[0], device))
    step = probe_step(net, objective, batch_shape, null, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    key = {"model_args": model_args, "batch": list(batch_shape), "objective": objective.spec()}
    return world * count_flops(step), choose_on_every_rank(requested, step, device, cache_dir, key)


def probe_step(net, objective, batch_shape, y, device):
    """One forward + backward on a fixed batch of this shape, gradients discarded:
    step(autocast) for measuring."""
    x = torch.zeros(batch_shape, device=device)
    t = objective.sample_time(batch_shape[0], torch.Generator().manual_seed(0), device)

    def step(autocast=contextlib.nullcontext()):
        with autocast:
            loss = objective.loss(net, x, t, x, y).float().mean()
        loss.backward()
        net.zero_grad(set_to_none=True)
    return step


class Precision(NamedTuple):
    """The precision a run trains in ('fp32' or 'bf16') and why (what was asked, what was
    measured)."""
    name: str
    evidence: dict


def choose(requested, step, device, cache_dir, key):
    """The Precision to train in: `requested` unless it is 'auto'; step(autocast) runs one
    forward + backward."""
    if requested != "auto":
        return Precision(requested, {"requested": requested})
    if not fast_bf16(device):
        return Precision("fp32", {"requested": "auto",
                                  "reason": f"no native bf16 matmuls on {device.type}"})
    if device.type == "cuda":
        return Precision("bf16", {"requested": "auto", "reason": "CUDA device with bf16 support"})
    key = json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, **key}, sort_keys=True)
    path = os.path.join(cache_dir, "precision.json")
    cache = {}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}   # a damaged cache is only a cache: measure again
    if not isinstance(cache, dict):
        cache = {}
    if not measured_times(cache.get(key)):   # absent, or an entry damaged by hand
        cache[key] = measure(step, device)
        atomic_json(cache, path)
    seconds = cache[key]
    precision = "bf16" if seconds["fp32"] >= SPEED_UP_NEEDED * seconds["bf16"] else "fp32"
    return Precision(precision, {
        "requested": "auto", "seconds_per_step": seconds,
        "reason": f"measured on this CPU: fp32 {seconds['fp32'] * 1e3:.1f} ms, bf16 "
                  f"{seconds['bf16'] * 1e3:.1f} ms per forward + backward"})


def measured_times(entry):
    """A cache entry as `measure` writes it: positive seconds for fp32 and bf16."""
    return isinstance(entry, dict) and all(
        isinstance(entry.get(p), (int, float)) and entry[p] > 0 for p in ("fp32", "bf16"))


def choose_on_every_rank(requested, step, device, cache_dir, key):
    """`choose` on rank 0 of a torchrun job, its answer broadcast, so every rank runs
    alike."""
    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice[0] = choose(requested, step, device, cache_dir, key)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return Precision(*choice[0])
