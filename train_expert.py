"""Stage 2: train one expert on one cluster, in complete isolation.

Reads the data set and runs/clusters.pt; writes only runs/experts/<cluster>/ (ckpt.pt,
log.jsonl, EMA sample grids). Nothing here talks to any other expert: K experts can train
on K machines, at different times, on different hardware, and be copied into one runs/.

    python train_expert.py --cluster 2 --objective fm        # a flow-matching expert on cluster 2
    python train_expert.py --cluster 0 --objective ddpm      # an epsilon-prediction (DDPM) expert
    python train_expert.py --cluster all                     # the monolith baseline, same code
    python train_expert.py --contribution eights --data digits --classes 8   # a contributor's own data
    torchrun --nproc_per_node=8 train_expert.py --cluster 2  # one expert on 8 GPUs (DDP)

The objective and the condition are objects chosen once: one training step serves every
combination. Resuming is automatic and exact (N steps + N resumed = 2N straight).
"""
import argparse
import contextlib
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from diffusion import objective_from_flags
from model import DEFAULT_EXPERT_MODEL, DiT_models
from plumbing.command_line import (Parser, Renamed, UsageError, class_list, cluster_name,
                                   float_in, int_at_least, contribution_name, run_main,
                                   seed_type)
from plumbing.condition import condition_for_data
from plumbing.data.datasets import TrainingBatches
from plumbing.training.plan import Plan, resume_point
from plumbing.run_dir import atomic_save, check_writable_dir, expert_dir, folder_lock
from plumbing.sources import expert_source
from plumbing.training.warm_start import network_to_train, start_from
from plumbing.training.log import LossLog, preview
from plumbing.training import Training, decay_start, learning_rate
from plumbing.training.precision import precision_autocast, step_cost
from plumbing.distributed import STOPPED_TO_RESUME, StopRequest, scheduler_job, setup_distributed


class ExpertPlan(Plan):
    """One expert's (or the monolith's, or a contributor's) training run: the flags of
    train_expert.py, and its name (the cluster, 'all' or the contribution) and folder."""
    # what a resume must repeat; --steps, logging and file flags may change between runs
    DEFINING = (
        "cluster", "contribution", "classes", "objective", "model", "modulation", "condition",
        "init", "time_map", "t_sampling", "beta_schedule", "batch_size", "lr", "lr_schedule",
        "decay_share", "weight_decay", "ema_decay", "grad_clip", "condition_dropout", "hflip",
        "seed")
    STAGE = "train_expert.py"
    RENAMED = {"contribution": "partition"}

    @classmethod
    def from_args(cls, args):
        if args.contribution and args.cluster is not None:
            raise UsageError("--contribution names a contributor's own data; --cluster a "
                                 "k-means cluster of the run's: give one")
        if args.classes is not None and not args.contribution:
            raise UsageError("--classes selects a contributor's data: use it with "
                                 "--contribution NAME")
        name = args.contribution or args.cluster or "0"
        return cls(args, name=name, cluster=None if args.contribution else name,
                   out_dir=args.out_dir or expert_dir(args.run_dir, name))

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, "ckpt.pt")

    def defining(self, **resolved_flags):
        # the checkpoint's "cluster" has always been the expert's name, a contributor's
        # too; --init is recorded by file name, since paths differ between machines
        init = os.path.basename(self.init) if self.init else None
        return super().defining(**{"cluster": self.name, "init": init, **resolved_flags})

    def comparable(self, flags):
        # --decay-share shapes only the wsd schedule
        return {**flags, "decay_share": None} if flags.get("lr_schedule") == "constant" else flags

    def check_resume(self, path, config, resolved_flags=None, **facts):
        super().check_resume(path, config, resolved_flags, **facts)
        planned = config.get("target_steps", self.steps)
        if self.lr_schedule == "wsd" and planned != self.steps:
            start = decay_start(planned, self.decay_share)
            if config.get("step", 0) > min(start, decay_start(self.steps, self.decay_share)):
                raise UsageError(f"{path} is past the start of its learning-rate decay "
                                     f"(step {config['step']} of {planned}, decay from "
                                     f"{start}); it cannot continue to --steps {self.steps}: "
                                     f"continue from its stable.pt (written at step {start}) "
                                     f"instead, or train to --steps {planned}")


