"""A mixture of isotropic Gaussians: closed-form optimal predictors, the tests' ground truth.

Cluster k has weight pi_k, mean mu_k (d,) and standard deviation s_k. On the flow path
x_t = (1-t) x0 + t eps, cluster k's marginal is N((1-t) mu_k, ((1-t)^2 s_k^2 + t^2) I), so
E[x0 | x_t, k], E[eps | x_t, k], the velocity and the posterior p(k | x_t) are all exact.
"""
import torch

from diffusion import DDPM


class GaussianMixture:
    def __init__(self, weights, means, stds):
        self.weights = torch.as_tensor(weights, dtype=torch.float64)
        self.means = torch.as_tensor(means, dtype=torch.float64)      # (K, d)
        self.stds = torch.as_tensor(stds, dtype=torch.float64)        # (K,)

    def sample(self, n, generator):
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        x = self.means[k] + self.stds[k, None] * torch.randn(n, self.means.shape[1], generator=generator, dtype=torch.float64)
        return x, k

    def _moments(self, a, b):
        """Cluster means (K, d) and variances (K,) of a*x0 + b*eps, with a, b of shape (N,)."""
        return a[:, None, None] * self.means[None], a[:, None] ** 2 * self.stds[None] ** 2 + b[:, None] ** 2

    def log_likelihoods(self, x, a, b):
        """log pi_k + log N(x; a mu_k, (a^2 s_k^2 + b^2) I): (N, K)."""
        mean, var = self._moments(a, b)
        d = x.shape[1]
        sq = ((x[:, None] - mean) ** 2).sum(-1)
        return self.weights.log()[None] - 0.5 * sq / var - 0.5 * d * torch.log(2 * torch.pi * var)

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
        """The whole mixture's optimal velocity, from E[x0 | x_t] and E[eps | x_t] of the mixture."""
        a, b = 1 - t, t
        mean, var = self._moments(a, b)
        # E[x0 | x_t] = x_t - ... mixes cluster-wise; derived independently of cluster_velocity via
        # the score: E[eps | x_t] = -b * grad log p(x_t), E[x0 | x_t] = (x_t - b E[eps]) / a.
        post = self.log_likelihoods(x, a, b).softmax(dim=1)
        score = -(post[:, :, None] * (x[:, None] - mean) / var[:, :, None]).sum(1)
        eps = -b[:, None] * score
        return eps - (x - b[:, None] * eps) / a[:, None]


class AnalyticExpert:
    """Cluster k's optimal predictor as an expert of either objective, on images of shape (N, d, 1, 1)."""

    def __init__(self, gmm, k, objective, schedule=None):
        self.gmm, self.k, self.objective = gmm, k, objective
        self.schedule = schedule or (DDPM() if objective == "ddpm" else None)

    def __call__(self, x, t_native, y=None):
        flat = x.flatten(1).double()
        t = t_native.double()
        if self.objective == "fm":
            out = self.gmm.cluster_velocity(flat, t, self.k)
        else:
            abar = self.schedule.alpha_bar_at(t)
            out = self.gmm.cluster_eps(flat, abar.sqrt(), (1 - abar).sqrt(), self.k)
        return out.to(x.dtype).reshape(x.shape)
