"""The two training objectives behind one interface, the epsilon -> velocity reading, and
the flow sampler.

Time convention, stated once:
  * Flow matching (rectified flow): x_t = (1 - t) x0 + t eps, t in [0, 1], t = 1 is pure noise.
    The target is the velocity v = eps - x0; sampling integrates dx/dt = v from t = 1 to 0.
  * DDPM: integer steps s = 0..T-1 (T = 1000), x_s = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps,
    s = T-1 is the noisiest. Networks may be queried at fractional s (see `DDPM.step_at`).

An objective (`RectifiedFlow` or `DDPM`) is all a stage needs to know about how a
network was trained: `sample_time` draws training times in its own units, `loss` is the
per-sample loss, `unit_time` maps its times to [0, 1] (noise level, for logging),
`velocity` reads a network trained under it as a rectified-flow velocity at flow time
t, and `spec` / `objective_from_spec` write it into and rebuild it from a checkpoint.
So heterogeneous experts mix in one sampler with no retraining, and no stage asks which
objective it holds. Read in this order: the flow, then DDPM and its reading as a flow,
then the sampler."""
import math

import torch

# losses, router accuracy and expert usage are reported per fifth of the noise range, as
# minRF does
T_BINS = 5
T_BIN_NAMES = [f"[{b / T_BINS:.1f},{(b + 1) / T_BINS:.1f})" for b in range(T_BINS)]


def t_bin(t_unit):
    """The bin (0..T_BINS-1) of noise levels in [0, 1] (a float or a tensor)."""
    if torch.is_tensor(t_unit):
        return (t_unit.float() * T_BINS).long().clamp(0, T_BINS - 1)
    return min(max(int(t_unit * T_BINS), 0), T_BINS - 1)


def expand(a, x):
    """Per-sample (N,) values shaped to broadcast against x (N, ...)."""
    return a.reshape(-1, *([1] * (x.dim() - 1)))


def per_sample_mse(pred, target):
    return ((pred - target) ** 2).flatten(1).mean(1)


class RectifiedFlow:
    """The rectified-flow objective: straight paths from data (t=0) to noise (t=1),
    velocity target.

    `time_map` says what the network is shown at flow time t:
      * 'linear' (every flow expert trained from scratch, and HDDM's conversion): (x_t, t); the
        network scales t by its own `t_scale` (1000 from scratch, 999 when converted from a
        DDPM DiT, so that t = 1 lands on step 999 as in HDDM).
      * 'snr' (this project's option for converted experts; not from the papers): the DDPM
        state with the same signal-to-noise ratio, (x_t / c, s(t)) of `DDPM.matched_state`,
        so a converted network starts out seeing exactly the inputs it was pretrained on, at
        every t. It still predicts the velocity directly and is fine-tuned to do so.
    """

    name = "fm"

    def __init__(self, t_sampling="uniform", time_map="linear", schedule=None, *, clip_x0=True):
        """clip_x0: the data-range switch every objective answers (see DDPM); a flow
        network's velocity needs no x0 estimate, so here it is only recorded."""
        if t_sampling not in ("uniform", "logit-normal"):
            raise ValueError(f"unknown t sampling {t_sampling!r} (uniform or logit-normal)")
        if time_map not in ("linear", "snr"):
            raise ValueError(f"unknown time map {time_map!r} (linear or snr)")
        self.t_sampling, self.time_map, self.clip_x0 = t_sampling, time_map, clip_x0
        self.schedule = (schedule or DDPM()) if time_map == "snr" else None
        # from scratch the network embeds 1000 t, the same range as DDPM steps; under the
        # SNR map it gets the step itself
        self.network_time_scale = 1000.0 if time_map == "linear" else 1.0

    def spec(self):
        spec = {"name": self.name, "t_sampling": self.t_sampling, "time_map": self.time_map}
        if self.schedule is not None:
            spec["schedule"] = self.schedule.spec()
        return spec

    @staticmethod
    def add_noise(x0, noise, t):
        t = expand(t, x0)
        return (1 - t) * x0 + t * noise

    @staticmethod
    def target(x0, noise):
        return noise - x0

    def sample_time(self, n, generator=None, device="cpu"):
        if self.t_sampling == "uniform":
            t = torch.rand(n, generator=generator)
        else:   # SD3's logit-normal(0, 1): more samples at mid noise, where the velocity is hardest
            t = torch.sigmoid(torch.randn(n, generator=generator))
        return t.to(device)

    def unit_time(self, t):
        return t.float()

    def network_input(self, x_t, t):
        if self.schedule is None:
            return x_t, t
        x_s, s, _ = self.schedule.matched_state(x_t, t)
        return x_s, s

    def loss(self, net, x0, t, noise, y=None):
        v = net(*self.network_input(self.add_noise(x0, noise, t), t.to(x0.dtype)), y)
        return per_sample_mse(v, self.target(x0, noise))

    def velocity(self, net, x_t, t, y=None):
        t = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device).expand(x_t.shape[0])
        return net(*self.network_input(x_t, t), y)

    @staticmethod
    def euler_step(v, x, t, t_next):
        return x + (t_next - t) * v

    @staticmethod
    def multistep(v, x, t, t_next, previous=None):
        """One step of the second-order Adams-Bashforth method on the velocity, from t to
        t_next: (x at t_next, what the next step needs). The velocity is extrapolated
        linearly in t through this step's v and the last step's (`previous`: (v, its step)),
        with the variable-step weights, so each step costs one network evaluation and the
        error falls with the square of the step; the first step, with no last one, is
        Euler's."""
        h = t_next - t
        if previous is None:
            return x + h * v, (v, h)
        v_last, h_last = previous
        return x + h * ((1 + h / (2 * h_last)) * v - h / (2 * h_last) * v_last), (v, h)


