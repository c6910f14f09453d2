"""Stage 1: split the data set into K clusters, one per expert.

Reads the data set; writes runs/clusters.pt (per-image assignment, centroids, K, the feature
spec and the data set's fingerprint), runs/clusters.png (examples per cluster), and caches
the features in runs/features/ so re-clustering with another K is fast.

    python cluster.py                                   # digits, K=4, whitened-PCA pixel features
    python cluster.py --k 8 --fine-k 1024               # the papers' two-stage k-means
    python cluster.py --data cifar10:data --features clip --clip-pretrained ViT-B-32.bin
    python cluster.py --data 'wds:data/{00000..00199}.tar' --fine-k 1024 --export-shards islands
    python cluster.py --data folder:imagenet/train --image-size 256 --features dinov2 \
        --dinov2-weights dinov2_vitb14_pretrain.pth --fine-k 1024 --k 8 --vae sd-vae-ft-ema   # the papers' setting

The papers cluster DINOv2 features with two-stage k-means (1024 fine centroids grouped
into K); semantic clusters beat random partitions because each expert then models a
narrower distribution and the router's job (telling clusters apart from a noisy sample) is
easier.

Memory is bounded by a batch, the k-means sample and the memory-mapped feature cache, not by
the data set: features are computed a batch at a time into runs/features/, k-means is fitted on
--fit-sample of them, and every image then goes to its nearest centroid. For sharded data
(--data wds:PATTERN) the cluster file also names every image by its shard key and content
digest, and --export-shards DIR writes each cluster's samples as its own shard set (shards.py).
The features of every kind and their cache are plumbing/data/features.py's.
"""
import argparse
import hashlib
import os

import numpy as np
import torch
from tqdm import tqdm

from plumbing.command_line import (Parser, Renamed, UsageError, device_type, int_at_least,
                                   run_main, seed_type)
from plumbing.data.datasets import DEFAULT_DATA, load_dataset
from plumbing.distributed import scheduler_job
from plumbing.data.features import Features, check_pca_dim, features
from plumbing.data.latents import VAE, latent_set
from plumbing.checkpoint import read_network_file
from plumbing.run_dir import (atomic_save, check_new_folder, check_writable_dir,
                              cluster_path, folder_lock, load_checkpoint, network_folders,
                              network_path, remove_dead_temporaries, save_grid)
from plumbing.data.islands import cluster_record, export_shards, write_dataset_shards
from plumbing.data.shards import ShardSet


def kmeans(x, k, seed, weights=None):
    """k-means++ (scikit-learn); mini-batch above 100k points, where full k-means is slow."""
    from sklearn.cluster import KMeans, MiniBatchKMeans
    if len(x) > 100_000:
        km = MiniBatchKMeans(k, init="k-means++", random_state=seed, batch_size=4096, n_init=3)
    else:
        km = KMeans(k, init="k-means++", random_state=seed, n_init=4)
    return km.fit(x, sample_weight=weights)


def enforce_min_size(feats, assign, centroids, min_size):
    """Grow every cluster below min_size with the nearest points of clusters that can
    spare them."""
    k = len(centroids)
    for j in np.argsort(np.bincount(assign, minlength=k)):
        need = min_size - np.sum(assign == j)
        if need <= 0:
            continue
        dist = ((feats - centroids[j]) ** 2).sum(1)
        for i in np.argsort(dist):
            if need == 0:
                break
            if assign[i] != j and np.sum(assign == assign[i]) > min_size:
                assign[i] = j
                need -= 1
    return assign


