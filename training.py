"""What every trained network here shares, expert or distilled student: the network, its EMA,
AdamW, gradient clipping and the step counter, the learning-rate schedule, and the process layout
under torchrun. The stages add what they learn and from what."""
import copy
import os

import torch
import torch.distributed as dist


class Training:
    """A network under training, its exponential moving average and its optimizer."""

    def __init__(self, model, *, lr, weight_decay, ema_decay, grad_clip):
        self.model = model
        self.ema = copy.deepcopy(model).requires_grad_(False).eval()
        # fused: the default CPU AdamW loops over parameters in Python, which shows on tiny
        # networks' steps
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr,
                                     weight_decay=weight_decay, fused=True)
        self.ema_decay, self.grad_clip = ema_decay, grad_clip
        self.step = 0

    def apply(self, loss, lr=None):
        """One optimizer step on the mean of a per-sample loss (B,), at learning rate `lr` if given,
        then the EMA."""
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


def decay_start(steps, decay_share):
    """The step at which wsd's decay begins: the last (decay_share x steps) updates decay, rounded
    to whole steps."""
    return steps - round(decay_share * steps)


def learning_rate(update, lr, schedule, steps, decay_share):
    """The learning rate of optimizer update number `update` (0-based) of a run of `steps` updates.

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
    """(rank, world size, device): torchrun sets RANK/WORLD_SIZE; a plain run is rank 0 of 1."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return rank, world, torch.device("cuda")
    return rank, world, torch.device("cpu")
