"""Stage 5 (optional): distil the routed ensemble into one model that needs no router.

Reads runs/experts/<k>/ckpt.pt, runs/router/ckpt.pt and the data set; writes
runs/experts/distilled/ (ckpt.pt, log.jsonl, an EMA sample grid). The checkpoint is a flow
expert like any other, so `sample.py --experts distilled` samples it with the monolith's sampler
(one network evaluation per step, no router) and `eval.py` evaluates it.

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
converted by checkpoint.convert_ddpm_to_fm) or from scratch at any registry size (--model).

What DDM does and what is this project's: DDM distils its ensemble into one dense model and
reports the student slightly ahead of a monolith trained from scratch (ImageNet FID 7.76 vs 7.82,
the paper's figures). Regressing the routed ensemble velocity at noisy real images is that step
as this project implements it; trajectory points, --init from an expert, a student of another
size and a sparse teacher (--routing top1) are this project's options.

    python distill.py                                   # DiT of the experts' size, full-mixture teacher
    python distill.py --model DiT-M/2 --steps 2000      # a smaller student
    python distill.py --init 0 --routing top1           # start from expert 0; DDM's top-1 ensemble as teacher
    python sample.py --experts distilled && python eval.py runs/samples/distilled.npz

FLOPs: the log and checkpoint count the student's forward + backward and every teacher
forward (each expert on the rows routed to it, and the router); the checkpoint also records the
experts' and the router's training FLOPs, so the student's total cost is one number.
Resuming is automatic and exact, as for experts. One process (no torchrun).
"""
import argparse
import json
import math
import os

import torch
from tqdm import tqdm

from command_line import (Parser, UsageError, device_type, float_in, int_at_least, run_main,
                          seed_type)
from condition import condition_for_data
from data import load_dataset
from diffusion import RectifiedFlow, objective_from_spec, per_sample_mse, sample_flow
from ensemble import SINGLE_MODELS, assemble
from latents import latent_set, resolve_vae
from checkpoint import (CHECKPOINT_FORMAT, CheckpointError, check_init_modulation,
                        init_from_checkpoint)
from model import DiT, DiT_models, count_flops, model_args_for
from precision import autocast as precision_autocast
from precision import choose as choose_precision
from precision import probe_step
from routing import Ensemble, ensemble_velocity, parse_routing, routing_function
from training import Training
from run_dir import (atomic_save, check_writable_dir, cluster_path, expert_dir, folder_lock,
                     load_checkpoint, load_clusters,
                     remove_stale_temporaries, save_grid, trim_log)

DISTILL_FLAGS = ["experts", "routing", "model", "modulation", "init", "batch_size", "lr",
                 "ema_decay", "grad_clip",
                 "condition_dropout", "trajectory_fraction", "trajectory_steps", "seed"]


def distill_flags(args):
    """The flags that define the run, as recorded in its checkpoint (--init by file name: paths
    differ between machines)."""
    flags = {name: getattr(args, name) for name in DISTILL_FLAGS}
    flags["init"] = os.path.basename(args.init) if args.init and not args.init.isdigit() else args.init
    return flags


class Teacher:
    """The routed ensemble's velocity at per-row flow times, and the FLOPs of every call it
    answers."""

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
    """(x_t, t): fresh noise moved along the teacher's Euler path, each row stopped after a random
    number of its `steps` steps."""
    stop = torch.randint(0, steps, (len(noise),), generator=generator)
    x = noise.clone()
    for i in range(int(stop.max())):
        moving = torch.nonzero(stop > i).flatten()
        t = 1 - i / steps
        x[moving] += -(1 / steps) * teacher(x[moving], torch.full((len(moving),), t, device=x.device), ids[moving])
    return x, (1 - stop.to(x) / steps).to(x.device)


