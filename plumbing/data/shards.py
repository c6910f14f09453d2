"""Sharded data sets (`--data wds:PATTERN`) and the per-cluster shard sets an island
trains from.

A shard set is what img2dataset and webdataset write: tar files whose members are grouped
into samples by key. `00001234.jpg`, `00001234.cls`, `00001234.txt` are one sample, key
`00001234`: its image (jpg, jpeg, png, webp, ppm, pgm or bmp), its class label (`.cls`, an
integer) and its caption (`.txt`), where present; other members (`.json`) travel along but
are not read. PATTERN is a brace pattern, a glob, or both (`data/{00000..00099}.tar`,
`shards/2/*.tar`); the shards are read in sorted order and a sample's position is its
place in that order.

Reading by position: webdataset 1.0 streams shards front to back and no longer ships its
indexed reader (wids, whose memory-mapped header parser also skips the tar headers'
checksums, so a truncated shard would read as garbage). Python's tarfile checks every
header: each shard is indexed once (where each sample's image starts and how long it is),
and a sample is one seek and one read. So a batch is still a pure function of (seed, rank,
step), as for the in-memory sets. webdataset writes the shards (`ShardWriter`) and splits
a member's name into key and extension as it does, so the files here are its files.

Memory: the index holds a key, an offset, a length, a label and (cluster.py, islands) a
digest per sample, about 50 bytes; the pixels stay in the shards. Images are decoded one
batch at a time, resized (short side) and centre-cropped to the set's side; the first
image sets the channels (grey: 1, anything else: 3).

Writing shards and the islands made of them: islands.py."""
import glob
import hashlib
import io
import os
import tarfile

import numpy as np
import torch
from tqdm import tqdm

from plumbing.command_line import UsageError, first_line

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp")
MAX_SHARDS = 100_000


def shard_paths(pattern):
    """The shards a PATTERN names, sorted: brace-expanded, then globbed."""
    from braceexpand import braceexpand
    paths = set()
    for n, part in enumerate(braceexpand(pattern)):
        if n >= MAX_SHARDS:   # the expansion is lazy: a typo's million names stop here
            raise UsageError(f"--data wds:{pattern} names more than {MAX_SHARDS:,} shards")
        paths.update(sorted(glob.glob(part)) if glob.has_magic(part) else [part])
    missing = sorted(p for p in paths if not os.path.isfile(p))
    if not paths or missing:
        raise UsageError(f"--data wds:{pattern}: no shard at {missing[0] if missing else pattern}")
    return sorted(paths)


def sample_digest(members):
    """A sample's content as 8 bytes: every member (extension and bytes), in name
    order."""
    h = hashlib.sha1()
    for ext in sorted(members):
        h.update(ext.encode() + b"\0" + len(members[ext]).to_bytes(8, "little") + members[ext])
    return np.frombuffer(h.digest()[:8], dtype="<i8")[0]


# larger images are refused from their header, before any pixel is decoded: a small
# compressed file can claim gigabytes of pixels
MAX_IMAGE_SIDE = 4096
# ImageNet-21k has 21,841 classes; far beyond that a label is damage
MAX_CLASSES = 100_000


def open_image(source, what):
    """A PIL image, decoded only once its header's size is checked."""
    from PIL import Image
    try:
        img = Image.open(source)
        if max(img.size) > MAX_IMAGE_SIDE:
            raise UsageError(f"{what}: {img.width}x{img.height} pixels; images larger "
                             f"than {MAX_IMAGE_SIDE} on a side are refused before "
                             "decoding")
        img.load()
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{what}: {first_line(e)}")
    return img


