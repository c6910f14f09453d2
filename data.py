"""Data sets, the runs/ layout, and the small plumbing every stage shares.

Data sets (`--data`), all held as uint8 (N, C, H, W) and turned into floats in [-1, 1] one
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

The runs/ layout (every stage reads and writes only these):
  runs/clusters.pt            cluster.py: assignments, centroids, K, feature spec, data fingerprint
  runs/clusters.png           cluster.py: a row of examples per cluster
  runs/features/KEY.npy       cluster.py: cached features, KEY hashes data set + feature spec
  runs/latents/KEY.npy        latents.py (--vae): the data set's VAE posterior (mean, std), KEY hashes data set + VAE
  runs/text/KEY.pt            encoders.py: cached caption embeddings, with the encoder spec they were made with
  runs/experts/<k>/           train_expert.py: ckpt.pt, log.jsonl, samples PNGs (<k> = 'all' for the monolith);
                              `lock` while a trainer writes there
  runs/router/                train_router.py: ckpt.pt, log.jsonl, accuracy.json
  runs/samples/NAME.npz       sample.py: arr_0 uint8 NHWC, arr_1 labels, run_id; NAME.png, NAME.json (same run_id) beside it
  runs/eval/                  eval.py: the cached classifier and reference statistics
"""
import argparse
import contextlib
import errno
import glob
import hashlib
import io
import json
import math
import os
import pickle
import socket
import sys
import zipfile

import numpy as np
import torch
import torch.nn.functional as F


class UsageError(Exception):
    """A problem with the user's input or files: reported as one line, never as a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is in --help), like every other error of the stages."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def run_main(main, parser):
    """Parse the command line and run main(args): a UsageError, or a disk that fills up or refuses a write,
    becomes one line on stderr and exit 2 (atomic writes leave the previous files as they were)."""
    args = parser.parse_args()
    try:
        main(args)
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
            raise
        print(f"{parser.prog}: error: cannot write {e.filename or 'a file'}: {e.strerror}; nothing was replaced", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:   # torch.save reports a full disk as a RuntimeError of its zip writer
        if "unexpected pos" not in str(e) and "file write failed" not in str(e):
            raise
        print(f"{parser.prog}: error: a checkpoint write failed (is the disk full?); nothing was replaced", file=sys.stderr)
        sys.exit(2)


# --- flag types: a bad value is refused where it is parsed, in one line -------------------------

def int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def float_in(low=-math.inf, high=math.inf, *, low_open=False, high_open=False):
    """A finite float in the range [low, high] (an end excluded when open)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low) or (high_open and value == high):
            raise argparse.ArgumentTypeError(f"must be a finite number in {'(' if low_open else '['}{low}, {high}"
                                             f"{')' if high_open else ']'}, got {text}")
        return value
    return parse


def device_type(text):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (cpu, cuda, cuda:N, mps)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {text}: no CUDA device is available here")
    return text


def check_writable_dir(path, what):
    """Refuse before any work when `path` cannot hold our files (a file in the way, or a read-only folder)."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    if not os.path.isdir(probe):
        raise UsageError(f"{what} {path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: {probe} is not writable")


# --- runs/ layout ------------------------------------------------------------------------------

def cluster_path(run_dir):
    return os.path.join(run_dir, "clusters.pt")


def expert_dir(run_dir, cluster):
    return os.path.join(run_dir, "experts", str(cluster))


def router_dir(run_dir):
    return os.path.join(run_dir, "router")


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path` (same extension); rename it over `path` only on success."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp{os.getpid()}{ext}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_temporaries(folder):
    """Delete what atomic_path left behind when a process was killed mid-write (call while holding the folder's lock)."""
    for path in glob.glob(os.path.join(folder, "*.tmp[0-9]*")):
        os.remove(path)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def folder_lock(folder, what):
    """Refuse a second writer of `folder` while the first runs; a lock whose process is gone (a killed run) is taken over."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "lock")
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with open(path) as f:
                host, _, pid = f.read().partition(" ")
            if host == socket.gethostname() and pid.strip().isdigit() and not _alive(int(pid)):
                os.remove(path)   # stale: its process was killed
                continue
            raise UsageError(f"{folder} is being written by another {what} (process {pid.strip()} on {host}); wait for it to "
                             f"finish, or remove {path} if that process is gone")
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    try:
        yield
    finally:
        os.remove(path)


def trim_log(path, last_step):
    """Keep only the log lines of steps up to the checkpoint's, so a killed and resumed run lists every step once."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            break   # a line cut off by a kill: nothing after it is from a completed step
    if len(keep) != len(lines):
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.writelines(keep)


def atomic_save(obj, path):
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def atomic_json(obj, path):
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)


def load_checkpoint(path, what):
    """torch.load(weights_only=True) with a one-line error for a missing or unreadable file."""
    if not os.path.isfile(path):
        raise UsageError(f"no {what} at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot read {what} {path}: {first_line(e)}")


