"""routing.py: the mixture of per-cluster flows is the data's flow, the router's loss is
minimised by the flow posterior, and the routing rules weigh and run the experts as they
say: the routed sampler with guidance, a held router and every solver, proven on Gaussian
mixtures."""
import pytest
import torch

import routing
from diffusion import DDPM, RectifiedFlow
from routing import mix, parse_routing, route, router_loss
from gmm import (AnalyticExpert, ClassConditionalMixture, ConditionalAnalyticExpert,
                 GaussianMixture,
                 mixture)
from plumbing.condition import ClassCondition, NoCondition

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("float64")]


def test_mixture_of_cluster_flows_is_the_data_flow():
    gmm = mixture()
    g = torch.Generator().manual_seed(4)
    for t_val in (0.05, 0.3, 0.6, 0.9, 0.99):
        x = torch.randn(64, 3, generator=g) * 2
        t = torch.full((64,), t_val)
        post = gmm.posterior(x, t)
        mixed = sum(post[:, k, None] * gmm.cluster_velocity(x, t, k) for k in range(3))
        torch.testing.assert_close(mixed, gmm.velocity(x, t), rtol=1e-8, atol=1e-8)


def test_router_loss_is_the_cross_entropy_of_the_flow_posterior_and_the_posterior_minimises_it():
    """router_loss noises the flow way, and the exact posterior p(k | x_t) scores best (a
    proper scoring rule): sharper or flatter versions of it, and the prior alone, all lose
    more on the same draws."""
    gmm = mixture()
    g = torch.Generator().manual_seed(5)
    x0, clusters = gmm.sample(100_000, g)
    t, noise = torch.rand(len(x0), generator=g), torch.randn(x0.shape, generator=g)
    exact = lambda x_t, t, y: gmm.posterior(x_t, t).log()
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
    by_hand = -gmm.posterior(x_t, t).log().gather(1, clusters[:, None]).squeeze(1)
    torch.testing.assert_close(router_loss(exact, x0, clusters, t, noise), by_hand,
                               rtol=1e-10, atol=1e-10)
    best = router_loss(exact, x0, clusters, t, noise).mean()
    for temperature in (0.7, 1.5):
        tempered = lambda x_t, t, y: gmm.posterior(x_t, t).log() * temperature
        assert router_loss(tempered, x0, clusters, t, noise).mean() > best + 1e-3
    prior_only = lambda x_t, t, y: gmm.weights.log().expand(len(x_t), -1)
    assert router_loss(prior_only, x0, clusters, t, noise).mean() > best + 0.1


def test_routing_weights_full_topk_threshold_subset():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.15, 0.05, 0.8]])
    torch.testing.assert_close(route(probs, "full")[0], probs)
    torch.testing.assert_close(route(probs, "topk", 1)[0],
                               torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]))
    torch.testing.assert_close(route(probs, "topk", 2)[0],
                               torch.tensor([[0.625, 0.375, 0], [0.15 / 0.95, 0, 0.8 / 0.95]]))
    torch.testing.assert_close(route(probs, "threshold", 0.25)[0],
                               torch.tensor([[0.625, 0.375, 0], [0, 0, 1.0]]))
    present = torch.tensor([True, False, True])
    torch.testing.assert_close(route(probs, "full", available=present)[0],
                               torch.tensor([[5 / 7, 0, 2 / 7], [0.15 / 0.95, 0, 0.8 / 0.95]]))
    torch.testing.assert_close(route(probs, "oracle", 1)[0],
                               torch.tensor([[0, 1.0, 0], [0, 1.0, 0]]))
    # with expert 0 missing, the threshold compares with the renormalised probabilities:
    # 0.3 and 0.2 become 0.6 and 0.4
    missing_first = torch.tensor([False, True, True])
    torch.testing.assert_close(route(probs[:1], "threshold", 0.35,
                                     available=missing_first)[0], torch.tensor([[0, 0.6, 0.4]]))
    torch.testing.assert_close(route(probs[:1], "topk", 1, available=missing_first)[0],
                               torch.tensor([[0, 1.0, 0]]))
    with pytest.raises(ValueError):
        route(probs, "topk", 3, available=present)
    with pytest.raises(ValueError):
        route(probs, "oracle", 1, available=present)
    assert (parse_routing("top2") == ("topk", 2)
            and parse_routing("threshold:0.1") == ("threshold", 0.1)
            and parse_routing("draw") == ("draw", None))
    for bad in ("top3x", "topk:0", "threshold:2", "oracle:-1", "nope", "full:1", "draw:2"):
        with pytest.raises(ValueError):
            parse_routing(bad)


