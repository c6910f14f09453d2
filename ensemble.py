"""The routed ensemble as one velocity field: loading experts and router, checking they belong
together, and v(x_t, t, y) = sum_k w_k(x_t, t, y) v_k(x_t, t, y) under a routing rule.

sample.py integrates this field; distill.py regresses a single student onto it. Both read the
same files, so they share this module rather than one stage importing the other.
"""
import os

import torch

from command_line import UsageError
from diffusion import mix, routing_selection, routing_weights
from latents import same_vae
from model import CheckpointError, load
from run_dir import describe, expert_dir, load_checkpoint, router_dir

SINGLE_MODELS = ("all", "distilled")   # expert folders that hold one model of the whole data set, not a cluster's expert


def load_network(path, what, expect):
    """model.load with one-line errors: a missing, unreadable or wrong kind of checkpoint."""
    try:
        return load(load_checkpoint(path, what), expect=expect)
    except CheckpointError as e:
        raise UsageError(f"{what} {path}: {e}")


def load_experts(run_dir, which):
    """{cluster id (int) or a single model's name: Network} for --experts ('' = every numbered folder in runs/experts/)."""
    root = os.path.join(run_dir, "experts")
    if which:
        names = [name.strip() for name in which.split(",") if name.strip()]
        if not names:
            raise UsageError(f"--experts {which!r} names no expert: give cluster ids (e.g. 0,2,3), 'all' or 'distilled', "
                             f"or leave it out for every expert")
    else:
        names = sorted((d for d in (os.listdir(root) if os.path.isdir(root) else []) if d.isdigit()), key=int)
        names = [d for d in names if os.path.isfile(os.path.join(root, d, "ckpt.pt"))]
        if not names:
            raise UsageError(f"no experts in {root}: run train_expert.py first")
    single = [name for name in names if name in SINGLE_MODELS]
    if single and len(names) > 1:
        raise UsageError(f"--experts {single[0]} is one model of the whole data set; it does not mix with other experts")
    experts = {}
    for name in names:
        if name not in SINGLE_MODELS and not (name.isascii() and name.isdigit()):
            raise UsageError(f"--experts takes cluster ids (e.g. 0,2,3), 'all' (the monolith) or 'distilled', not {name!r}")
        path = os.path.join(expert_dir(run_dir, name), "ckpt.pt")
        if not os.path.isfile(path):
            raise UsageError(f"no expert {name} at {path}" + (": run distill.py first" if name == "distilled" else ""))
        experts[name if name in SINGLE_MODELS else int(name)] = load_network(path, f"expert {name}", "dit")
    return experts


def load_router(run_dir, path, num_clusters):
    """The router Network from `path` (default RUN_DIR/router/ckpt.pt), checked to predict `num_clusters` clusters."""
    path = path or os.path.join(router_dir(run_dir), "ckpt.pt")
    if not os.path.isfile(path):
        raise UsageError(f"no router at {path}: run train_router.py first (or use --routing oracle:C)")
    router = load_network(path, "router", "router")
    if router.config["k"] != num_clusters:
        raise UsageError(f"the router predicts {router.config['k']} clusters, the experts were trained on {num_clusters}")
    return router


def check_compatible(experts, router):
    """Every expert (and the router) must describe the same images, condition and partition; say what differs."""
    keys = ["image_size", "channels", "data", "cluster_fingerprint", "condition"]
    (ref_name, ref), *others = experts.items()
    for name, expert in others:
        for key in keys:
            a, b = expert.config.get(key), ref.config.get(key)
            if a != b:
                show = describe if key == "data" else (lambda v: v)
                raise UsageError(f"expert {name} does not match expert {ref_name}: {key} {show(a)} vs {show(b)}")
        if not same_vae(expert.config.get("vae"), ref.config.get("vae")):
            raise UsageError(f"expert {name} and expert {ref_name} were trained in different spaces ({space(expert)} vs {space(ref)}); "
                             f"an ensemble's experts share one VAE")
    if router is None:
        return
    if not same_vae(router.config.get("vae"), ref.config.get("vae")):
        raise UsageError(f"the router reads {space(router)}, the experts were trained in {space(ref)}")
    if router.config["cluster_fingerprint"] != ref.config["cluster_fingerprint"]:
        raise UsageError("the router was trained on another clustering than the experts (cluster file fingerprints differ)")
    if router.config["data"] != ref.config["data"]:
        raise UsageError(f"the router was trained on {describe(router.config['data'])}, the experts on {describe(ref.config['data'])}")
    theirs, ours = router.condition.spec(), ref.condition.spec()
    reads_condition = theirs["kind"] != "none"
    if reads_condition and (theirs["kind"] != ours["kind"] or theirs.get("encoder") != ours.get("encoder")):
        raise UsageError(f"a router conditioned on {theirs} cannot route experts conditioned on {ours}")


def space(network):
    vae = network.config.get("vae")
    return f"the latents of VAE {vae['path']} ({vae['fingerprint'][:10]})" if vae else "pixels"


def routed_weights(router, routing, x, t, ids, available, null_ids, cfg_routing):
    """Mixture weights (N, K) for the rows (x, ids) at flow times t (N,); with guidance (null_ids given) for the doubled batch [cond; uncond]."""
    rule, param = routing
    guided = null_ids is not None
    xs, ts, all_ids = (torch.cat([x, x]), torch.cat([t, t]), torch.cat([ids, null_ids])) if guided else (x, t, ids)
    if rule == "oracle":   # no router needed: all weight on one expert
        return routing_weights(torch.zeros(xs.shape[0], len(available)), rule, param, available)
    probs = router(xs, ts, all_ids).float().softmax(1).cpu()
    if not guided or cfg_routing == "independent":
        return routing_weights(probs, rule, param, available)
    p_cond, p_uncond = probs.chunk(2)
    _, chosen = routing_selection(p_cond, rule, param, available)   # one expert set per sample, from p(k | x_t, y)
    return torch.cat([routing_weights(p_cond, rule, param, available),
                      routing_weights(p_uncond, rule, param, available, keep=chosen)])


def ensemble_velocity(experts, router, routing, x, t, ids, *, condition, available, cfg_scale=1.0, cfg_routing="shared"):
    """(guided velocity of the routed ensemble at flow time t, the conditional rows' weights (N, K)).

    t is one flow time for the batch or one per row (N,); ids are condition ids (condition.py)."""
    n, guided = x.shape[0], cfg_scale != 1
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(n)
    null_ids = condition.null(n, ids.device) if guided else None
    weights = routed_weights(router, routing, x, t, ids, available, null_ids, cfg_routing)
    y = condition.expert_input(torch.cat([ids, null_ids]) if guided else ids)
    xs, ts = (torch.cat([x, x]), torch.cat([t, t])) if guided else (x, t)
    v = mix(weights.to(x), lambda j, rows, t_rows, y_rows: experts[j].velocity(rows, t_rows, y_rows), xs, ts, y)
    if guided:
        v_cond, v_uncond = v.chunk(2)
        v = v_uncond + cfg_scale * (v_cond - v_uncond)
    return v, weights[:n]