class Distiller(Training):
    """The student's Training, its random stream and its teacher; `update` is one regression step
    onto the teacher."""

    def __init__(self, student, objective, teacher, *, optim, condition_dropout,
                 trajectory=(0.0, 16), seed=0):
        """optim: Training's lr, ema_decay and grad_clip (no weight decay); the condition is the
        teacher's."""
        super().__init__(student, weight_decay=0.0, **optim)
        self.objective, self.teacher, self.condition = objective, teacher, teacher.ensemble.condition
        self.condition_dropout = condition_dropout
        # the share of rows taught on teacher paths, their steps
        self.trajectory_fraction, self.trajectory_steps = trajectory
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def student(self):
        return self.model

    def points(self, x0, ids):
        """Where the student is taught: noisy real images, the first rows optionally replaced by
        teacher-trajectory points."""
        noise = torch.randn(x0.shape, generator=self.generator).to(x0.device)
        t = torch.rand(len(x0), generator=self.generator).to(x0.device)
        x_t = RectifiedFlow.add_noise(x0, noise, t)
        m = round(self.trajectory_fraction * len(x0))
        if m:
            fresh = torch.randn(x0[:m].shape, generator=self.generator).to(x0.device)
            x_t[:m], t[:m] = trajectory_points(self.teacher, fresh, ids[:m],
                                               self.trajectory_steps, self.generator)
        return x_t, t

    def update(self, x0, ids, autocast):
        """One step: teacher targets at this batch's points (condition dropped at the guidance
        rate), regression, EMA. Returns the loss (B,)."""
        ids = self.condition.drop(ids, self.condition_dropout, self.generator).to(x0.device)
        x_t, t = self.points(x0, ids)
        target = self.teacher(x_t, t, ids)
        with autocast:
            v = self.objective.velocity(self.student, x_t, t, self.condition.expert_input(ids))
        loss = per_sample_mse(v.float(), target.float())
        self.apply(loss)
        self.step += 1
        return loss.detach()

    def state(self):
        return {**super().state(), "rng": [self.generator.get_state()],
                "teacher_flops": self.teacher.flops}

    def load_state(self, ckpt):
        super().load_state(ckpt)
        self.teacher.flops = ckpt["teacher_flops"]
        self.generator.set_state(ckpt["rng"][0])


def load_teacher(args):
    """(experts by router output, router, routing, expert names by router output): the ensemble's
    experts and their router, checked to belong together."""
    try:
        routing = parse_routing(args.routing)
    except ValueError as e:
        raise UsageError(str(e))
    if routing[0] == "oracle":
        raise UsageError(f"--routing {args.routing} is one expert alone, not the ensemble; to ship "
                         f"that expert, sample it (sample.py --experts {routing[1]}) or start a "
                         f"student from it with --init {routing[1]}")
    if args.experts.strip() in SINGLE_MODELS:
        raise UsageError(f"--experts {args.experts.strip()}: the teacher is the ensemble's experts "
                         "(e.g. 0,1,2,3), not one model of the whole data set")
    experts, router, names = assemble(args.run_dir, args.experts, args.router, routing)
    if routing[0] == "topk" and routing[1] > len(experts):
        raise UsageError(f"top-{routing[1]} routing needs {routing[1]} experts; only "
                         f"{len(experts)} are available")
    return experts, router, routing, names


def per_row_flops(experts, router, route, condition, ref, device):
    """FLOPs of one row's forward through each expert and through the router (counted on two rows,
    at t = 0.5)."""
    x = torch.zeros(2, ref.config["channels"], ref.config["image_size"],
                    ref.config["image_size"], device=device)
    ids, t = condition.null(2, device), torch.full((2,), 0.5, device=device)
    with torch.no_grad():
        expert_flops = {k: count_flops(lambda: e.velocity(x, t, condition.expert_input(ids))) // 2
                        for k, e in experts.items()}
        return expert_flops, count_flops(lambda: route(x, t, ids)) // 2