def cluster(feats, k, clustering, seed, fit_sample, fine_k, min_size):
    """Assignments (N,) and centroids (K, F): k-means, or fine k-means then its
    centroids grouped into K (DDM's two stages), fitted on a sample of --fit-sample
    features (all of them when there are no more), then every image to its nearest
    centroid, a batch at a time; or random."""
    n = len(feats)
    if clustering == "random":   # the control: equal sizes, no semantics
        assign = np.random.default_rng(seed).permutation(np.arange(n) % k)
    else:
        whole = n <= fit_sample
        sample = np.arange(n) if whole else np.sort(np.random.default_rng(seed).choice(
            n, fit_sample, replace=False))
        fit_on = np.asarray(feats[sample])
        if fine_k:
            fine = kmeans(fit_on, fine_k, seed)
            sizes = np.bincount(fine.labels_, minlength=fine_k)
            coarse = kmeans(fine.cluster_centers_, k, seed, weights=sizes)
            fitted = coarse.labels_[fine.labels_]
            nearest = lambda x: coarse.labels_[fine.predict(x)]   # noqa: E731
        else:
            km = kmeans(fit_on, k, seed)
            fitted, nearest = km.labels_, km.predict
        del fit_on
        # the fit's own labels where it saw every image (they are its nearest centroids)
        assign = fitted if whole else np.concatenate([
            nearest(np.asarray(feats[i:i + 65536])) for i in tqdm(
                range(0, n, 65536), desc="assigning", leave=False)])
    assign = assign.astype(np.int64)
    centroids = member_means(feats, assign, k)
    if min_size:
        assign = enforce_min_size(feats, assign, centroids, min_size)
        centroids = member_means(feats, assign, k)
    sizes = np.bincount(assign, minlength=k)
    if not sizes.all():   # e.g. features that are all alike: no expert could train on it
        raise UsageError(f"the clustering left {int((sizes == 0).sum())} of {k} clusters empty "
                         f"(sizes {sizes.tolist()}): lower --k, or check the features")
    return assign, centroids.astype(np.float32)


def member_means(feats, assign, k):
    """Each cluster's mean feature (zeros for an empty one), summed a block at a time."""
    sums, counts = np.zeros((k, feats.shape[1])), np.bincount(assign, minlength=k)
    for i in range(0, len(feats), 65536):
        np.add.at(sums, assign[i:i + 65536], np.asarray(feats[i:i + 65536], dtype=np.float64))
    return sums / np.maximum(counts, 1)[:, None]


def report(assign, dataset, k):
    """The table of cluster sizes, label mix and purity."""
    labelled = "purity  top labels (share)" if dataset.labels is not None else ""
    print(f"{'cluster':>7} {'size':>6} {'share':>6}  " + labelled)
    for j in range(k):
        members = assign == j
        line = f"{j:>7} {members.sum():>6} {members.mean():>6.1%}  "
        if dataset.labels is not None and members.any():
            counts = np.bincount(dataset.labels[members], minlength=dataset.num_classes)
            top = np.argsort(-counts)[:3]
            shares = [f"{c} ({counts[c] / members.sum():.0%})" for c in top if counts[c]]
            line += f"{counts.max() / members.sum():>6.1%}  " + ", ".join(shares)
        print(line)
    if dataset.labels is not None:
        purity = sum(np.bincount(dataset.labels[assign == j]).max() for j in range(k)
                     if np.any(assign == j)) / len(assign)
        print(f"overall purity {purity:.3f} (fraction of images in their cluster's majority label)")


def dependents(run_dir, fingerprint):
    """The experts and router of RUN_DIR trained on the clustering with this fingerprint."""
    found = []
    router = network_path(os.path.join(run_dir, "router"))
    for path in list(network_folders(os.path.join(run_dir, "experts")).values()) + \
            ([router] if router else []):
        try:
            if read_network_file(path, "checkpoint")["config"].get("cluster_fingerprint") == fingerprint:
                found.append(os.path.relpath(os.path.dirname(path), run_dir))
        except UsageError:
            continue
    return found


