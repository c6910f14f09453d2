"""Schedules, the epsilon <-> velocity maths, and the ensemble rule.

Time convention, stated once:
  * Flow matching (rectified flow): x_t = (1 - t) x0 + t eps, t in [0, 1], t = 1 is pure noise.
    The target is the velocity v = eps - x0; sampling integrates dx/dt = v from t = 1 to 0.
  * DDPM: integer steps s = 0..T-1 (T = 1000), x_s = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps,
    s = T-1 is the noisiest. Networks may be queried at fractional s (see `DDPM.step_at`).
Every expert, whatever its objective, is turned into a flow velocity at flow time t by
`velocity`, so heterogeneous experts mix in one sampler with no retraining.
"""
import math

import torch


def expand(a, x):
    """Per-sample (N,) values shaped to broadcast against x (N, ...)."""
    return a.reshape(-1, *([1] * (x.dim() - 1)))


def per_sample_mse(pred, target):
    return ((pred - target) ** 2).flatten(1).mean(1)


class DDPM:
    """A discrete DDPM schedule with epsilon-prediction: noising, loss, ancestral and DDIM steps."""

    def __init__(self, num_timesteps=1000, beta_schedule="linear"):
        T = num_timesteps
        if beta_schedule == "linear":      # Ho et al., scaled to T steps as in DiT / diffusers
            betas = torch.linspace(1e-4 * 1000 / T, 0.02 * 1000 / T, T, dtype=torch.float64)
        elif beta_schedule == "cosine":    # Nichol & Dhariwal: squared cosine of abar, beta capped at 0.999
            f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = torch.tensor([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)], dtype=torch.float64)
        else:
            raise ValueError(f"unknown beta schedule {beta_schedule!r} (linear or cosine)")
        self.num_timesteps, self.beta_schedule = T, beta_schedule
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        # Log signal-to-noise ratio per step, strictly decreasing: the axis on which fractional
        # steps are defined, so that step_at and alpha_bar_at are exact inverses.
        self.log_snr = torch.log(self.alphas_cumprod) - torch.log1p(-self.alphas_cumprod)

    def config(self):
        return {"num_timesteps": self.num_timesteps, "beta_schedule": self.beta_schedule}

    def alpha_bar_at(self, s):
        """abar at fractional steps s in [0, T-1]: piecewise-linear interpolation of the log-SNR."""
        s = torch.as_tensor(s, dtype=torch.float64).clamp(0, self.num_timesteps - 1)
        i = s.floor().long().clamp(max=self.num_timesteps - 2)
        w = s - i
        log_snr = (1 - w) * self.log_snr[i] + w * self.log_snr[i + 1]
        return torch.sigmoid(log_snr)

    def step_at(self, log_snr):
        """The fractional step whose interpolated log-SNR equals log_snr (clamped to the schedule's range)."""
        table = self.log_snr.flip(0)                           # increasing, for searchsorted
        log_snr = torch.as_tensor(log_snr, dtype=torch.float64).clamp(table[0], table[-1])
        j = torch.searchsorted(table, log_snr).clamp(1, self.num_timesteps - 1)
        w = (log_snr - table[j - 1]) / (table[j] - table[j - 1])
        return (self.num_timesteps - 1) - (j - 1 + w)          # back to the decreasing axis

    def add_noise(self, x0, noise, s):
        abar = expand(self.alpha_bar_at(s).to(x0.device, x0.dtype), x0)
        return abar.sqrt() * x0 + (1 - abar).sqrt() * noise

    def sample_steps(self, n, generator=None, device="cpu"):
        return torch.randint(0, self.num_timesteps, (n,), generator=generator).to(device)

    def loss(self, model, x0, s, noise, y=None):
        """Per-sample epsilon MSE; a learned-sigma model's extra channels are not supervised here."""
        eps = model(self.add_noise(x0, noise, s), s.to(x0.dtype), y)[:, : x0.shape[1]]
        return per_sample_mse(eps, noise)

    def predict_x0(self, eps, x_s, s):
        abar = expand(self.alpha_bar_at(s).to(x_s.device, x_s.dtype), x_s)
        return (x_s - (1 - abar).sqrt() * eps) / abar.sqrt()

    def ancestral_step(self, eps, x_s, s, noise):
        """One step of Ho et al.'s sampler from integer step s to s-1 (posterior variance beta-tilde)."""
        s = torch.as_tensor(s).long()
        abar, abar_prev, beta = (expand(a[s].to(x_s.device, x_s.dtype), x_s)
                                 for a in (self.alphas_cumprod, self.alphas_cumprod_prev, self.betas))
        mean = (x_s - beta / (1 - abar).sqrt() * eps) / (1 - beta).sqrt()
        var = beta * (1 - abar_prev) / (1 - abar)
        return mean + expand((s > 0).to(x_s.dtype), x_s) * var.sqrt() * noise

    def ddim_step(self, eps, x_s, s, s_prev):
        """Deterministic DDIM (eta = 0) from step s to s_prev; s_prev < 0 means the clean image."""
        x0 = self.predict_x0(eps, x_s, s)
        s_prev = torch.as_tensor(s_prev, dtype=torch.float64)
        abar_prev = torch.where(s_prev < 0, torch.ones_like(s_prev), self.alpha_bar_at(s_prev.clamp(min=0)))
        abar_prev = expand(abar_prev.to(x_s.device, x_s.dtype).expand(x_s.shape[0]), x_s)
        return abar_prev.sqrt() * x0 + (1 - abar_prev).sqrt() * eps


