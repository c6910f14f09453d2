"""Stage 3: train the router, p(cluster | x_t, t[, y]), on the whole data set.

Reads the data set and runs/clusters.pt; writes runs/router/ (ckpt.pt, log.jsonl,
accuracy.json). The router classifies a noisy sample on the common rectified-flow path
(t ~ U(0, 1), x_t = (1-t) x0 + t eps) into the cluster its x0 came from, with cross-entropy
over the whole data set, so the learned posterior includes each cluster's prior pi_k.
At sampling time its softmax weighs the experts: sum_k p(k | x_t) v_k(x_t) is the flow of
the whole data set.

Why the router reads the experts' condition (the default): for a class-conditional ensemble the
exact weight of expert k in v(x_t | y) is p(k | x_t, y), not p(k | x_t). A label-blind router
sends a request for a '0' to whichever expert the noisy sample resembles, often one that has
hardly seen a '0'. `./ddm reproduce` measures both with the same experts (digits, K=4, seed 0,
N=500, top-1; README): FD 9.4 and 95 % of the requested class with the label-aware router,
32.1 and 59 % with a label-blind one.

The same network also gives p(k | x_t) when shown the null condition, which the unconditional
branch of classifier-free guidance needs. With condition dropout alone (10 % of rows) that
posterior is poor; so by default every noisy image is also shown once with the null condition
(--paired-null: twice the rows per step). Held-out accuracy of the top cluster without the
condition, mean of router seeds 0, 1, 2 (500 steps, batch 32, digits K=4; README):
condition-blind router 0.853 / 0.793 / 0.622 / 0.436 / 0.364 per fifth of t from t=0;
paired 0.869 / 0.811 / 0.621 / 0.444 / 0.366; dropout 0.1 alone 0.647 / 0.574 / 0.452 / 0.365 / 0.327.

    python train_router.py                          # after cluster.py (and the experts); defaults fit digits
    python train_router.py --condition none         # Paris's condition-blind router, for comparison

The kind of condition defaults to the experts' (read from runs/experts/*/ckpt.pt; else class for
labelled data, none otherwise). For text experts the router reads the caption's pooled CLIP
embedding, from the caption cache the experts left in runs/text/, so no encoder flag is needed;
Paris's router sees no text (--condition none). Caption dropout still gives p(k | x_t, t).
"""
import argparse
import glob
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from command_line import Parser, UsageError, device_type, float_in, int_at_least, run_main, seed_type
from condition import condition_for_data
from data import load_dataset
from diffusion import T_BIN_NAMES, T_BINS, RectifiedFlow
from latents import latent_set, resolve_vae
from model import CHECKPOINT_FORMAT, DiT_models, Router, count_flops, model_args_for, split_checkpoint
from run_dir import (atomic_json, atomic_path, atomic_save, check_writable_dir, folder_lock, load_checkpoint, load_clusters,
                     remove_stale_temporaries, router_dir)


def experts_condition(run_dir):
    """The condition spec the run's experts were trained with (they agree, or sample.py will say so), or None."""
    for path in sorted(glob.glob(os.path.join(run_dir, "experts", "*", "ckpt.pt"))):
        return split_checkpoint(load_checkpoint(path, "expert"))[2]["condition"]
    return None


@torch.no_grad()
def accuracy_per_t_bin(router, dataset, indices, assign, device, router_input, seed=0, draws=4):
    """Held-out accuracy of the most probable cluster, per fifth of the flow-time range; router_input(idx) gives y."""
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
                logits = router(RectifiedFlow.add_noise(x0, noise.to(device), t.to(device)), t.to(device), y)
                correct[b] += (logits.argmax(1) == target).sum().item()
                total[b] += len(idx)
    return (correct / total).tolist()


