"""Stage 5: measure sample batches against the real data set.

Reads runs/samples/NAME.npz (ADM batch format: arr_0 uint8 N x H x W x C, optional arr_1
labels) and the data set of the run; writes NAME.eval.json beside each file and caches the
feature networks and the real data's statistics in runs/eval/. Prints one row per file.

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
import hashlib
import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from command_line import Parser, UsageError, first_line, int_at_least, run_main, seed_type
from data import load_dataset
from encoders import TextEncoder, clip_image_features, load_clip
from release import INDEX, ReleaseError, check_index
from run_dir import (atomic_json, atomic_path, atomic_save, check_writable_dir, cluster_path,
                     load_checkpoint)

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")


# --- Frechet distance, precision / recall, diversity ---------------------------------------------

def frechet_distance(mu1, sigma1, mu2, sigma2):
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), with symmetric eigendecompositions in
    float64."""
    mu1, mu2, sigma1, sigma2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, sigma1, sigma2))
    w, v = np.linalg.eigh(sigma1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = root1 @ sigma2 @ root1
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_root)


def statistics(features):
    return features.mean(0), np.cov(features, rowvar=False)


PRECISION_RECALL_K = 3


def precision_recall(real, fake, k=PRECISION_RECALL_K):
    """Kynkaenniemi et al.: a sample is precise if it falls inside some real point's k-NN ball, and
    vice versa."""
    def radii(x):
        d = torch.cdist(x, x)
        return d.kthvalue(k + 1, dim=1).values          # +1: the point itself is at distance 0
    real, fake = torch.as_tensor(real, dtype=torch.float64), torch.as_tensor(fake, dtype=torch.float64)
    d = torch.cdist(fake, real)                          # (n_fake, n_real)
    precision = (d <= radii(real)[None]).any(1).double().mean().item()
    recall = (d.T <= radii(fake)[None]).any(1).double().mean().item()
    return precision, recall


def diversity(features, labels):
    """Mean pairwise distance within each label (labels with at least two samples), averaged over
    labels."""
    if labels is None:
        labels = np.zeros(len(features), dtype=np.int64)
    per_label = []
    for c in np.unique(labels):
        f = torch.as_tensor(features[labels == c], dtype=torch.float64)
        if len(f) >= 2:
            per_label.append((torch.pdist(f).mean()).item())
    return float(np.mean(per_label)) if per_label else float("nan")


# --- the classifier whose features FD-clf uses ---------------------------------------------------

def classifier_network(image_size):
    """Which Classifier network images of this size get: 'pooled' up to 16 px, 'flat' above."""
    return "pooled" if image_size <= 16 else "flat"


def classifier_identity(image_size, steps):
    """What an .eval.json records of the classifier it was measured with; FDs compare only at the
    same identity."""
    return f"{classifier_network(image_size)}-{steps}"