class RectifiedFlow:
    """Rectified flow: straight paths from data (t=0) to noise (t=1), velocity target, Euler sampler."""

    def __init__(self, t_sampling="uniform"):
        if t_sampling not in ("uniform", "logit-normal"):
            raise ValueError(f"unknown t sampling {t_sampling!r} (uniform or logit-normal)")
        self.t_sampling = t_sampling

    def config(self):
        return {"t_sampling": self.t_sampling}

    @staticmethod
    def add_noise(x0, noise, t):
        t = expand(t, x0)
        return (1 - t) * x0 + t * noise

    @staticmethod
    def target(x0, noise):
        return noise - x0

    def sample_t(self, n, generator=None, device="cpu"):
        if self.t_sampling == "uniform":
            t = torch.rand(n, generator=generator)
        else:   # SD3's logit-normal(0, 1): more samples at mid noise, where the velocity is hardest
            t = torch.sigmoid(torch.randn(n, generator=generator))
        return t.to(device)

    def loss(self, model, x0, t, noise, y=None):
        v = model(self.add_noise(x0, noise, t), t.to(x0.dtype), y)
        return per_sample_mse(v, self.target(x0, noise))

    @staticmethod
    def euler_step(v, x, t, t_next):
        return x + (t_next - t) * v


def velocity(expert, x_t, t, y=None):
    """Any expert's prediction as a rectified-flow velocity at flow time t (a float or (N,) tensor).

    An expert is a callable expert(x, t_native, y) with `.objective` in {'fm', 'ddpm'}; a
    DDPM expert also carries `.schedule` (a DDPM). For a DDPM epsilon-expert the match is
    exact in signal-to-noise ratio: the flow state x_t has SNR (1-t)^2 / t^2 and scale
    c = sqrt((1-t)^2 + t^2); x_t / c is a DDPM state with abar = (1-t)^2 / c^2, reached at the
    fractional step whose interpolated log-SNR equals 2 log((1-t)/t). Then
    x0_hat = (x_t - t eps_hat) / (1-t) and v = eps_hat - x0_hat = (eps_hat - x_t) / (1-t).

    The ends, where the schedule stops:
      * t below the schedule's cleanest level (SNR above step 0's): queried at step 0; the
        formula divides by 1-t ~ 1 there, so it stays stable.
      * t above its noisiest level (SNR below step T-1's, and t = 1 itself): 1/(1-t) would
        amplify eps_hat's error without bound, so x0 is estimated at step T-1 instead and
        clipped to the data range [-1, 1], and v = (x_t - x0_hat) / t, the same identity
        written with a division by t ~ 1. At t = 1 the optimal velocity is x_t - E[x0], and
        the noisiest step's x0 estimate is exactly a data mean.
    """
    t = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device).expand(x_t.shape[0])
    if expert.objective == "fm":
        return expert(x_t, t, y)
    if expert.objective != "ddpm":
        raise ValueError(f"unknown expert objective {expert.objective!r}")
    schedule = expert.schedule
    t64 = t.double().cpu()
    log_snr = 2 * (torch.log1p(-t64.clamp(max=1 - 1e-12)) - torch.log(t64.clamp(min=1e-12)))
    s = schedule.step_at(log_snr)
    scale = torch.sqrt((1 - t64) ** 2 + t64 ** 2)
    inv_c = expand((1 / scale).to(x_t), x_t)
    eps = expert(x_t * inv_c, s.to(x_t), y)[:, : x_t.shape[1]]
    v_inside = (eps - x_t) / expand(1 - t, x_t)
    beyond = expand((log_snr < schedule.log_snr[-1]).to(x_t.device), x_t)
    if not beyond.any():
        return v_inside
    x0 = schedule.predict_x0(eps, x_t * inv_c, s).clamp(-1, 1)
    v_beyond = (x_t - x0) / expand(t, x_t)
    return torch.where(beyond, v_beyond, v_inside)


