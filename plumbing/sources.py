"""Where an expert's images come from, as objects: a k-means cluster of the run's data set
(`Cluster`; 'all' is the monolith's), an island's shards of one cluster (`Island`), or a
contributor's own data (`Contribution`). Each knows its images (`dataset`), which of them
it owns (`indices`), what a checkpoint records of them (`record`) and who it is in an
ensemble (`member`), and refuses a claim on data another expert holds (`claim`); the stages
ask, and never branch on the kind.

A contributor trains an expert on their own data (`train_expert.py --contribution NAME`),
which never leaves their machine: the expert records what it was trained on as a
fingerprint (a hash of the data set's fingerprint and the images it owned, never the
images), its size and its label counts. That record is all the others need: it refuses a
name taken by other data or two experts of the same data (`Contribution.claim`), tells the
router each expert's prior and label distribution when it trains from the experts'
samples, and tells sample.py that an expert joined after the router was trained
(ensemble.py)."""
import hashlib
import json
import os

import numpy as np
import torch

from plumbing.command_line import CONTRIBUTION_NAME, SINGLE_MODELS, UsageError
from plumbing.data.datasets import DEFAULT_DATA, DataFlags, describe, load_dataset
from plumbing.data.islands import cluster_shards
from plumbing.data.latents import latent_set, resolve_vae
from plumbing.checkpoint import read_network_file
from plumbing.run_dir import cluster_path, load_checkpoint, network_folders
from plumbing.data.shards import ShardSet

# fewer images than this cannot fill an expert's first batches
MIN_IMAGES = 8


class Cluster:
    """Cluster `name` of the data set RUN_DIR/clusters.pt was made from, in the VAE's
    latents where the cluster file records one ('all': every image, the monolith's)."""
    origin = "cluster"
    classes = None
    # what a source too small to train on is called, and what to do about it
    too_few = ("cluster", " (re-run cluster.py with --min-size)")

    def __init__(self, name, clusters, dataset, data_flag=None):
        self.name, self.clusters, self.dataset = name, clusters, dataset
        self.data_flag = data_flag
        self.indices = self.owned()
        if len(self.indices) < MIN_IMAGES:
            word, hint = self.too_few
            raise UsageError(f"{word} {name} has {len(self.indices)} images, too few to "
                             f"train an expert{hint}")
        if name in SINGLE_MODELS:
            self.origin = "single"

    def owned(self):
        if self.name in SINGLE_MODELS:   # the monolith, the distilled student: every image
            return np.arange(len(self.dataset))
        if str(int(self.name)) != self.name or int(self.name) >= self.clusters["k"]:
            raise UsageError(f"unknown cluster {self.name!r}: valid ones are "
                             + ", ".join(map(str, range(self.clusters["k"]))) + ", all")
        return np.flatnonzero(self.clusters["assignments"].numpy() == int(self.name))

    @property
    def whole(self):
        """(fingerprint, spec) of the data set the indices are positions in."""
        return self.dataset.fingerprint, self.clusters.get("data_spec")

    def record(self):
        """What a checkpoint records of the images it was trained on."""
        data, spec = self.whole
        return {"image_size": self.dataset.image_size, "channels": self.dataset.channels,
                "cluster": self.name, "k": self.clusters["k"] if self.clusters else None,
                "data": data, "data_spec": self.data_flag or spec, "island_data": None,
                "cluster_size": len(self.indices)}

    def member(self):
        """Who this expert is in an ensemble: its name, where its data came from, and what
        it was trained on as a fingerprint (never the images); the size and label counts
        give a router trained from the experts' samples each expert's prior and condition
        distribution."""
        return {**expert_record(self.name, self.dataset, self.indices), "origin": self.origin,
                "classes": self.classes}

    def claim(self, out_dir, run_dir):
        """The folder is this expert's: one that holds an expert trained on other data is
        taken (a resume continues the same data's expert only)."""
        held = os.path.join(out_dir, "ckpt.pt")
        if os.path.isfile(held):
            theirs = recorded_member(held)
            if theirs.get("trained_on") not in (None, self.member()["trained_on"]):
                raise UsageError(f"{self.taken(held)}: {held} holds an expert trained on "
                                 f"other data ({theirs.get('size')} images, fingerprint "
                                 f"{str(theirs.get('trained_on'))[:10]})")

    def taken(self, held):
        return f"{os.path.dirname(held)} is taken; choose another --out-dir"