class Classifier(nn.Module):
    """A small CNN; `features` is its 128-d penultimate layer.

    'pooled' (8 px digits, the network of every digits figure in docs/) averages its last 2x2 map.
    At 28 px that average throws away where on the image things are (a sleeve, a heel): it reached
    84.5 % on Fashion-MNIST's test split at 3000 steps. 'flat' normalises its convolutions and
    flattens the last 7x7 map into the 128-d layer, and reached 92.1 % at 1500 steps (python eval.py
    --prepare --data fashion-mnist --classifier-steps 1500)."""
    def __init__(self, channels, num_classes, image_size):
        super().__init__()
        self.network = classifier_network(image_size)
        if self.network == "pooled":
            self.body = nn.Sequential(
                nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
                nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten())
        else:
            def conv(c_in, c_out, stride):
                return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                        nn.BatchNorm2d(c_out), nn.ReLU()]
            side = -(-image_size // 4)   # two stride-2 convolutions, each rounding up
            self.body = nn.Sequential(*conv(channels, 32, 1), *conv(32, 32, 2), *conv(32, 64, 1),
                                      *conv(64, 64, 2),
                                      nn.Flatten(), nn.Linear(64 * side * side, 128), nn.ReLU())
        self.head = nn.Linear(128, num_classes)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def data_key(dataset):
    return hashlib.sha1(json.dumps(dataset.fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def train_classifier(dataset, steps, seed=0):
    """Train on the training images and report accuracy on the test split; a set without one holds
    out 10 % of its images."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(dataset), generator=g).numpy()
    if dataset.test is not None:
        held_out, val, train = dataset.test, np.arange(len(dataset.test)), order
    else:
        n_val = max(1, len(dataset) // 10)
        held_out, val, train = dataset, order[:n_val], order[n_val:]
    model = Classifier(dataset.channels, dataset.num_classes, dataset.image_size)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(steps):
        # cosine decay to zero; 'pooled' keeps the constant rate its digits figures used
        if model.network == "flat":
            opt.param_groups[0]["lr"] = 1e-3 * (1 + np.cos(np.pi * step / steps))
        idx = train[torch.randint(len(train), (128,), generator=g).numpy()]
        x = dataset.batch(idx)
        # slight shift jitter
        x = torch.roll(x, shifts=tuple(torch.randint(-1, 2, (2,),
                                                     generator=g).tolist()), dims=(2, 3))
        loss = F.cross_entropy(model(x), torch.from_numpy(dataset.labels[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        chunks = [val[i:i + 512] for i in range(0, len(val), 512)]
        correct = sum(int((model(held_out.batch(c)).argmax(1).numpy() == held_out.labels[c]).sum()) for c in chunks)
    return model, correct / len(val)


def load_or_train_classifier(dataset, run_dir, steps):
    """The evaluation classifier, cached per data set, network and training steps; an unreadable
    cache is rebuilt."""
    network = classifier_network(dataset.image_size)
    # pooled: the name caches had before 'flat'
    name = f"{data_key(dataset)}-{steps}" if network == "pooled" else f"{data_key(dataset)}-{network}-{steps}"
    path = os.path.join(run_dir, "eval", f"classifier-{name}.pt")
    if os.path.isfile(path):
        try:
            ckpt = load_checkpoint(path, "classifier")
            model = Classifier(dataset.channels, dataset.num_classes, dataset.image_size)
            model.load_state_dict(ckpt["model"])
            return model.eval(), ckpt["accuracy"]
        except (UsageError, KeyError, RuntimeError) as e:
            print(f"the cached classifier {path} is unreadable ({e}); training it again")
    print(f"training the evaluation classifier on the real data ({steps} steps, cached in {path})")
    model, accuracy = train_classifier(dataset, steps)
    atomic_save({"model": model.state_dict(), "accuracy": accuracy, "data": dataset.fingerprint,
                 "network": network}, path)
    return model, accuracy


@torch.no_grad()
def batched(fn, x, batch_size=500):
    return torch.cat([fn(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])


# --- Inception (pytorch-fid's variant of torchvision's Inception-v3) -----------------------------

def fid_inception(weights_path):
    """pytorch-fid's FID network: torchvision's Inception-v3 with the TF graph's pooling quirks,
    1008 classes.

    The TensorFlow Inception used for the original FID pools without padding in its average
    pools and uses a max pool in the last block's pooling branch; these subclasses reproduce
    that, so pytorch-fid's weights load with strict key matching.
    """
    from torchvision.models import inception as tv

    def avg_pool(x):
        return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)

    class A(tv.InceptionA):
        def forward(self, x):
            b = [self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                 self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class C(tv.InceptionC):
        def forward(self, x):
            d = self.branch7x7dbl_1(x)
            for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                          self.branch7x7dbl_5):
                d = layer(d)
            b = [self.branch1x1(x), self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x))), d,
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class E(tv.InceptionE):
        def __init__(self, in_channels, max_pool):
            super().__init__(in_channels)
            self.max_pool = max_pool

        def forward(self, x):
            a = self.branch3x3_1(x)
            d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
            pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else avg_pool(x)
            b = [self.branch1x1(x), torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1),
                 torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1),
                 self.branch_pool(pooled)]
            return torch.cat(b, 1)

    net = tv.Inception3(num_classes=1008, aux_logits=False, init_weights=False)
    net.Mixed_5b, net.Mixed_5c = A(192, pool_features=32), A(256, pool_features=64)
    net.Mixed_5d = A(288, pool_features=64)
    net.Mixed_6b, net.Mixed_6c = C(768, channels_7x7=128), C(768, channels_7x7=160)
    net.Mixed_6d, net.Mixed_6e = C(768, channels_7x7=160), C(768, channels_7x7=192)
    net.Mixed_7b, net.Mixed_7c = E(1280, max_pool=False), E(2048, max_pool=True)
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        net.load_state_dict(state, strict=True)
    except Exception as e:
        raise UsageError(f"cannot load Inception weights {weights_path}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}")
    net.fc = nn.Identity()   # pool3 features (2048-d) are what FID compares
    return net.eval()


def inception_features(net, images):
    """images: floats in [-1, 1] (N, C, H, W); grey is repeated to RGB, then resized to 299 as
    pytorch-fid does."""
    x = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    return net(x)


# --- reading and checking sample files -----------------------------------------------------------

def check_unpacked_size(path):
    """Refuse an .npz whose arrays would not fit in memory, or that packs far more than real images
    compress to (a zip bomb), before anything is unpacked."""
    with zipfile.ZipFile(path) as z:
        members = z.infolist()
    unpacked, packed = sum(m.file_size for m in members), sum(m.compress_size for m in members)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else float("inf")
    if unpacked > memory / 2:
        raise UsageError(f"{path} unpacks to {unpacked / 2**30:.1f} GiB, more than half of this "
                         f"machine's {memory / 2**30:.0f} GiB of memory; evaluate it in smaller "
                         "batches")
    # images compress 2-5x; a 100x ratio is no batch of images
    if unpacked > 2 ** 30 and unpacked > 100 * packed:
        raise UsageError(f"{path} packs {unpacked / 2**30:.1f} GiB into {packed / 2**20:.1f} MiB: "
                         "not a batch of images (a zip bomb?)")


def read_samples(path, dataset):
    """(images in [-1, 1], labels or None, the sampler's run id or None) of an ADM-format batch,
    checked."""
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
        raise UsageError(f"{path}: images are {'x'.join(map(str, images.shape[1:]))}, the data "
                         f"set's are {'x'.join(map(str, want))}")
    # each sample's k-th neighbour among the others must exist
    if len(images) < PRECISION_RECALL_K + 1:
        raise UsageError(f"{path}: needs at least {PRECISION_RECALL_K + 1} images (k-NN "
                         f"precision/recall with k = {PRECISION_RECALL_K}), has {len(images)}")
    if labels is not None and (labels.dtype.kind not in "iu" or labels.shape != (len(images),)
                               or labels.min() < 0
                               or labels.max() >= max(dataset.num_classes, 1)):
        raise UsageError(f"{path}: arr_1 must hold one integer label in "
                         f"0..{dataset.num_classes - 1} per image")
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, labels, run_id


def routing_summary(path, run_id):
    """Overall expert shares from the sampler's JSON beside the npz, e.g. '22/28/17/34', if it is
    that batch's JSON."""
    usage_path = path[:-4] + ".json"
    if not os.path.isfile(usage_path):
        return None, None
    with open(usage_path) as f:
        usage = json.load(f)
    # left by another run of sample.py (e.g. one killed between its two writes)
    if usage.get("run_id") != run_id:
        print(f"{usage_path} belongs to another sampling run than {path}; its routing is not "
              "reported")
        return None, None
    counts = np.asarray(usage.get("usage_per_t_bin", {}).get("counts", []), dtype=np.float64)
    if counts.size == 0:
        return None, usage
    share = counts.sum(0) / counts.sum()
    return "/".join(f"{100 * s:.0f}" for s in share), usage


def feature_networks(args, dataset):
    """{name: features fn} of every feature space available, the classifier and its accuracy, and
    notes on what is missing."""
    feature_sets, notes, extra = {}, {}, {}
    if dataset.labels is not None:
        classifier, clf_accuracy = load_or_train_classifier(dataset, args.run_dir,
                                                            args.classifier_steps)
        feature_sets["clf"] = classifier.features
        extra.update(classifier=classifier, classifier_accuracy=clf_accuracy,
                     classifier_accuracy_on=held_out_name(dataset),
                     classifier_identity=classifier_identity(dataset.image_size,
                                                             args.classifier_steps))
        print(f"evaluation classifier: {clf_accuracy:.1%} accuracy on {held_out_name(dataset)}")
    if args.inception_weights or args.download:
        weights = args.inception_weights
        if not weights:
            weights = os.path.join(args.run_dir, "eval", os.path.basename(FID_WEIGHTS_URL))
            if not os.path.isfile(weights):
                torch.hub.download_url_to_file(FID_WEIGHTS_URL, weights)
        net = fid_inception(weights)
        feature_sets["fid"] = lambda x: inception_features(net, x)
    else:
        notes["FID"] = ("no Inception weights: pass --inception-weights pt_inception-2015-12-05-6726825d.pth "
                        "(or --download)")
    if args.clip_pretrained:
        clip = load_clip(args.clip_model, args.clip_pretrained, args.download, "cpu")
        feature_sets["clip"] = lambda x: clip_image_features(clip, x, "cpu")
        extra["text_encoder"] = TextEncoder(args.clip_model, args.clip_pretrained, args.download)
    else:
        notes["CLIP-FD"] = "no CLIP weights: pass --clip-pretrained LOCAL_FILE"
    return feature_sets, notes, extra


def held_out_name(dataset):
    return f"the {len(dataset.test)} test images" if dataset.test is not None else "a held-out 10 % of the real images"


def reference_statistics(args, dataset, feature_sets, rng):
    """Real-data features and their mean and covariance per feature space, cached per data set,
    scope and network.

    The reference is the test split where the data set has one (samples are never compared with the
    images the experts learnt), else the whole set; with --cluster, the training images of that
    cluster (the test images belong to no cluster)."""
    real, scope = (dataset.test, "test") if dataset.test is not None else (dataset, "all")
    pool = np.arange(len(real))
    if args.cluster is not None:   # one expert against its own cluster's images
        real = dataset
        clusters = load_checkpoint(cluster_path(args.run_dir), "cluster file")
        if not 0 <= args.cluster < clusters["k"]:
            raise UsageError(f"--cluster {args.cluster}: the cluster file has clusters "
                             f"0..{clusters['k'] - 1}")
        pool = np.flatnonzero(clusters["assignments"].numpy() == args.cluster)
        scope = f"c{args.cluster}-{clusters['fingerprint'][:8]}"
    n_ref = min(len(pool), args.max_real)
    ref_idx = np.sort(rng.choice(pool, n_ref, replace=False))
    real_images = real.batch(ref_idx)
    reference = {}
    for name, fn in feature_sets.items():
        # features of that classifier only
        network = {"clf": "-" + classifier_identity(dataset.image_size, args.classifier_steps),
                   "clip": "-" + os.path.basename(args.clip_pretrained or "")}.get(name, "")
        cache = os.path.join(args.run_dir, "eval",
                             f"ref-{data_key(dataset)}-{scope}-{name}{network}-{n_ref}-{args.seed}.npz")
        if os.path.isfile(cache):
            try:
                with np.load(cache, allow_pickle=False) as ref:
                    reference[name] = {k: ref[k] for k in ("features", "mu", "sigma")}
            except Exception as e:
                print(f"the cached reference statistics {cache} are unreadable ({first_line(e)}); "
                      "computing them again")
        if name not in reference:
            feats = batched(fn, real_images).numpy().astype(np.float64)
            mu, sigma = statistics(feats)
            reference[name] = {"features": feats, "mu": mu, "sigma": sigma}
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            with atomic_path(cache) as tmp:
                np.savez(tmp, **reference[name])
    return reference, real.labels[ref_idx] if real.labels is not None else None, scope


@dataclass(frozen=True)
class Yardstick:
    """What every batch is measured with: the feature networks, the real images' statistics in their
    features, and the notes on metrics that could not be measured."""
    feature_sets: dict      # {"clf" | "fid" | "clip": images -> features}
    # the classifier (conditional accuracy) and text encoder (CLIP score), where present
    extra: dict
    reference: dict         # {name: {"mu", "sigma", "features"}} of the real images
    ref_labels: object      # the real images' labels, or None
    scope: str              # which real images the reference holds
    notes: dict             # {metric: why it is missing}
    seed: int


def measure(path, x, labels, run_id, yardstick):
    """Every metric of one sample batch, as the dict written to NAME.eval.json."""
    feature_sets, extra, reference, notes = (yardstick.feature_sets, yardstick.extra, yardstick.reference,
                                             yardstick.notes)
    result = {"file": path, "n": len(x),
              "n_real": len(reference[next(iter(reference))]["features"]) if reference else 0,
              "reference": yardstick.scope, "notes": notes}
    shares, usage = routing_summary(path, run_id)
    prompts = (usage or {}).get("prompts") or []
    indexed = prompts and len(usage.get("prompt_index") or []) == len(x)
    prompt_index = np.asarray(usage["prompt_index"]) if indexed else None
    for name in feature_sets:
        feats = batched(feature_sets[name], x).numpy().astype(np.float64)
        mu, sigma = statistics(feats)
        key = {"clf": "fd_classifier", "fid": "fid", "clip": "clip_fd"}[name]
        result[key] = frechet_distance(mu, sigma, reference[name]["mu"], reference[name]["sigma"])
        if name == "clf":
            real = reference[name]["features"]
            # the real subset depends on N and --seed only: a batch's precision and recall never on
            # the other files evaluated
            subset = np.random.default_rng([yardstick.seed, len(feats)])
            real = real[subset.choice(len(real), min(len(real), len(feats)), replace=False)]
            result["precision"], result["recall"] = precision_recall(real, feats)
            result["diversity"] = diversity(feats, prompt_index if prompt_index is not None else labels)
            result["diversity_real"] = diversity(reference[name]["features"], yardstick.ref_labels
                                                 if labels is not None else None)
            if labels is not None:
                predicted = batched(extra["classifier"], x).argmax(1).numpy()
                result["conditional_accuracy"] = float((predicted == labels).mean())
        if name == "clip" and prompt_index is not None:
            _, text = extra["text_encoder"](prompts)
            image = torch.as_tensor(feats, dtype=torch.float32)
            cosine = (image * torch.nn.functional.normalize(text, dim=-1)[prompt_index]).sum(1)
            result["clip_score"] = float((100 * cosine).clamp(min=0).mean())
    if usage is not None:
        result["routing"] = {"routing": usage.get("routing"), "expert_share_percent": shares,
                             "missing": usage.get("missing"),
                             "usage_per_t_bin": usage.get("usage_per_t_bin")}
    result["classifier_accuracy_on_real"] = extra.get("classifier_accuracy")
    result["classifier_accuracy_measured_on"] = extra.get("classifier_accuracy_on")
    result["classifier"] = extra.get("classifier_identity")
    return result, shares


def main(args):
    spec, size = args.data, args.image_size
    if spec is None:
        index = os.path.join(args.run_dir, INDEX)
        if os.path.isfile(cluster_path(args.run_dir)):
            clusters = load_checkpoint(cluster_path(args.run_dir), "cluster file")
        elif os.path.isfile(index):   # a release (export.py) records the data set its experts saw
            try:
                clusters = check_index(args.run_dir)
            except ReleaseError as e:
                raise UsageError(str(e))
        else:
            raise UsageError(f"no --data given and no cluster file at {cluster_path(args.run_dir)} "
                             "to take it from")
        spec, size = clusters["data_spec"], size or clusters["data"]["shape"][-1]
    if not args.files and not args.prepare:
        raise UsageError("give one or more sample batches (.npz), or --prepare to build the "
                         "evaluation classifier and reference statistics before any sample exists")
    dataset = load_dataset(spec, size, args.download)
    # check every file before any work
    samples = [(path, *read_samples(path, dataset)) for path in args.files]
    for folder in {os.path.join(args.run_dir, "eval")} | {os.path.dirname(os.path.abspath(p))
                                                          for p in args.files}:
        check_writable_dir(folder, "eval.py writes to")
    if args.cluster is not None:   # checked before any network is trained or loaded
        clusters = load_checkpoint(cluster_path(args.run_dir), "cluster file")
        if not 0 <= args.cluster < clusters["k"]:
            raise UsageError(f"--cluster {args.cluster}: the cluster file has clusters "
                             f"0..{clusters['k'] - 1}")
    feature_sets, notes, extra = feature_networks(args, dataset)
    rng = np.random.default_rng(args.seed)
    reference, ref_labels, scope = reference_statistics(args, dataset, feature_sets, rng)
    yardstick = Yardstick(feature_sets, extra, reference, ref_labels, scope, notes, args.seed)
    if not samples:
        print("evaluation networks and reference statistics cached in "
              f"{os.path.join(args.run_dir, 'eval')}")
        return
    rows = []
    for path, x, labels, run_id in samples:
        result, shares = measure(path, x, labels, run_id, yardstick)
        atomic_json(result, path[:-4] + ".eval.json")
        rows.append((result, shares))

    columns = [("FD-clf", "fd_classifier", "{:.2f}"), ("acc", "conditional_accuracy", "{:.1%}"),
               ("prec", "precision", "{:.2f}"),
               ("rec", "recall", "{:.2f}"), ("div", "diversity", "{:.2f}"),
               ("div-real", "diversity_real", "{:.2f}"),
               ("FID", "fid", "{:.2f}"), ("CLIP-FD", "clip_fd", "{:.4f}"),
               ("CLIP", "clip_score", "{:.2f}")]
    width = max(len(os.path.basename(p)) for p in args.files) + 2
    print(f"{'file':<{width}}{'N':>6}" + "".join(f"{c:>10}" for c, _,
                                                 _ in columns) + "  experts used (%)")
    for result, shares in rows:
        cells = "".join(f"{fmt.format(result[key]) if key in result else '-':>10}" for _,
                        key, fmt in columns)
        print(f"{os.path.basename(result['file']):<{width}}{result['n']:>6}{cells}  {shares or '-'}")
    for metric, why in notes.items():
        print(f"{metric}: {why}")


def build_parser():
    p = Parser(prog="eval.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="sample batches (.npz, ADM format)")
    p.add_argument("--prepare", action="store_true",
                   help="only train and cache the evaluation classifier and the reference "
                        "statistics (e.g. while the experts train); sample batches may follow "
                        "later")
    p.add_argument("--data", default=None,
                   help="the real data set (default: the run's cluster file's)")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--download", action="store_true",
                   help="allow downloading the data set or the Inception weights")
    p.add_argument("--inception-weights", default=None,
                   help="pytorch-fid's pt_inception-2015-12-05-6726825d.pth (local file)")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="open_clip architecture name or model-config .json, for CLIP-FD")
    p.add_argument("--clip-pretrained", default=None,
                   help="local open_clip weights file, for CLIP-FD")
    p.add_argument("--classifier-steps", type=int_at_least(1), default=1500,
                   help="training steps of the evaluation classifier (cached)")
    p.add_argument("--max-real", type=int_at_least(2), default=10000,
                   help="real images used for the reference statistics")
    p.add_argument("--cluster", type=int_at_least(0), default=None,
                   help="compare against this cluster's real images only (one expert's own data)")
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--run-dir", default="runs")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