def test_mix_runs_each_expert_only_on_its_samples():
    calls = []
    def expert_fn(k, x, t):
        calls.append((k, x.shape[0]))
        return torch.full_like(x, float(k + 1))
    weights = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0, 0, 1.0], [0.5, 0, 0.5]])
    out = mix(weights, expert_fn, torch.zeros(4, 2), torch.zeros(4))
    assert sorted(calls) == [(0, 2), (2, 3)]
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, 3.0, 3.0, 2.0]))


def test_euler_on_mixture_flow_reproduces_the_mixture():
    gmm = GaussianMixture([0.6, 0.4], [[3.0, 0.0], [-3.0, 1.0]], [0.5, 0.3])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4000, 2, generator=g)
    ts = torch.linspace(1, 0, 201)
    for t, t_next in zip(ts[:-1], ts[1:]):
        tt = t.expand(4000)
        post = gmm.posterior(x, tt)
        v = sum(post[:, k, None] * gmm.cluster_velocity(x, tt, k) for k in range(2))
        x = RectifiedFlow.euler_step(v, x, t, t_next)
    k = ((x[:, None] - gmm.means[None]) ** 2).sum(-1).argmin(1)
    for c in range(2):
        assert abs((k == c).double().mean() - gmm.weights[c]) < 0.03
        torch.testing.assert_close(x[k == c].mean(0), gmm.means[c], atol=0.05, rtol=0)
        assert abs(x[k == c].std(0).mean() - gmm.stds[c]) < 0.05


GMM = GaussianMixture([0.4, 0.3, 0.2, 0.1], [[0.6, 0.6], [-0.6, 0.6],
                                             [0.6, -0.6], [-0.6, -0.6]], [0.15, 0.1, 0.12, 0.1])


def analytic_router(gmm):
    def router(x, t, ids):
        return gmm.log_likelihoods(x.flatten(1).double(), 1 - t.double(), t.double())
    return router


def run(experts, router, rule, z, steps, **options):
    """routing.sample on unconditional analytic experts over the 4 clusters of GMM."""
    guidance = {key: options.pop(key) for key in ("cfg_scale", "cfg_routing") if key in options}
    ensemble = routing.Ensemble(experts, router, rule, NoCondition(), 4, **guidance)
    return routing.sample(ensemble, z, torch.zeros(len(z), dtype=torch.long), steps, **options)


