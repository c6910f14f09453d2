"""Stage 4: sample from the ensemble of experts, routed at every step.

Reads runs/experts/*/ckpt.pt and runs/router/ckpt.pt (or a release's, export.py); writes
runs/samples/NAME.npz (ADM's batch format: arr_0 uint8 N x H x W x C, arr_1 labels),
NAME.png (a grid) and NAME.json (settings, which experts were missing, a digest of each
network's weights, and how often each expert was used per t-bin).

At every evaluation of the rectified-flow ODE (t = 1 -> 0; ab2, Euler or Heun steps)
the router gives p(k | x_t, t[, y]) for each sample at the point being evaluated, the
routing rule turns it into mixture weights, and each expert that got any weight runs once
on the sub-batch routed to it. DDPM (epsilon) experts and flow experts mix freely: each expert's
objective turns its output into a flow velocity (exact SNR matching for DDPM).

Classifier-free guidance (--cfg-scale S, S = 1 is none): v = v_uncond + S (v_cond - v_uncond),
where the conditional flow mixes v_k(x, y) with weights from p(k | x_t, y) and the
unconditional flow mixes v_k(x, null) with weights from p(k | x_t). With --routing full this is
the exact guided mixture. With top-k routing the two branches may pick different experts, and
then v_cond - v_uncond also carries the disagreement *between* experts, amplified by S.
--cfg-routing says how the unconditional branch is routed:
  shared       one expert set per sample, chosen from the conditional posterior; the
               unconditional weights are p(k | x_t) renormalised over that set. With top-1 this
               is DDM's per-expert guidance on the chosen expert.
  independent  each branch chooses its own top-k (not with draw or oracle, which run one
               expert per image for both branches).

    python sample.py                                  # every expert, top-1 routing, 64 images
    python sample.py --routing full --cfg-scale 2     # the exact mixture, guided
    python sample.py --routing draw                   # the exact mixture at one expert's cost
    python sample.py --routing oracle:2 --class 7     # expert 2 alone, sevens only
    python sample.py --solver euler --steps 50 --time-shift 1   # DDM's sampler: 50 Euler steps
    python sample.py --experts all                    # the monolith baseline, same sampler
    python sample.py --experts distilled              # the student distill.py made of the ensemble
    python sample.py --experts all --vae sd-vae-ft-ema --class 207 --cfg-scale 4
                                            # an imported official DiT-XL/2, decoded
    python sample.py --experts 0,2,3                  # a lost expert: the others are renormalised
    python sample.py --prompt "the digit 3" --prompt "a handwritten eight" --clip-pretrained FILE   # text experts
    torchrun --nproc_per_node=8 sample.py --num-samples 50000 --routing top1   # FID-50k on 8 GPUs: one batch file

Under torchrun each process samples every world-th batch of --batch-size images and rank 0
writes the one batch: every image's label and noise depend on --seed and its index alone,
so the images equal one process's bit for bit (at equal threads per process), and the record
holds the expert usage of all processes.
"""
import argparse
import contextlib
import hashlib
import os
import uuid

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from diffusion import MAX_SHIFT, MAX_STEPS, SOLVERS, T_BIN_NAMES, T_BINS
import routing
from routing import MAX_CFG_SCALE, Ensemble, routing_function
from plumbing.checkpoint import networks_digests
from plumbing.command_line import (Parser, UsageError, device_type, float_in,
                                   int_at_least, int_in, run_main, seed_type)
from plumbing.data.datasets import to_uint8
from plumbing.condition import ClusterCondition, ClusterView
from plumbing.ensemble import (SINGLE_MODELS, assemble, load_experts, load_router,
                               release_text_tower, release_vae, routing_rule, row_flops)
from plumbing.data.latents import resolve_vae
from plumbing.run_dir import atomic_json, atomic_path, check_writable_dir, save_grid
from plumbing.distributed import scheduler_job, setup_distributed


def check_rule_flags(routing, cfg_routing, router_every):
    """The rules of one expert per image (draw, oracle) leave --cfg-routing independent and
    --router-every nothing to do: refused in one line, not ignored."""
    rule_name = routing.split(":")[0]
    if rule_name not in ("draw", "oracle"):
        return
    if cfg_routing == "independent":
        raise UsageError(f"--cfg-routing independent lets guidance's unconditional branch pick "
                         f"its own experts; --routing {rule_name} runs one expert per image for "
                         "both branches: leave --cfg-routing shared")
    if router_every > 1:
        reads = "once per image, at t = 1" if rule_name == "draw" else "never"
        raise UsageError(f"--router-every {router_every}: --routing {rule_name} reads the "
                         f"router {reads}")