def flow_log_snr(t):
    """log SNR of the flow state x_t = (1-t) x0 + t eps, in float64: 2 log((1-t)/t),
    finite at both ends."""
    t64 = torch.as_tensor(t, dtype=torch.float64).cpu()
    return 2 * (torch.log1p(-t64.clamp(max=1 - 1e-12)) - torch.log(t64.clamp(min=1e-12)))


class DDPM:
    """The DDPM objective: a discrete schedule, epsilon-prediction, its loss, and its
    exact reading as a flow."""

    name = "ddpm"
    network_time_scale = 1.0   # the network embeds the step s itself, as every official DiT does

    def __init__(self, num_timesteps=1000, beta_schedule="linear", *, clip_x0=True):
        """clip_x0: pixels lie in [-1, 1], so an x0 estimate outside is known to be
        wrong and is clipped; VAE latents have no such bound."""
        T = num_timesteps
        if beta_schedule == "linear":      # Ho et al., scaled to T steps as in DiT / diffusers
            betas = torch.linspace(1e-4 * 1000 / T, 0.02 * 1000 / T, T, dtype=torch.float64)
        # Nichol & Dhariwal: squared cosine of abar, beta capped at 0.999
        elif beta_schedule == "cosine":
            f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = torch.tensor([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)],
                                 dtype=torch.float64)
        else:
            raise ValueError(f"unknown beta schedule {beta_schedule!r} (linear or cosine)")
        self.num_timesteps, self.beta_schedule, self.clip_x0 = T, beta_schedule, clip_x0
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        one = torch.ones(1, dtype=torch.float64)
        self.alphas_cumprod_prev = torch.cat([one, self.alphas_cumprod[:-1]])
        # Log signal-to-noise ratio per step, strictly decreasing: the axis on which
        # fractional steps are defined, so that step_at and alpha_bar_at are exact
        # inverses.
        self.log_snr = torch.log(self.alphas_cumprod) - torch.log1p(-self.alphas_cumprod)

    def spec(self):
        return {"name": self.name, "num_timesteps": self.num_timesteps,
                "beta_schedule": self.beta_schedule}

    def alpha_bar_at(self, s):
        """abar at fractional steps s in [0, T-1]: piecewise-linear interpolation of
        the log-SNR."""
        s = torch.as_tensor(s, dtype=torch.float64).clamp(0, self.num_timesteps - 1)
        i = s.floor().long().clamp(max=self.num_timesteps - 2)
        w = s - i
        log_snr = (1 - w) * self.log_snr[i] + w * self.log_snr[i + 1]
        return torch.sigmoid(log_snr)

    def step_at(self, log_snr):
        """The fractional step whose interpolated log-SNR equals log_snr (clamped to
        the schedule's range)."""
        table = self.log_snr.flip(0)                           # increasing, for searchsorted
        log_snr = torch.as_tensor(log_snr, dtype=torch.float64).clamp(table[0], table[-1])
        j = torch.searchsorted(table, log_snr).clamp(1, self.num_timesteps - 1)
        w = (log_snr - table[j - 1]) / (table[j] - table[j - 1])
        return (self.num_timesteps - 1) - (j - 1 + w)          # back to the decreasing axis

    def add_noise(self, x0, noise, s):
        abar = expand(self.alpha_bar_at(s).to(x0.device, x0.dtype), x0)
        return abar.sqrt() * x0 + (1 - abar).sqrt() * noise

    def sample_time(self, n, generator=None, device="cpu"):
        """Training steps, uniform over 0..T-1 (Ho et al.)."""
        return torch.randint(0, self.num_timesteps, (n,), generator=generator).to(device)

    def unit_time(self, s):
        return s.float() / self.num_timesteps

    def loss(self, net, x0, s, noise, y=None):
        """Per-sample epsilon MSE; a learned-sigma network's extra channels are not
        supervised here."""
        eps = net(self.add_noise(x0, noise, s), s.to(x0.dtype), y)[:, : x0.shape[1]]
        return per_sample_mse(eps, noise)

    def matched_state(self, x_t, t):
        """The DDPM state and fractional step with the flow state's signal-to-noise ratio:
        (x_t / c, s, log SNR).

        x_t has SNR (1-t)^2 / t^2 and scale c = sqrt((1-t)^2 + t^2); x_t / c is a DDPM
        state with abar = (1-t)^2 / c^2, reached at the fractional step whose
        interpolated log-SNR equals 2 log((1-t)/t) (clamped to the schedule's range at
        the ends)."""
        t64 = torch.as_tensor(t, dtype=torch.float64).cpu().expand(x_t.shape[0])
        log_snr = flow_log_snr(t64)
        inv_c = expand((1 / torch.sqrt((1 - t64) ** 2 + t64 ** 2)).to(x_t), x_t)
        return x_t * inv_c, self.step_at(log_snr).to(x_t), log_snr

    def velocity(self, net, x_t, t, y=None):
        """The epsilon-network as a rectified-flow velocity at flow time t (a float or
        (N,) tensor), by exact SNR match.

        At the matched state, x0_hat = (x_t - t eps_hat) / (1-t) and
        v = eps_hat - x0_hat = (eps_hat - x_t) / (1-t).

        The ends, where the schedule stops:
          * t below the schedule's cleanest level (SNR above step 0's): queried at step 0; the
            formula divides by 1-t ~ 1 there, so it stays stable.
          * t above its noisiest level (SNR below step T-1's, and t = 1 itself): 1/(1-t) would
            amplify eps_hat's error without bound, so x0 is estimated at step T-1 instead (and
            clipped to the data range [-1, 1] for pixels; latents are unbounded), and v = (x_t -
            x0_hat) / t, the same identity
            written with a division by t ~ 1. At t = 1 the optimal velocity is x_t - E[x0], and
            the noisiest step's x0 estimate is exactly a data mean.
        """
        t = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device).expand(x_t.shape[0])
        x_s, s, log_snr = self.matched_state(x_t, t)
        eps = net(x_s, s, y)[:, : x_t.shape[1]]
        v_inside = (eps - x_t) / expand(1 - t, x_t)
        beyond = expand((log_snr < self.log_snr[-1]).to(x_t.device), x_t)
        if not beyond.any():
            return v_inside
        x0 = self.predict_x0(eps, x_s, s)
        if self.clip_x0:
            x0 = x0.clamp(-1, 1)
        return torch.where(beyond, (x_t - x0) / expand(t, x_t), v_inside)

    def predict_x0(self, eps, x_s, s):
        abar = expand(self.alpha_bar_at(s).to(x_s.device, x_s.dtype), x_s)
        return (x_s - (1 - abar).sqrt() * eps) / abar.sqrt()


