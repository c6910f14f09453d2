"""Stage 5 (optional): distil the routed ensemble into one model that needs no router.

Reads runs/experts/<k>/ckpt.pt, runs/router/ckpt.pt and the data set; writes
runs/experts/distilled/ (ckpt.pt, log.jsonl, an EMA sample grid). The checkpoint is a flow
expert like any other, so `sample.py --experts distilled` samples it with the monolith's
sampler (one network evaluation per step, no router) and `eval.py` evaluates it.

The teacher is the ensemble's velocity as sample.py computes it,
    v(x_t, t, y) = sum_k w_k(x_t, t, y) v_k(x_t, t, y),
with the weights of --routing (default the exact `full` mixture) and DDPM experts read through
the exact epsilon -> velocity conversion. Like the experts, the condition is replaced by the
null at --condition-dropout, so the student also learns the unconditional flow that guidance needs.
The student minimises ||v_student(x_t, t, y) - v_teacher(x_t, t, y)||^2 at
  * noisy real images, x_t = (1-t) x0 + t eps with t ~ U(0, 1) and x0 from ALL clusters. The
    data never leave this machine, but this machine must hold the whole data set: unlike
    train_expert.py, distillation is not decentralized.
  * optionally (--trajectory-fraction), points on the teacher's own sampling trajectories:
    fresh noise integrated with the teacher's Euler steps (--trajectory-steps) and stopped at a
    random step, so the student also learns where its own samples will go.
and it may start from one expert's weights (--init 2, or a checkpoint path; a DDPM expert is
converted by warm_start.convert_ddpm_to_fm) or from scratch at any registry size (--model).

What DDM does and what is this project's: DDM distils its ensemble into one dense model
and reports the student slightly ahead of a monolith trained from scratch (ImageNet FID
7.76 vs 7.82, the paper's figures). Regressing the routed ensemble velocity at noisy real
images is that step as this project implements it; trajectory points, --init from an
expert, a student of another size and a sparse teacher (--routing top1) are this project's
options.

    python distill.py                                   # DiT of the experts' size, full-mixture teacher
    python distill.py --model DiT-M/2 --steps 2000      # a smaller student
    python distill.py --init 0 --routing top1           # start from expert 0; DDM's top-1 ensemble as teacher
    python sample.py --experts distilled && python eval.py runs/samples/distilled.npz

FLOPs: the log and checkpoint count the student's forward + backward and every teacher
forward (each expert on the rows routed to it, and the router); the checkpoint also
records the experts' and the router's training FLOPs, so the student's total cost is
one number. Resuming is automatic and exact, as for experts. One process (no torchrun)."""
import argparse
import os
import shlex
from functools import partial

import numpy as np
import torch
from tqdm import tqdm

from diffusion import RectifiedFlow, per_sample_mse
from model import DEFAULT_EXPERT_MODEL, DiT_models
from routing import Ensemble, ensemble_velocity, routing_function
from plumbing.checkpoint import networks_digests
from plumbing.training.warm_start import network_to_train, start_from
from plumbing.command_line import (Parser, UsageError, device_type, float_in,
                                   int_at_least, run_main, seed_type)
from plumbing.condition import condition_for_data
from plumbing.data.datasets import TrainingBatches, load_dataset
from plumbing.distributed import scheduler_job
from plumbing.ensemble import SINGLE_MODELS, assemble, row_flops
from plumbing.data.latents import latent_set, resolve_vae
from plumbing.sources import Cluster, load_clusters
from plumbing.training.plan import Plan, resume_point
from plumbing.run_dir import atomic_save, check_writable_dir, cluster_path, expert_dir, folder_lock
from plumbing.training import Training
from plumbing.training.precision import precision_autocast, step_cost
from plumbing.training.log import LossLog, preview


class StudentPlan(Plan):
    """A distillation run: the routed ensemble (the teacher) regressed into one
    network."""
    DEFINING = (
        "experts", "routing", "model", "modulation", "init", "batch_size", "lr", "ema_decay",
        "grad_clip", "condition_dropout", "trajectory_fraction", "trajectory_steps", "seed")
    STAGE = "distill.py"

    @classmethod
    def from_args(cls, args):
        if args.init and args.model:
            raise UsageError("--init fixes the student's architecture; give --init or "
                             "--model, not both")
        return cls(args, out_dir=args.out_dir or expert_dir(args.run_dir, "distilled"))

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, "ckpt.pt")

    @property
    def init_source(self):
        """--init as a path: an expert's name is its folder in this run."""
        return expert_dir(self.run_dir, self.init) if self.init.isdigit() else self.init

    def defining(self, **resolved_flags):
        init = self.init if not self.init or self.init.isdigit() else os.path.basename(self.init)
        return super().defining(**{"init": init, **resolved_flags})


