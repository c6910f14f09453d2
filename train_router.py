"""Stage 3: train the router, p(expert | x_t, t[, y]), on the data or on the experts' own
samples.

Reads the data set and runs/clusters.pt (or, with --from-samples, only runs/experts/);
writes runs/router/ (ckpt.pt, log.jsonl, accuracy.json, and samples/ with --from-samples).
The router classifies a noisy sample on the common rectified-flow path (t ~ U(0, 1), x_t =
(1-t) x0 + t eps) into the cluster its x0 came from, with cross-entropy over the whole
data set, so the learned posterior includes each cluster's prior pi_k. At sampling time
its softmax weighs the experts: sum_k p(k | x_t) v_k(x_t) is the flow of the whole data
set.

The router reads the experts' condition and is shown every noisy image once more with the
null condition (--paired-null), so it gives both p(k | x_t, y) and the p(k | x_t) that
guidance needs; --from-samples N trains it from N samples of each expert instead of data,
so it needs nobody's images. docs/router.md gives the reasons and the measurements.

    python train_router.py                          # after cluster.py; defaults fit digits
    python train_router.py --condition none         # Paris's condition-blind router
    python train_router.py --from-samples 256 --init runs/router   # after an expert joined
"""
import argparse
import json
import os

import numpy as np
import torch
from tqdm import tqdm

from diffusion import T_BIN_NAMES, T_BINS, RectifiedFlow
from model import DiT_models, count_flops, registry_name
from routing import router_loss
from plumbing.command_line import (Parser, UsageError, device_type, float_in,
                                   int_at_least, run_main, seed_type)
from plumbing.distributed import scheduler_job
from plumbing.router.data import examples_from_data
from plumbing.router.samples import SampleDraw, examples_from_samples, experts_to_sample
from plumbing.router.size import RouterFlags, build_router, router_init
from plumbing.training.plan import Plan
from plumbing.run_dir import (atomic_json, atomic_path, atomic_save, check_writable_dir,
                              folder_lock, router_dir)


class RouterPlan(Plan):
    """A router's training run (trained afresh each time: nothing to resume)."""
    DEFINING = (
        "model", "downsample", "condition", "from_samples", "sample_steps", "steps",
        "batch_size", "lr", "weight_decay", "condition_dropout", "paired_null", "seed")
    STAGE = "train_router.py"

    @classmethod
    def from_args(cls, args):
        if args.experts and not args.from_samples:
            raise UsageError("--experts chooses whose samples train the router (--from-samples); "
                             "from data, the router learns every cluster of the cluster file "
                             "and every contributor whose data it can read")
        return cls(args)


@torch.no_grad()
def accuracy_per_t_bin(router, dataset, indices, assign, device, router_input, seed=0, draws=4):
    """Held-out accuracy of the most probable cluster, per fifth of the flow-time range;
    router_input(idx) gives y."""
    g = torch.Generator().manual_seed(seed)
    correct, total = torch.zeros(T_BINS), torch.zeros(T_BINS)
    for start in range(0, len(indices), 512):
        idx = indices[start:start + 512]
        x0 = dataset.batch(idx).to(device)
        y = router_input(idx)
        target = torch.from_numpy(assign[idx]).to(device)
        for b in range(T_BINS):
            for _ in range(draws):
                t = (b + torch.rand(len(idx), generator=g)) / T_BINS
                noise = torch.randn(x0.shape, generator=g)
                logits = router(RectifiedFlow.add_noise(x0, noise.to(device), t.to(device)),
                                t.to(device), y)
                correct[b] += (logits.argmax(1) == target).sum().item()
                total[b] += len(idx)
    return (correct / total).tolist()


