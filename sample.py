"""Stage 4: sample from the ensemble of experts, routed at every step.

Reads runs/experts/*/ckpt.pt and runs/router/ckpt.pt; writes runs/samples/NAME.npz (ADM's
batch format: arr_0 uint8 N x H x W x C, arr_1 labels), NAME.png (a grid) and NAME.json
(settings, which experts were missing, and how often each expert was used per t-bin).

At every Euler step of the rectified-flow ODE (t = 1 -> 0) the router gives p(k | x_t, t[, y])
for each sample, the routing rule turns it into mixture weights, and each expert that got
any weight runs once on the sub-batch routed to it. DDPM (epsilon) experts and flow experts
mix freely: diffusion.velocity turns each into a flow velocity by exact SNR matching.

Classifier-free guidance (--cfg-scale S, S = 1 is none) is exact for the ensemble: the
conditional flow mixes v_k(x, y) with p(k | x_t, y), the unconditional flow mixes v_k(x, null)
with p(k | x_t), and v = v_uncond + S (v_cond - v_uncond). With a label-blind router both
weightings coincide and this is DDM's per-expert guidance followed by mixing.

    python sample.py                                  # every expert, top-1 routing, 64 images
    python sample.py --routing full --cfg-scale 2     # the exact mixture, guided
    python sample.py --routing oracle:2 --class 7     # expert 2 alone, sevens only
    python sample.py --experts all                    # the monolith baseline, same sampler
    python sample.py --experts 0,2,3                  # a lost expert: the others are renormalised
    python sample.py --prompt "the digit 3" --prompt "a handwritten eight" --clip-pretrained FILE   # text experts
"""
import argparse
import os

import numpy as np
import torch
from tqdm import tqdm

from data import UsageError, atomic_json, atomic_path, describe, expert_dir, load_checkpoint, router_dir, run_main, save_grid, to_uint8
from diffusion import mix, parse_routing, routing_weights, sample_flow, velocity
from data import DIGIT_PHRASES, digit_caption
from model import Router, load_model
from text import TextEncoder, encoder_spec

T_BINS = 5


def load_experts(run_dir, which):
    """{cluster id (int) or 'all': model} for --experts ('' = every numbered folder in runs/experts/)."""
    root = os.path.join(run_dir, "experts")
    if which:
        names = [name.strip() for name in which.split(",") if name.strip()]
    else:
        names = sorted((d for d in (os.listdir(root) if os.path.isdir(root) else []) if d.isdigit()), key=int)
        names = [d for d in names if os.path.isfile(os.path.join(root, d, "ckpt.pt"))]
        if not names:
            raise UsageError(f"no experts in {root}: run train_expert.py first")
    if "all" in names and len(names) > 1:
        raise UsageError("--experts all is the monolith alone; it does not mix with cluster experts")
    experts = {}
    for name in names:
        if name != "all" and not name.isdigit():
            raise UsageError(f"--experts takes cluster ids (e.g. 0,2,3) or 'all', not {name!r}")
        path = os.path.join(expert_dir(run_dir, name), "ckpt.pt")
        if not os.path.isfile(path):
            raise UsageError(f"no expert {name} at {path}")
        load_checkpoint(path, f"expert {name}")   # a clean error for an unreadable file
        experts[name if name == "all" else int(name)] = load_model(path)
    return experts