def noise(n=3000, seed=0):
    return torch.randn(n, 2, 1, 1, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def assert_matches_mixture(x, gmm, mass_tol=0.03, mean_tol=0.03):
    x = x.flatten(1)
    nearest = ((x[:, None] - gmm.means[None]) ** 2).sum(-1).argmin(1)
    for k in range(len(gmm.weights)):
        assert abs((nearest == k).double().mean() - gmm.weights[k]) < mass_tol
        assert (x[nearest == k].mean(0) - gmm.means[k]).abs().max() < mean_tol
        assert abs(x[nearest == k].std(0).mean() - gmm.stds[k]) < 0.03


@pytest.mark.parametrize("objectives", [("fm",) * 4, ("ddpm", "fm", "ddpm", "fm")])
def test_full_routing_with_the_analytic_posterior_samples_the_mixture(objectives):
    experts = {k: AnalyticExpert(GMM, k, o) for k, o in enumerate(objectives)}
    x, usage = run(experts, analytic_router(GMM), ("full", None), noise(), steps=100)
    assert_matches_mixture(x, GMM)
    # full routing runs every expert with any weight: all of them at high noise; near t = 0 far
    # clusters' posteriors underflow to exactly 0 and those experts are skipped
    assert torch.all(usage[4] == 21 * 3000) and torch.all(usage[0] <= 19 * 3000)


@pytest.mark.parametrize("solver", ["euler", "heun", "ab2"])
def test_every_solver_routes_exactly_at_every_evaluation(solver):
    """With the analytic posterior as router, the full ensemble's velocity is the
    mixture's at every point a solver evaluates, so each solver's routed trajectory is
    its trajectory of the exact mixture flow (to 1e-5: the router's softmax is float32),
    and ab2 converges at second order on it."""
    from diffusion import sample_flow
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(200)

    def mixture(x, t):
        tt = torch.as_tensor(t, dtype=torch.float64).expand(len(x))
        post = GMM.posterior(x.flatten(1), tt)
        return sum(post[:, k, None] * GMM.cluster_velocity(x.flatten(1), tt, k)
                   for k in range(4)).reshape(x.shape)
    routed, _ = run(experts, analytic_router(GMM), ("full", None), z, steps=12, solver=solver)
    torch.testing.assert_close(routed, sample_flow(mixture, z, 12, solver=solver),
                               atol=1e-5, rtol=0)
    if solver == "ab2":
        exact = sample_flow(mixture, z, 1024, solver="heun")
        errors = [(sample_flow(mixture, z, n, solver="ab2") - exact).flatten(1).norm(
            dim=1).mean().item()
                  for n in (16, 32, 64)]
        assert all(3.3 < errors[i] / errors[i + 1] < 4.7 for i in range(2)), errors


def test_top1_is_not_the_exact_mixture_it_favours_the_cluster_that_wins_at_high_noise():
    """At t ~ 1 the posterior is the prior, so top-1 sends every sample along the largest
    cluster's flow first; mass drifts towards it. Full routing (above) is exact."""
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    x, usage = run(experts, analytic_router(GMM), ("topk", 1), noise(), steps=100)
    assert usage.sum() == 100 * 3000          # top-1: one expert per sample per step
    assert torch.all(usage[4, 1:] < usage[4, 0] / 10)
    nearest = ((x.flatten(1)[:, None] - GMM.means[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == 0).double().mean() > GMM.weights[0] + 0.1


def test_draw_inverts_the_cumulative_probabilities_at_each_rows_uniform():
    probs = torch.tensor([[0.5, 0.3, 0.2]] * 5 + [[0.0, 0.0, 1.0]])
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.79, 0.999999, 0.3])
    assert routing.draw_experts(probs, uniforms).tolist() == [0, 0, 1, 1, 2, 2]
    # an expert that is not available is renormalised away: [0.5, 0, 0.2] -> [5/7, 0, 2/7]
    present = torch.tensor([True, False, True])
    assert routing.draw_experts(probs[:3], torch.tensor([0.7, 0.72, 0.9]),
                                present).tolist() == [0, 2, 2]


def test_the_draw_rule_samples_the_mixture_exactly_and_top1_does_not():
    """draw: each sample's expert drawn once from p(k | x_1, t = 1) (the analytic router,
    which at t = 1 is the prior), then that expert's flow alone. Each cluster's flow
    carries N(0, I) to the cluster exactly, so at N = 4000 the drawn sampler's cluster
    shares sit within 4 standard errors (sqrt(pi (1 - pi) / N) <= 0.0078) of the
    weights, and its clusters' means and spreads on the mixture's. Top-1 on the same
    noise puts 0.67 of the mass on cluster 0 (weight 0.4: 35 standard errors off; the
    assertion asks 13), the cluster that wins at high noise. The router runs once per
    sample."""
    n = 4000
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    calls = []

    def router(x, t, ids):
        calls.append(len(x))
        return analytic_router(GMM)(x, t, ids)
    z = noise(n, seed=3)
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x, usage = run(experts, router, ("draw", None), z, steps=100, draws=uniforms)
    assert calls == [n] and usage.sum() == 100 * n
    nearest = ((x.flatten(1)[:, None] - GMM.means[None]) ** 2).sum(-1).argmin(1)
    for k, weight in enumerate(GMM.weights.tolist()):
        share = (nearest == k).double().mean().item()
        assert abs(share - weight) < 4 * (weight * (1 - weight) / n) ** 0.5, (k, share)
    assert_matches_mixture(x, GMM, mass_tol=0.016, mean_tol=0.02)
    top1, _ = run(experts, analytic_router(GMM), ("topk", 1), z, steps=100)
    nearest = ((top1.flatten(1)[:, None] - GMM.means[None]) ** 2).sum(-1).argmin(1)
    excess = (nearest == 0).double().mean().item() - GMM.weights[0].item()
    assert excess > 13 * (0.4 * 0.6 / n) ** 0.5, excess


def test_the_draw_rule_guides_each_sample_on_its_drawn_expert():
    """With guidance, both branches of a drawn sample run its one expert: the class's
    posterior at t = 1 chooses, and the guided velocity is that expert's."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(30, 2, 1, 1, generator=g, dtype=torch.float64)
    ids = torch.arange(30) % 3
    uniforms = torch.rand(30, generator=g, dtype=torch.float64)
    experts = {k: ConditionalAnalyticExpert(CGMM, k) for k in range(3)}
    router = lambda xs, ts, cids: CGMM.router_logits(xs.flatten(1).double(), ts.double(), cids)
    ensemble = routing.Ensemble(experts, router, ("draw", None), ClassCondition(3), 3, 2.5)
    concrete = routing.drawn(ensemble, z, ids, uniforms)
    chosen = concrete.rule[1]
    probs = router(z, torch.ones(30, dtype=torch.float64), ids).softmax(1)
    assert torch.equal(chosen, routing.draw_experts(probs, uniforms))
    v, weights = routing.ensemble_velocity(concrete, z, 0.5, ids)
    assert torch.equal(weights.argmax(1), chosen) and torch.all(weights.sum(1) == 1)
    tt = torch.full((30,), 0.5, dtype=torch.float64)
    for k in range(3):
        rows = chosen == k
        if rows.any():
            v_c = CGMM.expert_velocity(k, z.flatten(1)[rows], tt[rows], ids[rows])
            v_u = CGMM.expert_velocity(k, z.flatten(1)[rows], tt[rows],
                                       torch.full((int(rows.sum()),), 3))
            torch.testing.assert_close(v.flatten(1)[rows], v_u + 2.5 * (v_c - v_u),
                                       rtol=1e-12, atol=1e-12)
    # so guidance's unconditional branch has no experts of its own to choose
    with pytest.raises(ValueError, match="cfg_routing 'shared'"):
        routing.Ensemble(experts, router, ("draw", None), ClassCondition(3), 3, 2.5,
                         "independent")


def test_top1_with_a_certain_router_is_oracle_sampling():
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(40)
    owner = torch.arange(40) % 4            # each sample belongs, with certainty, to one cluster
    def certain_router(x, t, ids):
        return torch.nn.functional.one_hot(owner[: x.shape[0]], 4).double() * 50
    routed, _ = run(experts, certain_router, ("topk", 1), z, steps=20)
    for k in range(4):
        oracle, _ = run(experts, None, ("oracle", k), z, steps=20)
        assert torch.equal(routed[owner == k], oracle[owner == k])


def test_a_missing_expert_renormalises_to_the_remaining_mixture():
    present = {0: AnalyticExpert(GMM, 0, "fm"), 2: AnalyticExpert(GMM, 2, "ddpm")}
    x, usage = run(present, analytic_router(GMM), ("full", None), noise(200), steps=50)
    assert usage[:, [1, 3]].sum() == 0
    w = GMM.weights[[0, 2]]
    sub = GaussianMixture(w / w.sum(), GMM.means[[0, 2]], GMM.stds[[0, 2]])
    expected = noise(200).flatten(1)
    ts = torch.linspace(1, 0, 51, dtype=torch.float64)
    for t, t_next in zip(ts[:-1], ts[1:]):
        tt = t.expand(200)
        post = sub.posterior(expected, tt)
        v = sum(post[:, i, None] * sub.cluster_velocity(expected, tt, i) for i in range(2))
        expected = RectifiedFlow.euler_step(v, expected, t, t_next)
    torch.testing.assert_close(x.flatten(1), expected, atol=1e-4, rtol=0)


def test_ddpm_and_fm_experts_of_one_cluster_give_the_same_trajectory():
    z = noise(100)
    for k in range(4):
        fm, _ = run({k: AnalyticExpert(GMM, k, "fm")}, None, ("oracle", k), z, steps=50)
        ddpm, _ = run({k: AnalyticExpert(GMM, k, "ddpm", DDPM(beta_schedule="cosine"))},
                      None, ("oracle", k), z, steps=50)
        torch.testing.assert_close(ddpm, fm, atol=1e-4, rtol=0)


CGMM = ClassConditionalMixture(
    weights=[[0.20, 0.05, 0.10], [0.05, 0.25, 0.05], [0.10, 0.05, 0.15]],
    means=[[[0.8, 0.6], [0.6, 0.9], [1.0, 0.2]], [[-0.7, 0.5], [-0.5, 0.8], [-0.9, 0.1]],
           [[0.1, -0.8], [-0.3, -0.6], [0.4, -0.9]]],
    stds=[[0.15, 0.2, 0.1], [0.1, 0.15, 0.2], [0.2, 0.1, 0.15]])


def guided(rule, cfg_routing, x, t, ids, cfg_scale=2.5, router=None, experts=None):
    experts = experts or {k: ConditionalAnalyticExpert(CGMM, k) for k in range(3)}
    router = router or (
        lambda xs, ts, cids: CGMM.router_logits(xs.flatten(1).double(), ts.double(), cids))
    ensemble = routing.Ensemble(experts, router, rule, ClassCondition(3), 3, cfg_scale,
                                cfg_routing)
    v, _ = routing.ensemble_velocity(ensemble, x, t, ids)
    return v.flatten(1)


@pytest.mark.parametrize("cfg_routing", ["shared", "independent"])
def test_full_routing_with_guidance_is_the_exact_guided_mixture(cfg_routing):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 2, 1, 1, generator=g, dtype=torch.float64)
    ids = torch.arange(60) % 3
    for t in (0.1, 0.4, 0.7, 0.95):
        tt = torch.full((60,), t, dtype=torch.float64)
        cond, uncond = CGMM.velocity(x.flatten(1), tt, ids), CGMM.velocity(
            x.flatten(1), tt, torch.full((60,), 3))
        torch.testing.assert_close(guided(("full", None), cfg_routing, x, t, ids), uncond
                                   + 2.5 * (cond - uncond), rtol=1e-5, atol=1e-5)


def test_top1_shared_with_a_certain_router_is_per_expert_guidance():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(30, 2, 1, 1, generator=g, dtype=torch.float64)
    ids, owner = torch.arange(30) % 3, torch.arange(30) // 10
    def certain(xs, ts, cids):
        owners = torch.cat([owner, owner])[: xs.shape[0]]
        return torch.nn.functional.one_hot(owners, 3).double() * 50
    for t in (0.2, 0.8):
        tt = torch.full((30,), t, dtype=torch.float64)
        v = guided(("topk", 1), "shared", x, t, ids, router=certain)
        for k in range(3):
            rows = owner == k
            v_c = CGMM.expert_velocity(k, x.flatten(1)[rows], tt[rows], ids[rows])
            v_u = CGMM.expert_velocity(k, x.flatten(1)[rows], tt[rows],
                                       torch.full((int(rows.sum()),), 3))
            torch.testing.assert_close(v[rows], v_u + 2.5 * (v_c - v_u), rtol=1e-12, atol=1e-12)


def test_independent_top1_guidance_mixes_experts_when_the_branches_disagree():
    """The posterior given the class and the one without it pick different experts
    somewhere; there the two choices differ, and only the shared one is guidance of a
    single expert."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(400, 2, 1, 1, generator=g, dtype=torch.float64) * 0.8
    ids = torch.arange(400) % 3
    t = 0.6
    tt = torch.full((400,), t, dtype=torch.float64)
    both = torch.cat([ids, torch.full((400,), 3)])
    top = CGMM.router_logits(torch.cat([x, x]).flatten(1), torch.cat([tt, tt]), both).argmax(1)
    disagree = top[:400] != top[400:]
    assert disagree.any()
    shared, independent = guided(("topk", 1), "shared", x, t,
                                 ids), guided(("topk", 1), "independent", x, t, ids)
    assert torch.allclose(shared[~disagree], independent[~disagree])
    assert (shared[disagree] - independent[disagree]).abs().amax(1).mean() > 1e-3


def test_a_router_held_for_m_evaluations_is_called_once_per_m_and_m_1_is_todays_sampler():
    calls = []

    def router(x, t, ids):
        calls.append(float(t[0]))
        return analytic_router(GMM)(x, t, ids)
    experts = {k: AnalyticExpert(GMM, k, "fm") for k in range(4)}
    z = noise(200)
    today, _ = run(experts, analytic_router(GMM), ("topk", 1), z, 12)
    every_1 = routing.sample(routing.Ensemble(experts, router,
                                              ("topk", 1), NoCondition(), 4, router_every=1),
                             z, torch.zeros(len(z), dtype=torch.long), 12)[0]
    assert torch.equal(every_1, today) and len(calls) == 12
    calls.clear()
    every_4 = routing.sample(routing.Ensemble(experts, router,
                                              ("topk", 1), NoCondition(), 4, router_every=4),
                             z, torch.zeros(len(z), dtype=torch.long), 12)[0]
    # at steps 0, 4 and 8, held between
    assert calls == pytest.approx([1.0, 1 - 4 / 12, 1 - 8 / 12])
    assert not torch.equal(every_4, today) and (every_4 - today).abs().mean() < 0.05
