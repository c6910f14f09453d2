"""What every trained network here shares, expert or distilled student: the network,
its EMA, AdamW, gradient clipping and the step counter, the learning-rate schedule, the
process layout under torchrun, and what a step costs: its FLOPs and the precision it
runs in (`step_cost`). The stages add what they learn and from what."""
import contextlib
import copy
import json
import math
import os
import platform
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from diffusion import T_BINS, sample_flow, t_bin
from model import count_flops
from .command_line import UsageError
from .run_dir import atomic_json, save_grid, trim_log


class Training:
    """A network under training, its exponential moving average and its optimizer."""

    def __init__(self, model, *, lr, weight_decay, ema_decay, grad_clip):
        self.model = model
        self.ema = copy.deepcopy(model).requires_grad_(False).eval()
        # fused: the default CPU AdamW loops over parameters in Python, which shows on
        # tiny networks' steps
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr,
                                     weight_decay=weight_decay, fused=True)
        self.ema_decay, self.grad_clip = ema_decay, grad_clip
        self.step = 0

    def apply(self, loss, lr=None):
        """One optimizer step on the mean of a per-sample loss (B,), at learning rate
        `lr` if given, then the EMA."""
        self.opt.zero_grad(set_to_none=True)
        loss.mean().backward()
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        with torch.no_grad():   # one kernel launch for all parameters, not one per tensor
            torch._foreach_lerp_(list(self.ema.parameters()), list(self.model.parameters()),
                                 1 - self.ema_decay)

    def state(self):
        return {"model": self.model.state_dict(), "ema": self.ema.state_dict(),
                "opt": self.opt.state_dict(),
                "step": self.step}

    def load_state(self, ckpt):
        """Weights, EMA, optimizer and step of a checkpoint written from state()."""
        self.model.load_state_dict(ckpt["model"])
        self.ema.load_state_dict(ckpt["ema"])
        self.opt.load_state_dict(ckpt["opt"])
        self.step = ckpt["step"]


class LossLog:
    """The loss per fifth of the noise range since the last log line, as minRF logs it, in
    the log file at `path` (rank 0's; None on the others), which a resumed run first trims
    to the checkpoint's step."""

    def __init__(self, path, device, step):
        self.file = None
        if path is not None:
            trim_log(path, step)
            self.file = open(path, "a")
        self.loss, self.count = torch.zeros(T_BINS, device=device), torch.zeros(T_BINS, device=device)
        # one reduction per batch: cheap beside the step, read only when the loss goes bad
        self.bad_inputs = torch.zeros((), dtype=torch.bool, device=device)
        self.since = (step, time.time())

    def add(self, x0, loss, t_unit):
        self.bad_inputs |= ~torch.isfinite(x0).all()
        which = t_bin(t_unit)
        self.loss.index_add_(0, which, loss)
        self.count.index_add_(0, which, torch.ones_like(loss))

    def close(self):
        if self.file is not None:
            self.file.close()

    def write(self, bar, trainer, batch_size, ckpt_path, **extra):
        """Log the steps since the last line (all ranks reduce; rank 0, which holds the
        log file, writes); a non-finite loss stops the run."""
        if dist.is_initialized():
            dist.all_reduce(self.loss)
            dist.all_reduce(self.count)
        mean = (self.loss.sum() / self.count.sum()).item()
        if not math.isfinite(mean):
            cause = ("the training images themselves hold NaN or inf (with --vae: the "
                     "VAE or its latent cache in RUN_DIR/latents/ is broken; remove the "
                     "cache to re-encode, or check the VAE's "
                     "weights)" if self.bad_inputs.item()
                     else "lower --lr or use --grad-clip")
            raise UsageError(f"non-finite loss at step {trainer.step}; stopped. The last "
                             f"good checkpoint ({ckpt_path}) is intact: {cause}")
        first, then = self.since
        images_per_s = (trainer.step - first) * batch_size / (time.time() - then)
        if self.file is not None:
            bar.set_postfix(loss=f"{mean:.4f}", img_s=f"{images_per_s:.0f}")
            line = {"step": trainer.step, "loss": mean,
                    "loss_per_t_bin": (self.loss / self.count.clamp(min=1)).tolist(),
                    "images_per_s": images_per_s, "lr": trainer.opt.param_groups[0]["lr"],
                    "flops": trainer.flops, **extra}
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        self.loss.zero_()
        self.count.zero_()
        self.since = (trainer.step, time.time())



@torch.no_grad()
def preview(ema, objective, condition, ids, dataset, path, generator=None):
    """A grid of the EMA network's samples, 25 Euler steps, 8 per row, for the
    condition ids `ids`; a network of VAE latents is decoded to pixels."""
    device = next(ema.parameters()).device
    # never the training generator: a preview must not change training
    g = generator or torch.Generator().manual_seed(1234)
    shape = (len(ids), dataset.channels, dataset.image_size, dataset.image_size)
    noise = torch.randn(shape, generator=g).to(device)
    y = condition.expert_input(ids.to(device))
    x = sample_flow(lambda x, t: objective.velocity(ema, x, t, y), noise, 25)
    if getattr(dataset, "autoencoder", None) is not None:
        x = dataset.autoencoder.decode(x, dataset.images_set.channels)
    save_grid(x.float().cpu(), path, nrow=8)


def decay_start(steps, decay_share):
    """The step at which wsd's decay begins: the last (decay_share x steps) updates
    decay, rounded to whole steps."""
    return steps - round(decay_share * steps)


def learning_rate(update, lr, schedule, steps, decay_share):
    """The learning rate of optimizer update number `update` (0-based) of a run of `steps`
    updates.

    constant: lr throughout. wsd (warmup-stable-decay, here with no warmup; Hägele et al. 2024 found
    its ~20 % cooldown level with cosine): lr until decay_start, then linearly down to lr / (decay
    length) at the last update. Unlike cosine, every update before the decay is the same whatever
    --steps is, so a longer run continues a shorter one from the checkpoint written where its decay
    began (stable.pt), and only the decay is paid twice."""
    start = decay_start(steps, decay_share)
    if schedule == "constant" or update < start:
        return lr
    return lr * (steps - update) / (steps - start)


def setup_distributed():
    """(rank, world size, device): torchrun sets RANK/WORLD_SIZE; a plain run is rank 0
    of 1. TF32 matmuls on a GPU that has them, as DiT trains."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return rank, world, torch.device("cuda")
    return rank, world, torch.device("cpu")


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


def autocast(device, precision):
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
    step(autocast(device, precision))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(autocast(device, precision))
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
    if key not in cache:
        cache[key] = measure(step, device)
        atomic_json(cache, path)
    seconds = cache[key]
    precision = "bf16" if seconds["fp32"] >= SPEED_UP_NEEDED * seconds["bf16"] else "fp32"
    return Precision(precision, {
        "requested": "auto", "seconds_per_step": seconds,
        "reason": f"measured on this CPU: fp32 {seconds['fp32'] * 1e3:.1f} ms, bf16 "
                  f"{seconds['bf16'] * 1e3:.1f} ms per forward + backward"})


def choose_on_every_rank(requested, step, device, cache_dir, key):
    """`choose` on rank 0 of a torchrun job, its answer broadcast, so every rank runs
    alike."""
    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice[0] = choose(requested, step, device, cache_dir, key)
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return Precision(*choice[0])