def check_compatible(experts, router_config):
    """Every expert (and the router) must describe the same images, classes and partition; say what differs."""
    keys = ["image_size", "channels", "num_classes", "data", "cluster_fingerprint", "conditioning", "text_encoder"]
    (ref_name, ref), *others = experts.items()
    for name, expert in others:
        for key in keys:
            a, b = expert.config.get(key), ref.config.get(key)
            if a != b:
                show = (lambda v: describe(v)) if key == "data" else (lambda v: v)
                raise UsageError(f"expert {name} does not match expert {ref_name}: {key} {show(a)} vs {show(b)}")
    for name, expert in experts.items():
        if expert.objective not in ("fm", "ddpm"):
            raise UsageError(f"expert {name} has an unknown objective/time convention {expert.objective!r}")
    if router_config is not None:
        if router_config["cluster_fingerprint"] != ref.config["cluster_fingerprint"]:
            raise UsageError("the router was trained on another clustering than the experts (cluster file fingerprints differ)")
        if router_config["data"] != ref.config["data"]:
            raise UsageError(f"the router was trained on {describe(router_config['data'])}, the experts on {describe(ref.config['data'])}")
        if router_config["conditioning"] == "text" and router_config.get("text_encoder") != ref.config.get("text_encoder"):
            raise UsageError(f"the router reads captions with {router_config.get('text_encoder')}, "
                             f"the experts with {ref.config.get('text_encoder')}")
        if router_config["conditioning"] in ("class", "text") and router_config["conditioning"] != ref.config.get("conditioning", "class"):
            raise UsageError(f"a {router_config['conditioning']}-conditioned router cannot route {ref.config.get('conditioning')}-conditioned experts")


def null_like(y, null_label):
    """The 'no condition' of a batch: the null class for labels, an all-zero caption for text embeddings."""
    return torch.zeros_like(y) if y.is_floating_point() else torch.full_like(y, null_label)


@torch.no_grad()
def sample(experts, router, routing, noise, y, steps, k, cfg_scale=1.0, null_label=None, progress=None, router_y=None):
    """Euler-sample the routed ensemble. Returns (x0, usage counts (T_BINS, k)).

    experts: {cluster index: expert callable with .objective}; router: callable (x, t, y) ->
    logits (N, k), unused (may be None) for oracle routing; routing: (rule, param) from
    diffusion.parse_routing; y: labels (N,), caption tokens (N, L, W) or None; null_label: the
    null class, for CFG; router_y: what the router reads, when not y (a caption's pooled embedding).
    The monolith is the k = 1 case: one expert, routing ('oracle', 0).
    """
    available = torch.zeros(k, dtype=torch.bool)
    available[list(experts)] = True
    rule, param = routing
    usage = torch.zeros(T_BINS, k)
    guided = cfg_scale != 1 and y is not None
    router_y = y if router_y is None else router_y

    def ensemble_velocity(x, t):
        n = x.shape[0]
        y_all, router_y_all = y, router_y
        if guided:   # conditional and unconditional rows in one batch: each expert still runs once
            x, y_all = torch.cat([x, x]), torch.cat([y, null_like(y, null_label)])
            router_y_all = torch.cat([router_y, null_like(router_y, null_label)]) if router_y is not None else None
        if rule == "oracle":   # no router needed: all weight on one expert
            weights = routing_weights(torch.zeros(x.shape[0], k), rule, param, available)
        else:
            probs = router(x, torch.full((x.shape[0],), t, device=x.device), router_y_all).float().softmax(1).cpu()
            weights = routing_weights(probs, rule, param, available)
        usage[min(int(t * T_BINS), T_BINS - 1)] += (weights[:n] > 0).sum(0)
        v = mix(weights.to(x), lambda j, xs, ys: velocity(experts[j], xs, t, ys), x, y_all)
        if guided:
            v_cond, v_uncond = v.chunk(2)
            return v_uncond + cfg_scale * (v_cond - v_uncond)
        return v

    return sample_flow(ensemble_velocity, noise, steps, progress), usage