def main(args):
    if args.to_shards is not None:   # not a clustering: the data set, written as shards
        check_new_folder(args.to_shards, "--to-shards")
        dataset = load_dataset(args.data, args.image_size, args.download)
        paths = write_dataset_shards(dataset, args.to_shards, args.shard_size)
        print(f"wrote {len(dataset)} samples as {len(paths)} shards: --data "
              f"'wds:{os.path.join(args.to_shards, '*.tar')}'")
        return
    check_writable_dir(args.run_dir, "--run-dir")
    # a second cluster.py on this folder would race this one's cluster file
    with folder_lock(args.run_dir, "cluster.py"):
        for folder in (os.path.join(args.run_dir, "latents"), os.path.join(args.run_dir, "features")):
            remove_dead_temporaries(folder)   # what a killed cluster.py left half-written

        # Data, with every flag that depends on its size checked before any work
        dataset = load_dataset(args.data, args.image_size, args.download)
        check_sizes(len(dataset), args.k, args.fine_k, args.fit_sample, args.min_size)
        if args.features == "pixels":
            check_pca_dim(dataset, args.pca_dim)
        if args.export_shards is not None:
            if not isinstance(dataset, ShardSet):
                raise UsageError("--export-shards writes a sharded data set's clusters: "
                                 "--data wds:PATTERN")
            check_new_folder(args.export_shards, "--export-shards")
        vae = VAE(args.vae, args.download, args.device) if args.vae else None
        if vae is not None:
            latent_set(dataset, vae, args.run_dir)   # encoded once here, read by every expert

        # Features, then the clustering
        wanted = Features(args.features, args.pca_dim, args.seed, args.clip_model,
                          args.clip_pretrained, args.dinov2_weights, args.dinov2_size,
                          args.batch_size, args.device, args.download)
        feats, spec = features(dataset, wanted, args.run_dir)
        assign, centroids = cluster(feats, args.k, args.clustering, args.seed, args.fit_sample,
                                    args.fine_k, args.min_size)
        report(assign, dataset, args.k)

        # The cluster file, never over one that networks were trained on
        clusters = {"assignments": torch.from_numpy(assign),
                    "centroids": torch.from_numpy(centroids), "k": args.k,
                    "sizes": np.bincount(assign, minlength=args.k).tolist(), "features": spec,
                    "clustering": args.clustering, "fine_k": args.fine_k, "seed": args.seed,
                    "data": dataset.fingerprint, "data_spec": args.data, "job": scheduler_job(),
                    "vae": vae.spec if vae else None, "fit_sample": args.fit_sample,
                    # sharded data: every sample's key and content digest, for the islands
                    **cluster_record(dataset),
                    # what experts and routers record, so that they can be checked to split
                    # the same partition
                    "fingerprint": hashlib.sha1(assign.tobytes()).hexdigest()}
        if not args.recluster:
            check_replaceable(args.run_dir, clusters["fingerprint"])
        # with --export-shards the cluster file is replaced only once every island is
        # written (they move into place after it): a kill leaves the old state or the new
        save = lambda: atomic_save(clusters, cluster_path(args.run_dir))   # noqa: E731
        if args.export_shards is not None:
            counts = export_shards(dataset, clusters, args.export_shards, args.shard_size, save)
            print(f"wrote {args.export_shards}/<k>/ for k = 0..{args.k - 1}: "
                  f"{', '.join(map(str, counts))} samples")
        else:
            save()
        print(f"wrote {cluster_path(args.run_dir)}")

        # A row of examples per cluster
        save_grid(example_rows(dataset, assign, args.k, args.seed),
                  os.path.join(args.run_dir, "clusters.png"), nrow=8)


def check_sizes(n, k, fine_k, fit_sample, min_size):   # with the number that is wrong
    if not 2 <= k <= n:
        raise UsageError(f"--k must be between 2 and the number of images ({n}), got {k}")
    if fit_sample < k:
        raise UsageError(f"--fit-sample {fit_sample} is below --k {k}: k-means needs at "
                         "least one sample per cluster")
    if fine_k and not k < fine_k <= min(n, fit_sample):
        raise UsageError("--fine-k must be larger than --k and at most the number of "
                         f"images (and --fit-sample), got {fine_k}")
    if min_size * k > n:
        raise UsageError(f"--min-size {min_size} x --k {k} exceeds the {n} images")


def check_replaceable(run_dir, fingerprint):
    """Refuse to replace a cluster file that trained experts or a router depend on, by
    another clustering."""
    if not os.path.isfile(cluster_path(run_dir)):
        return
    old = load_checkpoint(cluster_path(run_dir), "cluster file").get("fingerprint")
    trained = dependents(run_dir, old) if old != fingerprint else []
    if trained:
        raise UsageError(f"{cluster_path(run_dir)} is what {', '.join(trained)} were trained "
                         "on, and this clustering differs; use another --run-dir, or "
                         "--recluster to replace it anyway")


def example_rows(dataset, assign, k, seed, per_row=8):
    """Up to `per_row` random images of each cluster, a row each, padded with black."""
    rng, rows = np.random.default_rng(seed), []
    for j in range(k):
        members = np.flatnonzero(assign == j)
        pick = np.sort(rng.choice(members, min(per_row, len(members)), replace=False))
        pad = (per_row - len(pick), dataset.channels, dataset.image_size, dataset.image_size)
        rows += [dataset.batch(pick), -torch.ones(pad)]
    return torch.cat(rows)


