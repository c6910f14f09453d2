"""Stage 2: train one expert on one cluster, in complete isolation.

Reads the data set and runs/clusters.pt; writes only runs/experts/<cluster>/ (ckpt.pt,
log.jsonl, EMA sample grids). Nothing here talks to any other expert: K experts can train
on K machines, at different times, on different hardware, and be copied into one runs/.

    python train_expert.py --cluster 2 --objective fm        # a flow-matching expert on cluster 2
    python train_expert.py --cluster 0 --objective ddpm      # an epsilon-prediction (DDPM) expert
    python train_expert.py --cluster all                     # the monolith baseline, same code
    python train_expert.py --partition eights --data digits --classes 8   # a contributor's own data, no cluster file
    torchrun --nproc_per_node=8 train_expert.py --cluster 2  # one expert on 8 GPUs (DDP)

Contributors. --partition NAME trains on the contributor's own --data (all of it, or --classes),
with no cluster file: nobody else's data, and nobody sees theirs. The expert joins the run as
runs/experts/NAME beside the clusters' experts, and records what it was trained on as a fingerprint
(a hash of the data set's fingerprint and the owned images' indices), its size and label counts,
which a router trained from the experts' samples needs (train_router.py --from-samples). A name
already taken by other data, or data another expert of the run was trained on, is refused.

Objectives. fm: rectified flow, x_t = (1-t) x0 + t eps, the network predicts v = eps - x0 at
flow time t (embedded as 1000 t). ddpm: x_s = sqrt(abar_s) x0 + sqrt(1-abar_s) eps, the network
predicts eps at step s in 0..999. Both kinds mix at sampling time with no retraining
(each objective's `velocity`, e.g. diffusion.DDPM.velocity). Relative to v-training, eps-training
weights noise levels by alpha^2/sigma^2: it emphasises low noise, velocity emphasises high noise.

The objective (diffusion.RectifiedFlow or diffusion.DDPM) and the condition (condition.py:
none, class or text) are objects chosen once from the flags; the training step below is the same
for every combination.

Resuming is automatic when the folder holds a checkpoint: model, EMA, optimizer, step, data
order and random state continue exactly, so N steps + N resumed equals 2N straight. A resume
with other training flags than the checkpoint's is refused.
"""
import argparse
import contextlib
import json
import math
import os
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from command_line import (Parser, UsageError, cluster_name, first_line, float_in, int_at_least,
                          run_main, seed_type)
from condition import condition_for_data
from data import TrainingBatches, batch_loader
from diffusion import T_BINS, objective_from_flags, objective_from_spec, sample_flow, t_bin
from latents import LatentSet, clustered_data, file_hash, resolve_vae, same_vae
from shards import island_of
from contributors import check_membership, contributed_data, membership_record, partition_name
from checkpoint import (CHECKPOINT_FORMAT, CheckpointError, check_init_modulation,
                        init_from_checkpoint, split_checkpoint, split_expert_checkpoint)
from model import PATCHES, SIZES, DiT, DiT_models, count_flops, model_args_for, registry_name
from precision import autocast as precision_autocast
from precision import choose as choose_precision
from precision import probe_step
from training import Training, decay_start, learning_rate, setup_distributed
from run_dir import (atomic_save, check_writable_dir, cluster_path, expert_dir, folder_lock,
                     load_checkpoint, load_clusters, network_file_set,
                     remove_stale_temporaries, save_grid, trim_log)

# The flags that define what is trained; a resume must repeat them (steps, logging and precision may
# change).
TRAINING_FLAGS = ["cluster", "partition", "classes", "objective", "model", "modulation",
                  "condition", "init", "time_map", "t_sampling", "beta_schedule",
                  "batch_size", "lr", "lr_schedule", "decay_share", "weight_decay", "ema_decay",
                  "grad_clip", "condition_dropout", "hflip", "seed"]


