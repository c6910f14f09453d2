"""The runs/ folder: where every stage reads and writes, and how it writes so that nothing
is lost.

The layout (every stage reads and writes only these):
  runs/clusters.pt            cluster.py: assignments, centroids, K, feature spec, data fingerprint
  runs/clusters.png           cluster.py: a row of examples per cluster
  runs/features/KEY.npy       features.py (cluster.py): cached features, KEY hashes data set + feature spec
  runs/latents/KEY.npy        latents.py (--vae): the data set's VAE posterior (mean, std), KEY hashes data set + VAE
  runs/text/KEY.pt            encoders.py: cached caption embeddings, with the encoder spec they were made with
  runs/experts/<k>/           train_expert.py: ckpt.pt, log.jsonl, samples PNGs (<k> = 'all' for the monolith);
                              `lock` while a trainer writes there
  runs/router/                train_router.py: ckpt.pt, log.jsonl, accuracy.json
  (a release, export.py, has the same experts/<k>/ and router/ with config.json and safetensors weights
   in place of ckpt.pt: it is read as a run folder)
  runs/samples/NAME.npz       sample.py: arr_0 uint8 NHWC, arr_1 labels, run_id; NAME.png and
                              NAME.json (the same run_id) beside it
  runs/eval/                  eval.py: the cached classifier and reference statistics

Every file is written under a temporary name and renamed into place (`atomic_path`), a
folder being trained in is held by a lock file (`folder_lock`), checkpoints are read with
`torch.load(weights_only=True)` only (they come from other people's machines). Which
checkpoint a run may resume is training's question (training/plan.py)."""
import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile

import torch

from plumbing.command_line import UsageError, first_line


def cache_key(what, digits=16):
    """A cache file's name from everything its content depends on (JSON-able): another
    input, another file."""
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:digits]


def check_writable_dir(path, what):
    """Refuse before any work when `path` cannot hold our files: an empty name, a dangling
    link or a file where it or a parent must be a folder, or a file system that refuses a
    write there (probed by writing a file and removing it)."""
    if not str(path).strip():
        raise UsageError(f"{what}: an empty name; give a folder")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        if os.path.islink(probe):
            raise UsageError(f"{what} {path}: {probe} is a link to {os.readlink(probe)}, which "
                             "does not exist")
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{what} {path}: {probe} is a file, not a folder")
    try:
        handle, name = tempfile.mkstemp(dir=probe, prefix=".ddm-probe-")
        os.close(handle)
        os.remove(name)
    except OSError as e:
        raise UsageError(f"{what} {path}: {probe} refuses a write ({e.strerror})")


def cluster_path(run_dir):
    return os.path.join(run_dir, "clusters.pt")

def expert_dir(run_dir, cluster):
    return os.path.join(run_dir, "experts", str(cluster))

def router_dir(run_dir):
    return os.path.join(run_dir, "router")

# what a network folder holds: a training checkpoint, or a released network (release.py:
# config.json beside its safetensors weights), which every stage reads in its place
NETWORK_FILES = ("ckpt.pt", "config.json")

def network_path(folder):
    """The file a network folder is read from (its ckpt.pt, else a release's
    config.json), or None."""
    return next((os.path.join(folder, name) for name in NETWORK_FILES
                 if os.path.isfile(os.path.join(folder, name))), None)

def network_file_set(path):
    """The files that make up the network at `path` (a checkpoint file, or a folder:
    its ckpt.pt, else a release's config.json and weights), for a digest that changes
    whenever the network does."""
    if not os.path.isdir(path):
        return [path]
    found = network_path(path)
    if found is None or found.endswith(".pt"):
        return [found or os.path.join(path, "ckpt.pt")]
    return [found] + sorted(glob.glob(os.path.join(path, "*.safetensors")))