def parse_routing(spec):
    """'top1', 'top2', 'topk:K', 'full', 'threshold:TAU' or 'oracle:K' to (rule, parameter)."""
    name, _, arg = spec.partition(":")
    try:
        if name in ("top1", "top2") and not arg:
            return "topk", int(name[3:])
        if name == "full" and not arg:
            return "full", None
        if name == "topk" and int(arg) >= 1:
            return "topk", int(arg)
        if name == "threshold" and 0 <= float(arg) < 1:
            return "threshold", float(arg)
        if name == "oracle" and int(arg) >= 0:
            return "oracle", int(arg)
    except ValueError:
        pass
    raise ValueError(f"unknown routing {spec!r}: use top1, top2, topk:K, full, threshold:TAU (0<=TAU<1) or oracle:K")


def routing_weights(probs, rule, param=None, available=None):
    """Mixture weights (N, K) from router probabilities (N, K); each row sums to 1 over the experts used.

    rule: 'full' (all experts, the exact decomposition), 'topk' (the `param` most probable,
    renormalised), 'threshold' (drop weights below `param`, renormalise; the most probable
    expert is always kept), 'oracle' (all weight on expert `param`). `available` (K,) bool
    marks the experts present: the others get no weight and the rest are renormalised, so
    a lost expert degrades the ensemble instead of breaking it.
    """
    K = probs.shape[1]
    if available is None:
        available = torch.ones(K, dtype=torch.bool, device=probs.device)
    if rule == "oracle":
        if not 0 <= param < K or not available[param]:
            raise ValueError(f"oracle expert {param} is not available")
        return torch.nn.functional.one_hot(torch.full((probs.shape[0],), param, device=probs.device), K).to(probs)
    p = probs * available.to(probs)
    if rule == "topk":
        if param > int(available.sum()):
            raise ValueError(f"top-{param} needs {param} experts but only {int(available.sum())} are available")
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(1, p.topk(param, dim=1).indices, True)
    elif rule == "threshold":
        keep = (p >= param) | (p == p.max(dim=1, keepdim=True).values)
    elif rule == "full":
        keep = available.expand_as(p)
    else:
        raise ValueError(f"unknown routing rule {rule!r}")
    p = p * keep
    return p / p.sum(dim=1, keepdim=True)


def mix(weights, expert_fn, x, *args):
    """sum_k weights[:, k] * expert_fn(k, x, *args), running each expert only on the samples it has weight for.

    Expert k runs once, on the sub-batch gathered by its non-zero weights; top-1 routing over
    K experts thus costs one expert's work per sample, not K.
    """
    out = torch.zeros_like(x)
    for k in torch.nonzero(weights.sum(0) > 0).flatten().tolist():
        idx = torch.nonzero(weights[:, k] > 0).flatten()
        sub = [a[idx] if torch.is_tensor(a) and a.dim() > 0 else a for a in args]
        out.index_add_(0, idx, expand(weights[idx, k], x) * expert_fn(k, x[idx], *sub))
    return out


@torch.no_grad()
def sample_flow(velocity_fn, noise, steps, progress=None):
    """Euler integration of dx/dt = velocity_fn(x, t) from t = 1 (noise) to t = 0 on a uniform grid."""
    ts = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    x = noise
    for i in range(steps):
        x = RectifiedFlow.euler_step(velocity_fn(x, ts[i].item()), x, ts[i].item(), ts[i + 1].item())
        if progress is not None:
            progress.update(1)
    return x
