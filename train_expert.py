"""Stage 2: train one expert on one cluster, in complete isolation.

Reads the data set and runs/clusters.pt; writes only runs/experts/<cluster>/ (ckpt.pt,
log.jsonl, EMA sample grids). Nothing here talks to any other expert: K experts can train
on K machines, at different times, on different hardware, and be copied into one runs/.

    python train_expert.py --cluster 2 --objective fm        # a flow-matching expert on cluster 2
    python train_expert.py --cluster 0 --objective ddpm      # an epsilon-prediction (DDPM) expert
    python train_expert.py --cluster all                     # the monolith baseline, same code
    torchrun --nproc_per_node=8 train_expert.py --cluster 2  # one expert on 8 GPUs (DDP)

Objectives. fm: rectified flow, x_t = (1-t) x0 + t eps, the network predicts v = eps - x0 at
flow time t (embedded as 1000 t). ddpm: x_s = sqrt(abar_s) x0 + sqrt(1-abar_s) eps, the network
predicts eps at step s in 0..999. Both kinds mix at sampling time with no retraining
(diffusion.velocity). Relative to v-training, eps-training weights noise levels by
alpha^2/sigma^2: it emphasises low noise, velocity emphasises high noise.

Resuming is automatic when the folder holds a checkpoint: model, EMA, optimizer, step, data
order and random state continue exactly, so N steps + N resumed equals 2N straight.
"""
import argparse
import copy
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from data import (UsageError, atomic_save, expert_dir, load_checkpoint, load_clusters, load_dataset, run_main,
                  save_grid)
from diffusion import DDPM, RectifiedFlow, sample_flow, velocity
from model import DiT, convert_ddpm_to_fm, count_flops, model_args_for, read_checkpoint, split_checkpoint
from text import caption_embeddings

T_BINS = 5   # loss is logged per fifth of the noise range, as minRF does