def setup(run_dir, which, router_path, routing_flag):
    """(experts by router output, router Network or None, routing, expert names by
    router output): the experts `which` of the run and their router, under the rule
    `routing_flag`."""
    # the monolith or the distilled student: the same sampler, one model, all weight on it
    if which in SINGLE_MODELS:
        routing = routing_rule(routing_flag)
        model = load_experts(run_dir, which)[which]
        if model.condition.kind == ClusterCondition.kind:
            return cluster_views(run_dir, model, router_path, routing)
        print(f"{'monolith' if which == 'all' else 'distilled student'}: one model, no router")
        return {0: model}, None, ("oracle", 0), [which]
    experts, router, routing, names = assemble(run_dir, which, router_path, routing_flag)
    missing = [name for output, name in enumerate(names) if output not in experts]
    present = [names[output] for output in sorted(experts)]
    if missing:
        print(f"missing experts: {', '.join(missing)}; weights are renormalised over "
              f"{', '.join(present)}")
    return experts, router, routing, names


def cluster_views(run_dir, monolith, router_path, routing):
    """A cluster-conditioned monolith (the information control) as K experts: its view of
    each cluster, routed by the run's router exactly as the experts of those clusters."""
    k = monolith.condition.k
    router = load_router(run_dir, router_path) if routing[0] != "oracle" else None
    names = [str(c) for c in range(k)]
    routes = [m["name"] for m in router.config.get("experts", [])] if router else names
    if routes != names:
        raise UsageError(f"the router routes {', '.join(routes)}; the cluster-conditioned "
                         f"monolith knows clusters {', '.join(names)}")
    print(f"cluster-conditioned monolith: its {k} cluster views, routed as experts")
    return {c: ClusterView(monolith, c) for c in range(k)}, router, routing, names


# far more prompts than any sampling run takes; bounds what is read into memory
MAX_PROMPT_FILE_BYTES = 16 * 2 ** 20


def read_prompts(given, path):
    """The prompts given on the command line, then those of the file at `path` (one a
    line)."""
    prompts = list(given or [])
    if path:
        if os.path.isfile(path) and os.path.getsize(path) > MAX_PROMPT_FILE_BYTES:
            raise UsageError(f"{path} is {os.path.getsize(path) / 2**20:.0f} MiB; a "
                             "prompt file is read whole, so it may hold at most "
                             f"{MAX_PROMPT_FILE_BYTES // 2**20} MiB (one prompt per "
                             "line)")
        try:
            with open(path, encoding="utf-8") as f:
                from_file = [line.strip() for line in f if line.strip()]
        except FileNotFoundError:
            raise UsageError(f"no prompt file at {path}")
        except (UnicodeDecodeError, IsADirectoryError) as e:
            raise UsageError(f"cannot read prompt file {path}: {type(e).__name__} "
                             "(expected UTF-8 text, one prompt per line)")
        if not from_file:
            raise UsageError(f"{path} holds no prompt (one per line)")
        prompts += from_file
    if any(not p.strip() for p in prompts):
        raise UsageError("empty prompt")
    return prompts