def build_parser():
    p = Parser(prog="cluster.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="digits | digits-captions | fashion-mnist[:DIR] | mnist:DIR | "
                        "cifar10:PATH | imagenet64:PATH | folder:PATH (default: digits; "
                        "see data.py)")
    p.add_argument("--image-size", type=int_at_least(2), default=None,
                   help="resize images to this side (default: the data set's own)")
    p.add_argument("--download", action="store_true",
                   help="allow downloading CIFAR-10 or CLIP weights by tag")
    p.add_argument("--k", type=int_at_least(2), default=4,
                   help="number of clusters = number of experts (DDM found 8 best on ImageNet)")
    features = ["pixels", "clip", "dinov2", "text", "clip+text"]
    p.add_argument("--features", default="pixels", choices=features,
                   help="pixels: flattened, PCA-reduced, whitened; clip: open_clip image "
                        "embeddings, L2-normalised; dinov2: DINOv2 class tokens, "
                        "L2-normalised (the papers' choice; --dinov2-weights); text: the "
                        "captions' pooled CLIP text embeddings; clip+text: both, "
                        "concatenated")
    p.add_argument("--pca-dim", type=int_at_least(1), default=16,
                   help="components kept by the whitened PCA of the pixels (--features pixels): "
                        "at most the values per image, and one less than the images it is "
                        "fitted on (up to 20,000, drawn by --seed)")
    p.add_argument("--clustering", default="kmeans", choices=["kmeans", "random"],
                   help="how images are grouped. kmeans: semantic clusters; random: "
                        "equal-size random clusters, the control the papers compare "
                        "against")
    p.add_argument("--partition", dest="old_partition", action=Renamed,
                   new="--clustering (train_expert.py's --partition names a contributor's own data)")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="open_clip architecture name, or a model-config .json")
    p.add_argument("--clip-pretrained", default=None,
                   help="local open_clip weights file (or a tag, with --download; "
                        "'none': a random tower, for text features in smoke tests)")
    p.add_argument("--dinov2-weights", default=None,
                   help="dinov2: the official release's state dict (e.g. "
                        "dinov2_vits14_pretrain.pth)")
    p.add_argument("--dinov2-size", type=int_at_least(14), default=224,
                   help="dinov2: images are resized to this side")
    p.add_argument("--vae", default=None,
                   help="a diffusers AutoencoderKL folder (e.g. sd-vae-ft-ema): encode "
                        "the data set once into RUN_DIR/latents/ and record the VAE, so "
                        "experts and router train in its latents (clustering still reads "
                        "images); needs requirements-latent.txt")
    p.add_argument("--fine-k", type=int_at_least(0), default=0,
                   help="two-stage k-means: this many fine centroids, grouped into K (papers: 1024)")
    p.add_argument("--fit-sample", type=int_at_least(2), default=100_000,
                   help="fit k-means on this many features drawn at random (all of them "
                        "when there are no more), then give every image its nearest "
                        "centroid: memory is bounded by the sample, not the data set "
                        "(DDM fits on a sample too)")
    p.add_argument("--export-shards", default=None, metavar="DIR",
                   help="sharded data (--data wds:PATTERN): write each cluster's "
                        "samples, byte for byte, as DIR/<k>/*.tar with a manifest; an "
                        "island given only DIR/<k>/ and clusters.pt trains expert k "
                        "(README, Scaling out)")
    p.add_argument("--to-shards", default=None, metavar="DIR",
                   help="write --data itself as WebDataset shards into DIR (KEY.png, "
                        "KEY.cls) and stop: the sharded input of README's Scaling out, "
                        "from any data set held in memory")
    p.add_argument("--shard-size", type=int_at_least(1), default=10_000,
                   help="samples per written shard (img2dataset's default)")
    p.add_argument("--min-size", type=int_at_least(0), default=0,
                   help="grow any smaller cluster to this many images")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--batch-size", type=int_at_least(1), default=256,
                   help="images per feature-extraction batch")
    p.add_argument("--device", type=device_type, default="cuda"
                   if torch.cuda.is_available() else "cpu")
    p.add_argument("--run-dir", default="runs",
                   help="the shared runs/ folder every stage reads and writes")
    p.add_argument("--recluster", action="store_true",
                   help="replace a cluster file that trained experts or a router depend "
                        "on (they will then be refused; better: a new --run-dir)")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
