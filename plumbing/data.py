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
import glob
import gzip
import hashlib
import json
import os
import pickle
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

from .command_line import UsageError, first_line


class ImageSet:
    """uint8 images (N, C, H, W) with optional integer labels; `batch(idx)` gives
    floats in [-1, 1]."""

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

def batch_loader(batches, start, stop, workers, pin_memory):
    """Batches start..stop-1 of a TrainingBatches, made by `workers` processes (0: on
    the caller's thread) ahead of use."""
    return torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(start, stop),
                                       num_workers=workers,
                                       pin_memory=pin_memory, prefetch_factor=4
                                       if workers else None)

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
        (train, train_labels), (test, test_labels) = _read_idx_set(kind, path or FASHION_MNIST_PACKAGE_DIR, download)
        return ImageSet(kind, train, train_labels, 10, image_size,
                        test=ImageSet(kind + "-test", test, test_labels, 10, image_size))
    if kind == "wds":
        if not path:
            raise UsageError("--data wds needs a pattern: --data wds:data/{00000..00099}.tar")
        from .shards import ShardSet
        return ShardSet(spec, image_size)
    if kind in ("cifar10", "imagenet64", "folder") and not path:
        raise UsageError(f"--data {kind} needs a path: --data {kind}:PATH")
    if kind == "cifar10":
        return ImageSet(spec, *_read_cifar10(path, download), 10, image_size)
    if kind == "imagenet64":
        images, labels = _read_imagenet64(path)
        return ImageSet(spec, images, labels, 1000, image_size)
    if kind == "folder":
        if image_size is None:
            raise UsageError("--data folder:PATH needs --image-size (its images may have any size)")
        images, labels, classes, captions = _read_folder(path, image_size)
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

class CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR-10 batch holds: dicts, lists, bytes/str, ints, and
    numpy arrays of plain dtypes.

    A pickle can name any callable to run while it loads; a data set comes from other
    people, so every global it names is refused except numpy's array reconstruction."""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch "
                                     "never holds; refused without running it")

def _plain(obj):
    """True when a loaded batch holds only plain data (no object arrays smuggling other
    things in)."""
    if isinstance(obj, dict):
        return all(_plain(k) and _plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in "biuf"
    return isinstance(obj, (bytes, str, int, float, bool, type(None)))

def _read_cifar10(path, download):
    name = "cifar-10-batches-py"
    root = path if os.path.basename(os.path.normpath(path)) == name else os.path.join(path, name)
    files = [os.path.join(root, f"data_batch_{i}") for i in range(1, 6)]
    if not all(os.path.isfile(f) for f in files):
        if not download:
            raise UsageError(f"no CIFAR-10 at {root} (expected data_batch_1..5); add "
                             "--download to fetch it")
        import torchvision
        torchvision.datasets.CIFAR10(path, train=True, download=True)
    images, labels = [], []
    for f in files:
        try:
            with open(f, "rb") as fh:
                batch = CifarUnpickler(fh, encoding="bytes").load()
            if not isinstance(batch, dict) or not _plain(batch):
                raise ValueError("not a dict of plain arrays, lists and strings")
            data, batch_labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
            if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or batch_labels.shape != (len(data),):
                raise ValueError(f"data {data.dtype} {data.shape} and labels "
                                 f"{batch_labels.shape} are not CIFAR-10's")
            if batch_labels.dtype.kind not in "iu" or batch_labels.min() < 0 or batch_labels.max() > 9:
                raise ValueError("labels must be integers 0..9")
            images.append(data.reshape(-1, 3, 32, 32))
            labels.append(batch_labels.astype(np.int64))
        except Exception as e:
            raise UsageError(f"not a usable CIFAR-10 batch {f}: {first_line(e)}")
    return np.concatenate(images), np.concatenate(labels)

FASHION_MNIST_PACKAGE_DIR = "/usr/share/datasets/fashion-mnist"   # Debian's dataset-fashion-mnist
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}   # unsigned bytes, 3 dimensions (images) or 1 (labels)