class Teacher:
    """The routed ensemble's velocity at per-row flow times, and the FLOPs of every
    call it answers."""

    def __init__(self, ensemble, per_row_flops):
        self.ensemble = ensemble
        # {k: FLOPs of one row's forward}, one router row's
        self.expert_flops, self.router_flops = per_row_flops
        self.flops = 0

    @torch.no_grad()
    def __call__(self, x_t, t, ids):
        v, weights = ensemble_velocity(self.ensemble, x_t, t, ids)
        rows = (weights > 0).sum(0)
        self.flops += sum(int(rows[k]) * f for k, f in self.expert_flops.items())
        self.flops += x_t.shape[0] * self.router_flops if self.ensemble.router is not None else 0
        return v


@torch.no_grad()
def trajectory_points(teacher, noise, ids, steps, generator):
    """(x_t, t): fresh noise moved along the teacher's Euler path, each row stopped
    after a random number of its `steps` steps."""
    stop = torch.randint(0, steps, (len(noise),), generator=generator)
    x = noise.clone()
    for i in range(int(stop.max())):
        moving = torch.nonzero(stop > i).flatten()
        t = 1 - i / steps
        x[moving] += -(1 / steps) * teacher(x[moving], torch.full((len(moving),), t, device=x.device), ids[moving])
    return x, (1 - stop.to(x) / steps).to(x.device)


class Distiller(Training):
    """The student's Training, its random stream and its teacher; `update` is one
    regression step onto the teacher."""

    def __init__(self, student, objective, teacher, *, optim, condition_dropout,
                 trajectory=(0.0, 16), seed=0):
        """optim: Training's lr, ema_decay and grad_clip (no weight decay); the
        condition is the teacher's."""
        super().__init__(student, weight_decay=0.0, **optim)
        self.objective, self.teacher, self.condition = objective, teacher, teacher.ensemble.condition
        self.condition_dropout = condition_dropout
        # the share of rows taught on teacher paths, their steps
        self.trajectory_fraction, self.trajectory_steps = trajectory
        self.generator = torch.Generator().manual_seed(seed)
        self.flops_per_step = 0   # the student's own, once measured (step_cost)

    @property
    def student(self):
        return self.model

    @property
    def flops(self):
        """The student's training FLOPs and the teacher's answers so far."""
        return self.step * self.flops_per_step + self.teacher.flops

    def points(self, x0, ids):
        """Where the student is taught: noisy real images, the first rows optionally
        replaced by teacher-trajectory points."""
        noise = torch.randn(x0.shape, generator=self.generator).to(x0.device)
        t = torch.rand(len(x0), generator=self.generator).to(x0.device)
        x_t = RectifiedFlow.add_noise(x0, noise, t)
        m = round(self.trajectory_fraction * len(x0))
        if m:
            fresh = torch.randn(x0[:m].shape, generator=self.generator).to(x0.device)
            x_t[:m], t[:m] = trajectory_points(
                self.teacher, fresh, ids[:m], self.trajectory_steps, self.generator)
        return x_t, t

    def update(self, x0, ids, autocast):
        """One step: teacher targets at this batch's points (condition dropped at the
        guidance rate), regression, EMA. Returns the loss (B,) and the flow times (B,)."""
        ids = self.condition.drop(ids, self.condition_dropout, self.generator).to(x0.device)
        x_t, t = self.points(x0, ids)
        target = self.teacher(x_t, t, ids)
        with autocast:
            v = self.objective.velocity(self.student, x_t, t, self.condition.expert_input(ids))
        loss = per_sample_mse(v.float(), target.float())
        self.apply(loss)
        self.step += 1
        return loss.detach().float(), t

    def state(self):
        return {**super().state(), "rng": [self.generator.get_state()],
                "teacher_flops": self.teacher.flops}

    def load_own_state(self, ckpt):
        self.teacher.flops = ckpt["teacher_flops"]
        self.generator.set_state(ckpt["rng"][0])


