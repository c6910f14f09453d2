"""The data sets (`--data`), and the batches a trainer draws from them.

All held as uint8 (N, C, H, W) and turned into floats in [-1, 1] one
batch at a time, so large sets never sit in memory as floats:
  digits            scikit-learn's 8x8 handwritten digits (1797 images, 10 classes): the
                    embedded default, no download.
  cifar10:PATH      torchvision's on-disk CIFAR-10 (PATH or PATH/cifar-10-batches-py holds the
                    data_batch_* pickles); fetched only with --download.
  imagenet64:PATH   downsampled ImageNet (Chrabaszcz et al. 2017): PATH is a folder of
                    train_data_batch_*.npz or one .npz (e.g. val_data.npz); `data` is uint8,
                    channel-planar (N, 3*64*64), `labels` 1-based. Uncompressed npz members are
                    memory-mapped.
  folder:PATH       an ImageFolder tree (one sub-folder per class), resized and centre-cropped
                    to --image-size. Captions, when present: NAME.txt beside NAME.png, and/or
                    a captions.jsonl of {"file": relative path, "text": caption} at the top.
  digits-captions   digits with captions built from their labels in a few phrasings
                    ("a handwritten seven", "the digit 7", ...): the text path on a fresh machine.
  fashion-mnist     Zalando's Fashion-MNIST (60,000 training and 10,000 test images, 28x28 grey,
                    10 classes) from Debian's package `dataset-fashion-mnist`
                    (/usr/share/datasets/fashion-mnist); fashion-mnist:DIR reads the same four IDX
                    files (raw or .gz) from DIR or DIR/FashionMNIST/raw (torchvision's layout),
                    and --download fetches them there through torchvision.
  mnist:DIR         LeCun's MNIST in the same IDX format (DIR or DIR/MNIST/raw).
  wds:PATTERN       WebDataset tar shards (img2dataset's layout: KEY.jpg/png, KEY.cls labels,
                    KEY.txt captions), e.g. wds:data/{00000..00099}.tar or wds:shards/2/*.tar,
                    read by position from the shards, never loaded whole (shards.py).

A data set with a test split (fashion-mnist, mnist) carries it as `dataset.test`: every
stage trains on the training split, and eval.py compares samples against the test
images."""
import hashlib
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from plumbing.command_line import UsageError
from plumbing.data.files import (FASHION_MNIST_PACKAGE_DIR, read_cifar10, read_folder,
                                 read_idx_set, read_imagenet64)


# the embedded default: every command works with no download
DEFAULT_DATA = "digits"

class DataFlags(NamedTuple):
    """How a stage asks for its data set: --data, --image-size and --vae (None: the ones
    the cluster file records), and --download."""
    spec: str = None
    image_size: int = None
    vae: str = None
    download: bool = False


def describe(fp):
    """A data set's fingerprint (`ImageSet.fingerprint`) in one line, for messages."""
    return f"{fp['name']} N={fp['n']} {'x'.join(map(str, fp['shape']))} hash={fp['hash'][:10]}"


def same_vae(a, b):
    """Two recorded VAE specs (or None for pixels) describe the same space."""
    return (a or {}).get("fingerprint") == (b or {}).get("fingerprint")