def main(args):
    # Processes: one, or torchrun's (each samples every world-th batch; rank 0 writes)
    rank, world, device = setup_distributed() if "RANK" in os.environ else (0, 1, None)
    device = device if world > 1 else torch.device(args.device)

    # Output: where the batch goes, checked before any network is read
    default = {"all": "monolith", "distilled": "distilled"}.get(args.experts.strip()) or args.routing.replace(":", "-")
    name = args.out or os.path.join(args.run_dir, "samples", default + ".npz")
    if not name.endswith(".npz") or os.path.isdir(name):
        raise UsageError(f"--out must be a file name ending in .npz, got {name}")
    check_writable_dir(os.path.dirname(os.path.abspath(name)), "--out")
    check_rule_flags(args.routing, args.cfg_routing, args.router_every)

    # Ensemble: the experts and their router, checked to belong together; the VAE that
    # decodes latent experts
    which = args.experts.strip()
    experts, router, rule, names = setup(args.run_dir, which, args.router, args.routing)
    digests = networks_digests(experts, router, names)   # before any cast to the sampling device
    num_experts = len(names)
    ref = next(iter(experts.values()))
    size, channels = ref.config["image_size"], ref.config["channels"]
    # latent experts: decoded to images here
    vae = resolve_vae(args.vae or release_vae(args.run_dir), ref.config.get("vae"), args.download,
                      device)
    # an imported official model knows no data set
    data_shape = (ref.config.get("data") or {}).get("shape")
    image_channels = data_shape[0] if data_shape else (vae.in_channels if vae else channels)
    image_size = size * (vae.downsample if vae else 1)
    # the images kept as uint8 until written, and the float ones of a batch
    need = (args.n + 4 * args.batch_size) * image_channels * image_size ** 2
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory // 2:
        raise UsageError(f"--n {args.n} images of "
                         f"{image_channels}x{image_size}x{image_size} need about "
                         f"{need / 2 ** 30:.1f} GiB, more than half of this machine's "
                         f"{memory / 2 ** 30:.0f} GiB; sample in several batches of "
                         "files (--seed)")

    # Condition: what each image is asked for (labels drawn as the data's, or prompts)
    prompts = read_prompts(args.prompt, args.prompts)
    condition = ref.condition.with_prompts(
        prompts, args.negative_prompt, data_spec=ref.config.get("data_spec"), run_dir=args.run_dir,
        clip_model=args.clip_model, clip_pretrained=args.clip_pretrained,
        download=args.download,
        tower=None if args.clip_pretrained or not prompts else release_text_tower(args.run_dir))
    if router is not None:
        router.to(device)
    ensemble = Ensemble(experts, routing_function(router, condition), rule, condition,
                        num_experts, args.cfg_scale, args.cfg_routing, args.router_every)
    for expert in experts.values():
        expert.to(device)


    # Loop: the routed ODE, a batch of noise at a time. Every image's label and noise depend
    # on the seed and its index alone, and a batch is the same images in any process, so
    # any number of processes draws the one-process batch bit for bit
    ids = condition.requests(args.n, torch.Generator().manual_seed(args.seed), args.class_label)
    per_row = row_flops(ensemble.experts, ensemble.router, condition, ref, device)
    batches = [np.arange(s, min(s + args.batch_size, args.n))
               for s in range(0, args.n, args.batch_size)][rank::world]
    out, usage = {}, torch.zeros(T_BINS, num_experts)
    bar = tqdm(total=args.steps * len(batches), desc="sampling", disable=rank != 0)
    for idx in batches:
        noise = image_noise(args.seed, idx, (channels, size, size)).to(device)
        x, used = routing.sample(ensemble, noise, ids[idx].to(device), args.steps,
                                 solver=args.solver, time_shift=args.time_shift, progress=bar,
                                 draws=expert_draws(args.seed, idx))
        out[int(idx[0])] = to_uint8((vae.decode(x, image_channels) if vae else x).float().cpu())
        usage += used
    bar.close()
    out, usage = gathered(out, usage, world)
    if rank != 0:
        return
    evaluations = args.steps * SOLVERS[args.solver]
    # the draw rule reads the router once per image, at t = 1
    router_calls = 1 if rule[0] == "draw" else -(-evaluations // args.router_every)
    guided = 2 if args.cfg_scale != 1 else 1
    cost = sampling_cost(usage, per_row, args.n, router_calls, evaluations, guided,
                         next(iter(experts)))

    # Write: the ADM .npz, a grid and the record of what drew them
    networks = {"router_outputs": names, "router_condition": router.condition.kind if router else None,
                "weights": digests}
    settings = {"routing": args.routing, "cfg_scale": args.cfg_scale,
                "cfg_routing": args.cfg_routing, "solver": args.solver,
                "time_shift": args.time_shift, "steps": args.steps,
                "network_evaluations": args.steps * SOLVERS[args.solver], "n": args.n,
                "seed": args.seed, "router_every": args.router_every,
                "class_label": args.class_label, "negative_prompt": args.negative_prompt, **cost}
    print(f"sampling cost: {cost['sampling_flops_per_image'] / 1e9:.4g} GFLOPs per "
          f"image, router included: {cost['cost_vs_one_expert']:.2f}x one expert's")
    single = which if which in SINGLE_MODELS else None
    images = np.concatenate([out[start] for start in sorted(out)])
    write_outputs(name, images, ids, ensemble, prompts, usage, networks,
                  {"single": single, "processes": world, **settings})


def image_noise(seed, indices, shape):
    """The initial noise of the images at these indices: each image's own generator, seeded
    by (seed, index), so that image i starts from the same noise whichever process draws it
    (with whichever others)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1))
        for i in indices])


def expert_draws(seed, indices):
    """Each image's uniform number for the draw rule, from a stream of its own seeded by
    (seed, index) and apart from its noise's: image i draws the same expert whichever
    process samples it."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{seed}:{i}:expert".encode()).digest()[:8], "little") >> 1))
        for i in indices])