def load_teacher(plan):
    """(experts by router output, router, routing, expert names by router output): the
    ensemble's experts and their router, checked to belong together."""
    rule = plan.routing.partition(":")[0]
    if rule == "oracle":
        raise UsageError(f"--routing {plan.routing} is one expert alone, not the "
                         "ensemble; to ship that expert, sample it (sample.py --experts "
                         f"{plan.routing.partition(':')[2]}) or start a student from it "
                         "with --init")
    if rule == "draw":
        raise UsageError("--routing draw picks each image's expert once, at the noise: "
                         "it is a sampler, not a velocity field a student can regress "
                         "onto; distil the exact mixture (full) instead")
    if plan.experts.strip() in SINGLE_MODELS:
        raise UsageError(f"--experts {plan.experts.strip()}: the teacher is the "
                         "ensemble's experts (e.g. 0,1,2,3), not one model of the whole "
                         "data set")
    return assemble(plan.run_dir, plan.experts, plan.router, plan.routing)


def student_start(plan, ref, condition):
    """(--init's Start or None, the registry size that trains): an expert's weights (its id
    or a path), or a new network of --model, by default the experts' own size."""
    if plan.init:
        start = start_from(plan.init, plan.init_source, RectifiedFlow(), modulation=plan.modulation,
                           condition_args=condition.expert_args(),
                           image_size=ref.config["image_size"], channels=ref.config["channels"])
        return start, start.size
    return None, plan.model or ref.config.get("flags", {}).get("model", DEFAULT_EXPERT_MODEL)


def teacher_config(experts, names, router, routing_flag):
    """What the student was distilled from, and what that cost to train."""
    return {"routing": routing_flag, "router_flops": router.config["flops"],
            "experts": {names[k]: {"objective": e.objective.name, "init": e.config.get("init"),
                                   "flops": e.config.get("flops")}
                        for k, e in experts.items()}}


