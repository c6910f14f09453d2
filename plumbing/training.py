"""What every trained network here shares, expert or distilled student: the network,
its EMA, AdamW, gradient clipping and the step counter, the learning-rate schedule, and
the process layout under torchrun. The stages add what they learn and from what."""
import copy
import json
import math
import os
import time

import torch
import torch.distributed as dist

from diffusion import T_BINS, sample_flow, t_bin
from .command_line import UsageError
from .run_dir import save_grid, trim_log


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
