"""What cluster.py clusters each image by, and the cache of it: whitened PCA of the pixels,
CLIP or DINOv2 image features, the captions' CLIP features, or image and caption together.

`features(dataset, wanted, run_dir)` computes them once into runs/features/KEY.npy, KEY hashing
the data set's fingerprint and `wanted.spec()` (the kind and every option it depends on, a
weights file by its content), and reads them back from there when asked again, so that
re-clustering with another K costs no encoder pass. Image features are computed a batch at a
time into a memory-mapped file: memory holds one batch, whatever the data set's size."""
import os
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from plumbing.command_line import UsageError
from plumbing.data.encoders import (caption_embeddings, clip_image_features,
                                    dinov2_features, load_clip, load_dinov2)
from plumbing.data.latents import file_hash
from plumbing.run_dir import atomic_path, cache_key

PCA_FIT_IMAGES = 20000   # the pixels' PCA is fitted on at most this many images, drawn by --seed


class Features(NamedTuple):
    """What the clustering reads of each image: --features and the options of its kind."""
    kind: str
    pca_dim: int
    seed: int
    clip_model: str
    clip_pretrained: str
    dinov2_weights: str
    dinov2_size: int
    batch_size: int
    device: str
    download: bool

    def spec(self):
        """What the cached features are keyed by, and the cluster file records."""
        if self.kind == "pixels":
            return {"features": self.kind, "pca_dim": self.pca_dim, "seed": self.seed}
        if self.kind == "dinov2":
            return {"features": self.kind, "size": self.dinov2_size,
                    "dinov2_weights": content_key(self.dinov2_weights)}
        return {"features": self.kind, "clip_model": content_key(self.clip_model),
                "clip_pretrained": content_key(self.clip_pretrained)}


def content_key(path_or_name):
    """A weights file by its content (another file under the same name must not find these
    features), a tag by name."""
    if path_or_name and os.path.isfile(path_or_name):
        return file_hash([path_or_name])
    return path_or_name or ""


def features(dataset, wanted, run_dir):
    """The features to cluster (and their spec), as `wanted` (Features) asks, cached under
    RUN_DIR/features/ by data set and feature spec."""
    spec = wanted.spec()
    path = os.path.join(run_dir, "features", f"{cache_key([dataset.fingerprint, spec])}.npy")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder where the feature cache goes: remove it")
    if os.path.isfile(path):
        try:
            feats = np.load(path, allow_pickle=False, mmap_mode="r")
            if feats.ndim == 2 and len(feats) == len(dataset) and np.isfinite(feats).all():
                print(f"features: cached {path}")
                return feats, spec
        except (ValueError, OSError, EOFError):
            pass
        print(f"features: the cache {path} is unreadable or does not fit the data set; "
              "computing them again")
    if wanted.kind in ("text", "clip+text") and dataset.captions is None:
        raise UsageError(f"--features {wanted.kind} needs captions (--data "
                         "digits-captions, or folder:PATH with captions)")
    if wanted.kind == "pixels":
        return pixel_features(dataset, wanted.pca_dim, wanted.seed, path), spec
    if wanted.kind == "dinov2":
        model = load_dinov2(wanted.dinov2_weights, wanted.dinov2_size, wanted.device)
        return streamed(path, dataset, wanted.batch_size, "DINOv2 features",
                        lambda x: dinov2_features(model, x, wanted.device).cpu().numpy()), spec
    if wanted.kind == "clip":
        model = load_clip(wanted.clip_model, wanted.clip_pretrained, wanted.download, wanted.device)
        return streamed(path, dataset, wanted.batch_size, "CLIP features",
                        lambda x: clip_image_features(model, x, wanted.device).cpu().numpy()), spec
    # the captions' features: every caption is in memory already
    parts = []
    if wanted.kind == "clip+text":
        model = load_clip(wanted.clip_model, wanted.clip_pretrained, wanted.download, wanted.device)
        batches = [np.arange(i, min(i + wanted.batch_size, len(dataset)))
                   for i in range(0, len(dataset), wanted.batch_size)]
        parts.append(np.concatenate([clip_image_features(model, dataset.batch(idx), wanted.device).cpu().numpy()
                                     for idx in tqdm(batches, desc="CLIP features")]))
    _, pooled, index, _ = caption_embeddings(
        dataset.captions, run_dir, clip_model=wanted.clip_model,
        clip_pretrained=wanted.clip_pretrained, download=wanted.download)
    parts.append(pooled[index].numpy())
    # both L2-normalised, concatenated and rescaled: image and caption weigh equally in
    # the distances
    feats = np.concatenate(parts, axis=1) / np.sqrt(len(parts))
    with atomic_path(path) as tmp:
        np.save(tmp, feats)
    return feats, spec


def check_pca_dim(dataset, dim):
    """--pca-dim within what a PCA of this data set's pixels can keep (one line if not): no
    more components than values per image, nor than the directions that N centred images
    span (N - 1; whitening would blow a direction of zero variance up to unit variance)."""
    values = int(np.prod(dataset.batch(np.arange(1)).shape[1:]))
    fitted = min(len(dataset), PCA_FIT_IMAGES)
    if dim > min(values, fitted - 1):
        raise UsageError(f"--pca-dim {dim} is more than a PCA of these images can keep: at "
                         f"most {min(values, fitted - 1)} ({values} values per image; "
                         f"{fitted} images fitted, which span {fitted - 1} directions)")


def pixel_features(dataset, dim, seed, path, batch_size=1024):
    """Flattened pixels, PCA-reduced and whitened (fitted on up to PCA_FIT_IMAGES images),
    streamed into `path`."""
    from sklearn.decomposition import PCA
    rng = np.random.default_rng(seed)
    fit_idx = np.sort(rng.choice(len(dataset), min(len(dataset), PCA_FIT_IMAGES), replace=False))
    fit = dataset.batch(fit_idx).flatten(1).numpy()
    pca = PCA(n_components=dim, whiten=True, random_state=seed).fit(fit)
    del fit
    return streamed(path, dataset, batch_size, "pixel features",
                    lambda x: pca.transform(x.flatten(1).numpy()))


def streamed(path, dataset, batch_size, desc, compute):
    """Features computed a batch of images at a time into a memory-mapped .npy at
    `path` (written aside, renamed when complete): memory holds one batch, whatever the
    data set's size."""
    out = None
    with atomic_path(path) as tmp:
        for start in tqdm(range(0, len(dataset), batch_size), desc=desc):
            idx = np.arange(start, min(start + batch_size, len(dataset)))
            rows = np.asarray(compute(dataset.batch(idx)), dtype=np.float32)
            if out is None:
                out = np.lib.format.open_memmap(
                    tmp, mode="w+", dtype=np.float32, shape=(len(dataset), rows.shape[1]))
            out[start:start + len(idx)] = rows
        out.flush()
        del out
    return np.load(path, mmap_mode="r")
