"""training/: what every trained network here shares, expert or distilled student
(train_expert.py, distill.py; train_router.py uses the plan). This module holds the step
itself: the network, its EMA, AdamW, gradient clipping and the step counter, and the
learning-rate schedule. Beside it:

  log.py         the loss log per fifth of the noise range, and the preview grid
  precision.py   what a step costs: its FLOPs, and the precision it runs in (fp32, or bf16
                 where this machine runs it faster)
  plan.py        a training stage's frozen command line, its checkpoint record and the
                 check that a run may resume a checkpoint
  warm_start.py  where a network starts when it does not start from scratch (--init)

The process layout under torchrun is the core's (plumbing/distributed.py): sampling
splits over processes too."""
import copy

import torch

from plumbing.checkpoint import CheckpointError, fit_state
from plumbing.command_line import first_line


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

    def load_state(self, ckpt, source):
        """Weights, EMA, optimizer and step of a checkpoint written from state(), then what
        a subclass keeps beside them (load_own_state). One that does not fit this run,
        edited or damaged, is refused in one line naming `source`, before a step is
        taken."""
        try:
            fit_state(self.model, ckpt["model"], "its weights")
            fit_state(self.ema, ckpt["ema"], "its EMA weights")
            fit_optimizer(self.opt, ckpt["opt"])
            self.step = ckpt["step"]
            self.load_own_state(ckpt)
        except CheckpointError as e:
            raise CheckpointError(f"cannot resume {source}: {e}")
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot resume {source}: {first_line(e)}")

    def load_own_state(self, ckpt):
        """A subclass's own state beside the step (its random streams, its FLOP count)."""


def fit_optimizer(opt, state):
    """AdamW's state loaded, and each moment the shape of its parameter: load_state_dict
    checks only the number of parameters, and a moment of another shape would fail at
    the first step."""
    opt.load_state_dict(state)
    for group in opt.param_groups:
        for param in group["params"]:
            for key, value in opt.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() and value.shape != param.shape:
                    raise CheckpointError(
                        f"its optimizer's {key} is {tuple(value.shape)} for a parameter of "
                        f"{tuple(param.shape)}")



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