def starting_point(plan, dataset, condition):
    """(the objective the flags ask for, --init's Start or None, the registry size that
    trains): --init is read once, here."""
    objective = objective_from_flags(plan.objective, t_sampling=plan.t_sampling,
                                     clip_x0=dataset.bounded,
                                     time_map=plan.time_map, beta_schedule=plan.beta_schedule)
    if not plan.init:
        return objective, None, plan.model or DEFAULT_EXPERT_MODEL
    start = start_from(plan.init, plan.init, objective, modulation=plan.modulation,
                       condition_args=condition.expert_args(), image_size=dataset.image_size,
                       channels=dataset.channels, model=plan.model)
    return objective, start, start.size


class Trainer(Training):
    """One expert's Training, its objective, its FLOP count and its own random stream."""

    def __init__(self, model, objective, plan, rank, world):
        super().__init__(model, lr=plan.lr, weight_decay=plan.weight_decay,
                         ema_decay=plan.ema_decay, grad_clip=plan.grad_clip)
        self.objective, self.plan, self.flops = objective, plan, 0
        self.rank, self.world = rank, world
        # per-rank noise, condition dropout and times
        self.generator = torch.Generator().manual_seed(plan.seed * 1000 + rank)

    def update(self, train_model, x0, y, autocast):
        """One optimizer step and the EMA (the step counted); returns the per-sample loss and
        noise levels."""
        noise = torch.randn(x0.shape, generator=self.generator).to(x0.device)
        t = self.objective.sample_time(len(x0), self.generator, x0.device)
        with autocast:
            loss = self.objective.loss(train_model, x0, t, noise, y)           # (B,) per sample
        p = self.plan
        self.apply(loss, lr=learning_rate(self.step, p.lr, p.lr_schedule, p.steps, p.decay_share))
        self.step += 1
        return loss.detach().float(), self.objective.unit_time(t)

    def state(self, world=1):
        """Training's, the FLOPs so far and every rank's random stream (collective)."""
        rng = [self.generator.get_state()]
        if world > 1:
            rng = [None] * world
            dist.all_gather_object(rng, self.generator.get_state())
        return {**super().state(), "rng": rng, "flops": self.flops}

    def load_own_state(self, ckpt):
        self.flops = ckpt["config"]["flops"]
        if len(ckpt["rng"]) == self.world:
            self.generator.set_state(ckpt["rng"][self.rank])
        elif self.rank == 0:
            print(f"resuming with {self.world} processes instead of {len(ckpt['rng'])}: "
                  "random streams restart from --seed")
        if self.rank == 0:
            print(f"resumed {self.plan.ckpt_path} at step {self.step}")