class ImageSet:
    """uint8 images (N, C, H, W) with optional integer labels; `batch(idx)` gives
    floats in [-1, 1]."""
    bounded = True   # pixels: an x0 estimate outside [-1, 1] is known to be wrong

    def __init__(self, name, images, labels, num_classes, image_size=None,
                 captions=None, test=None):
        self.name, self.images, self.labels, self.num_classes = name, images, labels, num_classes
        self.captions = captions   # one string per image, or None
        self.test = test           # the held-out split as an ImageSet, where the data set has one
        self.image_size = image_size or images.shape[-1]
        self.channels = images.shape[1]
        self.fingerprint = self._fingerprint()

    def __len__(self):
        return len(self.images)

    def batch(self, idx, rng=None):
        """Float images in [-1, 1], resized to image_size, for an index array (`rng`:
        only LatentSet draws with it)."""
        x = torch.from_numpy(np.ascontiguousarray(self.images[idx])).float() / 127.5 - 1
        if x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              antialias=True, align_corners=False)
        return x

    def _fingerprint(self):
        """Identity of the data set that survives a move to another machine (no paths):
        name, N, shape, a hash."""
        h = hashlib.sha1()
        if self.captions is not None:
            h.update("\n".join(self.captions).encode())
        if self.labels is not None:
            h.update(np.ascontiguousarray(self.labels).tobytes())
        stride = max(1, len(self.images) // 256)   # a strided sample keeps hashing ImageNet cheap
        h.update(np.ascontiguousarray(self.images[::stride]).tobytes())
        return {"name": self.name.split(":")[0], "n": len(self.images),
                "shape": [self.channels, self.image_size, self.image_size], "hash": h.hexdigest()}

class TrainingBatches(torch.utils.data.Dataset):
    """Batch number `step` of one rank's share of `indices`, as (indices, images in [-1,
    1]).

    Each batch is a pure function of (seed, rank, step): the order of an epoch is the
    DistributedSampler's permutation for (seed, epoch), and the optional horizontal
    flips come from a generator seeded by (seed, rank, step). So any DataLoader worker
    can make any batch, in any order, and a resumed run sees exactly the batches it
    would have seen."""

    def __init__(self, dataset, indices, batch_size, seed, rank=0, world=1, hflip=False):
        from torch.utils.data.distributed import DistributedSampler
        if hflip and dataset.name.startswith("digits"):
            raise UsageError("--hflip is for natural images (cifar10, imagenet64, "
                             "folder): a mirrored digit is not a digit")
        if hflip and getattr(dataset, "autoencoder", None) is not None:
            raise UsageError("--hflip with --vae: the latent cache holds the images as "
                             "they are; a mirrored latent is not the latent of a "
                             "mirrored image")
        self.dataset, self.indices, self.batch_size = dataset, indices, batch_size
        self.seed, self.rank, self.hflip = seed, rank, hflip
        self.sampler = DistributedSampler(
            range(len(indices)), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.steps_per_epoch = max(1, len(self.sampler) // batch_size)
        self._epoch, self._order = None, None

    def epoch_order(self, epoch):
        if epoch != self._epoch:   # one permutation per epoch and worker
            self.sampler.set_epoch(epoch)
            # a small set repeats
            self._order = np.resize(np.array(list(self.sampler)),
                                    max(len(self.sampler), self.batch_size))
            self._epoch = epoch
        return self._order

    def __getitem__(self, step):
        epoch, b = divmod(step, self.steps_per_epoch)
        idx = self.indices[self.epoch_order(epoch)[b * self.batch_size:(b + 1) * self.batch_size]]
        # latents: a posterior draw
        x = self.dataset.batch(idx, rng=np.random.default_rng([self.seed, self.rank, step, 1]))
        if self.hflip:
            coins = np.random.default_rng([self.seed, self.rank, step]).random(len(idx))
            flip = torch.from_numpy(coins < 0.5)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return idx, x

    def loader(self, start, stop, workers, pin_memory):
        """Batches start..stop-1, made by `workers` processes (0: on the caller's thread)
        ahead of use."""
        return torch.utils.data.DataLoader(self, batch_size=None, sampler=range(start, stop),
                                           num_workers=workers, pin_memory=pin_memory,
                                           prefetch_factor=4 if workers else None)


def load_dataset(spec, image_size=None, download=False):
    """The data set named by a --data spec (see the module docstring)."""
    kind, _, path = spec.partition(":")
    if kind in ("digits", "digits-captions") and not path:
        from sklearn.datasets import load_digits
        d = load_digits()
        # 0..16 grey levels -> 0..255
        images = np.round(d.images * (255 / 16)).astype(np.uint8)[:, None]
        labels = d.target.astype(np.int64)
        captions = [digit_caption(c, i) for i,
                    c in enumerate(labels)] if kind == "digits-captions" else None
        return ImageSet(kind, images, labels, 10, image_size, captions)
    if kind == "fashion-mnist" or kind == "mnist":
        if kind == "mnist" and not path:
            raise UsageError("--data mnist needs a path: --data mnist:DIR (a folder of "
                             "MNIST's four IDX files)")
        (train, train_labels), (test, test_labels) = read_idx_set(kind, path or FASHION_MNIST_PACKAGE_DIR, download)
        return ImageSet(kind, train, train_labels, 10, image_size,
                        test=ImageSet(kind + "-test", test, test_labels, 10, image_size))
    if kind == "wds":
        if not path:
            raise UsageError("--data wds needs a pattern: --data wds:data/{00000..00099}.tar")
        from plumbing.data.shards import ShardSet
        return ShardSet(spec, image_size)
    if kind in ("cifar10", "imagenet64", "folder") and not path:
        raise UsageError(f"--data {kind} needs a path: --data {kind}:PATH")
    if kind == "cifar10":
        return ImageSet(spec, *read_cifar10(path, download), 10, image_size)
    if kind == "imagenet64":
        images, labels = read_imagenet64(path)
        return ImageSet(spec, images, labels, 1000, image_size)
    if kind == "folder":
        if image_size is None:
            raise UsageError("--data folder:PATH needs --image-size (its images may have any size)")
        images, labels, classes, captions = read_folder(path, image_size)
        return ImageSet(spec, images, labels, len(classes), image_size, captions)
    raise UsageError(f"unknown data set {spec!r}: use digits, digits-captions, "
                     "fashion-mnist[:DIR], mnist:DIR, cifar10:PATH, imagenet64:PATH, "
                     "folder:PATH or wds:PATTERN")

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

DIGIT_PHRASES = ["a handwritten {word}", "the digit {digit}", "a drawing of the number {word}",
                 "the number {digit}, handwritten"]

def digit_caption(label, index):
    """A caption for a digit image; the phrasing cycles with the image index, so every
    phrasing is seen."""
    return DIGIT_PHRASES[index % len(DIGIT_PHRASES)].format(word=DIGIT_WORDS[label], digit=label)

def caption_labels(data_spec, prompts):
    """The class label of each prompt where the data set makes its captions from labels
    (digits-captions), else None.

    Then samples prompted with "the digit 3" can be scored for class accuracy like
    class-conditional ones."""
    if data_spec != "digits-captions":
        return None
    known = {digit_caption(label, i): label for label in range(10)
             for i in range(len(DIGIT_PHRASES))}
    return [known[p] for p in prompts] if all(p in known for p in prompts) else None

def to_uint8(x):
    """Floats in [-1, 1] (N, C, H, W) to uint8 (N, H, W, C), the ADM batch format."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


class Rows:
    """Rows `indices` of a data set as floats in [-1, 1], read a slice at a time."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, rows):
        return self.dataset.batch(self.indices[rows])


class Pixels:
    """An ADM batch's uint8 images as flattened floats in [-1, 1], a slice at a time (the
    memorisation check's pixel rows, with no float copy of all of them)."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, rows):
        return self.images[rows].reshape(len(self.images[rows]), -1) / 127.5 - 1