def setup_distributed():
    """(rank, world size, device): torchrun sets RANK/WORLD_SIZE; a plain run is rank 0 of 1."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return rank, world, torch.device("cuda")
    return rank, world, torch.device("cpu")


def build_model(args, dataset, text_shape):
    """The network, its constructor arguments and where its weights came from (--init or scratch)."""
    num_classes = 0 if args.unconditional or text_shape else dataset.num_classes
    text_len, text_dim = text_shape or (77, 0)
    variant = "adaln-zero" if args.conditioning.endswith("adaln-zero") else "adaln-single"
    t_scale = 1000.0 if args.objective == "fm" else 1.0
    if not args.init:
        model_args = model_args_for(args.model, input_size=dataset.image_size, in_channels=dataset.channels, num_classes=num_classes,
                                    learn_sigma=False, conditioning=variant, t_scale=t_scale, text_dim=text_dim, text_len=text_len)
        return DiT(**model_args), model_args, "scratch"
    try:
        ckpt = read_checkpoint(args.init)
        state, model_args, config = split_checkpoint(ckpt)
        source_objective = config.get("objective", "ddpm")
        if args.objective == "fm" and source_objective == "ddpm":
            state, model_args = convert_ddpm_to_fm(ckpt, conditioning=variant, text_dim=text_dim, text_len=text_len)
            how = "convert_ddpm_to_fm"
        else:
            if source_objective != args.objective:
                raise UsageError(f"--init {args.init} is a {source_objective} checkpoint; it cannot start a {args.objective} expert")
            how = "weights"
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot read --init {args.init}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    want = {"input_size": dataset.image_size, "in_channels": dataset.channels, "num_classes": num_classes, "text_dim": text_dim}
    differ = [f"{k} {model_args.get(k, 0)} vs data {v}" for k, v in want.items() if model_args.get(k, 0) != v]
    if differ:
        raise UsageError(f"--init {args.init} does not fit this data set: " + "; ".join(differ))
    model = DiT(**model_args)
    model.load_state_dict(state, strict=True)
    return model, model_args, f"{how}:{os.path.basename(args.init)}"


def training_flops(model, schedule, batch_shape, num_classes, device, text_shape=None):
    """FLOPs of one forward + backward on one rank's batch, counted by PyTorch's FlopCounterMode."""
    x = torch.zeros(batch_shape, device=device)
    t = torch.full((batch_shape[0],), 0.5 if isinstance(schedule, RectifiedFlow) else 500.0, device=device)
    y = torch.zeros(batch_shape[0], dtype=torch.long, device=device) if num_classes else None
    if text_shape:
        y = torch.zeros(batch_shape[0], *text_shape, device=device)
    flops = count_flops(lambda: schedule.loss(model, x, t.long() if isinstance(schedule, DDPM) else t, x, y).mean().backward())
    model.zero_grad(set_to_none=True)
    return flops


@torch.no_grad()
def preview(ema, args, dataset, device, path, captions=None):
    """A grid of EMA samples (one row per class, or per caption, for a conditional expert), 25 Euler steps."""
    rows = min(len(captions), 8) if captions is not None else min(dataset.num_classes, 8) if ema.num_classes else 8
    n = 8 * rows
    g = torch.Generator().manual_seed(1234)   # never the training generator: previews must not change training
    noise = torch.randn(n, dataset.channels, dataset.image_size, dataset.image_size, generator=g).to(device)
    y = torch.arange(n, device=device) // 8 if ema.num_classes else None
    if captions is not None:
        y = captions[torch.arange(n) // 8].to(device)
    x = sample_flow(lambda x, t: velocity(ema, x, t, y), noise, 25)
    save_grid(x.float().cpu(), path, nrow=8)


def main(args):
    rank, world, device = setup_distributed()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    # --- the cluster this expert owns -----------------------------------------------------
    clusters = load_clusters(args.run_dir)
    dataset = load_dataset(args.data or clusters["data_spec"], args.image_size or clusters["data"]["shape"][-1], args.download)
    load_clusters(args.run_dir, dataset)   # the fingerprint check
    assign = clusters["assignments"].numpy()
    if args.cluster == "all":
        indices = np.arange(len(dataset))
    else:
        valid = ", ".join(map(str, range(clusters["k"]))) + ", all"
        if not args.cluster.isdigit() or int(args.cluster) >= clusters["k"]:
            raise UsageError(f"unknown cluster {args.cluster!r}: valid ones are {valid}")
        indices = np.flatnonzero(assign == int(args.cluster))
    if len(indices) < 8:
        raise UsageError(f"cluster {args.cluster} has {len(indices)} images, too few to train an expert (re-run cluster.py with --min-size)")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.batch_size % world:
        raise UsageError(f"--batch-size {args.batch_size} must divide evenly over {world} processes")
    local_batch = args.batch_size // world

    text_tokens = caption_index = text_spec = None
    if args.conditioning.startswith("text"):
        if dataset.captions is None:
            raise UsageError(f"--conditioning {args.conditioning} needs captions: use --data digits-captions, or folder:PATH "
                             f"with NAME.txt / captions.jsonl")
        text_tokens, _, caption_index, text_spec = caption_embeddings(dataset.captions, args.clip_model, args.clip_pretrained,
                                                                      args.run_dir, args.download)
        if rank == 0 and text_spec["clip_pretrained"].startswith("none"):
            print("text encoder: RANDOM weights (--clip-pretrained none): a smoke test, not a text-to-image model")
    text_shape = tuple(text_tokens.shape[1:]) if text_tokens is not None else None

    out_dir = args.out_dir or expert_dir(args.run_dir, args.cluster)
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    schedule = RectifiedFlow(args.t_sampling) if args.objective == "fm" else DDPM(beta_schedule=args.beta_schedule)

    # --- model, EMA, optimizer: from scratch, from --init, or resumed ----------------------
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    resume = load_checkpoint(ckpt_path, "checkpoint") if os.path.isfile(ckpt_path) else None
    if args.resume and resume is None:
        raise UsageError(f"--resume: no checkpoint at {ckpt_path}")
    if resume is not None:
        if resume["config"]["objective"] != args.objective or resume["config"]["cluster"] != args.cluster:
            raise UsageError(f"{ckpt_path} holds a {resume['config']['objective']} expert of cluster {resume['config']['cluster']}; "
                             f"use another --out-dir or remove it")
        if resume["config"]["schedule"] != schedule.config():
            raise UsageError(f"{ckpt_path} was trained with {resume['config']['schedule']}, not {schedule.config()}; "
                             f"resume with the same schedule flags")
        model_args, init = resume["model_args"], resume["config"]["init"]
        model = DiT(**model_args)
        model.load_state_dict(resume["model"])
    else:
        model, model_args, init = build_model(args, dataset, text_shape)
    model.to(device)
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    ema.objective, ema.schedule = args.objective, schedule if args.objective == "ddpm" else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    step, total_flops = 0, 0
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)   # per-rank noise, labels, times
    if resume is not None:
        ema.load_state_dict(resume["ema"])
        opt.load_state_dict(resume["opt"])
        step, total_flops = resume["step"], resume["config"]["flops"]
        if len(resume["rng"]) == world:
            generator.set_state(resume["rng"][rank])
        elif rank == 0:
            print(f"resuming with {world} processes instead of {len(resume['rng'])}: random streams restart from --seed")
        if rank == 0:
            print(f"resumed {ckpt_path} at step {step}")

    flops_per_step = world * training_flops(model, schedule, (local_batch, dataset.channels, dataset.image_size, dataset.image_size),
                                            model.num_classes, device, text_shape)
    train_model = DistributedDataParallel(model) if world > 1 else model
    if args.compile:
        train_model = torch.compile(train_model)

    config = {"objective": args.objective, "schedule": schedule.config(),
              "time": "fm: flow time t in [0,1], t=1 noise, network embeds 1000 t" if args.objective == "fm"
                      else "ddpm: step s in 0..T-1, s=T-1 noisiest, network embeds s",
              "image_size": dataset.image_size, "channels": dataset.channels, "num_classes": model.num_classes,
              "cluster": args.cluster, "cluster_fingerprint": clusters["fingerprint"], "k": clusters["k"],
              "data": dataset.fingerprint, "data_spec": args.data or clusters["data_spec"], "cluster_size": len(indices),
              "batch_size": args.batch_size, "lr": args.lr, "weight_decay": args.weight_decay, "ema_decay": args.ema_decay,
              "cfg_dropout": args.cfg_dropout, "precision": args.precision, "init": init, "world_size": world,
              "conditioning": "text" if text_spec else "class" if model.num_classes else "none", "text_encoder": text_spec,
              "flops_per_step": flops_per_step, "flops": total_flops}

    def save_checkpoint():
        rng = [generator.get_state()]
        if world > 1:
            rng = [None] * world
            dist.all_gather_object(rng, generator.get_state())
        if rank == 0:
            atomic_save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step,
                         "rng": rng, "model_args": model_args, "config": {**config, "flops": total_flops}}, ckpt_path)

    # --- the data order: a pure function of (seed, epoch), so a resumed run sees the same batches
    sampler = DistributedSampler(range(len(indices)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = max(1, len(sampler) // local_batch)
    epoch_order = None

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"expert {args.cluster}: {args.objective}, {len(indices)} images, {sum(p.numel() for p in model.parameters()):,} "
              f"parameters ({args.model if init == 'scratch' else init}), {flops_per_step / 1e9:.3f} GFLOPs per step")
    log = open(os.path.join(out_dir, "log.jsonl"), "a") if rank == 0 else None
    bins_loss, bins_count = torch.zeros(T_BINS, device=device), torch.zeros(T_BINS, device=device)
    # previews of a text expert: a row for each of the first distinct captions of its cluster
    preview_captions = text_tokens[torch.unique(caption_index[indices])[:8]] if text_tokens is not None else None
    last_log_step, last_time = step, time.time()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    bar = tqdm(total=args.steps, initial=step, desc=f"expert {args.cluster}", **({} if rank == 0 else {"disable": True}))
    train_model.train()
    while step < args.steps:
        epoch, b = divmod(step, steps_per_epoch)
        if b == 0 or epoch_order is None:
            sampler.set_epoch(epoch)
            epoch_order = np.array(list(sampler))
            epoch_order = np.resize(epoch_order, max(len(epoch_order), local_batch))   # a cluster smaller than a batch repeats
        idx = indices[epoch_order[b * local_batch:(b + 1) * local_batch]]
        x0 = dataset.batch(idx).to(device)
        y = None
        if model.num_classes:
            y = torch.from_numpy(dataset.labels[idx]).to(device)
            drop = torch.rand(len(idx), generator=generator).to(device) < args.cfg_dropout   # learn the null class for CFG
            y = torch.where(drop, torch.full_like(y, model.num_classes), y)
        elif text_tokens is not None:
            y = text_tokens[caption_index[idx]].to(device)
            keep = torch.rand(len(idx), generator=generator).to(device) >= args.cfg_dropout   # all-zero caption = the null one
            y = y * keep[:, None, None]
        noise = torch.randn(x0.shape, generator=generator).to(device)
        t = (schedule.sample_t if args.objective == "fm" else schedule.sample_steps)(len(idx), generator, device)
        with autocast:
            loss = schedule.loss(train_model, x0, t, noise, y)                     # (B,) per sample
        opt.zero_grad(set_to_none=True)
        loss.mean().backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        with torch.no_grad():
            for e, m in zip(ema.parameters(), model.parameters()):
                e.lerp_(m, 1 - args.ema_decay)
            t_unit = t.float() if args.objective == "fm" else t.float() / schedule.num_timesteps
            which = (t_unit * T_BINS).long().clamp(max=T_BINS - 1)
            bins_loss.index_add_(0, which, loss.detach().float())
            bins_count.index_add_(0, which, torch.ones_like(loss, dtype=torch.float))
        step += 1
        total_flops += flops_per_step
        bar.update(1)

        if step % args.log_every == 0 or step == args.steps:
            if world > 1:
                dist.all_reduce(bins_loss); dist.all_reduce(bins_count)
            per_bin = (bins_loss / bins_count.clamp(min=1)).tolist()
            mean_loss = (bins_loss.sum() / bins_count.sum()).item()
            if not math.isfinite(mean_loss):
                raise UsageError(f"non-finite loss at step {step}; stopped. The last good checkpoint ({ckpt_path}) is intact: "
                                 f"lower --lr or use --grad-clip")
            images_per_s = (step - last_log_step) * args.batch_size / (time.time() - last_time)
            if rank == 0:
                bar.set_postfix(loss=f"{mean_loss:.4f}", img_s=f"{images_per_s:.0f}")
                record = {"step": step, "loss": mean_loss, "loss_per_t_bin": per_bin, "images_per_s": images_per_s,
                          "lr": opt.param_groups[0]["lr"], "flops": total_flops}
                if text_spec:
                    record["text_encoder"] = text_spec
                log.write(json.dumps(record) + "\n")
                log.flush()
            bins_loss.zero_(); bins_count.zero_()
            last_log_step, last_time = step, time.time()
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint()
        if rank == 0 and ((args.sample_every and step % args.sample_every == 0) or step == args.steps):
            preview(ema, args, dataset, device, os.path.join(out_dir, f"samples_{step:07d}.png"), preview_captions)
    bar.close()
    if rank == 0:
        print(f"wrote {ckpt_path} (step {step}, {total_flops / 1e12:.3f} TFLOPs of training)")
        log.close()
    if world > 1:
        dist.destroy_process_group()


def build_parser():
    p = argparse.ArgumentParser(prog="train_expert.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--cluster", default="0", help="cluster id from runs/clusters.pt, or 'all' for the monolith baseline")
    g.add_argument("--objective", default="fm", choices=["fm", "ddpm"], help="fm: rectified-flow velocity; ddpm: epsilon prediction")
    g.add_argument("--model", default="DiT-T/2", help="size from model.DiT_models: DiT-{M,T,S,B,L,XL}/{1,2,4,8} (T, M: CPU-sized)")
    g.add_argument("--conditioning", default="adaln-single", choices=["adaln-single", "adaln-zero", "text", "text-adaln-zero"],
                   help="adaln-single (PixArt: one shared modulation MLP, ~1/3 fewer parameters) or DiT's adaln-zero, "
                        "class-conditional; text: a text-to-image expert (AdaLN-Single + cross-attention to CLIP tokens, "
                        "as Paris), text-adaln-zero the same with adaLN-Zero")
    g.add_argument("--clip-model", default="ViT-B-32", help="text: open_clip architecture name, or a model-config .json")
    g.add_argument("--clip-pretrained", default=None, help="text: local open_clip weights file (a tag with --download), "
                                                            "or 'none' for an explicitly random text tower (smoke tests)")
    g.add_argument("--unconditional", action="store_true", help="ignore the labels (default: class-conditional when labelled)")
    g.add_argument("--init", default=None, help="start from a checkpoint: ours, or an official facebookresearch/DiT .pt; "
                                                "a DDPM one starting an fm expert goes through model.convert_ddpm_to_fm")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=1000, help="total optimizer steps (a resumed run continues up to this)")
    g.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over torchrun processes")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (DiT-XL uses 1e-4; tiny models like more)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--ema-decay", type=float, default=0.995, help="EMA of the weights, used for sampling (DiT: 0.9999 over 400k steps)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient norm (0: off)")
    g.add_argument("--cfg-dropout", type=float, default=0.1, help="probability of replacing the label by the null class")
    g.add_argument("--t-sampling", default="uniform", choices=["uniform", "logit-normal"], help="fm: how flow times are drawn")
    g.add_argument("--beta-schedule", default="linear", choices=["linear", "cosine"], help="ddpm: the noise schedule")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast the forward pass")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("files")
    g.add_argument("--data", default=None, help="data set spec (default: the one the cluster file was made from)")
    g.add_argument("--image-size", type=int, default=None, help="default: the cluster file's")
    g.add_argument("--download", action="store_true", help="allow downloading the data set")
    g.add_argument("--run-dir", default="runs")
    g.add_argument("--out-dir", default=None, help="default: RUN_DIR/experts/<cluster>")
    g.add_argument("--resume", action="store_true", help="require a checkpoint to resume (resuming is automatic when one exists)")
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--ckpt-every", type=int, default=500)
    g.add_argument("--sample-every", type=int, default=0, help="also write an EMA sample grid every N steps (one is always written at the end)")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