def main(args):
    plan = RouterPlan.from_args(args)
    device = torch.device(plan.device)
    out_dir = router_dir(plan.run_dir)
    check_writable_dir(out_dir, "the router's folder")

    # The experts to route between, and the examples that teach the router: images with
    # the expert each belongs to, from the data or from the experts' own samples
    if plan.from_samples:
        experts, members, condition = experts_to_sample(plan.run_dir, plan.experts, plan.condition)
    else:
        examples, members, condition, learned_from = examples_from_data(
            plan.run_dir, plan.data_flags, plan.condition,
            (plan.clip_model, plan.clip_pretrained), device)
    init = router_init(plan.init, members)
    with folder_lock(out_dir, "train_router.py"):
        if plan.from_samples:
            draw = SampleDraw(plan.from_samples, plan.sample_steps, plan.seed,
                              plan.sample_batch_size)
            examples, learned_from = examples_from_samples(plan.run_dir, draw, experts, members,
                                                   condition, device)
        train_idx, val_idx = examples.held_out_split(plan.val_fraction, plan.seed)

        # Model: a fresh router (--model, or the size rule), or --init's
        asked = RouterFlags(plan.model, plan.expert_model, plan.downsample)
        router, model_args, size = build_router(
            plan.run_dir, asked, examples.batch(train_idx[:1]), members, condition, init,
            device, plan.seed)
        sizes = np.array([m["size"] for m in members], dtype=np.float64)
        prior = sizes / sizes.sum()

        # Optimizer, and the lesson of a step: samples come as a fixed number per expert, so
        # drawing each with probability prior_k / n_k gives the batches the experts' true
        # shares, and the router learns the prior of the training-set sizes (data: already so)
        opt = torch.optim.AdamW(router.parameters(), lr=plan.lr, weight_decay=plan.weight_decay,
                                fused=True)
        share = None if learned_from["source"] == "data" else \
            prior / np.bincount(examples.targets, minlength=len(members))
        lesson = Lesson(router, examples, condition, train_idx, share, plan, device)
        flops_per_step = count_flops(lambda: lesson.loss(train_idx[:plan.batch_size]).backward())
        router.zero_grad(set_to_none=True)
        announce(plan, members, condition, learned_from, router, model_args, size,
                 flops_per_step * plan.steps)

        # The loop; its log is written with the checkpoint, so an earlier router's stays
        # until this one is complete
        log, running = [], []
        for step in tqdm(range(1, plan.steps + 1), desc="router"):
            loss = lesson.loss(lesson.draw(plan.batch_size))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running.append(loss.detach())
            if step % plan.log_every == 0 or step == plan.steps:
                log.append({"step": step, "loss": torch.stack(running).mean().item()})
                running = []
        if not all(np.isfinite(entry["loss"]) for entry in log):
            raise UsageError("non-finite router loss; nothing was written (lower --lr)")

        # Held-out accuracy per t-bin, shown the condition and shown the null
        router.eval()
        shown = {"with_condition": lambda idx: examples.ids(idx),
                 "without_condition": lambda idx: condition.null(len(idx))}
        accuracy = {name: accuracy_per_t_bin(router, examples, val_idx, examples.targets, device,
                                             lambda idx, ids=ids: condition.router_input(ids(idx).to(device)))
                    for name, ids in shown.items()}
        what = "images" if learned_from["source"] == "data" else "samples"
        print_accuracy(accuracy, len(val_idx), what, prior.max(), condition.kind)

        # Save: the checkpoint with its record, the log and the accuracy table
        config = plan.checkpoint_config(
            {"model": size["model"]}, network="router", condition=condition.spec(),
            k=len(members), prior=prior.tolist(),
            experts=[{key: m[key] for key in ("name", "trained_on", "size")} for m in members],
            cluster_fingerprint=learned_from["cluster_fingerprint"], data=learned_from["data"],
            vae=learned_from["vae"], source=learned_from["source"], job=scheduler_job(),
            init=os.path.basename(plan.init) if init is not None else None,
            condition_dropout=plan.condition_dropout, paired_null=plan.paired_null,
            steps=plan.steps, batch_size=plan.batch_size, time="flow time t in [0,1], t=1 noise",
            flops=flops_per_step * plan.steps, accuracy=accuracy, accuracy_measured_on=what,
            t_bins=T_BIN_NAMES, size=size)
        atomic_save({"model": router.state_dict(), "model_args": model_args, "config": config},
                    os.path.join(out_dir, "ckpt.pt"))
        with atomic_path(os.path.join(out_dir, "log.jsonl")) as tmp, open(tmp, "w") as f:
            f.write("".join(json.dumps(entry) + "\n" for entry in log))
        atomic_json({"t_bins": T_BIN_NAMES, **accuracy, "condition": condition.kind,
                     f"held_out_{what}": len(val_idx)}, os.path.join(out_dir, "accuracy.json"))
    print(f"wrote {os.path.join(out_dir, 'ckpt.pt')}")


def announce(plan, members, condition, learned_from, router, model_args, size, flops):
    """Print what is about to train: its experts, data, size and cost."""
    source = "data" if learned_from["source"] == "data" else f"{plan.from_samples} samples per expert"
    start = f", from {os.path.basename(plan.init)}" if plan.init else ""
    print(f"router: {len(members)} experts ({', '.join(m['name'] for m in members)}), condition "
          f"{condition.kind}, from {source}{start}, "
          f"{sum(p.numel() for p in router.parameters()):,} parameters, "
          f"{flops / 1e12:.3f} TFLOPs of training")
    if size["share_of_expert"] is not None:
        print(f"router {registry_name(model_args)} ({size['chosen_by']}): one forward "
              f"{100 * size['share_of_expert']:.1f} % of one {size['expert_model']} expert's; "
              f"top-1 samples at {1 + size['share_of_expert']:.3f}x one expert's FLOPs")


