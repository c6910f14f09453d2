"""A mixture of isotropic Gaussians: closed-form optimal predictors, the tests' ground truth.

Cluster k has weight pi_k, mean mu_k (d,) and standard deviation s_k. On the flow path
x_t = (1-t) x0 + t eps, cluster k's marginal is N((1-t) mu_k, ((1-t)^2 s_k^2 + t^2) I), so
E[x0 | x_t, k], E[eps | x_t, k], the velocity and the posterior p(k | x_t) are all exact.
"""
import torch

from diffusion import DDPM, RectifiedFlow


class GaussianMixture:
    def __init__(self, weights, means, stds):
        self.weights = torch.as_tensor(weights, dtype=torch.float64)
        self.means = torch.as_tensor(means, dtype=torch.float64)      # (K, d)
        self.stds = torch.as_tensor(stds, dtype=torch.float64)        # (K,)

    def sample(self, n, generator):
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        x = self.means[k] + self.stds[k, None] * torch.randn(
            n, self.means.shape[1], generator=generator, dtype=torch.float64)
        return x, k

    def _moments(self, a, b):
        """Cluster means (K, d) and variances (K,) of a*x0 + b*eps, with a, b of shape (N,)."""
        return a[:, None,
                 None] * self.means[None], a[:,
                                             None] ** 2 * self.stds[None] ** 2 + b[:, None] ** 2

    def log_likelihoods(self, x, a, b):
        """log pi_k + log N(x; a mu_k, (a^2 s_k^2 + b^2) I): (N, K)."""
        mean, var = self._moments(a, b)
        d = x.shape[1]
        sq = ((x[:, None] - mean) ** 2).sum(-1)
        return self.weights.log()[None] - 0.5 * sq / var - 0.5 * d * torch.log(
            2 * torch.pi * var)

    def posterior(self, x, t):
        return self.log_likelihoods(x, 1 - t, t).softmax(dim=1)

    def cluster_eps(self, x, a, b, k):
        """E[eps | x, cluster k] for x = a x0 + b eps."""
        mean, var = self._moments(a, b)
        return b[:, None] / var[:, k, None] * (x - mean[:, k])

    def cluster_x0(self, x, a, b, k):
        mean, var = self._moments(a, b)
        s2 = self.stds[k] ** 2
        return self.means[k][None] + (a * s2 / var[:, k])[:, None] * (x - mean[:, k])

    def cluster_velocity(self, x, t, k):
        return self.cluster_eps(x, 1 - t, t, k) - self.cluster_x0(x, 1 - t, t, k)

    def velocity(self, x, t):
        """The whole mixture's optimal velocity, from E[x0 | x_t] and E[eps | x_t] of the
        mixture."""
        a, b = 1 - t, t
        mean, var = self._moments(a, b)
        # E[x0 | x_t] = x_t - ... mixes cluster-wise; derived independently of
        # cluster_velocity via the score: E[eps | x_t] = -b * grad log p(x_t),
        # E[x0 | x_t] = (x_t - b E[eps]) / a.
        post = self.log_likelihoods(x, a, b).softmax(dim=1)
        score = -(post[:, :, None] * (x[:, None] - mean) / var[:, :, None]).sum(1)
        eps = -b[:, None] * score
        return eps - (x - b[:, None] * eps) / a[:, None]


class AnalyticExpert:
    """Cluster k's optimal network under either objective, on images of shape (N, d, 1,
    1), used as an expert.

    Called as a network, net(x, t_native, y); `.velocity` reads it through its objective,
    exactly as sample.py reads a trained expert (model.Network).
    """

    def __init__(self, gmm, k, objective, schedule=None):
        self.gmm, self.k = gmm, k
        self.objective = (schedule or DDPM()) if objective == "ddpm" else RectifiedFlow()

    def __call__(self, x, t_native, y=None):
        flat = x.flatten(1).double()
        t = t_native.double()
        if self.objective.name == "fm":
            out = self.gmm.cluster_velocity(flat, t, self.k)
        else:
            abar = self.objective.alpha_bar_at(t)
            out = self.gmm.cluster_eps(flat, abar.sqrt(), (1 - abar).sqrt(), self.k)
        return out.to(x.dtype).reshape(x.shape)

    def velocity(self, x_t, t, y=None):
        return self.objective.velocity(self, x_t, t, y)