class Island(Cluster):
    """An island's shards: exactly cluster `name`'s samples of the data set the cluster
    file was made from (islands.cluster_shards checked them), so every image is owned and
    the record names the whole set they are part of."""

    def owned(self):
        return np.arange(len(self.dataset))

    @property
    def whole(self):
        island = island_of(self.dataset)
        return island["data"], island["data_spec"]

    def record(self):
        return {**super().record(), "data_spec": self.whole[1], "island_data": self.data_flag}


class Contribution(Cluster):
    """A contributor's own data set (`--contribution NAME`, optionally some of its classes):
    no cluster file is read, and no other expert may hold the same data or the name."""
    origin = "contributed"
    too_few = ("contribution", "")

    def __init__(self, name, dataset, classes, data_flag):
        if classes is not None and dataset.labels is None:
            raise UsageError(f"--classes: {dataset.name} has no labels")
        unknown = [c for c in classes or [] if c >= dataset.num_classes]
        if unknown:
            raise UsageError(f"--classes {','.join(map(str, unknown))}: {dataset.name} "
                             f"has classes 0..{dataset.num_classes - 1}")
        self.classes = classes
        super().__init__(name, None, dataset, data_flag)

    def owned(self):
        return owned_classes(self.dataset, self.classes)

    @property
    def whole(self):
        return self.dataset.fingerprint, self.data_flag

    @classmethod
    def recorded(cls, name, config, shape, download):
        """A contributor's data as their expert recorded it, re-read on this machine (the
        data router's) and checked by fingerprint and image shape."""
        member = config["member"]
        hint = "train the router from the experts' samples instead (--from-samples N)"
        if config.get("vae"):
            raise UsageError(f"expert {name} was trained in a VAE's latents; the data router "
                             f"reads contributors' data in pixels only: {hint}")
        try:
            dataset = load_dataset(config["data_spec"], config["data"]["shape"][-1], download)
        except UsageError as e:
            raise UsageError(f"expert {name}'s data ({config['data_spec']}) cannot be read "
                             f"here ({e}): {hint}")
        owned = owned_classes(dataset, member.get("classes"))
        if data_fingerprint(dataset.fingerprint, owned) != member["trained_on"]:
            raise UsageError(f"expert {name}'s data ({config['data_spec']}) here are not the "
                             f"data it was trained on (fingerprints differ): {hint}")
        if [dataset.channels, dataset.image_size, dataset.image_size] != list(shape):
            raise UsageError(f"expert {name} was trained on "
                             f"{dataset.channels}x{dataset.image_size}x{dataset.image_size} "
                             f"images, the others on {'x'.join(map(str, shape))}")
        return cls(name, dataset, member.get("classes"), config["data_spec"])

    def claim(self, out_dir, run_dir):
        """A contribution name names one contributor's data (Cluster.claim), and no two
        experts of a run are trained on the same data (a cluster's expert retrained as a
        variant, in another --out-dir, is fine)."""
        super().claim(out_dir, run_dir)
        trained_on = self.member()["trained_on"]
        for other in network_folders(os.path.join(run_dir, "experts")).values():
            if os.path.realpath(os.path.dirname(other)) == os.path.realpath(out_dir):
                continue
            theirs = recorded_member(other)
            if theirs.get("origin") in ("cluster", "contributed") and \
                    theirs.get("trained_on") == trained_on:
                raise UsageError(f"{other} was trained on exactly these data (fingerprint "
                                 f"{trained_on[:10]}): an ensemble's experts each model "
                                 "their own share; train on other data, or resume that "
                                 "expert")

    def taken(self, held):
        return f"contribution {self.name} is taken; choose another --contribution name"


def expert_source(name, run_dir, flags, device, *, contribution=False, classes=None):
    """The images an expert trains on: k-means cluster `name` of the run's data (or its
    island's shards), or, a `contribution`, the contributor's own --data (`classes` of
    it; the embedded default where no --data is given, as cluster.py's)."""
    if contribution:
        spec = flags.spec or DEFAULT_DATA
        dataset = load_dataset(spec, flags.image_size, flags.download)
        dataset = in_latents(dataset, flags, None, run_dir, device)
        return Contribution(name, dataset, classes, spec)
    clusters, dataset = clustered_data(run_dir, flags, device=device, cluster=name)
    return (Island if island_of(dataset) else Cluster)(name, clusters, dataset, flags.spec)