class Lesson:
    """What one router step shows: noisy examples labelled with their expert, the condition
    dropped at --condition-dropout and (--paired-null) every noisy image once more with the
    null condition, so that p(k | x_t) sees all the data, as a blind router would."""

    def __init__(self, router, examples, condition, train_idx, share, plan, device):
        """share: each expert's weight per example (None: examples drawn uniformly)."""
        self.router, self.examples, self.condition = router, examples, condition
        self.train_idx, self.device = train_idx, device
        self.dropout, self.paired_null = plan.condition_dropout, plan.paired_null
        self.generator = torch.Generator().manual_seed(plan.seed + 1)
        self.weights = None
        if share is not None:
            per_example = torch.from_numpy(share)[examples.targets[train_idx]]
            self.weights = per_example / per_example.sum()

    def draw(self, batch_size):
        g = self.generator
        pick = torch.randint(len(self.train_idx), (batch_size,), generator=g) if self.weights is None \
            else torch.multinomial(self.weights, batch_size, replacement=True, generator=g)
        return self.train_idx[pick.numpy()]

    def loss(self, idx):
        g, device = self.generator, self.device
        x0 = self.examples.batch(idx).to(device)
        target = torch.from_numpy(self.examples.targets[idx]).to(device)
        t = torch.rand(len(idx), generator=g).to(device)
        noise = torch.randn(x0.shape, generator=g).to(device)
        ids = self.condition.drop(self.examples.ids(idx), self.dropout, g)
        if self.paired_null:
            x0, noise, t, target = (torch.cat([a, a]) for a in (x0, noise, t, target))
            ids = torch.cat([ids, self.condition.null(len(ids))])
        return router_loss(self.router, x0, target, t, noise,
                           self.condition.router_input(ids.to(device))).mean()


def print_accuracy(accuracy, n, what, chance, kind):
    print(f"held-out accuracy of the top expert ({n} {what}, chance {chance:.2f} by always "
          f"guessing the largest share; condition {kind})")
    print(f"{'t':>12} " + " ".join(f"{name:>18}" for name in accuracy))
    for b, name in enumerate(T_BIN_NAMES):
        print(f"{name:>12} " + " ".join(f"{acc[b]:>18.3f}" for acc in accuracy.values()))


def build_parser():
    p = Parser(prog="train_router.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--condition", default=None, choices=["class", "text", "none"],
                   help="what the router reads besides (x_t, t): class: p(k | x_t, t, "
                        "y); text: the same with the caption's pooled CLIP embedding; "
                        "none: p(k | x_t, t) only (default: the experts' condition)")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="text, when no caption cache exists yet: open_clip architecture name")
    p.add_argument("--clip-pretrained", default=None,
                   help="text, when no caption cache exists yet: local open_clip weights file")
    p.add_argument("--model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="router trunk size from the DiT registry (Paris: DiT-B/2); default: "
                        "the largest whose forward costs at most 5 %% of one expert's, so "
                        "top-1 samples within 1.05x one expert's FLOPs (docs/router.md)")
    p.add_argument("--expert-model", default=None, choices=list(DiT_models), metavar="MODEL",
                   help="the experts' size, to size the router by before any expert is "
                        "trained (default: the trained experts', else train_expert.py's "
                        "default DiT-T/2)")
    p.add_argument("--downsample", type=int_at_least(1), default=1, metavar="F",
                   help="the router reads x_t average-pooled by F (F x F pixels to one), "
                        "which divides its tokens by F^2")
    p.add_argument("--steps", type=int_at_least(1), default=500,
                   help="default: about 3%% of one default expert's training FLOPs")
    p.add_argument("--batch-size", type=int_at_least(1), default=32)
    p.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3)
    p.add_argument("--weight-decay", type=float_in(0), default=0.0)
    p.add_argument("--condition-dropout", type=float_in(0, 1), default=0.1,
                   help="probability of hiding the condition, so the router also learns "
                        "p(k | x_t, t) for guidance")
    p.add_argument("--paired-null", action=argparse.BooleanOptionalAction, default=True,
                   help="also train on every noisy image with the null condition (twice "
                        "the rows per step), so p(k | x_t) learns from all the data: as "
                        "accurate as a condition-blind router (see the docstring)")
    p.add_argument("--val-fraction", type=float_in(0, 1, low_open=True, high_open=True),
                   default=0.1, help="images held out to measure accuracy per t-bin")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--log-every", type=int_at_least(1), default=50)
    p.add_argument("--from-samples", type=int_at_least(8), default=None, metavar="N",
                   help="train on N samples drawn from each expert (cached in RUN_DIR/router/"
                        "samples/), labelled by the expert that drew them, with each expert's "
                        "share from its recorded training-set size: no contributor's data "
                        "needed (default: train on the data, the cluster file's and every "
                        "contributor's this machine can read)")
    p.add_argument("--experts", default="",
                   help="--from-samples: whose samples, e.g. 0,1,2,mine (default: every "
                        "expert of the run)")
    p.add_argument("--sample-steps", type=int_at_least(1), default=32,
                   help="--from-samples: Euler steps per sample")
    p.add_argument("--sample-batch-size", type=int_at_least(1), default=256)
    p.add_argument("--init", default=None, metavar="ROUTER",
                   help="fine-tune from this router (a ckpt.pt or a router folder) for a "
                        "grown expert set: every expert it knew keeps its output, a new "
                        "one starts from the prior; e.g. after an expert joined later")
    p.add_argument("--data", default=None, help="default: the cluster file's")
    p.add_argument("--image-size", type=int_at_least(2), default=None)
    p.add_argument("--vae", default=None,
                   help="route in the latents of this diffusers AutoencoderKL folder "
                        "(default: the cluster file's)")
    p.add_argument("--download", action="store_true")
    p.add_argument("--device", type=device_type, default="cuda"
                   if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
