"""What a training run shows while it runs: the loss per fifth of the noise range in the
run's log file (minRF's view of a flow's training), and a grid of the EMA network's
samples."""
import json
import math
import time

import torch
import torch.distributed as dist

from diffusion import T_BINS, sample_flow, t_bin
from plumbing.command_line import UsageError
from plumbing.run_dir import save_grid, trim_log


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
