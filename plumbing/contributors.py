"""Open contribution: experts that are not the run's k-means clusters.

A contributor trains an expert on their own data (`train_expert.py --partition NAME`),
which never leaves their machine: the expert records what it was trained on as a
fingerprint (a hash of the data set's fingerprint and the images it owned, never the
images), its size and its label counts (`membership_record`). That record is all the
others need: it refuses a name taken by other data or two experts of the same data
(`check_membership`), tells the router each expert's prior and label distribution when
it trains from the experts' samples, and tells sample.py that an expert joined after
the router was trained (ensemble.py)."""
import argparse
import hashlib
import json
import os
import re

import numpy as np

from .command_line import UsageError
from .data import load_dataset
from .latents import latent_set, resolve_vae
from .run_dir import load_checkpoint, network_folders
from .shards import island_of

# expert folders that hold one model of the whole data set, not a cluster's expert
SINGLE_MODELS = ("all", "distilled")

# A contributor's expert is named, not numbered: a letter, then letters, digits, '_', '.',
# '-'.
PARTITION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")

def partition_name(text):
    """argparse type of --partition: a name that cannot be mistaken for a cluster id or
    a single model."""
    if not PARTITION_NAME.fullmatch(text) or text in SINGLE_MODELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a partition name: a letter, then up to 63 letters, digits, "
            f"'_', '.' or '-' (not {' or '.join(SINGLE_MODELS)}; numbers are k-means "
            "clusters)")
    return text


def data_fingerprint(dataset_fingerprint, indices):
    """What an expert was trained on, as a hash of its data set's fingerprint and the
    images it owned: never the data."""
    h = hashlib.sha1(json.dumps(dataset_fingerprint, sort_keys=True).encode())
    h.update(np.sort(np.asarray(indices, dtype=np.int64)).tobytes())
    return h.hexdigest()


def expert_record(name, dataset, indices):
    """An expert's record of what it was trained on: its name, data fingerprint, size
    and label counts (None unlabelled)."""
    counts = None if dataset.labels is None else np.bincount(
        dataset.labels[indices], minlength=dataset.num_classes).tolist()
    island = island_of(dataset)   # an island's shards name their samples in the whole set
    whole, positions = (island["data"], island["indices"][indices]) if island else \
        (dataset.fingerprint, indices)
    return {"name": name, "trained_on": data_fingerprint(whole, positions),
            "size": len(indices), "label_counts": counts}


def membership(config):
    """(name, data fingerprint or None) of an expert: checkpoints before open
    contribution know only their cluster id."""
    member = config.get("member") or {}
    return member.get("name", str(config.get("cluster"))), member.get("trained_on")


def contributed(network):
    return (network.config.get("member") or {}).get("origin") == "contributed"


def contributed_data(partition, classes, data, image_size, vae, run_dir, download, device):
    """(data set, indices) of --partition: the contributor's own data set (optionally
    some of its classes); no cluster file is read."""
    dataset = load_dataset(data or "digits", image_size, download)
    autoencoder = resolve_vae(vae, None, download, device)
    if autoencoder is not None:
        dataset = latent_set(dataset, autoencoder, run_dir)
    indices = np.arange(len(dataset))
    if classes is not None:
        if dataset.labels is None:
            raise UsageError(f"--classes: {dataset.name} has no labels")
        unknown = [c for c in classes if c >= dataset.num_classes]
        if unknown:
            raise UsageError(f"--classes {','.join(map(str, unknown))}: {dataset.name} "
                             f"has classes 0..{dataset.num_classes - 1}")
        indices = np.flatnonzero(np.isin(dataset.labels, classes))
    if len(indices) < 8:
        raise UsageError(f"partition {partition} has {len(indices)} images, too few to "
                         "train an expert")
    return dataset, indices


def membership_record(name, partition, classes, dataset, indices):
    """Who this expert is in an ensemble: its name, where its data came from, and what
    it was trained on as a fingerprint (a hash of the data set's fingerprint and the
    owned indices, never the images); the size and label counts give a router trained
    from the experts' samples each expert's prior and condition distribution."""
    origin = "contributed" if partition else "single" if name == "all" else "cluster"
    return {**expert_record(name, dataset, indices), "origin": origin, "classes": classes}


def check_membership(partition, out_dir, run_dir, record):
    """A partition name names one contributor's data, and no two experts of a run are
    trained on the same data (a cluster's expert retrained as a variant, in another
    --out-dir, is fine)."""
    held = os.path.join(out_dir, "ckpt.pt")
    if os.path.isfile(held):
        theirs = (load_checkpoint(held, "checkpoint").get("config") or {}).get("member") or {}
        if theirs.get("trained_on") != record["trained_on"]:
            raise UsageError(f"partition {partition} is taken: {held} holds an expert "
                             f"trained on other data ({theirs.get('size')} images, "
                             f"fingerprint {str(theirs.get('trained_on'))[:10]}); choose "
                             "another --partition name")
    for other in network_folders(os.path.join(run_dir, "experts")).values():
        if os.path.realpath(os.path.dirname(other)) == os.path.realpath(out_dir):
            continue
        theirs = (load_checkpoint(other, "checkpoint").get("config") or {}).get("member") or {}
        if theirs.get("origin") in ("cluster", "contributed") and theirs.get("trained_on") == record["trained_on"]:
            raise UsageError(f"{other} was trained on exactly these data (fingerprint "
                             f"{record['trained_on'][:10]}): an ensemble's experts each "
                             "model their own share; train on other data, or resume that "
                             "expert")


def contributors(run_dir):
    """{name: checkpoint config} of the contributors' experts in runs/experts/ (named, trained with
    --partition)."""
    found = {}
    for name, path in network_folders(os.path.join(run_dir, "experts")).items():
        if not name.isdigit() and PARTITION_NAME.fullmatch(name):
            config = load_checkpoint(path, f"expert {name}").get("config") or {}
            if (config.get("member") or {}).get("origin") == "contributed":
                found[name] = config
    return dict(sorted(found.items()))   # ensemble.ordered: contributors by name


def contributor_data(name, config, shape, download):
    """A contributor's data set and owned indices, re-read here from the spec they
    recorded and checked by fingerprint."""
    member, hint = config["member"], "train the router from the experts' samples instead (--from-samples N)"
    if config.get("vae"):
        raise UsageError(f"expert {name} was trained in a VAE's latents; the data router "
                         f"reads contributors' data in pixels only: {hint}")
    try:
        dataset = load_dataset(config["data_spec"], config["data"]["shape"][-1], download)
    except UsageError as e:
        raise UsageError(f"expert {name}'s data ({config['data_spec']}) cannot be read "
                         f"here ({e}): {hint}")
    classes = member.get("classes")
    owned = np.arange(len(dataset)) if classes is None else np.flatnonzero(np.isin(dataset.labels, classes))
    if data_fingerprint(dataset.fingerprint, owned) != member["trained_on"]:
        raise UsageError(f"expert {name}'s data ({config['data_spec']}) here are not the "
                         f"data it was trained on (fingerprints differ): {hint}")
    if [dataset.channels, dataset.image_size, dataset.image_size] != list(shape):
        raise UsageError(f"expert {name} was trained on "
                         f"{dataset.channels}x{dataset.image_size}x{dataset.image_size} "
                         f"images, the others on {'x'.join(map(str, shape))}")
    return dataset, owned