def class_list(text):
    """argparse type of --classes: distinct class labels, e.g. 0,1,2."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected class labels like 0,1,2, got {text!r}")
    labels = sorted(int(p) for p in parts)
    if len(set(labels)) != len(labels):
        raise argparse.ArgumentTypeError(f"{text!r} names a class twice")
    return labels


def training_flags(args, condition):
    """The flags that define the run, as recorded in its checkpoint (--init by file name: paths
    differ between machines; the condition as it runs, whether --condition chose it or the data
    set's labels did)."""
    flags = {name: getattr(args, name) for name in TRAINING_FLAGS}
    flags.update(init=os.path.basename(args.init) if args.init else None, condition=condition.kind)
    return flags


class Owned(NamedTuple):
    """The images this expert trains on: the data set (pixels, or a latents.LatentSet with a VAE),
    the run's cluster file (None for a contributor's own data) and the indices of the images it
    owns."""
    dataset: object
    clusters: dict
    indices: np.ndarray


class Processes(NamedTuple):
    """This process's place in the run: torchrun's rank and world size, its device and its share of
    the batch."""
    rank: int
    world: int
    device: torch.device
    local_batch: int


def owned_data(args, device):
    """(data set (pixels, or a latents.LatentSet with a VAE), cluster file, indices of the images
    this expert owns)."""
    if args.partition:
        dataset, indices = contributed_data(args, device)
        return Owned(dataset, None, indices)
    clusters, dataset = clustered_data(args.run_dir, args.data, args.image_size, args.vae,
                                       download=args.download, device=device, cluster=args.cluster)
    if island_of(dataset):   # an island's shards: every sample is this cluster's
        indices = np.arange(len(dataset))
    elif args.cluster == "all":
        indices = np.arange(len(dataset))
    else:
        valid = ", ".join(map(str, range(clusters["k"]))) + ", all"
        if not args.cluster.isdigit() or str(int(args.cluster)) != args.cluster or int(args.cluster) >= clusters["k"]:
            raise UsageError(f"unknown cluster {args.cluster!r}: valid ones are {valid}")
        indices = np.flatnonzero(clusters["assignments"].numpy() == int(args.cluster))
    if len(indices) < 8:
        raise UsageError(f"cluster {args.cluster} has {len(indices)} images, too few to train an "
                         "expert (re-run cluster.py with --min-size)")
    return Owned(dataset, clusters, indices)


def resolved(args):
    """The command line as this run uses it, resolved once on a copy that nothing writes to
    afterwards: the expert's name (its folder and its name in the ensemble: a contributor's
    --partition, or the --cluster) and --model."""
    run = argparse.Namespace(**vars(args))
    run.cluster = args.partition or args.cluster or "0"
    run.model = resolve_model(run)
    return run


def resolve_model(args):
    """--model as it will run: with --init, the starting checkpoint's size (a different --model is
    refused, so the recorded flags always name the network that was trained); else the flag, DiT-T/2
    by default."""
    if not args.init or args.import_path:
        return args.model or "DiT-T/2"
    try:
        size = registry_name(split_checkpoint(load_checkpoint(args.init, "--init checkpoint"))[1])
    except (CheckpointError, KeyError, ValueError, TypeError) as e:
        raise UsageError(f"cannot start from --init {args.init}: {first_line(e)}")
    if args.model and args.model != size:
        raise UsageError(f"--init {args.init} is a {size}; --model {args.model} would not be what "
                         "trains: drop --model, or start from a checkpoint of that size")
    return size


def build_network(args, dataset, condition, objective):
    """(network, constructor args, objective, where its weights came from): from scratch or from
    --init."""
    if not args.init:
        patch = DiT_models[args.model][3]
        if dataset.image_size % patch:
            raise UsageError(f"--model {args.model} cuts images into {patch}x{patch} patches; "
                             f"{dataset.image_size}-pixel images do not divide")
        model_args = model_args_for(args.model, input_size=dataset.image_size,
                                    in_channels=dataset.channels, learn_sigma=False,
                                    modulation=args.modulation,
                                    t_scale=objective.network_time_scale, **condition.expert_args())
        return DiT(**model_args), model_args, objective, "scratch"
    try:
        state, model_args, objective, how = init_from_checkpoint(
            load_checkpoint(args.init, "--init checkpoint"), objective, modulation=args.modulation,
            condition_args=condition.expert_args())
    except (CheckpointError, KeyError) as e:
        raise UsageError(f"cannot start from --init {args.init}: {e}")
    want = {"input_size": dataset.image_size, "in_channels": dataset.channels,
            **condition.expert_args()}
    differ = [f"{k} {model_args.get(k, 0)} vs data {v}" for k, v in want.items()
              if model_args.get(k, 0) != v]
    if differ:
        raise UsageError(f"--init {args.init} does not fit this data set: " + "; ".join(differ))
    try:
        check_init_modulation(args.init, model_args, args.modulation)
    except CheckpointError as e:
        raise UsageError(str(e))
    model = DiT(**model_args)
    model.load_state_dict(state, strict=True)
    return model, model_args, objective, f"{how}:{os.path.basename(args.init)}"


def check_resume(ckpt_path, resume, args, condition, clusters, dataset):
    """A checkpoint resumes only with the flags, condition and clustering it was trained with."""
    config = resume["config"]
    if config.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{ckpt_path} was written by an older version of train_expert.py (format "
                         f"{config.get('format', 1)}; this one reads {CHECKPOINT_FORMAT}): retrain "
                         "it in another --out-dir")
    then, now = config["flags"], training_flags(args, condition)
    unrecorded = [f"--{name.replace('_', '-')}" for name in TRAINING_FLAGS if name not in then]
    if unrecorded:   # no release ever wrote such a checkpoint: no defaults to assume for it
        raise UsageError(f"{ckpt_path} was written by an older version of train_expert.py (it records "
                         f"no {', '.join(unrecorded)}): retrain it in another --out-dir")
    changed = [f"--{name.replace('_', '-')} {then.get(name)} -> {now[name]}"
               for name in TRAINING_FLAGS if then.get(name) != now[name]]
    if changed:
        raise UsageError(f"{ckpt_path} was trained with other flags ({'; '.join(changed)}); resume "
                         "with the same flags, or use another --out-dir")
    if config["condition"] != condition.spec():
        raise UsageError(f"{ckpt_path} reads the condition {config['condition']}, not "
                         f"{condition.spec()}")
    if config["cluster_fingerprint"] != (clusters or {}).get("fingerprint"):
        raise UsageError(f"{ckpt_path} was trained on another clustering than "
                         f"{args.run_dir}/clusters.pt; resume it in its own run dir, or use "
                         "another --out-dir")
    if args.lr_schedule == "wsd":
        planned = config.get("target_steps", args.steps)
        start = decay_start(planned, args.decay_share)
        if planned != args.steps and resume["step"] > min(start, decay_start(args.steps, args.decay_share)):
            raise UsageError(f"{ckpt_path} is past the start of its learning-rate decay (step "
                             f"{resume['step']} of {planned}, decay from {start}); it cannot "
                             f"continue to --steps {args.steps}: continue from its stable.pt "
                             f"(written at step {start}) instead, or train to --steps {planned}")
    if not same_vae(config.get("vae"), getattr(dataset, "vae", None)):
        space = "the latents of VAE " + config["vae"]["path"] if config.get("vae") else "pixels"
        raise UsageError(f"{ckpt_path} was trained in {space}; resume it in the same space (--vae)")


def resolve_precision(args, trainer, batch_shape, step, device):
    """--precision as it will run (auto: measured once per machine and model, see precision.py), on
    rank 0 for every rank."""
    choice = [None]
    if trainer.rank == 0:
        choice[0] = choose_precision(args.precision, step, device, args.run_dir,
                                     {"model_args": trainer.model_args, "batch": list(batch_shape),
                                      "objective": trainer.objective.spec()})
    if trainer.world > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


@torch.no_grad()
def preview(ema, objective, condition, indices, dataset, device, path, vae=None):
    """A grid of EMA samples, 25 Euler steps: one row per condition found in the cluster (up to 8
    rows)."""
    rows = torch.unique(condition.ids(indices))[:8]
    ids = rows.repeat_interleave(8).to(device)
    # never the training generator: previews must not change training
    g = torch.Generator().manual_seed(1234)
    noise = torch.randn(len(ids), dataset.channels, dataset.image_size, dataset.image_size,
                        generator=g).to(device)
    y = condition.expert_input(ids)
    x = sample_flow(lambda x, t: objective.velocity(ema, x, t, y), noise, 25)
    if vae is not None:
        x = vae.decode(x, dataset.images_set.channels)
    save_grid(x.float().cpu(), path, nrow=8)


class Trainer(Training):
    """One expert's Training, objective, FLOP count and random stream: built fresh, from --init, or
    resumed."""

    def __init__(self, args, owned, condition, procs):
        dataset, clusters = owned.dataset, owned.clusters
        self.args, self.rank, self.world = args, procs.rank, procs.world
        self.ckpt_path = os.path.join(args.out_dir or expert_dir(args.run_dir, args.cluster), "ckpt.pt")
        objective = objective_from_flags(args.objective, t_sampling=args.t_sampling,
                                         time_map=args.time_map,
                                         beta_schedule=args.beta_schedule)
        torch.manual_seed(args.seed)   # the same initial weights on every rank
        resume = load_checkpoint(self.ckpt_path,
                                 "checkpoint") if os.path.isfile(self.ckpt_path) else None
        if resume is not None and resume.get("config", {}).get("imported"):
            raise UsageError(f"{self.ckpt_path} holds an imported checkpoint; to fine-tune it, "
                             f"start a new expert from it: --init {self.ckpt_path} --out-dir "
                             "NEW_FOLDER")
        if args.resume and resume is None:
            raise UsageError(f"--resume: no checkpoint at {self.ckpt_path}")
        if resume is not None:
            check_resume(self.ckpt_path, resume, args, condition, clusters, dataset)
            self.model_args, self.init = resume["model_args"], resume["config"]["init"]
            self.objective = objective_from_spec(resume["config"]["objective"])
            self.model = DiT(**self.model_args)
        else:
            self.model, self.model_args, self.objective, self.init = build_network(args, dataset, condition, objective)
        # latents are unbounded (previews read the expert as a flow)
        self.objective.clip_x0 = not isinstance(dataset, LatentSet)
        super().__init__(self.model.to(procs.device), lr=args.lr, weight_decay=args.weight_decay,
                         ema_decay=args.ema_decay,
                         grad_clip=args.grad_clip)
        self.flops = 0
        # per-rank noise, dropout, times
        self.generator = torch.Generator().manual_seed(args.seed * 1000 + procs.rank)
        if resume is not None:
            self.load_state(resume)
            self.flops = resume["config"]["flops"]
            if len(resume["rng"]) == self.world:
                self.generator.set_state(resume["rng"][self.rank])
            elif self.rank == 0:
                print(f"resuming with {self.world} processes instead of {len(resume['rng'])}: "
                      "random streams restart from --seed")
            if self.rank == 0:
                print(f"resumed {self.ckpt_path} at step {self.step}")

    def update(self, train_model, x0, y, autocast):
        """One optimizer step and the EMA; returns the per-sample loss and the times' noise levels
        in [0, 1]."""
        noise = torch.randn(x0.shape, generator=self.generator).to(x0.device)
        t = self.objective.sample_time(len(x0), self.generator, x0.device)
        with autocast:
            loss = self.objective.loss(train_model, x0, t, noise, y)           # (B,) per sample
        a = self.args
        self.apply(loss, lr=learning_rate(self.step, a.lr, a.lr_schedule, a.steps, a.decay_share))
        return loss.detach().float(), self.objective.unit_time(t)

    def save(self, config, path=None):
        rng = [self.generator.get_state()]
        if self.world > 1:
            rng = [None] * self.world
            dist.all_gather_object(rng, self.generator.get_state())
        if self.rank == 0:
            atomic_save({**self.state(), "rng": rng, "model_args": self.model_args,
                         "config": {**config, "flops": self.flops}},
                        path or self.ckpt_path)


def checkpoint_config(args, trainer, condition, owned, flops_per_step, precision):
    """What the next stages check: the objective and condition as specs, and the data, clustering
    and flags."""
    dataset, clusters, indices = owned
    return {"format": CHECKPOINT_FORMAT, "network": "dit", "objective": trainer.objective.spec(),
            "condition": condition.spec(),
            "flags": training_flags(args, condition), "init": trainer.init,
            "image_size": dataset.image_size, "channels": dataset.channels,
            "cluster": args.cluster, "cluster_fingerprint": clusters["fingerprint"]
            if clusters else None,
            "k": clusters["k"] if clusters else None,
            "member": membership_record(args, dataset, indices),
            # an island records the whole data set its shards are part of, and its shards
            "data": (island_of(dataset) or {}).get("data", dataset.fingerprint),
            "data_spec": (island_of(dataset) or {}).get("data_spec") or args.data
            or (clusters["data_spec"] if clusters else "digits"),
            "island_data": args.data if island_of(dataset) else None,
            "cluster_size": len(indices),
            "precision": precision[0], "precision_evidence": precision[1],
            "world_size": trainer.world,
            "target_steps": args.steps,
            "vae": getattr(dataset, "vae", None),
            "flops_per_step": flops_per_step}


def import_checkpoint(args):
    """--import: a pretrained DiT written to the expert's folder unchanged, recording where it came
    from and its space."""
    source = load_checkpoint(args.import_path, "--import checkpoint")
    try:
        state, model_args, config = split_expert_checkpoint(source)
        net = DiT(**model_args)
        net.load_state_dict(state, strict=True)
    except (CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UsageError(f"--import {args.import_path}: not a DiT checkpoint this project can load "
                         f"({first_line(e)})")
    has_clusters = os.path.isfile(cluster_path(args.run_dir))
    if args.cluster != "all" and not has_clusters:
        raise UsageError(f"--import as expert {args.cluster} needs the run's cluster file "
                         f"({cluster_path(args.run_dir)}); without one, import it as --cluster all")
    clusters = load_clusters(args.run_dir) if has_clusters else None
    run_vae = clusters.get("vae") if clusters else None
    if config.get("vae") and run_vae and not same_vae(config["vae"], run_vae):
        raise UsageError(f"--import {args.import_path} was trained in another VAE's latents than "
                         "the cluster file's")
    vae = resolve_vae(args.vae, config.get("vae") or run_vae, args.download)
    size, channels = model_args["input_size"], model_args["in_channels"]
    space = f"{channels}x{size}x{size}"
    if vae is not None and channels != vae.latent_channels:
        raise UsageError(f"--import {args.import_path} reads {space} inputs; the VAE's latents "
                         f"have {vae.latent_channels} channels")
    if clusters is not None:
        c, side = clusters["data"]["shape"][0], clusters["data"]["shape"][-1]
        want = (vae.latent_channels, side // vae.downsample) if vae else (c, side)
        if (channels, size) != want:
            raise UsageError(f"--import {args.import_path} reads {space} inputs; the cluster "
                             "file's data gives "
                             f"{want[0]}x{want[1]}x{want[1]}" + ("" if vae else " (a latent model "
                                                                                "needs --vae)"))
        if args.cluster != "all" and (not args.cluster.isdigit() or int(args.cluster) >= clusters["k"]):
            raise UsageError(f"unknown cluster {args.cluster!r}: valid ones are "
                             f"0..{clusters['k'] - 1}, all")
    out_dir = args.out_dir or expert_dir(args.run_dir, args.cluster)
    check_writable_dir(out_dir, "the expert's folder")
    digest = file_hash(network_file_set(args.import_path))
    existing = os.path.join(out_dir, "ckpt.pt")
    if os.path.isfile(existing):   # an import replaces nothing but the same file imported before
        held = load_checkpoint(existing, "expert checkpoint")
        if ((held.get("config") or {}).get("imported") or {}).get("sha1") != digest:
            raise UsageError(f"{out_dir} already holds an expert (step {held.get('step')}, init "
                             f"{(held.get('config') or {}).get('init', 'scratch')}); import into "
                             f"another --out-dir or --run-dir, or remove {existing} first")
    config = {**config, "format": CHECKPOINT_FORMAT,
              "imported": {"file": os.path.basename(args.import_path), "sha1": digest},
              "init": f"imported:{os.path.basename(args.import_path)}", "image_size": size,
              "channels": channels,
              "vae": vae.spec if vae else None, "cluster": args.cluster, "flops": 0,
              "flops_per_step": None,
              "cluster_fingerprint": clusters["fingerprint"] if clusters else None,
              "k": clusters["k"] if clusters else 1,
              "data": clusters["data"] if clusters else None, "data_spec": clusters["data_spec"]
              if clusters else None}
    with folder_lock(out_dir, "train_expert.py"):
        atomic_save({"model": net.state_dict(), "ema": None, "opt": None, "step": 0, "rng": [],
                     "model_args": model_args,
                     "config": config}, os.path.join(out_dir, "ckpt.pt"))
    print(f"imported {args.import_path} ({config['objective']['name']}, {space}, condition "
          f"{config['condition']['kind']}{', VAE ' + vae.spec['path'] if vae else ''}) as "
          f"{os.path.join(out_dir, 'ckpt.pt')}; it samples as-is, and --init starts a fine-tuned "
          "expert from it")


def main(args):
    if args.partition and args.cluster is not None:
        raise UsageError("--partition names a contributor's own data; --cluster a k-means cluster "
                         "of the run's: give one")
    if args.classes is not None and not args.partition:
        raise UsageError("--classes selects a contributor's data: use it with --partition NAME")
    args = resolved(args)
    if args.import_path:
        if args.partition:
            raise UsageError("--import places a pretrained model as a k-means expert or the "
                             "monolith (--cluster); a contributor trains theirs with --partition")
        return import_checkpoint(args)
    rank, world, device = setup_distributed()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.batch_size % world:
        raise UsageError(f"--batch-size {args.batch_size} must divide evenly over {world} processes")
    procs = Processes(rank, world, device, args.batch_size // world)

    out_dir = args.out_dir or expert_dir(args.run_dir, args.cluster)
    check_writable_dir(out_dir, "the expert's folder")
    owned = owned_data(args, device)
    dataset = owned.dataset
    if rank == 0:
        check_membership(args, out_dir, membership_record(args, dataset, owned.indices))
    kind = args.condition or ("class" if dataset.labels is not None else "none")
    condition = condition_for_data(kind, dataset, args.run_dir, clip_model=args.clip_model,
                                   clip_pretrained=args.clip_pretrained, download=args.download)
    natural = not dataset.name.startswith("digits")
    if args.hflip and not natural:
        raise UsageError("--hflip is for natural images (cifar10, imagenet64, folder): a mirrored "
                         "digit is not a digit")
    if args.hflip and isinstance(dataset, LatentSet):
        raise UsageError("--hflip with --vae: the latent cache holds the images as they are; a "
                         "mirrored latent is not the latent of a mirrored image")
    with folder_lock(out_dir, "train_expert.py") if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            remove_stale_temporaries(out_dir)
        run_training(args, owned, condition, procs)
    if world > 1:
        dist.destroy_process_group()


def run_training(args, owned, condition, procs):
    """Build or resume the expert, count a step's FLOPs, and train."""
    (dataset, _, indices), (rank, world, device, local_batch) = owned, procs
    trainer = Trainer(args, owned, condition, procs)
    if rank == 0:
        trim_log(os.path.join(os.path.dirname(trainer.ckpt_path), "log.jsonl"), trainer.step)
    batch_shape = (local_batch, dataset.channels, dataset.image_size, dataset.image_size)
    step = probe_step(trainer.model, trainer.objective, batch_shape,
                      condition.expert_input(condition.null(local_batch, device)), device)
    flops_per_step = world * count_flops(step)
    precision = resolve_precision(args, trainer, batch_shape, step, device)
    config = checkpoint_config(args, trainer, condition, owned, flops_per_step, precision)
    train_model = DistributedDataParallel(trainer.model) if world > 1 else trainer.model
    if args.compile:
        train_model = torch.compile(train_model)
    if rank == 0:
        print(f"expert {args.cluster}: {trainer.objective.name}, condition {condition.kind}, "
              f"{len(indices)} images, {sum(p.numel() for p in trainer.model.parameters()):,} "
              f"parameters ({args.model if trainer.init == 'scratch' else trainer.init}), "
              f"{flops_per_step / 1e9:.3f} GFLOPs per step, {precision[0]} "
              f"({precision[1].get('reason', 'as asked')})")
    train(args, trainer, train_model, owned, condition, config, procs)


def train(args, trainer, train_model, owned, condition, config, procs):
    """The loop: a batch of the cluster, conditions with guidance dropout, one update; log,
    checkpoint, preview."""
    (dataset, _, indices), (rank, world, device, local_batch) = owned, procs
    batches = TrainingBatches(dataset, indices, local_batch, args.seed, rank, world,
                              hflip=args.hflip)
    # digits sit in memory as 8x8 arrays: a worker process would cost more than it saves
    workers = 0 if dataset.name.startswith("digits") else min(4, os.cpu_count() or 1)
    workers = args.workers if args.workers is not None else workers
    loader = batch_loader(batches, trainer.step, args.steps, workers,
                          pin_memory=device.type == "cuda")
    out_dir = os.path.dirname(trainer.ckpt_path)
    log = open(os.path.join(out_dir, "log.jsonl"), "a") if rank == 0 else None
    bins_loss, bins_count = torch.zeros(T_BINS, device=device), torch.zeros(T_BINS, device=device)
    # a reduction per batch: cheap beside the step, read only on failure
    bad_inputs = torch.zeros((), dtype=torch.bool, device=device)
    last_log_step, last_time = trainer.step, time.time()
    autocast = precision_autocast(device, config["precision"])
    bar = tqdm(total=args.steps, initial=trainer.step, desc=f"expert {args.cluster}",
               **({} if rank == 0 else {"disable": True}))
    train_model.train()
    for idx, x0 in loader:
        idx = idx.numpy()
        # learn the null too, for CFG
        ids = condition.drop(condition.ids(idx), args.condition_dropout, trainer.generator)
        x0 = x0.to(device, non_blocking=True)
        bad_inputs |= ~torch.isfinite(x0).all()
        loss, t_unit = trainer.update(train_model, x0,
                                      condition.expert_input(ids.to(device)), autocast)
        which = t_bin(t_unit)
        bins_loss.index_add_(0, which, loss)
        bins_count.index_add_(0, which, torch.ones_like(loss))
        trainer.step += 1
        trainer.flops += config["flops_per_step"]
        bar.update(1)
        if trainer.step % args.log_every == 0 or trainer.step == args.steps:
            if world > 1:
                dist.all_reduce(bins_loss); dist.all_reduce(bins_count)
            mean_loss = (bins_loss.sum() / bins_count.sum()).item()
            if not math.isfinite(mean_loss):
                cause = ("the training images themselves hold NaN or inf (with --vae: the VAE or "
                         f"its latent cache in {args.run_dir}/latents/ is broken; remove the cache "
                         "to re-encode, or check the VAE's weights)"
                         if bad_inputs.item() else "lower --lr or use --grad-clip")
                raise UsageError(f"non-finite loss at step {trainer.step}; stopped. The last good "
                                 f"checkpoint ({trainer.ckpt_path}) is intact: {cause}")
            images_per_s = (trainer.step - last_log_step) * args.batch_size / (time.time() - last_time)
            if rank == 0:
                bar.set_postfix(loss=f"{mean_loss:.4f}", img_s=f"{images_per_s:.0f}")
                log.write(json.dumps({"step": trainer.step, "loss": mean_loss,
                                      "loss_per_t_bin": (bins_loss / bins_count.clamp(min=1)).tolist(),
                                      "images_per_s": images_per_s,
                                      "lr": trainer.opt.param_groups[0]["lr"],
                                      "flops": trainer.flops,
                                      "condition": config["condition"],
                                      "precision": config["precision"]}) + "\n")
                log.flush()
            bins_loss.zero_(); bins_count.zero_()
            last_log_step, last_time = trainer.step, time.time()
        if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps:
            trainer.save(config)
        if args.lr_schedule == "wsd" and trainer.step == decay_start(args.steps, args.decay_share):
            # where a longer run of the same flags continues
            trainer.save(config, os.path.join(out_dir, "stable.pt"))
        if rank == 0 and ((args.sample_every and trainer.step % args.sample_every == 0)
                          or trainer.step == args.steps):
            preview(trainer.ema, trainer.objective, condition, indices, dataset, device,
                    os.path.join(out_dir, f"samples_{trainer.step:07d}.png"),
                    vae=getattr(dataset, "autoencoder", None))
    bar.close()
    if rank == 0:
        print(f"wrote {trainer.ckpt_path} (step {trainer.step}, {trainer.flops / 1e12:.3f} TFLOPs "
              "of training)")
        log.close()


def add_file_flags(p):
    """Where the run reads and writes: data, VAE, run folder, resumption."""
    g = p.add_argument_group("files")
    g.add_argument("--data", default=None,
                   help="data set spec (default: the one the cluster file was made from)")
    g.add_argument("--vae", default=None,
                   help="train in the latents of this diffusers AutoencoderKL folder (default: "
                        "the cluster file's, if cluster.py had --vae); needs "
                        "requirements-latent.txt")
    g.add_argument("--workers", type=int_at_least(0), default=None,
                   help="DataLoader processes that read and decode batches ahead of the training "
                        "step (default: 0 for the in-memory digits, else min(4, CPU count)); the "
                        "batches are the same for any value")
    g.add_argument("--image-size", type=int_at_least(2), default=None,
                   help="default: the cluster file's")
    g.add_argument("--download", action="store_true", help="allow downloading the data set")
    g.add_argument("--run-dir", default="runs")
    g.add_argument("--out-dir", default=None, help="default: RUN_DIR/experts/<cluster>")
    g.add_argument("--resume", action="store_true",
                   help="require a checkpoint to resume (resuming is automatic when one exists)")
    g.add_argument("--log-every", type=int_at_least(1), default=50)
    g.add_argument("--ckpt-every", type=int_at_least(1), default=500)
    g.add_argument("--sample-every", type=int_at_least(0), default=0,
                   help="also write an EMA sample grid every N steps (one is always written at "
                        "the end)")


def build_parser():
    p = Parser(prog="train_expert.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--cluster", type=cluster_name, default=None,
                   help="cluster id from runs/clusters.pt (default 0), or 'all' for the "
                                                                     "monolith baseline")
    g.add_argument("--partition", type=partition_name, default=None, metavar="NAME",
                   help="a contributor's expert, trained on their own --data (no cluster file, "
                        "nothing shared): it joins the ensemble as RUN_DIR/experts/NAME beside "
                        "the clusters' experts; route it with a router trained from the experts' "
                        "samples (train_router.py --from-samples)")
    g.add_argument("--classes", type=class_list, default=None, metavar="C,C,...",
                   help="with --partition: only these classes of --data (a contributor holding "
                        "some classes)")
    g.add_argument("--objective", default="fm", choices=["fm", "ddpm"],
                   help="fm: rectified-flow velocity; ddpm: epsilon prediction")
    g.add_argument("--model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="size from model.DiT_models: "
                        f"DiT-{{{','.join(SIZES)}}}/{{{','.join(map(str, PATCHES))}}} (N, M, T: "
                        "CPU-sized; default DiT-T/2, or with --init the starting checkpoint's "
                        "size)")
    g.add_argument("--modulation", default="adaln-single", choices=["adaln-single", "adaln-zero"],
                   help="how the time (and class) modulate the blocks: adaln-single (PixArt: one "
                        "shared modulation MLP, ~1/3 fewer parameters) or DiT's adaln-zero (an "
                        "MLP per block)")
    g.add_argument("--condition", default=None, choices=["class", "text", "none"],
                   help="what the expert is conditioned on: class labels, captions (PixArt "
                        "cross-attention to CLIP tokens, as Paris) or nothing (default: class for "
                        "labelled data, else none)")
    g.add_argument("--clip-model", default="ViT-B-32",
                   help="text: open_clip architecture name, or a model-config .json")
    g.add_argument("--clip-pretrained", default=None,
                   help="text: local open_clip weights file (a tag with --download), or 'none' "
                        "for an explicitly random text tower (smoke tests)")
    g.add_argument("--init", default=None,
                   help="start from a checkpoint: ours, or an official facebookresearch/DiT .pt; "
                        "a DDPM one starting an fm expert goes through "
                        "checkpoint.convert_ddpm_to_fm")
    g.add_argument("--import", dest="import_path", default=None, metavar="CKPT",
                   help="place a pretrained DiT (an official facebookresearch/DiT .pt, e.g. "
                        "DiT-XL-2-256x256.pt with --vae, or ours) in the expert's folder as it "
                        "is, untrained, with its provenance recorded: it then samples as "
                        "--experts all, or as expert <cluster> of an ensemble (the cluster file's "
                        "data must fit its shape)")
    g.add_argument("--time-map", default="linear", choices=["linear", "snr"],
                   help="fm: what the network sees at flow time t. linear: (x_t, t) (HDDM's map "
                        "for converted experts); snr: the DDPM state of equal signal-to-noise "
                        "ratio (this project's option for --init from DDPM)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int_at_least(1), default=1000,
                   help="total optimizer steps (a resumed run continues up to this)")
    g.add_argument("--batch-size", type=int_at_least(1), default=64,
                   help="global batch, split evenly over torchrun processes")
    g.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3,
                   help="AdamW learning rate (DiT-XL uses 1e-4; tiny models like more)")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "wsd"],
                   help="constant: --lr throughout; wsd: --lr, then a linear decay over the last "
                        "--decay-share of --steps (warmup-stable-decay without warmup). A wsd run "
                        "also writes stable.pt where its decay begins: a run to more --steps "
                        "continues from that, not from ckpt.pt")
    g.add_argument("--decay-share", type=float_in(0, 1, low_open=True), default=0.2,
                   help="wsd: the share of --steps over which the learning rate decays")
    g.add_argument("--weight-decay", type=float_in(0), default=0.0)
    g.add_argument("--ema-decay", type=float_in(0, 1), default=0.995,
                   help="EMA of the weights, used for sampling (DiT: 0.9999 over 400k steps)")
    g.add_argument("--grad-clip", type=float_in(0), default=1.0,
                   help="clip the gradient norm (0: off)")
    g.add_argument("--condition-dropout", type=float_in(0, 1), default=0.1,
                   help="probability of replacing the condition by the null one, so the expert "
                        "also learns p(x) for guidance")
    g.add_argument("--t-sampling", default="uniform", choices=["uniform", "logit-normal"],
                   help="fm: how flow times are drawn")
    g.add_argument("--beta-schedule", default="linear", choices=["linear", "cosine"],
                   help="ddpm (and fm --time-map snr): the noise schedule")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="bf16: autocast the forward pass; auto: bf16 on CUDA, and on a CPU where "
                        "a measurement of this model says bf16 is at least 10%% faster (cached in "
                        "RUN_DIR/precision.json), else fp32")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model")
    g.add_argument("--seed", type=seed_type, default=0)
    g.add_argument("--hflip", action="store_true",
                   help="random horizontal flips, as DiT trains ImageNet (natural images only: "
                        "refused for digits, whose mirror images are not digits)")
    add_file_flags(p)
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
