"""diffusion.py, proven on data whose optimal predictors are known in closed form: the
objectives (flow and DDPM, and the exact velocity of a DDPM expert), the schedules, and the
solvers' orders."""
import math

import pytest
import torch

from diffusion import DDPM, RectifiedFlow, expand, sample_flow, time_grid
from gmm import AnalyticExpert, mixture, mixture_flow

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("float64")]


def ancestral_step(s, eps, x_s, step, noise):
    """One step of Ho et al.'s sampler from integer step `step` to step - 1 (posterior variance
    beta-tilde): the schedule's tensors checked against their textbook use."""
    step = torch.as_tensor(step).long()
    abar, abar_prev, beta = (expand(a[step].to(x_s.device, x_s.dtype), x_s)
                             for a in (s.alphas_cumprod, s.alphas_cumprod_prev, s.betas))
    mean = (x_s - beta / (1 - abar).sqrt() * eps) / (1 - beta).sqrt()
    var = beta * (1 - abar_prev) / (1 - abar)
    return mean + expand((step > 0).to(x_s.dtype), x_s) * var.sqrt() * noise


def ddim_step(s, eps, x_s, step, s_prev):
    """Deterministic DDIM (eta = 0) from step `step` to s_prev; s_prev < 0 means the
    clean image."""
    x0 = s.predict_x0(eps, x_s, step)
    s_prev = torch.as_tensor(s_prev, dtype=torch.float64)
    abar_prev = torch.where(s_prev < 0, torch.ones_like(s_prev),
                            s.alpha_bar_at(s_prev.clamp(min=0)))
    abar_prev = expand(abar_prev.to(x_s.device, x_s.dtype).expand(x_s.shape[0]), x_s)
    return abar_prev.sqrt() * x0 + (1 - abar_prev).sqrt() * eps


def test_cluster_predictors_satisfy_tweedie():
    """E[eps | x] = -b grad log p(x | k) for x = a x0 + b eps: the closed forms are the
    true posteriors."""
    gmm = mixture()
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    a, b = torch.full((16,), 0.6), torch.full((16,), 0.8)
    for k in range(3):
        xr = x.clone().requires_grad_(True)
        mean, var = gmm.means[k] * a[:, None], a ** 2 * gmm.stds[k] ** 2 + b ** 2
        logp = (-0.5 * ((xr - mean) ** 2).sum(1) / var).sum()
        (grad,) = torch.autograd.grad(logp, xr)
        torch.testing.assert_close(gmm.cluster_eps(x, a, b, k), -b[:, None] * grad,
                                   rtol=1e-10, atol=1e-10)
        # x = a E[x0] + b E[eps]: the two conditional means are consistent
        torch.testing.assert_close(a[:, None] * gmm.cluster_x0(x, a, b, k)
                                   + b[:, None] * gmm.cluster_eps(x, a, b, k), x)


@pytest.mark.parametrize("beta_schedule", ["linear", "cosine"])
def test_ddpm_expert_as_velocity_matches_flow_velocity(beta_schedule):
    """velocity() of the analytic epsilon-expert is the analytic flow velocity: the SNR
    match is exact."""
    gmm = mixture()
    schedule = DDPM(beta_schedule=beta_schedule)
    t = torch.linspace(0.02, 0.98, 49)
    x = torch.randn(49, 3, generator=torch.Generator().manual_seed(1)) * 1.5
    for k in range(3):
        eps_expert = AnalyticExpert(gmm, k, "ddpm", schedule)
        v = eps_expert.velocity(x[:, :, None, None], t).flatten(1)
        torch.testing.assert_close(v, gmm.cluster_velocity(x, t, k), rtol=1e-5, atol=1e-5)


def test_same_index_approximation_is_not_what_velocity_does():
    """Guard: querying the DDPM network at step 999*t (no SNR match) is far off;
    DDPM.velocity is not."""
    gmm, schedule = mixture(), DDPM()
    eps_expert = AnalyticExpert(gmm, 0, "ddpm", schedule)
    t = torch.full((8,), 0.5)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
    naive = (eps_expert(x[:, :, None, None], 999 * t).flatten(1) - x) / 0.5
    assert (naive - gmm.cluster_velocity(x, t, 0)).abs().max() > 0.1


def test_velocity_endpoints_are_finite_and_sensible():
    gmm, schedule = mixture(), DDPM()
    expert = AnalyticExpert(gmm, 0, "ddpm", schedule)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    for t in (0.0, 0.001, 0.995, 0.9999, 1.0):
        v = expert.velocity(x[:, :, None, None], t).flatten(1)
        assert torch.isfinite(v).all()
    # at t = 1 the optimal velocity is x_t - E[x0]; the estimate is clipped to [-1, 1]
    v1 = expert.velocity(x[:, :, None, None], 1.0).flatten(1)
    torch.testing.assert_close(v1, x - gmm.means[0].clamp(-1, 1), atol=2e-2, rtol=0)


def test_linear_schedule_closed_form():
    s = DDPM(beta_schedule="linear")
    i = torch.arange(1000, dtype=torch.float64)
    torch.testing.assert_close(s.betas, 1e-4 + i * (0.02 - 1e-4) / 999)
    torch.testing.assert_close(s.alphas_cumprod, torch.cumprod(1 - s.betas, 0))
    assert abs(s.alphas_cumprod[-1].item() - 4.0358e-5) < 1e-8