def check_not_released(folder):
    """Nothing writes a network beside a released one: its config.json would win over the
    new ckpt.pt (network_path), and the release would no longer be what it says."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        raise UsageError(f"{folder} holds a released network: write into another folder")


def network_folders(parent):
    """{folder name: network file} of the networks in the folders under `parent` (e.g.
    runs/experts), by name."""
    names = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    return {name: path for name in names
            if (path := network_path(os.path.join(parent, name))) is not None}


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path` (same extension); rename it over `path`
    only on success."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    remove_dead_temporaries(os.path.dirname(os.path.abspath(path)))
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp-{writer()}{ext}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_safetensors(tensors, path, metadata=None):
    """Tensors written as a safetensors file whole or not at all. safetensors' own save_file
    stages the file under a name of its own (.tmpXXXXXX), which a killed writer leaves
    behind and no one removes; serialised in memory instead, the bytes go through
    atomic_path, whose temporaries the next writer clears."""
    from safetensors.torch import save
    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def writer():
    """HOST-PID: who writes a temporary. A run folder may be shared between machines (an
    island's, a cluster's file system), where a process id means something only on the
    host that gave it."""
    return f"{re.sub(r'[^A-Za-z0-9-]', '-', socket.gethostname())}-{os.getpid()}"


# atomic_path's NAME.tmp-HOST-PID.EXT, staged's OUT.partial-HOST-PID
TEMPORARY = re.compile(r"\.(?:tmp|partial)-(?P<host>[A-Za-z0-9-]+)-(?P<pid>\d+)(\.[^./]*)?$")


def dead_writer(name):
    """Whether the temporary `name` was left by a process of this host that is gone: one
    of another host, or of a live process, is another writer's, and never ours to delete."""
    found = TEMPORARY.search(name)
    if found is None:
        return False
    here = writer().rpartition("-")[0]
    return found.group("host") == here and not process_alive(int(found.group("pid")))


def remove_dead_temporaries(folder):
    """Delete what atomic_path left behind when its process was killed mid-write: every
    writer calls this (atomic_path does, for the folder it writes to)."""
    for path in glob.glob(os.path.join(glob.escape(folder), "*.tmp-*")):
        if dead_writer(os.path.basename(path)):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.remove(path)


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):   # gone, or never a process id
        return False
    except PermissionError:
        return True
    return True

@contextlib.contextmanager
def folder_lock(folder, what):
    """Refuse a second writer of `folder` while the first runs; a lock whose process is
    gone (a killed run) is taken over, and its half-written files are removed."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "lock")
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with open(path) as f:
                host, _, pid = f.read().partition(" ")
            if host == socket.gethostname() and pid.strip().isdigit() and not process_alive(int(pid)):
                os.remove(path)   # stale: its process was killed
                continue
            raise UsageError(f"{folder} is being written by another {what} (process "
                             f"{pid.strip()} on {host}); wait for it to finish, or "
                             f"remove {path} if that process is gone")
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    remove_dead_temporaries(folder)
    try:
        yield
    finally:
        os.remove(path)

def trim_log(path, last_step):
    """Keep only the log lines of steps up to the checkpoint's, so a killed and resumed
    run lists every step once."""
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
    """Standard JSON, which any reader parses: a value that is not a finite number (a
    monolith's router share, an interval over one seed) is written as null."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(finite_or_null(obj), f, indent=1, allow_nan=False)


def finite_or_null(obj):
    """OBJ with every NaN or infinity replaced by None: Python's json would write them as
    NaN/Infinity, which are not JSON (RFC 8259): JavaScript's JSON.parse refuses them, and
    other parsers differ (jq 1.6 reads NaN as null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_or_null(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(value) for value in obj]
    return obj

def load_checkpoint(path, what):
    """torch.load(weights_only=True) with a one-line error for a missing or unreadable
    file. (A network that may be a released one: checkpoint.read_network_file.)"""
    if not os.path.isfile(path):
        raise UsageError(f"no {what} at {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot read {what} {path}: {first_line(e)}")
    # every file a stage writes, and an official DiT state dict, is a dict
    if not isinstance(obj, dict):
        raise UsageError(f"{what} {path} holds a {type(obj).__name__}, not a checkpoint "
                         "(a dict of weights and settings)")
    return obj

def save_grid(x, path, nrow):
    """Floats in [-1, 1] as a PNG grid, written atomically."""
    from torchvision.utils import save_image
    with atomic_path(path) as tmp:
        save_image((x.clamp(-1, 1) + 1) / 2, tmp, nrow=nrow, padding=1, pad_value=1.0)


@contextlib.contextmanager
def staged(out, flag):
    """A folder written beside OUT and moved into place whole when the block ends, so a
    killed writer leaves no OUT; OUT may exist only as an empty folder."""
    check_new_folder(out, flag)
    base = os.path.abspath(out).rstrip("/")
    for leftover in glob.glob(glob.escape(base) + ".partial-*"):   # a dead writer's of this host
        if dead_writer(os.path.basename(leftover)):
            shutil.rmtree(leftover, ignore_errors=True)
    staging = f"{base}.partial-{writer()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_new_folder(out, flag):
    """Refuse, before any work, an output folder (`flag` names it) that is not new or
    empty, is a link, or lies where nothing can be written."""
    if not str(out).strip():
        raise UsageError(f"{flag}: an empty name; give a folder")
    if os.path.islink(out):
        raise UsageError(f"{flag} {out} is a link; give the folder itself")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{flag} {out} is not an empty folder; choose a new one")
    check_writable_dir(os.path.dirname(os.path.abspath(out)), flag)