def main(args):
    plan = StudentPlan.from_args(args)
    device = torch.device(plan.device)
    check_writable_dir(plan.out_dir, "the distilled model's folder")

    # The teacher: the experts and their router, checked to belong together
    experts, router, routing, names = load_teacher(plan)
    ref = next((e for output, e in sorted(experts.items()) if names[output].isdigit()), None)
    if ref is None:   # the student learns at noisy images of the cluster file's data set
        raise UsageError("distill.py trains the student at noisy images of the run's "
                         "clustered data set; these experts are all contributors' "
                         "(named), so there is none here: add the k-means experts "
                         "(cluster.py, train_expert.py --cluster)")

    # Data: every image of the clustered set, in the teacher's space (this step is not
    # decentralized: this machine holds the whole data set), and the teacher on it
    source = whole_data(plan.run_dir, ref.config, plan.vae, plan.download, device)
    dataset = source.dataset
    spec = ref.condition.spec()
    condition = condition_for_data(spec["kind"], dataset, plan.run_dir, encoder=spec.get("encoder"),
                                   clip_model=plan.clip_model, download=plan.download,
                                   clip_pretrained=plan.clip_pretrained)
    for network in [*experts.values(), router]:
        network.to(device)
    route = routing_function(router, condition)
    # the teacher's identity: a student resumes only with the networks it learnt from
    teacher_weights = networks_digests(experts, router, names)
    teacher = Teacher(Ensemble(experts, route, routing, condition, len(names)),
                      row_flops(experts, route, condition, ref, device))

    with folder_lock(plan.out_dir, "distill.py"):
        # Student: resumed, or built (from an expert's weights, or afresh); a resume is
        # checked on what the flags resolve to (the teacher's experts, the student's size)
        torch.manual_seed(plan.seed)
        start, size = student_start(plan, ref, condition)
        resolved_flags = {"experts": ",".join(names[output] for output in sorted(experts)),
                    "model": size}
        resume = resume_point(plan.ckpt_path, plan.steps, stage=plan.STAGE, check=partial(
            plan.check_resume, resolved_flags=resolved_flags, teacher_weights=teacher_weights))
        student, model_args, objective, init = network_to_train(
            resume, start, RectifiedFlow(), size, plan.modulation, condition,
            ref.config["image_size"], ref.config["channels"])
        init = f"scratch:{size}" if init == "scratch" else init   # the record names the size

        # EMA and optimizer, and where a resumed run stood
        distiller = Distiller(student.to(device), objective, teacher, seed=plan.seed,
                              optim={"lr": plan.lr, "ema_decay": plan.ema_decay,
                                     "grad_clip": plan.grad_clip},
                              condition_dropout=plan.condition_dropout,
                              trajectory=(plan.trajectory_fraction, plan.trajectory_steps))
        if resume is not None:
            distiller.load_state(resume, plan.ckpt_path)
            print(f"resumed {plan.ckpt_path} at step {distiller.step}")

        # What a student step costs, and the checkpoint record
        shape = (plan.batch_size, dataset.channels, dataset.image_size, dataset.image_size)
        student_flops, precision = step_cost(
            student, model_args, objective, condition, shape, device, plan.precision, plan.run_dir)
        distiller.flops_per_step = student_flops
        config = plan.checkpoint_config(
            resolved_flags, network="dit", objective=objective.spec(), condition=condition.spec(), init=init,
            **source.record(), cluster_fingerprint=ref.config["cluster_fingerprint"],
            vae=ref.config.get("vae"), precision=precision.name,
            precision_evidence=precision.evidence, world_size=1, flops_per_step=student_flops,
            teacher=teacher_config(experts, names, router, plan.routing),
            teacher_weights=teacher_weights, job=scheduler_job())
        print(f"distilling {len(teacher.ensemble.experts)} experts ({plan.routing} "
              f"routing) into {sum(p.numel() for p in student.parameters()):,} "
              f"parameters ({init}) on all {len(dataset)} images; student "
              f"{student_flops / 1e9:.3f} GFLOPs per step, {precision.name}")

        # The loop: every image of the set, batches a function of (seed, step) as an
        # expert's, so a resumed run sees the same batches
        autocast = precision_autocast(device, precision.name)
        everything = np.arange(len(dataset))
        batches = TrainingBatches(dataset, everything, plan.batch_size, plan.seed)
        log = LossLog(os.path.join(plan.out_dir, "log.jsonl"), device, distiller.step)
        bar = tqdm(total=plan.steps, initial=distiller.step, desc="distill")
        distiller.student.train()
        for idx, x0 in batches.loader(distiller.step, plan.steps, 0, pin_memory=False):
            x0 = x0.to(device)
            loss, t = distiller.update(x0, condition.ids(idx.numpy()), autocast)
            log.add(x0, loss, t)
            bar.update(1)
            if distiller.step % plan.log_every == 0 or distiller.step == plan.steps:
                log.write(bar, distiller, plan.batch_size, plan.ckpt_path,
                          teacher_flops=distiller.teacher.flops)
            if distiller.step % plan.ckpt_every == 0 or distiller.step == plan.steps:
                save(distiller, config, plan.ckpt_path, model_args)
        bar.close()
        log.close()

        # A preview of the EMA student: 8 rows of the data's conditions
        g = torch.Generator().manual_seed(1234)
        preview(distiller.ema, objective, condition, condition.requests(64, g).sort().values,
                dataset, os.path.join(plan.out_dir, f"samples_{distiller.step:07d}.png"), generator=g)
    print(f"wrote {plan.ckpt_path} (step {distiller.step}); {how_to_sample(plan.ckpt_path)}")


def save(distiller, config, ckpt_path, model_args):
    teacher = config["teacher"]
    below = teacher["router_flops"] + sum(e["flops"] or 0 for e in teacher["experts"].values())
    own = distiller.flops
    atomic_save({**distiller.state(), "model_args": model_args,
                 "config": {**config, "flops": own, "distillation_flops": own,
                            "total_flops_with_teacher_training": own + below}},
                ckpt_path)


def how_to_sample(ckpt_path):
    """The command that samples the student: sample.py finds it as RUN/experts/distilled, wherever
    --out-dir put it."""
    folder = os.path.dirname(os.path.abspath(ckpt_path))
    experts = os.path.dirname(folder)
    if os.path.basename(folder) == "distilled" and os.path.basename(experts) == "experts":
        run = shlex.quote(os.path.dirname(experts))
        return f"sample it with: python sample.py --experts distilled --run-dir {run}"
    return (f"to sample it, link it into a run folder (ln -s {shlex.quote(folder)} "
            "RUN/experts/distilled) and run python sample.py --experts distilled "
            "--run-dir RUN")