def main(args):
    device = torch.device(args.device)
    out_dir = router_dir(args.run_dir)
    check_writable_dir(out_dir, "the router's folder")
    clusters = load_clusters(args.run_dir)
    dataset = load_dataset(args.data or clusters["data_spec"], args.image_size or clusters["data"]["shape"][-1], args.download)
    load_clusters(args.run_dir, dataset)
    vae = resolve_vae(args.vae, clusters.get("vae"), args.download, device)
    if vae is not None:   # the router reads x_t where the experts do: in the latents (posterior means)
        dataset = latent_set(dataset, vae, args.run_dir)
    experts = experts_condition(args.run_dir)
    kind = args.condition or (experts["kind"] if experts else "class" if dataset.labels is not None else "none")
    condition = condition_for_data(kind, dataset, args.run_dir, encoder=(experts or {}).get("encoder"), clip_model=args.clip_model,
                                   clip_pretrained=args.clip_pretrained, download=args.download)

    # a fixed held-out split, only for measuring accuracy
    order = np.random.default_rng(args.seed).permutation(len(dataset))
    n_val = int(len(dataset) * args.val_fraction)
    if not 1 <= n_val < len(dataset):
        raise UsageError(f"--val-fraction {args.val_fraction} holds out {n_val} of {len(dataset)} images; keep some for each side")
    val_idx, train_idx = np.sort(order[:n_val]), order[n_val:]
    with folder_lock(out_dir, "train_router.py"):
        remove_stale_temporaries(out_dir)
        train(args, dataset, clusters, condition, train_idx, val_idx, device)


