"""The decentralized half of the method: the router's objective, the routing rules and the
routed ensemble as one velocity field (diffusion.py holds the other half: the objectives
and the samplers). Read top to bottom:

  router_loss        the router learns p(k | x_t, t, y) by cross-entropy on noised images of
                     cluster k, the flow way (x_t = (1 - t) x0 + t eps), whatever its experts'
                     objective;
  route              a rule (full, top-k, threshold, oracle) turns p(k | ...) into weights;
  draw_experts       the draw rule: each image's expert drawn once from p(k | x_1, 1, y),
                     then that expert alone (an exact sampler of the mixture);
  mix                sum_k w_k v_k, each expert run once on the rows routed to it;
  ensemble_velocity  the routed, guided velocity of the whole ensemble at one flow time;
  sample             integrates it from noise to data.

Under 'full' routing this is exact: the data's flow is the posterior-weighted sum of
the clusters' flows, v(x_t, t) = sum_k p(k | x_t, t) v_k(x_t, t), so an ensemble of
experts trained apart optimises the same objective as one network trained on
everything. 'draw' is exact too, and cheaper: p(x | y) = sum_k p(k | y) p_k(x | y), so
drawing k from p(k | y) and following expert k alone samples the mixture; at t = 1 the
noise carries nothing of the data, so the router's p(k | x_1, 1, y) is p(k | y), read
once. Top-1 is neither: it takes the most probable expert at every step (a mode-seeking
rule, which favours the cluster that wins at high noise)."""
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from diffusion import T_BINS, RectifiedFlow, expand, sample_flow, t_bin


def router_loss(router, x0, clusters, t, noise, y=None):
    """Cross-entropy of the router's p(k | x_t, t, y) against each image's cluster, per
    sample (N,).

    The router sees images noised on the flow path at flow time t (N,), so one router
    serves experts of any objective: each expert's velocity is read at the same flow
    time when mixed."""
    x_t = RectifiedFlow.add_noise(x0, noise, t)
    return F.cross_entropy(router(x_t, t, y), clusters, reduction="none")


def parse_routing(spec):
    """'top1', 'top2', 'topk:N', 'full', 'draw', 'threshold:TAU' or 'oracle:C' (cluster
    id C) to (rule, parameter)."""
    name, _, arg = spec.partition(":")
    try:
        if name in ("top1", "top2") and not arg:
            return "topk", int(name[3:])
        if name in ("full", "draw") and not arg:
            return name, None
        if name == "topk" and int(arg) >= 1:
            return "topk", int(arg)
        if name == "threshold" and 0 <= float(arg) < 1:
            return "threshold", float(arg)
        if name == "oracle" and int(arg) >= 0:
            return "oracle", int(arg)
    except ValueError:
        pass
    raise ValueError(f"unknown routing {spec!r}: use top1, top2, topk:N, full, draw, "
                     "threshold:TAU (0<=TAU<1) or oracle:C")


def route(probs, rule, param=None, available=None, keep=None):
    """(weights (N, K), kept (N, K) bool): mixture weights from router probabilities (N,
    K), each row summing to 1 over the experts the rule keeps.

    rule: 'full' (every expert present: the exact decomposition), 'topk' (the `param`
    most probable), 'threshold' (probability at least `param`; the most probable always
    kept), 'oracle' (expert `param` alone), 'assigned' (row i's expert `param[i]` alone:
    the draw rule's choice, made once by draw_experts). `available` (K,) marks the
    experts present: the probabilities are renormalised over them *before* the rule, so a
    lost expert degrades the ensemble (to the exact sub-mixture, under 'full') instead of
    breaking it. `keep` (N, K) overrides the rule's choice (guidance's shared expert set)."""
    num_experts = probs.shape[1]
    if available is None:
        available = torch.ones(num_experts, dtype=torch.bool, device=probs.device)
    if rule == "oracle":
        if not 0 <= param < num_experts or not available[param]:
            raise ValueError(f"oracle expert {param} is not available")
        chosen = torch.full((probs.shape[0],), param, device=probs.device)
        kept = F.one_hot(chosen, num_experts).bool()
        return kept.to(probs), kept
    if rule == "assigned":
        if not available[param].all():
            raise ValueError("an image was assigned an expert that is not available")
        kept = F.one_hot(param.to(probs.device), num_experts).bool()
        return kept.to(probs), kept
    p = probs * available.to(probs)
    p = p / p.sum(dim=1, keepdim=True)
    if rule == "topk":
        if param > int(available.sum()):
            raise ValueError(f"top-{param} needs {param} experts but only "
                             f"{int(available.sum())} are available")
        kept = torch.zeros_like(p, dtype=torch.bool).scatter(1, p.topk(param, dim=1).indices, True)
    elif rule == "threshold":
        kept = (p >= param) | (p == p.max(dim=1, keepdim=True).values)
    elif rule == "full":
        kept = available.expand_as(p).clone()
    else:
        raise ValueError(f"unknown routing rule {rule!r}")
    kept = kept if keep is None else keep
    w = p * kept
    # probabilities can underflow to 0 on a given set far from the data; the set then
    # shares equally
    w = torch.where(w.sum(dim=1, keepdim=True) > 0, w, kept.to(w))
    return w / w.sum(dim=1, keepdim=True), kept


