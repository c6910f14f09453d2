"""routing.py: the mixture of per-cluster flows is the data's flow, the router's loss is
minimised by the flow posterior, and the routing rules weigh and run the experts as they
say, proven on Gaussian mixtures."""
import pytest
import torch

from diffusion import RectifiedFlow
from routing import mix, parse_routing, route, router_loss
from gmm import GaussianMixture, mixture

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
    """router_loss noises the flow way, and the exact posterior p(k | x_t) scores best (a proper scoring rule):
    sharper or flatter versions of it, and the prior alone, all lose more on the same draws."""
    gmm = mixture()
    g = torch.Generator().manual_seed(5)
    x0, clusters = gmm.sample(100_000, g)
    t, noise = torch.rand(len(x0), generator=g), torch.randn(x0.shape, generator=g)
    exact = lambda x_t, t, y: gmm.posterior(x_t, t).log()
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
    by_hand = -gmm.posterior(x_t, t).log().gather(1, clusters[:, None]).squeeze(1)
    torch.testing.assert_close(router_loss(exact, x0, clusters, t, noise), by_hand, rtol=1e-10, atol=1e-10)
    best = router_loss(exact, x0, clusters, t, noise).mean()
    for temperature in (0.7, 1.5):
        tempered = lambda x_t, t, y: gmm.posterior(x_t, t).log() * temperature
        assert router_loss(tempered, x0, clusters, t, noise).mean() > best + 1e-3
    prior_only = lambda x_t, t, y: gmm.weights.log().expand(len(x_t), -1)
    assert router_loss(prior_only, x0, clusters, t, noise).mean() > best + 0.1


def test_routing_weights_full_topk_threshold_subset():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.15, 0.05, 0.8]])
    torch.testing.assert_close(route(probs, "full")[0], probs)
    torch.testing.assert_close(route(probs, "topk", 1)[0], torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]))
    torch.testing.assert_close(route(probs, "topk", 2)[0], torch.tensor([[0.625, 0.375, 0], [0.15 / 0.95, 0, 0.8 / 0.95]]))
    torch.testing.assert_close(route(probs, "threshold", 0.25)[0], torch.tensor([[0.625, 0.375, 0], [0, 0, 1.0]]))
    present = torch.tensor([True, False, True])
    torch.testing.assert_close(route(probs, "full", available=present)[0], torch.tensor([[5 / 7, 0, 2 / 7], [0.15 / 0.95, 0, 0.8 / 0.95]]))
    torch.testing.assert_close(route(probs, "oracle", 1)[0], torch.tensor([[0, 1.0, 0], [0, 1.0, 0]]))
    # with expert 0 missing, the threshold compares with the renormalised probabilities: 0.3 and 0.2 become 0.6 and 0.4
    missing_first = torch.tensor([False, True, True])
    torch.testing.assert_close(route(probs[:1], "threshold", 0.35, available=missing_first)[0], torch.tensor([[0, 0.6, 0.4]]))
    torch.testing.assert_close(route(probs[:1], "topk", 1, available=missing_first)[0], torch.tensor([[0, 1.0, 0]]))
    with pytest.raises(ValueError):
        route(probs, "topk", 3, available=present)
    with pytest.raises(ValueError):
        route(probs, "oracle", 1, available=present)
    assert parse_routing("top2") == ("topk", 2) and parse_routing("threshold:0.1") == ("threshold", 0.1)
    for bad in ("top3x", "topk:0", "threshold:2", "oracle:-1", "nope", "full:1"):
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