def objective_from_flags(name, *, t_sampling="uniform", time_map="linear", beta_schedule="linear",
                         clip_x0=True):
    """The objective a training command asks for ('fm' or 'ddpm'); each takes the
    options that concern it."""
    if name == "fm":
        schedule = DDPM(beta_schedule=beta_schedule) if time_map == "snr" else None
        return RectifiedFlow(t_sampling, time_map, schedule, clip_x0=clip_x0)
    if name == "ddpm":
        return DDPM(beta_schedule=beta_schedule, clip_x0=clip_x0)
    raise ValueError(f"unknown objective {name!r} (fm or ddpm)")


def objective_from_spec(spec, clip_x0=True):
    """Rebuild the objective a checkpoint was trained with from its `spec()` (clip_x0:
    False for a network of VAE latents)."""
    spec = dict(spec)
    name = spec.pop("name", None)
    if name == "ddpm":
        return DDPM(**spec, clip_x0=clip_x0)
    if name == "fm":
        schedule = spec.pop("schedule", None)
        if schedule:
            schedule = DDPM(**{k: v for k, v in schedule.items() if k != "name"})
        return RectifiedFlow(**spec, schedule=schedule, clip_x0=clip_x0)
    raise ValueError(f"unknown objective {name!r}")


SOLVERS = {"euler": 1, "heun": 2, "ab2": 1}   # network evaluations per step


