"""Stage 3: train the router, p(cluster | x_t, t[, y]), on the whole data set.

Reads the data set and runs/clusters.pt; writes runs/router/ (ckpt.pt, log.jsonl,
accuracy.json). The router classifies a noisy sample on the common rectified-flow path
(t ~ U(0, 1), x_t = (1-t) x0 + t eps) into the cluster its x0 came from, with cross-entropy
over the whole data set, so the learned posterior includes each cluster's prior pi_k.
At sampling time its softmax weighs the experts: sum_k p(k | x_t) v_k(x_t) is the flow of
the whole data set.

Why the router sees the class label (--conditioning class, the default for labelled data):
for a class-conditional ensemble the exact weight of expert k in v(x_t | y) is p(k | x_t, y),
not p(k | x_t). A label-blind router sends a request for a '0' to whichever expert the noisy
sample resembles, often one that has hardly seen a '0'. Measured on digits with K=4 pixel
clusters and top-1 routing, a label-blind router gave a Frechet distance of 240-290 with
45-69% of samples of the requested class; a label-aware router with the same experts gave
15 and 99%. Label dropout trains the same network to give p(k | x_t) (the null label),
which the unconditional branch of classifier-free guidance needs.

    python train_router.py                          # after cluster.py; defaults fit digits
    python train_router.py --conditioning none      # Paris's label-blind router, for comparison
    python train_router.py --conditioning text --clip-pretrained FILE   # text experts: p(k | x_t, t, caption)

For text-to-image experts, Paris's router sees no text: p(k | x_t, t). With --conditioning text it
also reads the caption's pooled CLIP embedding, which makes the weights exact for a
prompt-conditional ensemble (as for classes) and, with caption dropout (an all-zero embedding),
still gives p(k | x_t, t) for the unconditional branch of guidance.
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data import UsageError, atomic_json, atomic_save, load_clusters, load_dataset, router_dir, run_main
from diffusion import RectifiedFlow
from model import Router, count_flops, model_args_for
from text import caption_embeddings

T_BINS = 5


@torch.no_grad()
def accuracy_per_t_bin(router, dataset, indices, assign, device, condition, seed=0, draws=4):
    """Held-out accuracy of the most probable cluster, per fifth of the flow-time range; condition(idx) gives y or None."""
    g = torch.Generator().manual_seed(seed)
    correct, total = torch.zeros(T_BINS), torch.zeros(T_BINS)
    for start in range(0, len(indices), 512):
        idx = indices[start:start + 512]
        x0 = dataset.batch(idx).to(device)
        y = condition(idx)
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
    clusters = load_clusters(args.run_dir)
    dataset = load_dataset(args.data or clusters["data_spec"], args.image_size or clusters["data"]["shape"][-1], args.download)
    load_clusters(args.run_dir, dataset)
    assign = clusters["assignments"].numpy()
    conditioning = args.conditioning or ("class" if dataset.labels is not None else "none")
    if conditioning == "class" and dataset.labels is None:
        raise UsageError("--conditioning class needs a labelled data set")
    pooled = caption_index = text_spec = None
    if conditioning == "text":
        if dataset.captions is None:
            raise UsageError("--conditioning text needs captions (--data digits-captions, or folder:PATH with captions)")
        _, pooled, caption_index, text_spec = caption_embeddings(dataset.captions, args.clip_model, args.clip_pretrained,
                                                                 args.run_dir, args.download)

    def condition(idx, hide=None):
        """The router's condition for these images (None if it has none); `hide` (bool mask) replaces it by the null."""
        if conditioning == "class":
            y = torch.from_numpy(dataset.labels[idx]).to(device)
            return y if hide is None else torch.where(hide, torch.full_like(y, dataset.num_classes), y)
        if conditioning == "text":
            y = pooled[caption_index[idx]].to(device)
            return y if hide is None else y * ~hide[:, None]
        return None

    # a fixed held-out split, only for measuring accuracy
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(dataset))
    n_val = int(len(dataset) * args.val_fraction)
    val_idx, train_idx = np.sort(order[:n_val]), order[n_val:]

    torch.manual_seed(args.seed)
    model_args = dict(model_args_for(args.model, input_size=dataset.image_size, in_channels=dataset.channels,
                                     num_clusters=clusters["k"], num_classes=dataset.num_classes if conditioning == "class" else 0,
                                     text_dim=pooled.shape[1] if pooled is not None else 0))
    router = Router(**model_args).to(device)
    opt = torch.optim.AdamW(router.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    g = torch.Generator().manual_seed(args.seed + 1)
    flow = RectifiedFlow()

    def loss_on(idx):
        x0 = dataset.batch(idx).to(device)
        target = torch.from_numpy(assign[idx]).to(device)
        t = torch.rand(len(idx), generator=g).to(device)
        x_t = flow.add_noise(x0, torch.randn(x0.shape, generator=g).to(device), t)
        drop = torch.rand(len(idx), generator=g).to(device) < args.label_dropout   # also learn p(k | x_t)
        return F.cross_entropy(router(x_t, t, condition(idx, drop)), target)

    flops_per_step = count_flops(lambda: loss_on(train_idx[:args.batch_size]).backward())
    router.zero_grad(set_to_none=True)
    out_dir = router_dir(args.run_dir)
    os.makedirs(out_dir, exist_ok=True)
    print(f"router: {clusters['k']} clusters, conditioning={conditioning}, {sum(p.numel() for p in router.parameters()):,} "
          f"parameters, {flops_per_step * args.steps / 1e12:.3f} TFLOPs of training")
    with open(os.path.join(out_dir, "log.jsonl"), "w") as log:
        running = 0.0
        for step in tqdm(range(1, args.steps + 1), desc="router"):
            idx = train_idx[torch.randint(len(train_idx), (args.batch_size,), generator=g).numpy()]
            loss = loss_on(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.detach()
            if step % args.log_every == 0:
                log.write(json.dumps({"step": step, "loss": (running / args.log_every).item()}) + "\n")
                running = 0.0

    router.eval()
    accuracy = {}
    if conditioning != "none":
        accuracy["with_label" if conditioning == "class" else "with_caption"] = \
            accuracy_per_t_bin(router, dataset, val_idx, assign, device, condition)
    accuracy["without_label" if conditioning != "text" else "without_caption"] = \
        accuracy_per_t_bin(router, dataset, val_idx, assign, device, lambda idx: None)
    bins = [f"[{b / T_BINS:.1f},{(b + 1) / T_BINS:.1f})" for b in range(T_BINS)]
    print(f"held-out accuracy of the top cluster ({n_val} images, chance {max(clusters['sizes']) / len(dataset):.2f} "
          f"by always guessing the largest cluster)")
    print(f"{'t':>12} " + " ".join(f"{name:>14}" for name in accuracy))
    for b, name in enumerate(bins):
        print(f"{name:>12} " + " ".join(f"{acc[b]:>14.3f}" for acc in accuracy.values()))

    config = {"k": clusters["k"], "cluster_fingerprint": clusters["fingerprint"], "data": dataset.fingerprint,
              "conditioning": conditioning, "label_dropout": args.label_dropout, "steps": args.steps, "batch_size": args.batch_size,
              "time": "flow time t in [0,1], t=1 noise", "text_encoder": text_spec, "flops": flops_per_step * args.steps, "accuracy": accuracy, "t_bins": bins}
    atomic_save({"model": router.state_dict(), "model_args": model_args, "config": config}, os.path.join(out_dir, "ckpt.pt"))
    atomic_json({"t_bins": bins, **accuracy, "held_out_images": n_val}, os.path.join(out_dir, "accuracy.json"))
    print(f"wrote {os.path.join(out_dir, 'ckpt.pt')}")


def build_parser():
    p = argparse.ArgumentParser(prog="train_router.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conditioning", default=None, choices=["class", "text", "none"],
                   help="class: p(k | x_t, t, y) and, via label dropout, p(k | x_t, t); text: the same with the caption's "
                        "pooled CLIP embedding; none: p(k | x_t, t) only (default: class for labelled data)")
    p.add_argument("--clip-model", default="ViT-B-32", help="text: open_clip architecture name, or a model-config .json")
    p.add_argument("--clip-pretrained", default=None, help="text: local open_clip weights file, or 'none' (random, smoke tests)")
    p.add_argument("--model", default="DiT-M/2", help="router trunk size from the DiT registry (Paris: DiT-B/2)")
    p.add_argument("--steps", type=int, default=500, help="default: about 3%% of one default expert's training FLOPs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--label-dropout", type=float, default=0.1, help="probability of hiding the label (or caption) during training")
    p.add_argument("--val-fraction", type=float, default=0.1, help="images held out to measure accuracy per t-bin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--data", default=None, help="default: the cluster file's")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--download", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