class ClassConditionalMixture:
    """Clusters k and classes c: component (k, c) is N(means[k, c], stds[k, c]^2 I) with
    weight weights[k, c] > 0.

    Everything a class-conditional ensemble needs, exact: expert k's velocity given a class or
    the null (id C: expert k's own unconditional flow), the router's logits log p(k, x_t | c) or
    log p(k, x_t), and the whole data set's velocity given a class or the null.
    """

    def __init__(self, weights, means, stds):
        self.weights = torch.as_tensor(weights, dtype=torch.float64)   # (K, C)
        self.means = torch.as_tensor(means, dtype=torch.float64)       # (K, C, d)
        self.stds = torch.as_tensor(stds, dtype=torch.float64)         # (K, C)
        self.num_clusters, self.num_classes = self.weights.shape

    def part(self, ks, cs):
        """The sub-mixture of components (k, c) for k in ks and c in cs, its weights
        renormalised."""
        w = self.weights[ks][:, cs].reshape(-1)
        return GaussianMixture(w / w.sum(), self.means[ks][:, cs].reshape(len(w), -1),
                               self.stds[ks][:, cs].reshape(-1))

    def classes(self, cid):
        return list(range(self.num_classes)) if cid == self.num_classes else [cid]

    def _per_id(self, ids, fn, width):
        out = torch.zeros(len(ids), width, dtype=torch.float64)
        for cid in ids.unique().tolist():
            rows = ids == cid
            out[rows] = fn(rows, self.classes(cid))
        return out

    def expert_velocity(self, k, x, t, ids):
        return self._per_id(
            ids, lambda rows, cs: self.part([k], cs).velocity(x[rows], t[rows]), x.shape[1])

    def router_logits(self, x, t, ids):
        def logits(rows, cs):
            flat = GaussianMixture(self.weights.reshape(-1), self.means.reshape(
                -1, self.means.shape[-1]), self.stds.reshape(-1))
            ll = flat.log_likelihoods(x[rows], 1 - t[rows],
                                      t[rows]).view(-1, self.num_clusters, self.num_classes)
            return ll[:, :, cs].logsumexp(-1)
        return self._per_id(ids, logits, self.num_clusters)

    def velocity(self, x, t, ids):
        all_clusters = list(range(self.num_clusters))
        return self._per_id(ids,
                            lambda rows, cs: self.part(all_clusters, cs).velocity(x[rows], t[rows]),
                            x.shape[1])


class ConditionalAnalyticExpert:
    """Expert k of a ClassConditionalMixture, on images (N, d, 1, 1), read through the
    flow objective like a trained one."""

    def __init__(self, mixture, k):
        self.mixture, self.k = mixture, k

    def velocity(self, x_t, t, ids):
        t = torch.as_tensor(t, dtype=torch.float64).expand(x_t.shape[0])
        return self.mixture.expert_velocity(self.k, x_t.flatten(1).double(), t, ids).to(
            x_t.dtype).reshape(x_t.shape)


def mixture():
    """A three-component mixture in 3-D, the analytic tests' data."""
    return GaussianMixture([0.5, 0.3, 0.2], [[2.0, 0.0, 1.0],
                                             [-2.0, 1.0, 0.0], [0.0, -2.5, -1.0]], [0.3, 0.5, 0.2])


def mixture_flow(x, t):
    """The exact velocity of a two-component Gaussian mixture in 2-D: the
    posterior-weighted cluster velocities."""
    gmm = GaussianMixture([0.6, 0.4], [[1.0, 0.0], [-1.0, 0.5]], [0.5, 0.4])
    tt = torch.full((x.shape[0],), t)
    post = gmm.posterior(x, tt)
    return sum(post[:, k, None] * gmm.cluster_velocity(x, tt, k) for k in range(2))