def main(args):
    device = torch.device(args.device)
    experts = load_experts(args.run_dir, args.experts)
    monolith = "all" in experts
    first = next(iter(experts.values()))
    cfg = first.config
    try:
        routing = parse_routing(args.routing)
    except ValueError as e:
        raise UsageError(str(e))

    name = args.out or os.path.join(args.run_dir, "samples", ("monolith" if monolith else args.routing.replace(":", "-")) + ".npz")
    if not name.endswith(".npz"):
        raise UsageError(f"--out must end in .npz, got {name}")
    router, router_config, k = None, None, cfg.get("k", 1)
    if monolith:   # the same sampler: one expert, all weight on it
        experts, k, routing = {0: experts["all"]}, 1, ("oracle", 0)
        print("monolith: one model, no router")
    else:
        missing = sorted(set(range(k)) - set(experts))
        if missing:
            print(f"missing experts: {', '.join(map(str, missing))}; weights are renormalised over {', '.join(map(str, sorted(experts)))}")
        if routing[0] == "oracle" and routing[1] not in experts:
            raise UsageError(f"oracle:{routing[1]} names an expert that is not available (have {', '.join(map(str, sorted(experts)))})")
        if routing[0] == "topk" and routing[1] > len(experts):
            raise UsageError(f"top-{routing[1]} routing needs {routing[1]} experts; only {len(experts)} are available")
        if routing[0] != "oracle":
            router_path = args.router or os.path.join(router_dir(args.run_dir), "ckpt.pt")
            if not os.path.isfile(router_path):
                raise UsageError(f"no router at {router_path}: run train_router.py first (or use --routing oracle:K)")
            ckpt = load_checkpoint(router_path, "router")
            router_config = ckpt["config"]
            router = Router(**ckpt["model_args"])
            router.load_state_dict(ckpt["model"])
            router.to(device).eval()
            if router_config["k"] != k:
                raise UsageError(f"the router predicts {router_config['k']} clusters, the experts were trained on {k}")
    check_compatible(experts, router_config)
    for expert in experts.values():
        expert.to(device)

    num_classes, size, channels = cfg["num_classes"], cfg["image_size"], cfg["channels"]
    if args.class_label is not None and not 0 <= args.class_label < max(num_classes, 1):
        raise UsageError(f"--class {args.class_label} is not a class of these experts ({num_classes} classes)"
                         if num_classes else "--class: these experts are not class-conditional")
    g = torch.Generator().manual_seed(args.seed)
    labels = None
    if num_classes:
        labels = torch.full((args.n,), args.class_label) if args.class_label is not None else torch.randint(num_classes, (args.n,), generator=g)
    prompts, tokens, pooled = read_prompts(args, cfg)
    prompt_of = torch.arange(args.n) % len(prompts) if prompts else None
    if prompts and cfg.get("data_spec") == "digits-captions":   # captions made from labels: keep the labels
        known = {digit_caption(c, i): c for c in range(10) for i in range(len(DIGIT_PHRASES))}
        if all(p in known for p in prompts):
            labels = torch.tensor([known[p] for p in prompts])[prompt_of]
    out, usage = [], torch.zeros(T_BINS, k)
    bar = tqdm(total=args.steps * -(-args.n // args.batch_size), desc="sampling")
    for start in range(0, args.n, args.batch_size):
        n = min(args.batch_size, args.n - start)
        noise = torch.randn(n, channels, size, size, generator=g).to(device)
        y = labels[start:start + n].to(device) if labels is not None and num_classes else None
        router_y = None
        if prompts:
            y = tokens[prompt_of[start:start + n]].to(device)
            router_y = pooled[prompt_of[start:start + n]].to(device) if router_config and router_config["conditioning"] == "text" else None
        x, used = sample(experts, router, routing, noise, y, args.steps, k, args.cfg_scale, num_classes, bar, router_y)
        out.append(x.float().cpu())
        usage += used
    bar.close()
    x = torch.cat(out)

    with atomic_path(name) as tmp:
        arrays = {"arr_0": to_uint8(x)}
        if labels is not None:
            arrays["arr_1"] = labels.numpy()
        np.savez(tmp, **arrays)
    stem = name[:-4]
    order = torch.argsort(labels, stable=True) if labels is not None else torch.arange(len(x))
    save_grid(x[order][:256], stem + ".png", nrow=16)
    for i, prompt in enumerate(prompts):   # one grid per prompt
        save_grid(x[prompt_of == i][:64], f"{stem}.prompt{i}.png", nrow=8)
    share = (usage / usage.sum(1, keepdim=True).clamp(min=1)).tolist()
    atomic_json({"experts": sorted(map(str, experts)) if not monolith else ["all"], "k": k,
                 "missing": [] if monolith else sorted(set(range(k)) - set(experts)), "routing": args.routing,
                 "router_conditioning": router_config["conditioning"] if router_config else None,
                 "cfg_scale": args.cfg_scale, "steps": args.steps, "n": args.n, "seed": args.seed,
                 "objectives": {str(j): e.objective for j, e in experts.items()},
                 "prompts": prompts, "prompt_index": prompt_of.tolist() if prompts else None,
                 "text_encoder": cfg.get("text_encoder"),
                 "usage_per_t_bin": {"t_bins": [f"[{b / T_BINS:.1f},{(b + 1) / T_BINS:.1f})" for b in range(T_BINS)],
                                     "share": share, "counts": usage.tolist()}}, stem + ".json")
    print(f"wrote {name} ({args.n} images), {stem}.png, {stem}.json")
    if not monolith:
        overall = usage.sum(0) / usage.sum()
        print("expert usage: " + ", ".join(f"{j}: {overall[j]:.0%}" for j in range(k)))


def read_prompts(args, cfg):
    """(prompts, token embeddings (P, L, W), pooled (P, E)) for text experts; ([], None, None) otherwise."""
    prompts = list(args.prompt or [])
    if args.prompts:
        if not os.path.isfile(args.prompts):
            raise UsageError(f"no prompt file at {args.prompts}")
        with open(args.prompts) as f:
            from_file = [line.strip() for line in f if line.strip()]
        if not from_file:
            raise UsageError(f"{args.prompts} holds no prompt (one per line)")
        prompts += from_file
    if cfg.get("conditioning") != "text":
        if prompts:
            raise UsageError("--prompt/--prompts need text-conditional experts; these are "
                             f"{cfg.get('conditioning', 'class')}-conditional")
        return [], None, None
    if not prompts:
        raise UsageError("these experts are text-conditional: give --prompt TEXT (repeatable) or --prompts FILE")
    if any(not p for p in prompts):
        raise UsageError("empty prompt")
    if not args.clip_pretrained:
        raise UsageError(f"pass the experts' text encoder ({cfg['text_encoder']}) with --clip-model and --clip-pretrained")
    if encoder_spec(args.clip_model, args.clip_pretrained) != cfg["text_encoder"]:
        raise UsageError(f"--clip-model/--clip-pretrained give {encoder_spec(args.clip_model, args.clip_pretrained)}, "
                         f"but the experts were trained with {cfg['text_encoder']}")
    tokens, pooled = TextEncoder(args.clip_model, args.clip_pretrained, args.download)(prompts)
    return prompts, tokens, pooled


def build_parser():
    p = argparse.ArgumentParser(prog="sample.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="", help="cluster ids, e.g. 0,2,3 (default: every expert in runs/experts/), or 'all' for the monolith")
    p.add_argument("--router", default=None, help="router checkpoint (default: RUN_DIR/router/ckpt.pt)")
    p.add_argument("--routing", default="top1", help="top1 | top2 | topk:K | full | threshold:TAU | oracle:K "
                                                      "(DDM found top-1 best on ImageNet; full is the exact mixture)")
    p.add_argument("--n", type=int, default=64, help="number of images")
    p.add_argument("--steps", type=int, default=50, help="Euler steps from t=1 to t=0 (DDM used 50)")
    p.add_argument("--cfg-scale", type=float, default=1.0, help="classifier-free guidance scale; 1 means none")
    p.add_argument("--class", dest="class_label", type=int, default=None, help="one label for every image (default: random labels)")
    p.add_argument("--prompt", action="append", help="text experts: a prompt (repeatable); images cycle through the prompts")
    p.add_argument("--prompts", default=None, help="text experts: a file of prompts, one per line")
    p.add_argument("--clip-model", default="ViT-B-32", help="text experts: the open_clip architecture they were trained with")
    p.add_argument("--clip-pretrained", default=None, help="text experts: the same weights file (or 'none' if they used a random tower)")
    p.add_argument("--download", action="store_true", help="allow fetching CLIP weights by tag")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output .npz (default: RUN_DIR/samples/<routing>.npz or monolith.npz)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