def whole_data(run_dir, recorded, vae_flag, download, device):
    """The student's source: every image of the data set the experts record (checked by
    fingerprint), in their latent space, with the clustering they record. A release
    (export.py) carries the clustering's identity in its experts instead of a cluster
    file."""
    dataset = load_dataset(recorded["data_spec"], recorded["data"]["shape"][-1], download)
    if dataset.fingerprint != recorded["data"]:
        raise UsageError(f"the data set {recorded['data_spec']} has changed since the "
                         "experts were trained on it")
    clusters = load_clusters(run_dir) if os.path.isfile(cluster_path(run_dir)) else \
        {"fingerprint": recorded["cluster_fingerprint"], "k": recorded["k"]}
    if clusters["fingerprint"] != recorded["cluster_fingerprint"]:
        raise UsageError(f"the experts were trained on another clustering than {run_dir}/clusters.pt")
    vae = resolve_vae(vae_flag, recorded.get("vae"), download, device)
    dataset = latent_set(dataset, vae, run_dir) if vae is not None else dataset
    return Cluster("distilled", clusters, dataset, recorded["data_spec"])


def build_parser():
    p = Parser(prog="distill.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the teacher")
    g.add_argument("--experts", default="",
                   help="cluster ids of the teacher's experts, e.g. 0,2,3 (default: "
                        "every expert in runs/experts/)")
    g.add_argument("--router", default=None,
                   help="router checkpoint (default: RUN_DIR/router/ckpt.pt)")
    g.add_argument("--routing", default="full",
                   help="the teacher's rule: full (the exact mixture) | top1 | top2 | "
                        "topk:N | threshold:TAU")
    g = p.add_argument_group("the student")
    g.add_argument("--model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="registry size, e.g. DiT-M/2 for a student smaller than the "
                        "experts (default: the experts' size)")
    g.add_argument("--modulation", default="adaln-single", choices=["adaln-single", "adaln-zero"],
                   help="as train_expert.py")
    g.add_argument("--init", default=None,
                   help="start from an expert: its cluster id (e.g. 0) or a checkpoint "
                        "path; a DDPM one is converted to flow matching")
    g.add_argument("--trajectory-fraction", type=float_in(0, 1), default=0.0,
                   help="share of each batch taken from the teacher's own sampling "
                        "trajectories instead of noisy data")
    g.add_argument("--trajectory-steps", type=int_at_least(1), default=16,
                   help="Euler steps of those trajectories")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int_at_least(1), default=1000)
    g.add_argument("--batch-size", type=int_at_least(1), default=64)
    g.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3)
    g.add_argument("--ema-decay", type=float_in(0, 1), default=0.995)
    g.add_argument("--grad-clip", type=float_in(0), default=1.0,
                   help="clip the gradient norm (0: off)")
    g.add_argument("--condition-dropout", type=float_in(0, 1), default=0.1,
                   help="probability of asking the teacher and student for the "
                        "unconditional flow (the null condition)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the student's forward pass, as train_expert.py: auto measures "
                        "once whether bf16 pays here")
    g.add_argument("--seed", type=seed_type, default=0)
    g = p.add_argument_group("files")
    g.add_argument("--clip-model", default="ViT-B-32",
                   help="text experts, when runs/text/ lacks the captions: open_clip architecture")
    g.add_argument("--clip-pretrained", default=None,
                   help="text experts, when runs/text/ lacks the captions: the same weights file")
    g.add_argument("--vae", default=None,
                   help="latent experts: where their VAE folder is on this machine "
                        "(default: the path they recorded)")
    g.add_argument("--download", action="store_true", help="allow downloading the data set")
    g.add_argument("--run-dir", default="runs")
    g.add_argument("--out-dir", default=None, help="default: RUN_DIR/experts/distilled")
    g.add_argument("--log-every", type=int_at_least(1), default=50)
    g.add_argument("--ckpt-every", type=int_at_least(1), default=500)
    g.add_argument("--device", type=device_type, default="cuda"
                   if torch.cuda.is_available() else "cpu")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