def main(args):
    plan = ExpertPlan.from_args(args)

    # Processes: one, or torchrun's; rank 0 alone writes
    rank, world, device = setup_distributed()
    if plan.batch_size % world:
        raise UsageError(f"--batch-size {plan.batch_size} must split evenly over {world} ranks")
    local_batch = plan.batch_size // world
    check_writable_dir(plan.out_dir, "the expert's folder")

    # Data: the images this expert owns (its cluster's, or its own), and its condition
    source = expert_source(plan.name, plan.run_dir, plan.data_flags, device,
                           contribution=bool(plan.contribution), classes=plan.classes)
    dataset = source.dataset
    batches = TrainingBatches(dataset, source.indices, local_batch, plan.seed, rank, world,
                              hflip=plan.hflip)
    condition = condition_for_data(plan.condition, dataset, plan.run_dir, download=plan.download,
                                   clip_model=plan.clip_model, clip_pretrained=plan.clip_pretrained,
                                   clusters=source.clusters if plan.cluster == "all" else None)
    facts = {"condition": condition.spec(), "vae": getattr(dataset, "vae", None),
             "cluster_fingerprint": (source.clusters or {}).get("fingerprint")}

    with folder_lock(plan.out_dir, "train_expert.py") if rank == 0 else contextlib.nullcontext():
        # Model: resumed, or built (from scratch or --init), the same on every rank
        torch.manual_seed(plan.seed)
        objective, start, size = starting_point(plan, dataset, condition)
        resolved_flags = {"condition": condition.kind, "model": size}
        resume = resume_point(plan.ckpt_path, plan.steps, stage=plan.STAGE, required=plan.resume,
                              check=partial(plan.check_resume, resolved_flags=resolved_flags, **facts))
        if rank == 0:
            source.claim(plan.out_dir, plan.run_dir)   # no two experts of one run share data
        model, model_args, objective, init = network_to_train(
            resume, start, objective, size, plan.modulation, condition, dataset.image_size,
            dataset.channels)

        # EMA and optimizer, and where a resumed run stood
        trainer = Trainer(model.to(device), objective, plan, rank, world)
        if resume is not None:
            trainer.load_state(resume, plan.ckpt_path)

        # What a step costs, in FLOPs and in which precision it runs
        batch_shape = (local_batch, dataset.channels, dataset.image_size, dataset.image_size)
        flops_per_step, precision = step_cost(
            model, model_args, objective, condition, batch_shape, device, plan.precision, plan.run_dir)
        config = plan.checkpoint_config(
            resolved_flags, **facts, network="dit", objective=objective.spec(), init=init,
            member=source.member(), **source.record(), target_steps=plan.steps,
            precision=precision.name, precision_evidence=precision.evidence, world_size=world,
            flops_per_step=flops_per_step, job=scheduler_job())
        if rank == 0:
            print(f"expert {plan.name}: {objective.name}, condition {condition.kind}, "
                  f"{len(source.indices)} images, {sum(p.numel() for p in model.parameters()):,} "
                  f"parameters ({init.replace('scratch', size)}), {flops_per_step / 1e9:.3f} "
                  f"GFLOPs per step, {precision.name} ({precision.evidence.get('reason', 'as asked')})")

        # The loop: a batch of the cluster, conditions with guidance dropout, an update
        train_model = DistributedDataParallel(model) if world > 1 else model
        train_model = torch.compile(train_model) if plan.compile else train_model
        train_model.train()
        autocast = precision_autocast(device, precision.name)
        stop = StopRequest()
        loader = batches.loader(trainer.step, plan.steps, data_workers(plan, dataset),
                                pin_memory=device.type == "cuda")
        log = LossLog(os.path.join(plan.out_dir, "log.jsonl") if rank == 0 else None, device,
                      trainer.step)
        # a preview row per condition found in the cluster (up to 8)
        preview_rows = torch.unique(condition.ids(source.indices))[:8].repeat_interleave(8)
        bar = tqdm(total=plan.steps, initial=trainer.step, desc=f"expert {plan.name}",
                   disable=rank != 0)
        for idx, x0 in loader:
            # the null condition too, for classifier-free guidance
            ids = condition.drop(condition.ids(idx.numpy()), plan.condition_dropout,
                                 trainer.generator)
            x0 = x0.to(device, non_blocking=True)
            loss, t_unit = trainer.update(
                train_model, x0, condition.expert_input(ids.to(device)), autocast)
            log.add(x0, loss, t_unit)
            trainer.flops += flops_per_step
            bar.update(1)
            if trainer.step % plan.log_every == 0 or trainer.step == plan.steps:
                log.write(bar, trainer, plan.batch_size, plan.ckpt_path,
                               condition=config["condition"], precision=precision.name)

            # Save: the checkpoint, wsd's stable point, a preview
            if trainer.step % plan.ckpt_every == 0 or trainer.step == plan.steps:
                save(trainer, model_args, config, plan.ckpt_path, world)
            if plan.lr_schedule == "wsd" and trainer.step == decay_start(plan.steps, plan.decay_share):
                save(trainer, model_args, config, os.path.join(plan.out_dir, "stable.pt"), world)
            if rank == 0 and ((plan.sample_every and trainer.step % plan.sample_every == 0)
                              or trainer.step == plan.steps):
                preview(trainer.ema, objective, condition, preview_rows, dataset,
                        os.path.join(plan.out_dir, f"samples_{trainer.step:07d}.png"))
            # a scheduler's warning or requeue: save where we are, and stop to be resumed
            if trainer.step < plan.steps and stop.requested(device):
                save(trainer, model_args, config, plan.ckpt_path, world)
                break
        bar.close()
        log.close()
    finish(plan, trainer, stop, rank, world)


def finish(plan, trainer, stop, rank, world):
    """The run's end: done, or stopped on a scheduler's request with its checkpoint saved,
    which exits STOPPED_TO_RESUME (`./ddm slurm`'s expert jobs requeue on it)."""
    if world > 1:
        dist.destroy_process_group()
    if trainer.step == plan.steps:
        if rank == 0:
            print(f"wrote {plan.ckpt_path} (step {trainer.step}, {trainer.flops / 1e12:.3f} "
                  "TFLOPs of training)")
        return
    if rank == 0:
        print(f"stopped by {stop.signal} at step {trainer.step}, checkpoint saved: the same "
              "command resumes it")
    sys.exit(STOPPED_TO_RESUME)


def save(trainer, model_args, config, path, world):
    state = trainer.state(world)   # collective: every rank gives its random stream
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    flops = state.pop("flops")
    atomic_save({**state, "model_args": model_args, "config": {**config, "flops": flops}}, path)


