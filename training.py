"""What every trained network here shares, expert or distilled student: the network, its EMA,
AdamW, gradient clipping and the step counter. The stages add what they learn and from what."""
import copy

import torch


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