def clustered_data(run_dir, flags=DataFlags(), *, device="cpu", cluster=None):
    """(cluster file, data set) of a run: the data set the cluster file was made from
    (or flags.spec at flags.image_size), checked against its fingerprint, in the VAE's
    latents where the cluster file records one (or flags.vae names one). An island's
    shards of one `cluster` stand for the data set where they are exactly that
    cluster's samples (islands.cluster_shards)."""
    clusters = load_clusters(run_dir)
    side = clusters["data"]["shape"][-1]
    if flags.image_size and flags.image_size != side:   # other pixels are other data
        raise UsageError(f"--image-size {flags.image_size}: {cluster_path(run_dir)} was made "
                         f"from another data set, {side}-pixel images; experts and routers "
                         "read them at that size (drop --image-size)")
    dataset = load_dataset(flags.spec or clusters["data_spec"], side, flags.download)
    if isinstance(dataset, ShardSet) and dataset.fingerprint != clusters["data"]:
        cluster_shards(dataset, clusters, cluster, cluster_path(run_dir))
    else:
        check_made_from(clusters, dataset, cluster_path(run_dir))
    return clusters, in_latents(dataset, flags, clusters.get("vae"), run_dir, device)


def in_latents(dataset, flags, recorded, run_dir, device):
    """The data set in the VAE's latents where --vae names one or a file records one
    (`recorded`), else in pixels (a pixel run never loads the latent code)."""
    if flags.vae is None and recorded is None:
        return dataset
    vae = resolve_vae(flags.vae, recorded, flags.download, device)
    return latent_set(dataset, vae, run_dir)


def load_clusters(run_dir, dataset=None):
    """The cluster file, checked against the data set it claims to partition where one
    is given."""
    path = cluster_path(run_dir)
    if not os.path.isfile(path):
        raise UsageError(f"no cluster file at {path}: run cluster.py first")
    clusters = load_checkpoint(path, "cluster file")
    check_partition(clusters, path)
    if dataset is not None:
        check_made_from(clusters, dataset, path)
    return clusters


def check_partition(clusters, path):
    """The assignments as cluster.py wrote them: one integer in 0..k-1 per image, whose
    hash is the fingerprint every expert and router records. An edited or damaged file
    would otherwise train experts on other images than it names, or fail inside a loss."""
    assign, k = clusters.get("assignments"), clusters.get("k")
    if not (torch.is_tensor(assign) and assign.dim() == 1 and assign.dtype == torch.int64
            and isinstance(k, int) and k >= 2):
        raise UsageError(f"{path} is not a cluster file: no k, or no assignments (one "
                         "integer per image)")
    if hashlib.sha1(assign.numpy().tobytes()).hexdigest() != clusters.get("fingerprint"):
        raise UsageError(f"{path}: its assignments are not those its fingerprint records "
                         "(edited or damaged): run cluster.py again")
    if len(assign) and not 0 <= int(assign.min()) <= int(assign.max()) < k:
        raise UsageError(f"{path} assigns images to clusters outside 0..{k - 1}")


def check_made_from(clusters, dataset, path):
    """Refuse a cluster file (read from `path`) made from another data set than `dataset`."""
    if clusters["data"] != dataset.fingerprint:
        raise UsageError(f"{path} was made from another data set "
                         f"({describe(clusters['data'])}), not "
                         f"{describe(dataset.fingerprint)}; re-run cluster.py or pass "
                         "the matching --data/--image-size")


def island_of(dataset):
    """The record `cluster_shards` left on an island's shards (the whole set's
    fingerprint and spec, and these samples' positions in it), or None for any other
    data set."""
    return getattr(dataset, "part_of", None)


def owned_classes(dataset, classes):
    return np.arange(len(dataset)) if classes is None else \
        np.flatnonzero(np.isin(dataset.labels, classes))


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


def member_of(config):
    """Who a checkpoint's network is in an ensemble (Cluster.member), as its config
    records it ({} where it records nothing)."""
    return config.get("member") or {}


def recorded_member(path):
    """member_of the network at `path` (its folder, ckpt.pt or a release's config.json)."""
    return member_of(read_network_file(path, "checkpoint").get("config") or {})


def membership(config):
    """(name, data fingerprint or None) of an expert: checkpoints before open
    contribution know only their cluster id."""
    member = member_of(config)
    return member.get("name", str(config.get("cluster"))), member.get("trained_on")


def is_contribution(network):
    """Whether the network is a contributor's expert (trained with --contribution)."""
    return member_of(network.config).get("origin") == "contributed"


def contributors(run_dir):
    """{name: checkpoint config} of the contributors' experts in runs/experts/ (named,
    trained with --contribution), by name."""
    found = {}
    for name, path in network_folders(os.path.join(run_dir, "experts")).items():
        if not name.isdigit() and CONTRIBUTION_NAME.fullmatch(name):
            config = read_network_file(path, f"expert {name}").get("config") or {}
            if member_of(config).get("origin") == "contributed":
                found[name] = config
    return dict(sorted(found.items()))   # ensemble.ordered: contributors by name
