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

cluster.py --export-shards DIR writes each cluster's samples, byte for byte and in the
order of the full set, as DIR/<k>/*.tar with DIR/<k>/manifest.json. An island that
holds only DIR/<k>/ and clusters.pt trains expert k from them: `cluster_shards` checks
that they are exactly cluster k's samples (keys and content digests, both recorded in
the cluster file), and the expert's weights equal those of the same expert trained from
the full set."""
import glob
import hashlib
import io
import json
import os
import tarfile

import numpy as np
import torch
from tqdm import tqdm

from .command_line import UsageError, first_line
from .run_dir import staged

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp")
MANIFEST_FORMAT = 1
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


def cluster_record(dataset):
    """What a cluster file made from shards holds besides the assignments: every
    sample's key and content digest, so an island can check that its shards are exactly
    its cluster's samples."""
    if not isinstance(dataset, ShardSet):
        return {}
    if any("\n" in k for k in dataset.keys):
        raise UsageError(f"--data {dataset.name}: a sample key holds a line break")
    return {"keys": "\n".join(dataset.keys),
            "sample_digests": torch.from_numpy(dataset.content_digests())}


def write_shards(folder, samples, per_shard):
    """Samples ({"__key__": ..., "png": bytes, "cls": b"3", ...}) as FOLDER/000000.tar,
    ... with `per_shard` samples each; returns the shard paths."""
    paths = []
    with shard_writer(folder, per_shard, paths) as writer:
        for sample in samples:
            writer.write(sample)
    return paths


def shard_writer(folder, per_shard, written):
    """webdataset's ShardWriter into FOLDER/000000.tar, ...: members as given (bytes),
    mtime 0 so the same samples give the same files; each finished shard's path is
    appended to `written`."""
    from webdataset import ShardWriter
    os.makedirs(folder, exist_ok=True)
    return ShardWriter(os.path.join(folder, "%06d.tar"), maxcount=per_shard, verbose=0,
                       post=written.append, encoder=False, mtime=0)


def png_bytes(pixels):
    """uint8 (H, W) or (H, W, 3) pixels as PNG bytes (lossless: decoding gives them
    back)."""
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_dataset_shards(dataset, out, per_shard):
    """Any data set the project reads in memory (digits, Fashion-MNIST, a folder...) as
    a shard set OUT/000000.tar, ...: KEY.png with its pixels as stored, KEY.cls,
    KEY.txt (captions), in the data set's order. Written beside OUT and moved into
    place at the end."""
    if not hasattr(dataset, "images"):
        raise UsageError(f"--to-shards writes a data set held in memory; {dataset.name} "
                         "is already a shard set")
    def samples():
        for i in tqdm(range(len(dataset.images)), desc="writing shards", leave=False):
            pixels = np.asarray(dataset.images[i]).transpose(1, 2, 0)   # (H, W, C)
            grey = pixels.shape[2] == 1   # PNG's grey mode takes (H, W)
            sample = {"__key__": f"{i:08d}", "png": png_bytes(pixels[..., 0] if grey else pixels)}
            if dataset.labels is not None:
                sample["cls"] = str(int(dataset.labels[i])).encode()
            if getattr(dataset, "captions", None) is not None:
                sample["txt"] = dataset.captions[i].encode()
            yield sample
    with staged(out) as staging:
        paths = write_shards(staging, samples(), per_shard)
    return [os.path.join(out, os.path.basename(p)) for p in paths]


def export_shards(dataset, clusters, out, shard_size, commit=None):
    """Each cluster's samples, every member byte for byte, as OUT/<k>/000000.tar ... in
    the full set's order, with OUT/<k>/manifest.json; written beside OUT and moved into
    place at the end, so a killed export leaves no OUT. `commit()` runs once every shard
    is written, before they move into place (cluster.py saves its cluster file there)."""
    with staged(out) as staging:
        shard_files = write_cluster_shards(
            dataset, clusters["assignments"].numpy(), clusters["k"], staging, shard_size)
        for k in range(clusters["k"]):
            manifest = {"format": MANIFEST_FORMAT, "cluster": k, "k": clusters["k"],
                        "cluster_fingerprint": clusters["fingerprint"], "data": clusters["data"],
                        "data_spec": clusters["data_spec"], "size": clusters["sizes"][k],
                        "shards": shard_files[k]}
            with open(os.path.join(staging, str(k), "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
        if commit is not None:
            commit()
    return clusters["sizes"]


def write_cluster_shards(dataset, assign, k_total, folder, shard_size):
    """One pass over the shards, each sample appended to its cluster's shard set."""
    shard_files = {k: [] for k in range(k_total)}
    writers = [shard_writer(os.path.join(folder, str(k)), shard_size, shard_files[k])
               for k in range(k_total)]
    position = 0
    try:
        for path in tqdm(dataset.paths, desc="exporting shards", leave=False):
            with open(path, "rb") as f:
                for key, members in shard_samples(path):
                    writers[int(assign[position])].write(
                        {"__key__": key, **{ext: read_member(f, m) for ext, m in members.items()}})
                    position += 1
    finally:
        for w in writers:
            w.close()
    return ({k: [os.path.basename(p) for p in files] for k, files in shard_files.items()})


def cluster_shards(dataset, clusters, cluster, cluster_file):
    """Accept a shard set that is not the clustered set only where it is exactly
    cluster `cluster`'s samples in the clustered order (keys, then content digests):
    then `dataset.part_of` records the full set's fingerprint and those samples'
    positions in it."""
    if "keys" not in clusters:
        raise UsageError(f"{cluster_file} was made from {clusters['data_spec']}, not "
                         f"from shards, so it cannot check {dataset.name}: cluster the "
                         "shard set itself")
    if cluster is None or not str(cluster).isdigit() or int(cluster) >= clusters["k"]:
        raise UsageError(f"--data {dataset.name} is not the data set {cluster_file} "
                         "clustered; it can only be one cluster's exported shards, for "
                         "train_expert.py --cluster K (the router: --from-samples)")
    manifest = read_manifest(dataset.paths)
    if manifest is not None and (manifest.get("data") != clusters["data"]
                                 or manifest.get("cluster_fingerprint") != clusters["fingerprint"]):
        raise UsageError(f"--data {dataset.name} was exported from another clustering or "
                         f"data set ({(manifest.get('data') or {}).get('name')}, cluster "
                         f"fingerprint {str(manifest.get('cluster_fingerprint'))[:10]}) "
                         f"than {cluster_file}")
    k = int(cluster)
    all_keys = np.array(clusters["keys"].split("\n"))
    assign = clusters["assignments"].numpy()
    members = np.flatnonzero(assign == k)
    expected = all_keys[members]
    if len(expected) != len(dataset) or not np.array_equal(expected, dataset.keys):
        raise UsageError(mismatch(dataset, all_keys, assign, expected, k, cluster_file))
    digests = dataset.content_digests()
    wrong = np.flatnonzero(digests != clusters["sample_digests"].numpy()[members])
    if len(wrong):
        raise UsageError(f"--data {dataset.name}: sample {dataset.keys[wrong[0]]} is not "
                         f"the one {cluster_file} clustered ({len(wrong)} samples differ "
                         "in content: shards of another data set under the same keys?)")
    classes = clusters["data"].get("classes")
    if dataset.labels is not None and classes is not None:
        if dataset.labels.max() >= classes:
            raise UsageError(f"--data {dataset.name}: label {dataset.labels.max()} is "
                             f"out of range (the clustered set has {classes} classes)")
        dataset.num_classes = classes
    # the whole set's first image set its channels; this island's first may be another
    # kind
    dataset.channels = clusters["data"]["shape"][0]
    dataset.part_of = {"data": clusters["data"], "data_spec": clusters["data_spec"],
                       "indices": members}
    return dataset


def mismatch(dataset, all_keys, assign, expected, k, cluster_file):
    """Why a shard set is not cluster k's samples, in one line."""
    extra = np.setdiff1d(dataset.keys, expected)
    if len(extra):
        found = np.flatnonzero(np.isin(all_keys, extra[:1]))
        if len(found):
            return (f"--data {dataset.name} holds sample {extra[0]} of cluster "
                    f"{assign[found[0]]}, not {k} ({len(extra)} samples of other "
                    "clusters)")
        return (f"--data {dataset.name}: sample {extra[0]} is not in the data set "
                f"{cluster_file} clustered ({len(extra)} such samples: shards of another "
                "data set?)")
    missing = np.setdiff1d(expected, dataset.keys)
    if len(missing):
        return (f"--data {dataset.name} lacks {len(missing)} of cluster {k}'s "
                f"{len(expected)} samples (e.g. {missing[0]}): a shard is missing from "
                "the pattern")
    return (f"--data {dataset.name} holds cluster {k}'s samples in another order than "
            f"{cluster_file}; export them with cluster.py --export-shards")


def island_of(dataset):
    """The record `cluster_shards` left on an island's shards (the whole set's
    fingerprint and spec, and these samples' positions in it), or None for any other
    data set."""
    return getattr(dataset, "part_of", None)


def read_manifest(paths):
    folders = {os.path.dirname(os.path.abspath(p)) for p in paths}
    if len(folders) != 1:
        return None
    path = os.path.join(folders.pop(), "manifest.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not a readable manifest: {first_line(e)}")
    if not isinstance(manifest, dict) or manifest.get("format", 0) > MANIFEST_FORMAT:
        raise UsageError(f"{path} is not a shard manifest this version reads")
    return manifest