# What a sampler may be asked for: the time grid holds steps + 1 floats and the loop runs
# them all (DDPM's 1000 steps and a Heun reference of 1024 are far inside); past a shift of
# 1e3 either way the grid puts all but one step at one end, and a shift near 0 makes its
# first point overflow. sample.py's flags and a release's pipeline take these bounds.
MAX_STEPS = 100_000
MAX_SHIFT = 1e3


@torch.no_grad()
def time_grid(steps, shift=1.0):
    """steps + 1 times from 1 (noise) to 0: uniform, or warped by SD3's shift t = s*u / (1 + (s -
    1)*u).

    shift > 1 spends more of the steps near the noise end, shift < 1 near the data end;
    the end points stay at 1 and 0 for every shift."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"the number of steps must be a whole number in 1..{MAX_STEPS}, not {steps}")
    if not 1 / MAX_SHIFT <= shift <= MAX_SHIFT:   # False for NaN too
        raise ValueError(f"the time shift must be within 1/{MAX_SHIFT:g} and {MAX_SHIFT:g}, "
                         f"not {shift}")
    u = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u)).tolist()


def sample_flow(velocity_fn, noise, steps, *, solver="euler", time_shift=1.0, progress=None):
    """Integrate dx/dt = velocity_fn(x, t) from t = 1 (noise) to t = 0 in `steps` steps on
    time_grid(steps, time_shift).

    euler: first order, one evaluation per step (DDM samples with 50). heun: the
    explicit trapezoidal rule (EDM's and k-diffusion's second-order step), two
    evaluations per step. ab2: second-order Adams-Bashforth (RectifiedFlow.multistep), one
    evaluation per step, the last step's velocity reused. Every evaluation is at the point
    where the velocity is wanted, so routing stays exact at each."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r} ({' or '.join(SOLVERS)})")
    ts = time_grid(steps, time_shift)
    x, previous = noise, None
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = velocity_fn(x, t)
        if solver == "heun":
            v = (v + velocity_fn(RectifiedFlow.euler_step(v, x, t, t_next), t_next)) / 2
        if solver == "ab2":
            x, previous = RectifiedFlow.multistep(v, x, t, t_next, previous)
        else:
            x = RectifiedFlow.euler_step(v, x, t, t_next)
        if progress is not None:
            progress.update(1)
    return x