def build_student(args, ref, condition):
    """(student, constructor args, objective, where its weights came from): --init (an expert id or
    a path) or a fresh --model."""
    if args.init:
        source = expert_dir(args.run_dir, args.init) if args.init.isdigit() else args.init
        try:
            state, model_args, objective, how = init_from_checkpoint(
                load_checkpoint(source, "--init checkpoint"), RectifiedFlow(), modulation=args.modulation,
                condition_args=condition.expert_args())
        except (CheckpointError, KeyError) as e:
            raise UsageError(f"cannot start the student from --init {args.init}: {e}")
        if (model_args["input_size"],
            model_args["in_channels"]) != (ref.config["image_size"], ref.config["channels"]):
            raise UsageError(f"--init {args.init} is a network for other images than the experts'")
        try:
            check_init_modulation(args.init, model_args, args.modulation)
        except CheckpointError as e:
            raise UsageError(str(e))
        student = DiT(**model_args)
        student.load_state_dict(state, strict=True)
        source_name = args.init if args.init.isdigit() else os.path.basename(args.init)
        return student, model_args, objective, f"{how}:{source_name}"
    size = args.model or ref.config.get("flags", {}).get("model", "DiT-T/2")
    objective = RectifiedFlow()
    model_args = model_args_for(size, input_size=ref.config["image_size"],
                                in_channels=ref.config["channels"], learn_sigma=False,
                                modulation=args.modulation, t_scale=objective.network_time_scale,
                                **condition.expert_args())
    return DiT(**model_args), model_args, objective, f"scratch:{size}"


def teacher_config(experts, names, router, routing_flag):
    """What the student was distilled from, and what that cost to train."""
    return {"routing": routing_flag, "router_flops": router.config["flops"],
            "experts": {names[k]: {"objective": e.objective.name, "init": e.config.get("init"),
                                   "flops": e.config.get("flops")}
                        for k, e in experts.items()}}


def main(args):
    device = torch.device(args.device)
    if args.init and args.model:
        raise UsageError("--init fixes the student's architecture; give --init or --model, not both")
    out_dir = args.out_dir or expert_dir(args.run_dir, "distilled")
    check_writable_dir(out_dir, "the distilled model's folder")
    experts, router, routing, names = load_teacher(args)
    ref = next((e for output, e in sorted(experts.items()) if names[output].isdigit()), None)
    if ref is None:   # the student learns at noisy images of the cluster file's data set
        raise UsageError("distill.py trains the student at noisy images of the run's clustered "
                         "data set; these experts are all contributors' (named), so there is none "
                         "here: add the k-means experts (cluster.py, train_expert.py --cluster)")
    # the student learns at every image, so only the clustering's identity is needed: a release
    # (export.py) carries it in its experts instead of the cluster file
    clusters = load_clusters(args.run_dir) if os.path.isfile(cluster_path(args.run_dir)) else \
        {"fingerprint": ref.config["cluster_fingerprint"], "k": ref.config["k"]}
    if clusters["fingerprint"] != ref.config["cluster_fingerprint"]:
        raise UsageError("the experts were trained on another clustering than "
                         f"{args.run_dir}/clusters.pt")
    # the images' own size
    dataset = load_dataset(ref.config["data_spec"], ref.config["data"]["shape"][-1], args.download)
    if dataset.fingerprint != ref.config["data"]:
        raise UsageError(f"the data set {ref.config['data_spec']} has changed since the experts "
                         "were trained on it")
    vae = resolve_vae(args.vae, ref.config.get("vae"), args.download, device)
    if vae is not None:   # the student learns in the teacher's latents
        dataset = latent_set(dataset, vae, args.run_dir)
    spec = ref.condition.spec()
    condition = condition_for_data(spec["kind"], dataset, args.run_dir, encoder=spec.get("encoder"),
                                   clip_model=args.clip_model,
                                   clip_pretrained=args.clip_pretrained, download=args.download)
    for network in [*experts.values(), router]:
        network.to(device)
    route = routing_function(router, condition)
    teacher = Teacher(Ensemble(experts, route, routing, condition, len(names)),
                      per_row_flops(experts, router, route, condition, ref, device))
    with folder_lock(out_dir, "distill.py"):
        remove_stale_temporaries(out_dir)
        run(args, out_dir, teacher, dataset, clusters, ref,
            teacher_config(experts, names, router, args.routing), device)