def draw_experts(probs, uniforms, available=None):
    """Each row's expert (N,), drawn from its probabilities (N, K) by inverting their
    cumulative sum at the row's uniform number in [0, 1) (N,): the row's own random
    stream decides, so a row draws the same expert in any batch and any process.
    Experts that are not `available` (K,) have their probability renormalised away."""
    if available is not None:
        probs = probs * available.to(probs)
    cumulative = probs.double().cumsum(1)
    cumulative = cumulative / cumulative[:, -1:]
    chosen = (cumulative <= uniforms.double()[:, None]).sum(1)
    # u just below 1 with rounding in the cumulative sum: the last expert that has mass
    last = probs.shape[1] - 1 - (probs.flip(1) > 0).double().argmax(1)
    return torch.minimum(chosen, last)


def mix(weights, expert_fn, x, *args):
    """sum_j weights[:, j] * expert_fn(j, x, *args), running each expert only on the
    samples it has weight for.

    Expert j runs once, on the sub-batch gathered by its non-zero weights; top-1
    routing over K experts thus costs one expert's work per sample, not K."""
    out = torch.zeros_like(x)
    for j in torch.nonzero(weights.sum(0) > 0).flatten().tolist():
        idx = torch.nonzero(weights[:, j] > 0).flatten()
        sub = [a[idx] if torch.is_tensor(a) and a.dim() > 0 else a for a in args]
        out.index_add_(0, idx, expand(weights[idx, j], x) * expert_fn(j, x[idx], *sub))
    return out


MAX_CFG_SCALE = 100


@dataclass(frozen=True)
class Ensemble:
    """A routed ensemble: what its velocity field needs, and nothing about files.

    experts: {router output k: anything with .velocity(x_t, t, y)}, any subset of the K
    outputs (a lost expert is renormalised away); router: (x, t, ids) -> logits (N, K),
    or None for oracle (and assigned) routing; rule: (rule, param) from parse_routing,
    or ('assigned', experts (N,)) once the draw rule has drawn; condition:
    condition.py's object, which turns ids into the networks' inputs and gives the
    null. The monolith is the K = 1 case: one expert and ('oracle', 0)."""
    experts: dict
    router: object
    rule: tuple
    condition: object
    num_experts: int
    cfg_scale: float = 1.0
    cfg_routing: str = "shared"   # or "independent": how guidance's unconditional branch is routed
    router_every: int = 1         # evaluate the router at every m-th velocity call, held between

    def __post_init__(self):
        # guidance extrapolates v_cond - v_uncond: past 100 it only saturates the images
        scale = self.cfg_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not 0 <= scale <= MAX_CFG_SCALE:   # False for NaN too
            raise ValueError(f"the guidance scale must be a number in 0..{MAX_CFG_SCALE}, "
                             f"not {scale!r}")
        if self.cfg_routing not in ("shared", "independent"):
            raise ValueError(f"cfg_routing is shared or independent, not {self.cfg_routing!r}")
        if self.cfg_routing == "independent" and self.rule[0] == "draw":
            raise ValueError("the draw rule runs each image's one expert for both of "
                             "guidance's branches: cfg_routing 'shared', not 'independent'")

    @cached_property   # read at every velocity evaluation: built once
    def available(self):
        present = torch.zeros(self.num_experts, dtype=torch.bool)
        present[list(self.experts)] = True
        return present