def test_cosine_schedule_closed_form():
    s = DDPM(beta_schedule="cosine")
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
    for i in (0, 1, 500, 998):
        assert abs(s.betas[i].item() - (1 - f((i + 1) / 1000) / f(i / 1000))) < 1e-12
        # the product telescopes
        assert abs(s.alphas_cumprod[i].item() - f((i + 1) / 1000) / f(0)) < 1e-9
    assert s.betas[-1].item() == 0.999


def test_fractional_steps_invert_exactly():
    s = DDPM()
    steps = torch.tensor([0.0, 0.25, 17.5, 500.0, 998.9, 999.0])
    back = s.step_at(torch.log(s.alpha_bar_at(steps)) - torch.log1p(-s.alpha_bar_at(steps)))
    torch.testing.assert_close(back, steps, rtol=0, atol=1e-8)
    torch.testing.assert_close(s.alpha_bar_at(torch.arange(1000.0)), s.alphas_cumprod)


def test_ddim_and_ancestral_steps_with_known_x0():
    s, g = DDPM(), torch.Generator().manual_seed(6)
    x0, eps = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    step = torch.full((4,), 600)
    x = s.add_noise(x0, eps, step)
    torch.testing.assert_close(ddim_step(s, eps, x, step, 300),
                               s.add_noise(x0, eps, torch.full((4,), 300)))
    torch.testing.assert_close(ddim_step(s, eps, x, step, -1), x0)
    # the ancestral mean is the Gaussian posterior mean of q(x_{s-1} | x_s, x0)
    ab, abp, beta = s.alphas_cumprod[600], s.alphas_cumprod[599], s.betas[600]
    posterior_mean = abp.sqrt() * beta / (1 - ab) * x0 + (1 - beta).sqrt() * (1 - abp) / (
        1 - ab) * x
    torch.testing.assert_close(ancestral_step(s, eps, x, step, torch.zeros_like(x)),
                               posterior_mean)


def test_rectified_flow_path_and_loss_on_the_optimal_predictor_is_its_variance():
    rf = RectifiedFlow()
    x0, eps = torch.randn(3, 2), torch.randn(3, 2)
    t = torch.tensor([0.0, 0.5, 1.0])
    xt = rf.add_noise(x0, eps, t)
    torch.testing.assert_close(xt[0], x0[0]); torch.testing.assert_close(xt[2], eps[2])
    # moving along v reaches the noise
    torch.testing.assert_close(xt[1] + 0.5 * rf.target(x0, eps)[1], eps[1])
    ts = RectifiedFlow("logit-normal").sample_time(10000, torch.Generator().manual_seed(0))
    assert 0 < ts.min() and ts.max() < 1 and abs(ts.median() - 0.5) < 0.02


def test_heun_is_second_order_and_euler_first_on_the_mixture_flow():
    """Halving the step divides the global error at t = 0 by about 2 for Euler and about
    4 for Heun and for the second-order Adams-Bashforth multistep (one evaluation per step)."""
    flow = mixture_flow
    z = torch.randn(256, 2, generator=torch.Generator().manual_seed(10))
    exact = sample_flow(flow, z, 1024, solver="heun")
    for solver, low, high in (("euler", 1.7, 2.3), ("heun", 3.3, 4.7), ("ab2", 3.3, 4.7)):
        errors = [(sample_flow(flow, z, steps, solver=solver)
                   - exact).norm(dim=1).mean().item() for steps in (16, 32, 64)]
        ratios = [errors[0] / errors[1], errors[1] / errors[2]]
        assert all(low < r < high for r in ratios), (solver, errors, ratios)


def test_shifted_time_grids_keep_the_ends_and_converge_to_the_same_flow_at_their_order():
    """SD3's shift only moves the interior times, so both solvers keep their order on a
    warped grid."""
    assert time_grid(4, 1.0) == [1.0, 0.75, 0.5, 0.25, 0.0]
    # 3 * 0.5 / (1 + 2 * 0.5)
    assert time_grid(2, 3.0) == pytest.approx([1.0, 0.75, 0.0])
    for shift in (0.5, 3.0):
        ts = time_grid(8, shift)
        assert ts[0] == 1.0 and ts[-1] == 0.0 and all(a > b for a, b in zip(ts, ts[1:]))
    assert time_grid(8, 3.0)[1] - time_grid(8, 3.0)[0] > -1 / 8 > time_grid(
        8, 0.33)[1] - time_grid(8, 0.33)[0]
    flow = mixture_flow
    z = torch.randn(256, 2, generator=torch.Generator().manual_seed(11))
    exact = sample_flow(flow, z, 1024, solver="heun")
    for solver, low, high in (("euler", 1.6, 2.4), ("heun", 3.2, 4.8)):
        errors = [(sample_flow(flow, z, steps, solver=solver, time_shift=2.0)
                   - exact).norm(dim=1).mean().item() for steps in (16, 32, 64)]
        assert all(low < errors[i] / errors[i + 1] < high for i in range(2)), (solver, errors)
    # bounded where the grid is made, for sample.py and a release's pipeline alike: a shift
    # near 0 overflows the first point, a step count past the bound is an allocation
    for steps, shift in ((4, 0.0), (4, 1e-17), (4, float("nan")), (4, 1e9), (0, 1.0),
                         (100_001, 1.0), (2.5, 1.0), (True, 1.0)):
        with pytest.raises(ValueError, match="time shift|number of steps"):
            time_grid(steps, shift)