def train(args, dataset, clusters, condition, train_idx, val_idx, device):
    """Train the router, measure it per t-bin on the held-out images, and write ckpt.pt, log.jsonl and accuracy.json."""
    assign, out_dir = clusters["assignments"].numpy(), router_dir(args.run_dir)

    torch.manual_seed(args.seed)
    model_args = model_args_for(args.model, input_size=dataset.image_size, in_channels=dataset.channels,
                                num_clusters=clusters["k"], **condition.router_args())
    router = Router(**model_args).to(device)
    opt = torch.optim.AdamW(router.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    g = torch.Generator().manual_seed(args.seed + 1)

    def loss_on(idx):
        x0 = dataset.batch(idx).to(device)
        target = torch.from_numpy(assign[idx]).to(device)
        t = torch.rand(len(idx), generator=g).to(device)
        x_t = RectifiedFlow.add_noise(x0, torch.randn(x0.shape, generator=g).to(device), t)
        ids = condition.drop(condition.ids(idx), args.condition_dropout, g)   # the null condition: also learn p(k | x_t)
        if args.paired_null:   # every noisy image also once with the null: p(k | x_t) sees all the data, as a blind router would
            x_t, t, target, ids = torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([target, target]), \
                torch.cat([ids, condition.null(len(ids))])
        return F.cross_entropy(router(x_t, t, condition.router_input(ids.to(device))), target)

    flops_per_step = count_flops(lambda: loss_on(train_idx[:args.batch_size]).backward())
    router.zero_grad(set_to_none=True)
    print(f"router: {clusters['k']} clusters, condition {condition.kind}, {sum(p.numel() for p in router.parameters()):,} "
          f"parameters, {flops_per_step * args.steps / 1e12:.3f} TFLOPs of training")
    log, running, count = [], 0.0, 0   # written with the checkpoint: an earlier router's log stays until this one is complete
    for step in tqdm(range(1, args.steps + 1), desc="router"):
        idx = train_idx[torch.randint(len(train_idx), (args.batch_size,), generator=g).numpy()]
        loss = loss_on(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running, count = running + loss.detach(), count + 1
        if step % args.log_every == 0 or step == args.steps:
            log.append(json.dumps({"step": step, "loss": (running / count).item()}))
            running, count = 0.0, 0
    if not all(np.isfinite(json.loads(line)["loss"]) for line in log):
        raise UsageError("non-finite router loss; nothing was written (lower --lr)")

    router.eval()
    given = lambda idx: condition.router_input(condition.ids(idx).to(device))
    hidden = lambda idx: condition.router_input(condition.null(len(idx), device))
    accuracy = {"with_condition": accuracy_per_t_bin(router, dataset, val_idx, assign, device, given),
                "without_condition": accuracy_per_t_bin(router, dataset, val_idx, assign, device, hidden)}
    print(f"held-out accuracy of the top cluster ({len(val_idx)} images, chance {max(clusters['sizes']) / len(dataset):.2f} "
          f"by always guessing the largest cluster; condition {condition.kind})")
    print(f"{'t':>12} " + " ".join(f"{name:>18}" for name in accuracy))
    for b, name in enumerate(T_BIN_NAMES):
        print(f"{name:>12} " + " ".join(f"{acc[b]:>18.3f}" for acc in accuracy.values()))

    config = {"format": CHECKPOINT_FORMAT, "network": "router", "condition": condition.spec(), "k": clusters["k"],
              "cluster_fingerprint": clusters["fingerprint"], "data": dataset.fingerprint, "vae": getattr(dataset, "vae", None),
              "condition_dropout": args.condition_dropout, "paired_null": args.paired_null, "steps": args.steps, "batch_size": args.batch_size, "time": "flow time t in [0,1], t=1 noise",
              "flops": flops_per_step * args.steps, "accuracy": accuracy, "t_bins": T_BIN_NAMES}
    atomic_save({"model": router.state_dict(), "model_args": model_args, "config": config}, os.path.join(out_dir, "ckpt.pt"))
    with atomic_path(os.path.join(out_dir, "log.jsonl")) as tmp, open(tmp, "w") as f:
        f.write("\n".join(log) + "\n")
    atomic_json({"t_bins": T_BIN_NAMES, **accuracy, "condition": condition.kind, "held_out_images": len(val_idx)},
                os.path.join(out_dir, "accuracy.json"))
    print(f"wrote {os.path.join(out_dir, 'ckpt.pt')}")


def build_parser():
    p = Parser(prog="train_router.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--condition", default=None, choices=["class", "text", "none"],
                   help="what the router reads besides (x_t, t): class: p(k | x_t, t, y); text: the same with the caption's "
                        "pooled CLIP embedding; none: p(k | x_t, t) only (default: the experts' condition)")
    p.add_argument("--clip-model", default="ViT-B-32", help="text, when no caption cache exists yet: open_clip architecture name")
    p.add_argument("--clip-pretrained", default=None, help="text, when no caption cache exists yet: local open_clip weights file")
    p.add_argument("--model", default="DiT-M/2", choices=list(DiT_models), metavar="MODEL", help="router trunk size from the DiT registry (Paris: DiT-B/2)")
    p.add_argument("--steps", type=int_at_least(1), default=500, help="default: about 3%% of one default expert's training FLOPs")
    p.add_argument("--batch-size", type=int_at_least(1), default=32)
    p.add_argument("--lr", type=float_in(0, low_open=True), default=1e-3)
    p.add_argument("--weight-decay", type=float_in(0), default=0.0)
    p.add_argument("--condition-dropout", type=float_in(0, 1), default=0.1,
                   help="probability of hiding the condition, so the router also learns p(k | x_t, t) for guidance")
    p.add_argument("--paired-null", action=argparse.BooleanOptionalAction, default=True,
                   help="also train on every noisy image with the null condition (twice the rows per step), so p(k | x_t) "
                        "learns from all the data: as accurate as a condition-blind router (see the docstring)")
    p.add_argument("--val-fraction", type=float_in(0, 1, low_open=True, high_open=True), default=0.1, help="images held out to measure accuracy per t-bin")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--log-every", type=int_at_least(1), default=50)
    p.add_argument("--data", default=None, help="default: the cluster file's")
    p.add_argument("--image-size", type=int_at_least(2), default=None)
    p.add_argument("--vae", default=None, help="route in the latents of this diffusers AutoencoderKL folder (default: the cluster file's)")
    p.add_argument("--download", action="store_true")
    p.add_argument("--device", type=device_type, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