def gathered(out, usage, world):
    """Every process's {first index: uint8 batch} and the expert usage summed, at rank 0
    (the one process's own where there is one)."""
    if world == 1:
        return out, usage
    parts = [None] * world
    dist.all_gather_object(parts, out)
    dist.all_reduce(usage)
    return {start: batch for part in parts for start, batch in part.items()}, usage


def sampling_cost(usage, per_row, n, router_calls, evaluations, guided, ref_output):
    """The matrix FLOPs per image this batch of n ran, router included: every row each
    expert ran (usage: the conditional rows; with guidance, guided = 2, the unconditional
    rows count as many), the router's evaluations of each image (held ones skipped), and
    that over one expert sampling alone (the monolith's cost, top-1's were the router free)."""
    experts = sum(float(usage[:, k].sum()) * flops for k, flops in per_row[0].items())
    flops = round(guided * (experts + per_row[1] * router_calls * n) / n)
    one = evaluations * per_row[0][ref_output]
    return {"sampling_flops_per_image": flops, "one_expert_flops_per_image": one,
            "cost_vs_one_expert": flops / one}


def grid_rows(labels, n, width=16):
    """(indices, row length) of the batch's grid: one row per requested class, as many
    of each as every class has (<= width)."""
    if labels is None:
        return torch.arange(min(n, width * width)), width
    classes = labels.unique()
    per_class = min(width, min(int((labels == c).sum()) for c in classes))
    return torch.cat([torch.nonzero(labels == c).flatten()[:per_class] for c in classes]), per_class