def ensemble_weights(ensemble, x, t, ids, null_ids=None):
    """Mixture weights (N, K) for the rows (x, ids) at flow times t (N,); with guidance
    (null_ids given) for the doubled batch [cond; uncond], both halves on the
    conditional rows' experts unless cfg_routing is 'independent'."""
    (rule, param), available, guided = ensemble.rule, ensemble.available, null_ids is not None
    xs, ts, all_ids = (torch.cat([x, x]), torch.cat([t, t]),
                       torch.cat([ids, null_ids])) if guided else (x, t, ids)
    if rule in ("oracle", "assigned"):   # no router needed: all weight on one expert
        # guidance's unconditional half follows each row's own expert (DDM's per-expert
        # guidance, as top-1 shared)
        param = torch.cat([param, param]) if guided and rule == "assigned" else param
        return route(torch.zeros(xs.shape[0], len(available)), rule, param, available)[0]
    probs = ensemble.router(xs, ts, all_ids).float().softmax(1).cpu()
    if not guided or ensemble.cfg_routing == "independent":
        return route(probs, rule, param, available)[0]
    p_cond, p_uncond = probs.chunk(2)
    w_cond, chosen = route(p_cond, rule, param, available)   # one expert set per sample
    return torch.cat([w_cond, route(p_uncond, rule, param, available, keep=chosen)[0]])


def ensemble_velocity(ensemble, x, t, ids):
    """(guided velocity of the routed ensemble at flow time t, the conditional rows'
    weights (N, K)).

    t is one flow time for the batch or one per row (N,); ids are condition ids
    (condition.py)."""
    n, guided, condition = x.shape[0], ensemble.cfg_scale != 1, ensemble.condition
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(n)
    null_ids = condition.null(n, ids.device) if guided else None
    weights = ensemble_weights(ensemble, x, t, ids, null_ids)
    y = condition.expert_input(torch.cat([ids, null_ids]) if guided else ids)
    xs, ts = (torch.cat([x, x]), torch.cat([t, t])) if guided else (x, t)

    def expert_velocity(j, rows, t_rows, y_rows):
        return ensemble.experts[j].velocity(rows, t_rows, y_rows)

    v = mix(weights.to(x), expert_velocity, xs, ts, y)   # sum_k w_k v_k
    if guided:
        v_cond, v_uncond = v.chunk(2)
        v = v_uncond + ensemble.cfg_scale * (v_cond - v_uncond)
    return v, weights[:n]


def held(router, every):
    """The router evaluated at every `every`-th call, its logits held in between: p(k |
    x_t, t) moves slowly along one trajectory, and each skipped call saves a router
    forward."""
    last = {"calls": 0, "logits": None}

    def route(x, t, ids):
        if last["calls"] % every == 0:
            last["logits"] = router(x, t, ids)
        last["calls"] += 1
        return last["logits"]
    return route


def drawn(ensemble, noise, ids, uniforms):
    """The ensemble under the draw rule made concrete: each row's expert drawn from the
    router's p(k | x_1, 1, y) at the noise itself (t = 1, where it is p(k | y)) with the
    row's uniform number, then no router: ('assigned', experts)."""
    if uniforms is None or uniforms.shape != (noise.shape[0],):
        raise ValueError("the draw rule needs one uniform number per image (draws)")
    t = torch.ones(noise.shape[0], dtype=noise.dtype, device=noise.device)
    probs = ensemble.router(noise, t, ids).float().softmax(1).cpu()
    chosen = draw_experts(probs, uniforms.cpu(), ensemble.available)
    return replace(ensemble, rule=("assigned", chosen), router=None)


@torch.no_grad()
def sample(ensemble, noise, ids, steps, *, solver="euler", time_shift=1.0, progress=None,
           draws=None):
    """Sample the routed ensemble from `noise` for the condition ids (N,). Returns (x0,
    usage counts (T_BINS, K)).

    draws: each row's uniform number in [0, 1), which the draw rule needs (its own
    random stream per image, so a row draws the same expert in any batch)."""
    usage = torch.zeros(T_BINS, ensemble.num_experts)
    if ensemble.rule[0] == "draw":
        ensemble = drawn(ensemble, noise, ids, draws)
    if ensemble.router is not None and ensemble.router_every > 1:   # held per batch of rows
        ensemble = replace(ensemble, router=held(ensemble.router, ensemble.router_every))

    def velocity(x, t):
        v, weights = ensemble_velocity(ensemble, x, t, ids)
        usage[t_bin(t)] += (weights > 0).sum(0)
        return v

    return sample_flow(velocity, noise, steps, solver=solver, time_shift=time_shift,
                       progress=progress), usage


def routing_function(router, condition):
    """(x, t, ids) -> the router's logits, reading the condition the router was trained
    on; None without a router."""
    if router is None:
        return None
    # a condition-blind router reads None
    reader = condition if router.condition.kind == condition.kind else router.condition
    return lambda x, t, ids: router.net(x, t, reader.router_input(ids))