def run(args, out_dir, teacher, dataset, clusters, ref, teacher_info, device):
    """Build or resume the student and distil up to --steps, checkpointing atomically."""
    condition = teacher.ensemble.condition
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    resume = load_checkpoint(ckpt_path, "checkpoint") if os.path.isfile(ckpt_path) else None
    torch.manual_seed(args.seed)
    if resume is not None:
        changed = [f"--{k.replace('_', '-')} {resume['config']['flags'].get(k)} -> {v}" for k,
                   v in distill_flags(args).items()
                   if resume["config"]["flags"].get(k) != v]
        if changed:
            raise UsageError(f"{ckpt_path} was distilled with other flags ({'; '.join(changed)}); "
                             "resume with the same flags, or use another --out-dir")
        model_args, init = resume["model_args"], resume["config"]["init"]
        student, objective = DiT(**model_args), objective_from_spec(resume["config"]["objective"])
    else:
        student, model_args, objective, init = build_student(args, ref, condition)
    optim = {"lr": args.lr, "ema_decay": args.ema_decay, "grad_clip": args.grad_clip}
    distiller = Distiller(student.to(device), objective, teacher, optim=optim,
                          condition_dropout=args.condition_dropout,
                          trajectory=(args.trajectory_fraction,
                                      args.trajectory_steps), seed=args.seed)
    if resume is not None:
        distiller.load_state(resume)
        print(f"resumed {ckpt_path} at step {distiller.step}")
    y = condition.expert_input(condition.null(args.batch_size, device))
    shape = (args.batch_size, dataset.channels, dataset.image_size, dataset.image_size)
    step = probe_step(student, objective, shape, y, device)   # for counting and timing
    student_flops = count_flops(step)
    precision, evidence = choose_precision(args.precision, step, device, args.run_dir,
                                           {"model_args": model_args, "batch": list(shape),
                                            "objective": objective.spec()})
    config = {"format": CHECKPOINT_FORMAT, "network": "dit", "objective": objective.spec(),
              "condition": condition.spec(),
              "flags": distill_flags(args), "init": init, "image_size": dataset.image_size,
              "channels": dataset.channels,
              "cluster": "distilled", "cluster_fingerprint": clusters["fingerprint"],
              "k": clusters["k"], "data": dataset.fingerprint,
              "data_spec": ref.config["data_spec"], "vae": ref.config.get("vae"),
              "cluster_size": len(dataset), "precision": precision,
              "precision_evidence": evidence, "world_size": 1,
              "flops_per_step": student_flops, "teacher": teacher_info}
    print(f"distilling {len(teacher.ensemble.experts)} experts ({args.routing} routing) into "
          f"{sum(p.numel() for p in student.parameters()):,} parameters ({init}) on all "
          f"{len(dataset)} images; student {student_flops / 1e9:.3f} GFLOPs per step, "
          f"{precision}")
    trim_log(os.path.join(out_dir, "log.jsonl"), distiller.step)
    loop(args, distiller, dataset, condition, config, ckpt_path, model_args, device)


def save(distiller, config, ckpt_path, model_args):
    teacher = config["teacher"]
    below = teacher["router_flops"] + sum(e["flops"] or 0 for e in teacher["experts"].values())
    own = distiller.step * config["flops_per_step"] + distiller.teacher.flops
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
        return f"sample it with: python sample.py --experts distilled --run-dir {os.path.dirname(experts)}"
    return (f"to sample it, link it into a run folder (ln -s {folder} RUN/experts/distilled) and "
            "run python sample.py --experts distilled --run-dir RUN")