def _idx_folder(kind, path, download):
    """The folder holding the four IDX files: PATH itself or torchvision's
    PATH/<Name>/raw; fetched only with --download."""
    raw = os.path.join(path, "FashionMNIST" if kind == "fashion-mnist" else "MNIST", "raw")
    def complete(folder):
        return all(os.path.isfile(os.path.join(folder, f))
                   or os.path.isfile(os.path.join(folder, f + ".gz"))
                   for pair in IDX_FILES.values() for f in pair)
    for folder in (path, raw):
        if complete(folder):
            return folder
    if download:
        import torchvision
        fetch = getattr(torchvision.datasets, "FashionMNIST"
                        if kind == "fashion-mnist" else "MNIST")
        for train in (True, False):
            fetch(path, train=train, download=True)
        return raw
    how = ("install Debian's package: apt-get install dataset-fashion-mnist, or pass "
           "--data fashion-mnist:DIR --download"
           if kind == "fashion-mnist" else "pass --data mnist:DIR --download to fetch it into DIR")
    raise UsageError(f"no {kind} at {path} (expected "
                     f"{', '.join(IDX_FILES['train'] + IDX_FILES['test'])}, raw or .gz): "
                     f"{how}")


def _read_idx(path, dims):
    """One IDX array of unsigned bytes (LeCun's format: magic, big-endian sizes, data),
    from a raw or .gz file."""
    file = path if os.path.isfile(path) else path + ".gz"
    try:
        with (gzip.open(file, "rb") if file.endswith(".gz") else open(file, "rb")) as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise UsageError(f"cannot read {file}: {first_line(e)}")
    header = 4 + 4 * dims
    if len(raw) < header or int.from_bytes(raw[:4], "big") != IDX_MAGIC[dims]:
        raise UsageError(f"{file} is not an IDX file of "
                         f"{'images' if dims == 3 else 'labels'} (its magic number is "
                         f"not {IDX_MAGIC[dims]:#010x})")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    if len(raw) - header != int(np.prod(shape)):
        raise UsageError(f"{file}: its header says {'x'.join(map(str, shape))} = "
                         f"{int(np.prod(shape))} bytes of data, but it holds "
                         f"{len(raw) - header} (a truncated or padded file)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _read_idx_set(kind, path, download):
    """((train images (N, 1, 28, 28), labels), (test images, labels)) of an IDX data
    set, every file checked."""
    folder = _idx_folder(kind, path, download)
    splits = []
    for images_name, labels_name in IDX_FILES.values():
        images, labels = _read_idx(os.path.join(folder, images_name),
                                   3), _read_idx(os.path.join(folder, labels_name), 1)
        if len(images) != len(labels):
            raise UsageError(f"{folder}: {images_name} holds {len(images)} images but "
                             f"{labels_name} {len(labels)} labels")
        if len(labels) and labels.max() > 9:
            raise UsageError(f"{folder}/{labels_name}: label {int(labels.max())} is out "
                             "of range (0..9)")
        splits.append((np.ascontiguousarray(images[:, None]), labels.astype(np.int64)))
    return splits


def _npz_member(path, key):
    """An array of an .npz, memory-mapped when the member is stored uncompressed
    (np.savez)."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(key + ".npy")
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as f:
                f.seek(info.header_offset)
                local = f.read(30)
                name_length = int.from_bytes(local[26:28], "little")
                extra_length = int.from_bytes(local[28:30], "little")
                start = info.header_offset + 30 + name_length + extra_length
                f.seek(start)
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(f)
                offset = f.tell()
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F"
                             if fortran else "C")
    return np.load(path)[key]

def _read_imagenet64(path):
    files = sorted(glob.glob(os.path.join(path, "train_data_batch_*.npz"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise UsageError(f"no downsampled ImageNet at {path} (expected "
                         "train_data_batch_*.npz or one .npz file)")
    images, labels = [], []
    for f in files:
        try:
            data = _npz_member(f, "data")
            # the format: one row of 3 x side x side bytes per image
            if data.ndim != 2 or data.dtype != np.uint8:
                raise ValueError("'data' must be uint8 rows of 3*side*side pixel bytes, "
                                 f"not {data.dtype} of shape {data.shape}")
            side = int(round((data.shape[1] // 3) ** 0.5))
            if 3 * side * side != data.shape[1] or side < 2:
                raise ValueError(f"rows of {data.shape[1]} values are not 3 x side x side pixels")
            images.append(data.reshape(-1, 3, side, side))
            file_labels = np.asarray(_npz_member(f, "labels"))
            if file_labels.dtype.kind not in "iu" or file_labels.min() < 1 or file_labels.max() > 1000:
                raise ValueError("labels must be integers 1..1000 (the format is 1-based)")
            if len(file_labels) != len(data):
                raise ValueError(f"{len(data)} images but {len(file_labels)} labels")
            labels.append(file_labels.astype(np.int64) - 1)
        except (KeyError, ValueError, zipfile.BadZipFile, OSError) as e:
            raise UsageError(f"not a usable downsampled-ImageNet file {f}: {first_line(e)}")
    # One memory map stays a memory map; several are joined (uint8, never floats).
    return (images[0] if len(images) == 1 else np.concatenate(images)), np.concatenate(labels)

def _text(path):
    """A caption file's text: UTF-8, as the captions are embedded; anything else is one
    line."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"caption file {path} is not UTF-8 text (byte {e.start}: "
                         f"{e.reason}); save it as UTF-8")

def _read_folder(path, image_size):
    from PIL import Image
    from tqdm import tqdm
    if not os.path.isdir(path):
        raise UsageError(f"no image folder at {path}")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    exts = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
    items = [(os.path.join(path, c, f), i) for i, c in enumerate(classes)
             for f in sorted(os.listdir(os.path.join(path, c))) if f.lower().endswith(exts)]
    if not items:
        raise UsageError(f"{path} holds no images in class sub-folders (expected "
                         f"{path}/<class>/<image>.png)")
    listed = {}
    if os.path.isfile(os.path.join(path, "captions.jsonl")):
        for n, line in enumerate(_text(os.path.join(path, "captions.jsonl")).splitlines()):
            try:
                entry = json.loads(line)
                listed[os.path.normpath(os.path.join(path, entry["file"]))] = str(entry["text"])
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{path}/captions.jsonl line {n + 1}: expected "
                                 f"{{\"file\": ..., \"text\": ...}}")
    captions = []
    for f, _ in items:
        side = os.path.splitext(f)[0] + ".txt"
        captions.append(_text(side).strip() if os.path.isfile(side)
                        else listed.get(os.path.normpath(f)))
    if all(c is None for c in captions):
        captions = None
    elif any(c is None for c in captions):
        missing = [os.path.relpath(f, path) for (f, _), c in zip(items, captions) if c is None]
        raise UsageError(f"{len(missing)} images in {path} have no caption (e.g. "
                         f"{missing[0]}): add NAME.txt or a captions.jsonl entry")
    images = np.empty((len(items), 3, image_size, image_size), dtype=np.uint8)
    from .shards import open_image
    for n, (f, _) in enumerate(tqdm(items, desc="reading images", leave=False)):
        img = open_image(f, f"cannot read image {f}")
        try:
            # 16-bit: PIL's convert("RGB") would clip at 255
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                img = Image.fromarray((np.asarray(img, dtype=np.float64) / 257).round().clip(0, 255).astype(np.uint8))
            img = img.convert("RGB")
        except Exception as e:
            raise UsageError(f"cannot read image {f}: {first_line(e)}")
        scale = image_size / min(img.size)   # resize the short side, then centre-crop
        img = img.resize((max(image_size, round(img.width * scale)),
                          max(image_size, round(img.height * scale))), Image.BICUBIC)
        left, top = (img.width - image_size) // 2, (img.height - image_size) // 2
        box = (left, top, left + image_size, top + image_size)
        images[n] = np.asarray(img.crop(box)).transpose(2, 0, 1)
    return images, np.array([i for _, i in items], dtype=np.int64), classes, captions

def to_uint8(x):
    """Floats in [-1, 1] (N, C, H, W) to uint8 (N, H, W, C), the ADM batch format."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