def as_floats(images):
    """uint8 (N, H, W, C) back to floats in [-1, 1] (N, C, H, W), for a grid."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1


def write_outputs(name, images, ids, ensemble, prompts, usage, networks, settings):
    """NAME.npz (ADM format), NAME.json and NAME.png, replaced together; one grid per
    prompt; npz and json share a run id.

    networks: the record's fields on the networks drawn from (router_outputs: the expert
    each router output stands for; router_condition; weights); settings: the sampler's
    (single: the one model of all data sampled without a router)."""
    run_id = uuid.uuid4().hex
    experts, condition, names = ensemble.experts, ensemble.condition, networks["router_outputs"]
    labels = condition.labels(ids)
    stem = name[:-4]
    single = settings.pop("single")
    # all three are written under temporary names and renamed only once every one is
    # complete: a failed write replaces none of the previous batch's files, so NAME.npz
    # and NAME.json never come from two runs
    with contextlib.ExitStack() as stack:
        npz, record, png = (stack.enter_context(atomic_path(p))
                            for p in (name, stem + ".json", stem + ".png"))
        share = (usage / usage.sum(1, keepdim=True).clamp(min=1)).tolist()
        used = [single] if single else [names[output] for output in sorted(experts)]
        missing = [] if single else [n for output, n in enumerate(names) if output not in experts]
        models = "one model (no ensemble)" if single else \
            f"an ensemble: {len(experts)} of {usage.shape[1]} experts"
        usage_record = {"t_bins": T_BIN_NAMES, "share": share, "counts": usage.tolist()}
        atomic_json({"run_id": run_id, "experts": used, "k": usage.shape[1],
                     "router_outputs": names, "missing": missing,
                     "router_condition": networks["router_condition"],
                     "condition": condition.spec(), **settings, "models": models,
                     "objectives": {names[j]: e.objective.name for j, e in experts.items()},
                     "vae": next(iter(experts.values())).config.get("vae"),
                     "weights": networks["weights"],
                     "prompts": prompts, "prompt_index": ids.tolist() if prompts else None,
                     "job": scheduler_job(),
                     "usage_per_t_bin": usage_record}, record)
        arrays = {"arr_0": images, "run_id": np.array(run_id)}
        if labels is not None:
            arrays["arr_1"] = labels.numpy()
        np.savez(npz, **arrays)
        rows, row_length = grid_rows(labels, len(images))
        save_grid(as_floats(images[rows.numpy()]), png, nrow=row_length)
    for i, _ in enumerate(prompts):   # one grid per prompt
        save_grid(as_floats(images[torch.nonzero(ids == i).flatten()[:64].numpy()]),
                  f"{stem}.prompt{i}.png", nrow=8)
    print(f"wrote {name} ({len(images)} images), {stem}.png, {stem}.json")
    if not single:
        overall = usage.sum(0) / usage.sum()
        print("expert usage: " + ", ".join(
            (f"{names[j]}: {overall[j]:.0%}" for j in range(usage.shape[1]))))


def build_parser():
    p = Parser(prog="sample.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="",
                   help="cluster ids, e.g. 0,2,3 (default: every expert in "
                        "runs/experts/), 'all' for the monolith, or 'distilled' for "
                        "distill.py's student")
    p.add_argument("--router", default=None,
                   help="router checkpoint (default: RUN_DIR/router/ckpt.pt)")
    p.add_argument("--routing", default="top1",
                   help="top1 | top2 | topk:N | full | draw | threshold:TAU | oracle:C "
                        "(DDM found top-1 best on ImageNet; full is the exact mixture; "
                        "draw samples it too, at one expert's cost: each image's expert "
                        "drawn once from the router's p(k | y) at t = 1)")
    p.add_argument("--num-samples", dest="n", type=int_at_least(1), default=64,
                   help="number of images; under torchrun, of all processes together (the "
                        "batch is bit-identical to one process's at equal threads per process)")
    # the short spelling, kept for the commands that use it and not offered: torchrun's own
    # parser takes --n for an abbreviation of its --nnodes / --nproc-per-node
    p.add_argument("--n", dest="n", type=int_at_least(1), help=argparse.SUPPRESS)
    # The defaults come from docs/sampling-steps.md (Fashion-MNIST DiT-M/4, top-1 and
    # monolith, 3 sampling seeds): of this file's solvers, ab2 on the shift-3 grid had
    # the lowest judge FD at 8 and 16 evaluations, lower than Euler at 16, 32 or 64;
    # 16 integrates closer to the ODE than 8 at no difference in FD.
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=16,
                   help="solver steps from t=1 to t=0 (DDM used 50 Euler steps; "
                        "the default, 16 ab2 steps on the shift-3 grid, was chosen "
                        "in docs/sampling-steps.md)")
    p.add_argument("--solver", default="ab2", choices=list(SOLVERS),
                   help="euler: 1 network evaluation per step, first order; heun: "
                        "2, second order; ab2 (default): 1, second order "
                        "(Adams-Bashforth on the velocity, DPM-Solver++(2M) for "
                        "flows)")
    p.add_argument("--time-shift", type=float_in(1 / MAX_SHIFT, MAX_SHIFT), default=3.0,
                   help="the time grid: 1 uniform (DDM); s > 1 crowds the steps "
                        "toward the noise end, s < 1 toward the data end (SD3's "
                        f"shift t = s*u / (1 + (s-1)*u)); default 3, within 1/{MAX_SHIFT:g} "
                        f"and {MAX_SHIFT:g}")
    p.add_argument("--cfg-scale", type=float_in(0, MAX_CFG_SCALE), default=1.0,
                   help="classifier-free guidance scale; 1 means none, 0 the "
                        "unconditional model (DDM: 3 on ImageNet)")
    p.add_argument("--cfg-routing", default="shared", choices=["shared", "independent"],
                   help="with guidance and top-k routing, how the unconditional branch "
                        "picks experts (see above)")
    p.add_argument("--class", dest="class_label", type=int_at_least(0), default=None,
                   help="one label for every image (default: random labels)")
    p.add_argument("--prompt", action="append",
                   help="text experts: a prompt (repeatable); images cycle through the prompts")
    p.add_argument("--prompts", default=None, help="text experts: a file of prompts, one per line")
    p.add_argument("--negative-prompt", default=None,
                   help="text experts, with --cfg-scale: the caption guidance steers away "
                        "from, read by its unconditional branch in place of the null caption")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="text experts, for prompts not in runs/text/: their open_clip architecture")
    p.add_argument("--clip-pretrained", default=None,
                   help="text experts, for prompts not in runs/text/: the same weights "
                        "file (or 'none' if they used a random tower)")
    p.add_argument("--vae", default=None,
                   help="latent experts: where their VAE folder is on this machine "
                        "(default: the path they recorded; it must be the same VAE, by "
                        "hash); samples are decoded through it")
    p.add_argument("--download", action="store_true",
                   help="allow fetching CLIP or VAE weights by tag")
    p.add_argument("--router-every", type=int_at_least(1), default=1, metavar="M",
                   help="evaluate the router at every M-th network evaluation and hold "
                        "its weights in between (1: at every one)")
    p.add_argument("--batch-size", type=int_at_least(1), default=256)
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--out", default=None,
                   help="output .npz (default: RUN_DIR/samples/<routing>.npz, "
                        "monolith.npz or distilled.npz)")
    p.add_argument("--device", type=device_type, default="cuda"
                   if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