def loop(args, distiller, dataset, condition, config, ckpt_path, model_args, device):
    """Batches of all images in an order that is a function of (seed, epoch), so a resumed run sees
    the same batches."""
    out_dir = os.path.dirname(ckpt_path)
    autocast = precision_autocast(device, config["precision"])
    steps_per_epoch = max(1, len(dataset) // args.batch_size)
    bar = tqdm(total=args.steps, initial=distiller.step, desc="distill")
    distiller.student.train()
    running = []
    with open(os.path.join(out_dir, "log.jsonl"), "a") as log:
        while distiller.step < args.steps:
            epoch, b = divmod(distiller.step, steps_per_epoch)
            order = torch.randperm(len(dataset),
                                   generator=torch.Generator().manual_seed(args.seed * 100003 + epoch)).numpy()
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            loss = distiller.update(dataset.batch(idx).to(device), condition.ids(idx), autocast)
            running.append(loss.mean().item())
            bar.update(1)
            if distiller.step % args.log_every == 0 or distiller.step == args.steps:
                mean_loss = sum(running) / len(running)
                if not math.isfinite(mean_loss):
                    raise UsageError(f"non-finite loss at step {distiller.step}; the last good "
                                     f"checkpoint ({ckpt_path}) is intact: lower --lr")
                bar.set_postfix(loss=f"{mean_loss:.4f}")
                log.write(json.dumps({"step": distiller.step, "loss": mean_loss,
                                      "teacher_flops": distiller.teacher.flops,
                                      "flops": distiller.step * config["flops_per_step"]
                                      + distiller.teacher.flops}) + "\n")
                log.flush()
                running = []
            if distiller.step % args.ckpt_every == 0 or distiller.step == args.steps:
                save(distiller, config, ckpt_path, model_args)
    bar.close()
    preview(distiller, condition, dataset, device, os.path.join(out_dir,
                                                                f"samples_{distiller.step:07d}.png"))
    print(f"wrote {ckpt_path} (step {distiller.step}); {how_to_sample(ckpt_path)}")


@torch.no_grad()
def preview(distiller, condition, dataset, device, path):
    """A grid of the EMA student's samples, 25 Euler steps, 8 rows of the data set's conditions (the
    null when there are none)."""
    g = torch.Generator().manual_seed(1234)   # never the training generator
    ids = condition.requests(64, g).sort().values.to(device)
    noise = torch.randn(64, dataset.channels, dataset.image_size, dataset.image_size,
                        generator=g).to(device)
    y = condition.expert_input(ids)
    x = sample_flow(lambda x_t, t: distiller.objective.velocity(distiller.ema, x_t,
                                                                t, y), noise, 25)
    if getattr(dataset, "autoencoder", None) is not None:
        x = dataset.autoencoder.decode(x, dataset.images_set.channels)
    save_grid(x.float().cpu(), path, nrow=8)


def build_parser():
    p = Parser(prog="distill.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the teacher")
    g.add_argument("--experts", default="",
                   help="cluster ids of the teacher's experts, e.g. 0,2,3 (default: every expert "
                        "in runs/experts/)")
    g.add_argument("--router", default=None,
                   help="router checkpoint (default: RUN_DIR/router/ckpt.pt)")
    g.add_argument("--routing", default="full",
                   help="the teacher's rule: full (the exact mixture) | top1 | top2 | topk:N | "
                        "threshold:TAU")
    g = p.add_argument_group("the student")
    g.add_argument("--model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="registry size, e.g. DiT-M/2 for a student smaller than the experts "
                        "(default: the experts' size)")
    g.add_argument("--modulation", default="adaln-single", choices=["adaln-single", "adaln-zero"],
                   help="as train_expert.py")
    g.add_argument("--init", default=None,
                   help="start from an expert: its cluster id (e.g. 0) or a checkpoint path; "
                                                "a DDPM one is converted to flow matching")
    g.add_argument("--trajectory-fraction", type=float_in(0, 1), default=0.0,
                   help="share of each batch taken from the teacher's own sampling trajectories "
                        "instead of noisy data")
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
                   help="probability of asking the teacher and student for the unconditional flow "
                        "(the null condition)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the student's forward pass, as train_expert.py: auto measures once "
                        "whether bf16 pays here")
    g.add_argument("--seed", type=seed_type, default=0)
    g = p.add_argument_group("files")
    g.add_argument("--clip-model", default="ViT-B-32",
                   help="text experts, when runs/text/ lacks the captions: open_clip architecture")
    g.add_argument("--clip-pretrained", default=None,
                   help="text experts, when runs/text/ lacks the captions: the same weights file")
    g.add_argument("--vae", default=None,
                   help="latent experts: where their VAE folder is on this machine (default: the "
                        "path they recorded)")
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