def plain_name(path, name):
    """A member's name is used as a path when its shard is exported or extracted: only
    a plain relative name in UTF-8 passes (no absolute path, no '..')."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"shard {path}: a member's name is not UTF-8 ({name!r})")
    if name.startswith("/") or ".." in name.split("/") or "\\" in name:
        raise UsageError(f"shard {path}: member {name!r} is not a plain relative name")


def shard_samples(path):
    """Yield (key, {extension: tarfile member}) for each sample of one shard, in order;
    a truncated shard, a key seen twice, a sample without exactly one image are
    one-line errors."""
    size = os.path.getsize(path)
    try:
        tar = tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as e:
        raise UsageError(f"shard {path} is not a readable tar file: {first_line(e)}")
    from webdataset.tariterators import base_plus_ext
    key, members, seen = None, {}, set()
    with tar:
        try:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise UsageError(f"shard {path} is truncated: {member.name} needs "
                                     f"bytes up to {member.offset_data + member.size}, "
                                     f"the file has {size}")
                plain_name(path, member.name)
                name_key, ext = base_plus_ext(member.name)
                if name_key is None:
                    continue
                if name_key != key:
                    if key is not None:
                        yield key, checked(path, key, members)
                    if name_key in seen:
                        raise UsageError(f"shard {path}: key {name_key} appears twice")
                    key, members = name_key, {}
                    seen.add(key)
                if ext in members:
                    raise UsageError(f"shard {path}: key {key} holds {key}.{ext} twice")
                members[ext] = member
        except tarfile.TarError as e:
            raise UsageError(f"shard {path} is damaged or truncated: {first_line(e)}")
        if key is not None:
            yield key, checked(path, key, members)


def image_extensions(members):
    return [ext for ext in members if ext.lower() in IMAGE_EXTENSIONS]


def checked(path, key, members):
    images = image_extensions(members)
    if len(images) != 1:
        raise UsageError(f"shard {path}: sample {key} has {len(images) or 'no'} images "
                         f"({', '.join(sorted(members))}); every sample needs exactly "
                         "one")
    return members


def read_member(tar_file, member):
    tar_file.seek(member.offset_data)
    return tar_file.read(member.size)


class ShardSet:
    """A WebDataset shard set read by position, with the in-memory sets' interface
    (data.ImageSet): `batch(idx)` gives floats in [-1, 1], `labels`, `captions`,
    `num_classes`, `fingerprint`."""
    bounded = True

    def __init__(self, spec, image_size=None):
        self.name = spec
        self.paths = shard_paths(spec.partition(":")[2])
        self.test, self.part_of = None, None
        self._open, self._pid = {}, os.getpid()   # path -> file descriptor, per process
        self._index()
        first = self._decode(0, None)
        self.channels = 1 if first.mode in ("1", "L", "LA", "I", "I;16") else 3
        self.image_size = image_size or min(first.size)
        self.fingerprint = self._fingerprint()

    def _index(self):
        keys, shard, offset, length, labels, captions = [], [], [], [], [], []
        for s, path in enumerate(tqdm(self.paths, desc="indexing shards", leave=False)):
            with open(path, "rb") as f:
                for key, members in shard_samples(path):
                    image = members[image_extensions(members)[0]]
                    keys.append(key)
                    shard.append(s)
                    offset.append(image.offset_data)
                    length.append(image.size)
                    if "cls" in members:
                        labels.append(parse_label(path, key, read_member(f, members["cls"])))
                    if "txt" in members:
                        captions.append(caption_text(path, key, read_member(f, members["txt"])))
        n = len(keys)
        if n == 0:
            raise UsageError(f"--data {self.name}: the shards hold no samples")
        for what, found in (("a class label (.cls)", labels), ("a caption (.txt)", captions)):
            if 0 < len(found) < n:
                raise UsageError(f"--data {self.name}: {len(found)} of {n} samples have "
                                 f"{what}; give every sample one, or none")
        self.keys = np.array(keys)
        self.shard, self.offset = np.array(shard, np.int32), np.array(offset, np.int64)
        self.length = np.array(length, np.int64)
        self.labels = np.array(labels, np.int64) if labels else None
        self.num_classes = int(self.labels.max()) + 1 if labels else None
        self.captions = captions or None
        self.digests = None   # content_digests() reads every byte once, where it is needed
        duplicate = first_duplicate(self.keys)
        if duplicate is not None:
            shards = sorted({self.paths[s] for s in self.shard[self.keys == duplicate]})
            raise UsageError(f"--data {self.name}: key {duplicate} appears twice (in "
                             f"{', '.join(shards)})")

    def __len__(self):
        return len(self.keys)

    def content_digests(self):
        """Every sample's `sample_digest`: one pass over all the shards' bytes
        (cluster.py, and an island checking its shards)."""
        if self.digests is None:
            digests = []
            for path in tqdm(self.paths, desc="hashing samples", leave=False):
                with open(path, "rb") as f:
                    for _, members in shard_samples(path):
                        sample = {ext: read_member(f, m) for ext, m in members.items()}
                        digests.append(sample_digest(sample))
            self.digests = np.array(digests, np.int64)
        return self.digests

    def __getstate__(self):   # open files stay with their process
        return {**self.__dict__, "_open": {}, "_pid": None}

    def _bytes(self, i):
        # os.pread: forked DataLoader workers share the parent's open files, and with them
        # a file offset that a seek in one worker would move under another's read
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        path = self.paths[self.shard[i]]
        if path not in self._open:
            if len(self._open) >= 16:
                os.close(self._open.pop(next(iter(self._open))))
            self._open[path] = os.open(path, os.O_RDONLY)
        return os.pread(self._open[path], int(self.length[i]), int(self.offset[i]))

    def _decode(self, i, side):
        from PIL import Image
        what = f"sample {self.keys[i]} of {self.paths[self.shard[i]]}: cannot decode its image"
        img = open_image(io.BytesIO(self._bytes(i)), what)
        if side is None:
            return img
        img = img.convert("L" if self.channels == 1 else "RGB")
        if img.size != (side, side):   # the short side to `side`, then the centre
            scale = side / min(img.size)
            img = img.resize((max(side, round(img.width * scale)),
                              max(side, round(img.height * scale))), Image.BICUBIC)
            left, top = (img.width - side) // 2, (img.height - side) // 2
            img = img.crop((left, top, left + side, top + side))
        return img

    def uint8(self, idx):
        """The images at positions `idx` as uint8 (n, C, H, W)."""
        out = np.empty((len(idx), self.channels, self.image_size, self.image_size), np.uint8)
        for n, i in enumerate(np.asarray(idx).reshape(-1)):
            pixels = np.asarray(self._decode(int(i), self.image_size))
            out[n] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return out

    def batch(self, idx, rng=None):
        return torch.from_numpy(self.uint8(idx)).float() / 127.5 - 1

    def _fingerprint(self):
        """Keys, image lengths, labels and captions of every sample, and the bytes of a
        strided sample of images: cheap (the index already holds the rest), and no
        paths."""
        h = hashlib.sha1("\n".join(self.keys).encode())
        h.update(self.length.tobytes())
        if self.labels is not None:
            h.update(self.labels.tobytes())
        if self.captions is not None:
            h.update("\n".join(self.captions).encode())
        for i in range(0, len(self), max(1, len(self) // 256)):
            h.update(self._bytes(i))
        shape = [self.channels, self.image_size, self.image_size]
        return {"name": "wds", "n": len(self), "shape": shape,
                "hash": h.hexdigest(), "classes": self.num_classes}


def parse_label(path, key, raw):
    text = raw.decode("utf-8", "replace").strip()
    # a label sizes the label table: a huge one would allocate before any other check
    if not (text.isascii() and text.isdigit()) or int(text) >= MAX_CLASSES:
        raise UsageError(f"shard {path}: sample {key}'s label {text[:20]!r} is out of "
                         "range (a class label is an integer 0, 1, 2, ... below "
                         f"{MAX_CLASSES})")
    return int(text)


def caption_text(path, key, raw):
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise UsageError(f"shard {path}: sample {key}'s caption is not UTF-8 (byte {e.start})")


def first_duplicate(keys):
    ordered = np.sort(keys)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return str(ordered[same[0]]) if len(same) else None