def data_workers(plan, dataset):
    """--workers, or by default none for digits: they sit in memory as 8x8 arrays,
    where a worker process costs more than it saves."""
    if plan.workers is not None:
        return plan.workers
    return 0 if dataset.name.startswith("digits") else min(4, os.cpu_count() or 1)


def build_parser():
    p = Parser(prog="train_expert.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--cluster", type=cluster_name, default=None,
                   help="cluster id of runs/clusters.pt (default 0), or 'all': the monolith")
    g.add_argument("--contribution", type=contribution_name, default=None, metavar="NAME",
                   help="a contributor's expert, trained on their own --data with no "
                        "cluster file; it joins the ensemble as RUN_DIR/experts/NAME")
    g.add_argument("--partition", dest="old_partition", action=Renamed, new="--contribution")
    g.add_argument("--classes", type=class_list, default=None, metavar="C,C,...",
                   help="with --contribution: only these classes of --data")
    g.add_argument("--objective", default="fm", choices=["fm", "ddpm"],
                   help="fm: rectified-flow velocity; ddpm: epsilon prediction")
    g.add_argument("--model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="a DiT registry size, DiT-{XL,L,B,S,T,M,N}/PATCH (N, M, T: CPU-sized; "
                        "default DiT-T/2, or --init's size)")
    g.add_argument("--modulation", default="adaln-single", choices=["adaln-single", "adaln-zero"],
                   help="PixArt's one shared modulation MLP, or DiT's MLP per block")
    g.add_argument("--condition", default=None, choices=["class", "text", "none", "class+cluster"],
                   help="default: class for labelled data, else none; text: CLIP captions; "
                        "class+cluster: the monolith told each image's cluster too (routed)")
    g.add_argument("--clip-model", default="ViT-B-32", help="text: open_clip architecture")
    g.add_argument("--clip-pretrained", default=None,
                   help="text: local open_clip weights, or 'none' for a random text tower")
    g.add_argument("--init", default=None,
                   help="start from a checkpoint, ours or an official DiT .pt (a DDPM "
                        "one starting an fm expert is converted)")
    g.add_argument("--import", action=Renamed,
                   new="a command of its own: python import_dit.py CKPT --cluster C")
    g.add_argument("--time-map", default="linear", choices=["linear", "snr"],
                   help="fm: what the network sees at flow time t: (x_t, t), or the DDPM "
                        "state of equal signal-to-noise ratio (for --init from DDPM)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int_at_least(1), default=1000,
                   help="total optimizer steps (a resumed run continues up to this)")
    g.add_argument("--batch-size", type=int_at_least(1), default=64,
                   help="global batch, split evenly over torchrun processes")
    g.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3,
                   help="AdamW learning rate (DiT-XL uses 1e-4; tiny models like more)")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "wsd"],
                   help="wsd: --lr, then a linear decay over the last --decay-share of "
                        "--steps; stable.pt, written where it begins, is what a longer "
                        "run continues")
    g.add_argument("--decay-share", type=float_in(0, 1, low_open=True), default=0.2)
    g.add_argument("--weight-decay", type=float_in(0), default=0.0)
    g.add_argument("--ema-decay", type=float_in(0, 1), default=0.995,
                   help="EMA of the weights, used for sampling (DiT: 0.9999 over 400k steps)")
    g.add_argument("--grad-clip", type=float_in(0), default=1.0, help="gradient norm (0: off)")
    g.add_argument("--condition-dropout", type=float_in(0, 1), default=0.1,
                   help="share of rows given the null condition, so the expert also "
                        "learns p(x) for guidance")
    g.add_argument("--t-sampling", default="uniform", choices=["uniform", "logit-normal"])
    g.add_argument("--beta-schedule", default="linear", choices=["linear", "cosine"],
                   help="ddpm (and fm --time-map snr): the noise schedule")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 on CUDA, and on a CPU where it measures at least "
                        "10%% faster (cached in RUN_DIR/precision.json)")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model")
    g.add_argument("--seed", type=seed_type, default=0)
    g.add_argument("--hflip", action="store_true",
                   help="random horizontal flips (natural images only)")
    g = p.add_argument_group("files")
    g.add_argument("--data", default=None, help="data set spec (default: the cluster file's)")
    g.add_argument("--vae", default=None,
                   help="train in the latents of this diffusers AutoencoderKL folder "
                        "(default: the cluster file's)")
    g.add_argument("--workers", type=int_at_least(0), default=None,
                   help="DataLoader processes (default: 0 for digits, else min(4, "
                        "CPUs)); the batches are the same for any value")
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
                   help="also write an EMA sample grid every N steps (one is always "
                        "written at the end)")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