def first_line(error):
    """An exception as one short line, also when its message is empty (EOFError) or long (torch's unpickler)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def load_clusters(run_dir, dataset=None):
    """The cluster file, checked against the data set it claims to partition."""
    path = cluster_path(run_dir)
    if not os.path.isfile(path):
        raise UsageError(f"no cluster file at {path}: run cluster.py first")
    clusters = load_checkpoint(path, "cluster file")
    if dataset is not None and clusters["data"] != dataset.fingerprint:
        raise UsageError(f"{path} was made from another data set ({describe(clusters['data'])}), "
                         f"not {describe(dataset.fingerprint)}; re-run cluster.py or pass the matching --data/--image-size")
    return clusters


def describe(fp):
    return f"{fp['name']} N={fp['n']} {'x'.join(map(str, fp['shape']))} hash={fp['hash'][:10]}"


# --- data sets ----------------------------------------------------------------------------------

class ImageSet:
    """uint8 images (N, C, H, W) with optional integer labels; `batch(idx)` gives floats in [-1, 1]."""

    def __init__(self, name, images, labels, num_classes, image_size=None, captions=None):
        self.name, self.images, self.labels, self.num_classes = name, images, labels, num_classes
        self.captions = captions   # one string per image, or None
        self.image_size = image_size or images.shape[-1]
        self.channels = images.shape[1]
        self.fingerprint = self._fingerprint()

    def __len__(self):
        return len(self.images)

    def batch(self, idx, rng=None):
        """Float images in [-1, 1], resized to image_size, for an index array (`rng`: only LatentSet draws with it)."""
        x = torch.from_numpy(np.ascontiguousarray(self.images[idx])).float() / 127.5 - 1
        if x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True, align_corners=False)
        return x

    def _fingerprint(self):
        """Identity of the data set that survives a move to another machine (no paths): name, N, shape, a hash."""
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
    """Batch number `step` of one rank's share of `indices`, as (indices, images in [-1, 1]).

    Each batch is a pure function of (seed, rank, step): the order of an epoch is the
    DistributedSampler's permutation for (seed, epoch), and the optional horizontal flips come
    from a generator seeded by (seed, rank, step). So any DataLoader worker can make any batch,
    in any order, and a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, dataset, indices, batch_size, seed, rank=0, world=1, hflip=False):
        from torch.utils.data.distributed import DistributedSampler
        self.dataset, self.indices, self.batch_size, self.seed, self.rank, self.hflip = dataset, indices, batch_size, seed, rank, hflip
        self.sampler = DistributedSampler(range(len(indices)), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.steps_per_epoch = max(1, len(self.sampler) // batch_size)
        self._epoch, self._order = None, None

    def epoch_order(self, epoch):
        if epoch != self._epoch:   # one permutation per epoch and worker
            self.sampler.set_epoch(epoch)
            self._order = np.resize(np.array(list(self.sampler)), max(len(self.sampler), self.batch_size))   # a small set repeats
            self._epoch = epoch
        return self._order

    def __getitem__(self, step):
        epoch, b = divmod(step, self.steps_per_epoch)
        idx = self.indices[self.epoch_order(epoch)[b * self.batch_size:(b + 1) * self.batch_size]]
        x = self.dataset.batch(idx, rng=np.random.default_rng([self.seed, self.rank, step, 1]))   # latents: a posterior draw
        if self.hflip:
            flip = torch.from_numpy(np.random.default_rng([self.seed, self.rank, step]).random(len(idx)) < 0.5)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return idx, x


def batch_loader(batches, start, stop, workers, pin_memory):
    """Batches start..stop-1 of a TrainingBatches, made by `workers` processes (0: on the caller's thread) ahead of use."""
    return torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(start, stop), num_workers=workers,
                                       pin_memory=pin_memory, prefetch_factor=4 if workers else None)


def load_dataset(spec, image_size=None, download=False):
    """The data set named by a --data spec (see the module docstring)."""
    kind, _, path = spec.partition(":")
    if kind in ("digits", "digits-captions") and not path:
        from sklearn.datasets import load_digits
        d = load_digits()
        images = np.round(d.images * (255 / 16)).astype(np.uint8)[:, None]      # 0..16 grey levels -> 0..255
        labels = d.target.astype(np.int64)
        captions = [digit_caption(c, i) for i, c in enumerate(labels)] if kind == "digits-captions" else None
        return ImageSet(kind, images, labels, 10, image_size, captions)
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
    raise UsageError(f"unknown data set {spec!r}: use digits, digits-captions, cifar10:PATH, imagenet64:PATH or folder:PATH")


DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGIT_PHRASES = ["a handwritten {word}", "the digit {digit}", "a drawing of the number {word}", "the number {digit}, handwritten"]


def digit_caption(label, index):
    """A caption for a digit image; the phrasing cycles with the image index, so every phrasing is seen."""
    return DIGIT_PHRASES[index % len(DIGIT_PHRASES)].format(word=DIGIT_WORDS[label], digit=label)


def caption_labels(data_spec, prompts):
    """The class label of each prompt where the data set makes its captions from labels (digits-captions), else None.

    Then samples prompted with "the digit 3" can be scored for class accuracy like class-conditional ones.
    """
    if data_spec != "digits-captions":
        return None
    known = {digit_caption(label, i): label for label in range(10) for i in range(len(DIGIT_PHRASES))}
    return [known[p] for p in prompts] if all(p in known for p in prompts) else None


class CifarUnpickler(pickle.Unpickler):
    """Unpickles only what a CIFAR-10 batch holds: dicts, lists, bytes/str, ints, and numpy arrays of plain dtypes.

    A pickle can name any callable to run while it loads; a data set comes from other people,
    so every global it names is refused except numpy's array reconstruction.
    """
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch never holds; refused without running it")


def _plain(obj):
    """True when a loaded batch holds only plain data (no object arrays smuggling other things in)."""
    if isinstance(obj, dict):
        return all(_plain(k) and _plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in "biuf"
    return isinstance(obj, (bytes, str, int, float, bool, type(None)))


def _read_cifar10(path, download):
    root = path if os.path.basename(os.path.normpath(path)) == "cifar-10-batches-py" else os.path.join(path, "cifar-10-batches-py")
    files = [os.path.join(root, f"data_batch_{i}") for i in range(1, 6)]
    if not all(os.path.isfile(f) for f in files):
        if not download:
            raise UsageError(f"no CIFAR-10 at {root} (expected data_batch_1..5); add --download to fetch it")
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
                raise ValueError(f"data {data.dtype} {data.shape} and labels {batch_labels.shape} are not CIFAR-10's")
            if batch_labels.dtype.kind not in "iu" or batch_labels.min() < 0 or batch_labels.max() > 9:
                raise ValueError("labels must be integers 0..9")
            images.append(data.reshape(-1, 3, 32, 32))
            labels.append(batch_labels.astype(np.int64))
        except Exception as e:
            raise UsageError(f"not a usable CIFAR-10 batch {f}: {first_line(e)}")
    return np.concatenate(images), np.concatenate(labels)


def _npz_member(path, key):
    """An array of an .npz, memory-mapped when the member is stored uncompressed (np.savez)."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(key + ".npy")
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as f:
                f.seek(info.header_offset)
                local = f.read(30)
                start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
                f.seek(start)
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                offset = f.tell()
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
    return np.load(path)[key]


def _read_imagenet64(path):
    files = sorted(glob.glob(os.path.join(path, "train_data_batch_*.npz"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise UsageError(f"no downsampled ImageNet at {path} (expected train_data_batch_*.npz or one .npz file)")
    images, labels = [], []
    for f in files:
        try:
            data = _npz_member(f, "data")
            side = int(round((data.shape[1] // 3) ** 0.5))
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
        raise UsageError(f"{path} holds no images in class sub-folders (expected {path}/<class>/<image>.png)")
    listed = {}
    if os.path.isfile(os.path.join(path, "captions.jsonl")):
        with open(os.path.join(path, "captions.jsonl")) as fh:
            for n, line in enumerate(fh):
                try:
                    entry = json.loads(line)
                    listed[os.path.normpath(os.path.join(path, entry["file"]))] = str(entry["text"])
                except (ValueError, KeyError, TypeError):
                    raise UsageError(f"{path}/captions.jsonl line {n + 1}: expected {{\"file\": ..., \"text\": ...}}")
    captions = []
    for f, _ in items:
        side = os.path.splitext(f)[0] + ".txt"
        captions.append(open(side).read().strip() if os.path.isfile(side) else listed.get(os.path.normpath(f)))
    if all(c is None for c in captions):
        captions = None
    elif any(c is None for c in captions):
        missing = [os.path.relpath(f, path) for (f, _), c in zip(items, captions) if c is None]
        raise UsageError(f"{len(missing)} images in {path} have no caption (e.g. {missing[0]}): add NAME.txt or a captions.jsonl entry")
    images = np.empty((len(items), 3, image_size, image_size), dtype=np.uint8)
    for n, (f, _) in enumerate(tqdm(items, desc="reading images", leave=False)):
        try:
            img = Image.open(f)
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):   # 16-bit: PIL's convert("RGB") would clip at 255
                img = Image.fromarray((np.asarray(img, dtype=np.float64) / 257).round().clip(0, 255).astype(np.uint8))
            img = img.convert("RGB")
        except Exception as e:
            raise UsageError(f"cannot read image {f}: {first_line(e)}")
        scale = image_size / min(img.size)   # resize the short side, then centre-crop
        img = img.resize((max(image_size, round(img.width * scale)), max(image_size, round(img.height * scale))), Image.BICUBIC)
        left, top = (img.width - image_size) // 2, (img.height - image_size) // 2
        images[n] = np.asarray(img.crop((left, top, left + image_size, top + image_size))).transpose(2, 0, 1)
    return images, np.array([i for _, i in items], dtype=np.int64), classes, captions


def to_uint8(x):
    """Floats in [-1, 1] (N, C, H, W) to uint8 (N, H, W, C), the ADM batch format."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def save_grid(x, path, nrow):
    """Floats in [-1, 1] as a PNG grid, written atomically."""
    from torchvision.utils import save_image
    with atomic_path(path) as tmp:
        save_image((x.clamp(-1, 1) + 1) / 2, tmp, nrow=nrow, padding=1, pad_value=1.0)
