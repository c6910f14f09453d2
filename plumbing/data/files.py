"""The on-disk formats the data sets of --data come in (data.py lists them): CIFAR-10's
pickles, read without running code from them; the IDX files of MNIST and Fashion-MNIST;
downsampled ImageNet's npz batches; and an ImageFolder tree with optional captions.
Each reader gives uint8 (N, C, H, W) images and int64 labels, and refuses a damaged or
oversized file in one line before allocating for it."""
import glob
import gzip
import json
import os
import pickle
import zipfile

import numpy as np

from plumbing.command_line import UsageError, first_line


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

def plain_object(obj):
    """True when a loaded batch holds only plain data (no object arrays smuggling other
    things in)."""
    if isinstance(obj, dict):
        return all(plain_object(k) and plain_object(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(plain_object(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in "biuf"
    return isinstance(obj, (bytes, str, int, float, bool, type(None)))

def read_cifar10(path, download):
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
            if not isinstance(batch, dict) or not plain_object(batch):
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


def idx_folder(kind, path, download):
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


def read_idx(path, dims):
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


def read_idx_set(kind, path, download):
    """((train images (N, 1, 28, 28), labels), (test images, labels)) of an IDX data
    set, every file checked."""
    folder = idx_folder(kind, path, download)
    splits = []
    for images_name, labels_name in IDX_FILES.values():
        images, labels = read_idx(os.path.join(folder, images_name),
                                   3), read_idx(os.path.join(folder, labels_name), 1)
        if len(images) != len(labels):
            raise UsageError(f"{folder}: {images_name} holds {len(images)} images but "
                             f"{labels_name} {len(labels)} labels")
        if len(labels) and labels.max() > 9:
            raise UsageError(f"{folder}/{labels_name}: label {int(labels.max())} is out "
                             "of range (0..9)")
        splits.append((np.ascontiguousarray(images[:, None]), labels.astype(np.int64)))
    return splits


def npz_member(path, key):
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

def read_imagenet64(path):
    files = sorted(glob.glob(os.path.join(path, "train_data_batch_*.npz"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise UsageError(f"no downsampled ImageNet at {path} (expected "
                         "train_data_batch_*.npz or one .npz file)")
    images, labels = [], []
    for f in files:
        try:
            data = npz_member(f, "data")
            # the format: one row of 3 x side x side bytes per image
            if data.ndim != 2 or data.dtype != np.uint8:
                raise ValueError("'data' must be uint8 rows of 3*side*side pixel bytes, "
                                 f"not {data.dtype} of shape {data.shape}")
            side = int(round((data.shape[1] // 3) ** 0.5))
            if 3 * side * side != data.shape[1] or side < 2:
                raise ValueError(f"rows of {data.shape[1]} values are not 3 x side x side pixels")
            images.append(data.reshape(-1, 3, side, side))
            file_labels = np.asarray(npz_member(f, "labels"))
            if file_labels.dtype.kind not in "iu" or file_labels.min() < 1 or file_labels.max() > 1000:
                raise ValueError("labels must be integers 1..1000 (the format is 1-based)")
            if len(file_labels) != len(data):
                raise ValueError(f"{len(data)} images but {len(file_labels)} labels")
            labels.append(file_labels.astype(np.int64) - 1)
        except (KeyError, ValueError, zipfile.BadZipFile, OSError) as e:
            raise UsageError(f"not a usable downsampled-ImageNet file {f}: {first_line(e)}")
    # One memory map stays a memory map; several are joined (uint8, never floats).
    return (images[0] if len(images) == 1 else np.concatenate(images)), np.concatenate(labels)

def caption_file(path):
    """A caption file's text: UTF-8, as the captions are embedded; anything else is one
    line."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"caption file {path} is not UTF-8 text (byte {e.start}: "
                         f"{e.reason}); save it as UTF-8")

def read_folder(path, image_size):
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
        for n, line in enumerate(caption_file(os.path.join(path, "captions.jsonl")).splitlines()):
            try:
                entry = json.loads(line)
                listed[os.path.normpath(os.path.join(path, entry["file"]))] = str(entry["text"])
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{path}/captions.jsonl line {n + 1}: expected "
                                 f"{{\"file\": ..., \"text\": ...}}")
    captions = []
    for f, _ in items:
        side = os.path.splitext(f)[0] + ".txt"
        captions.append(caption_file(side).strip() if os.path.isfile(side)
                        else listed.get(os.path.normpath(f)))
    if all(c is None for c in captions):
        captions = None
    elif any(c is None for c in captions):
        missing = [os.path.relpath(f, path) for (f, _), c in zip(items, captions) if c is None]
        raise UsageError(f"{len(missing)} images in {path} have no caption (e.g. "
                         f"{missing[0]}): add NAME.txt or a captions.jsonl entry")
    images = np.empty((len(items), 3, image_size, image_size), dtype=np.uint8)
    from plumbing.data.shards import open_image
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
