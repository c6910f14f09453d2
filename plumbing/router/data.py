"""What a router trains on from data: a set of parts, each a data set with the expert each of
its images belongs to: the cluster file's data set with its assignments, and every
contributor's data that this machine can read (`examples_from_data`). The experts' own
samples make the same parts with no one's data (router_samples.py)."""
import os

import numpy as np
import torch

from plumbing.checkpoint import read_network_file, split_checkpoint
from plumbing.command_line import UsageError
from plumbing.condition import condition_for_data, condition_from_spec
from plumbing.run_dir import cluster_path, network_folders
from plumbing.sources import (Contribution, clustered_data, contributors, expert_record,
                              load_clusters)


class RoutingExamples:
    """The router's training set as parts, each (images with .batch(idx), target expert of
    each image, condition ids): one data set with its cluster assignments, a contributor's
    data set, or one expert's samples.

    Example g of the whole is image g - offset of its part, so with one part (the
    clusters' data set) the examples are exactly the data set's images."""

    def __init__(self, parts):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(targets) for _, targets, _ in parts])
        self.targets = np.concatenate([targets for _, targets, _ in parts])

    def __len__(self):
        return len(self.targets)

    def _split(self, idx):
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        return [(p, np.flatnonzero(part == p)) for p in np.unique(part)]

    def _gather(self, idx, fetch):
        idx = np.asarray(idx)
        pieces = [(rows, fetch(p, idx[rows] - self.offsets[p])) for p, rows in self._split(idx)]
        if len(pieces) == 1:
            return pieces[0][1]
        out = torch.empty((len(idx), *pieces[0][1].shape[1:]), dtype=pieces[0][1].dtype)
        for rows, values in pieces:
            out[torch.from_numpy(rows)] = values
        return out

    def batch(self, idx, rng=None):
        return self._gather(idx, lambda p, local: self.parts[p][0].batch(local))

    def ids(self, idx):
        return self._gather(idx, lambda p, local: self.parts[p][2](local))

    def held_out_split(self, fraction, seed):
        """(training, held-out) indices: a fixed split, the held-out part only for
        measuring."""
        order = np.random.default_rng(seed).permutation(len(self))
        n_val = int(len(self) * fraction)
        if not 1 <= n_val < len(self):
            raise UsageError(f"--val-fraction {fraction} holds out {n_val} of {len(self)} "
                             "images; keep some for each side")
        return order[n_val:], np.sort(order[:n_val])


def experts_condition(run_dir):
    """The condition spec the run's experts were trained with (they agree, or sample.py
    will say so), or None."""
    for path in network_folders(os.path.join(run_dir, "experts")).values():
        spec = split_checkpoint(read_network_file(path, "expert"))[2]["condition"]
        # the information control's monolith is told the cluster; its router, the class
        return {"kind": "class"} if spec.get("kind") == "class+cluster" else spec
    return None


def cluster_members(clusters, dataset):
    """The k-means experts of the cluster file, in ensemble order: name, data
    fingerprint, size, label counts."""
    assign = clusters["assignments"].numpy()
    return [expert_record(str(j), dataset, np.flatnonzero(assign == j))
            for j in range(clusters["k"])]


def examples_from_data(run_dir, flags, kind, clip, device):
    """(RoutingExamples, members, condition, what the router learns from): the cluster file's
    data set with its assignments (if the run has one), and every contributor's data
    set that this machine can read. `kind`: --condition (None: the experts'); `clip`:
    (open_clip model, its weights) for a text condition's captions."""
    has_clusters = os.path.isfile(cluster_path(run_dir))
    others = contributors(run_dir)
    if not has_clusters and not others:
        raise UsageError(f"no cluster file at {cluster_path(run_dir)} and no "
                         "contributors' experts: run cluster.py first, or train experts "
                         "with --contribution NAME")
    parts, members = [], []
    if has_clusters:
        # it would replace the router of pixel experts with one they cannot use
        if flags.vae and load_clusters(run_dir).get("vae") is None:
            raise UsageError(f"--vae {flags.vae}: {cluster_path(run_dir)} and its "
                             "experts are in pixels; a router in a VAE's latents could "
                             "not route them (for a latent run: cluster.py --vae, in "
                             "another --run-dir)")
        # the router reads x_t where the experts do: in the latents (posterior means)
        clusters, dataset = clustered_data(run_dir, flags, device=device)
        experts = experts_condition(run_dir)
        condition = condition_for_data(kind or (experts or {}).get("kind"), dataset, run_dir,
                                       encoder=(experts or {}).get("encoder"),
                                       clip_model=clip[0], clip_pretrained=clip[1],
                                       download=flags.download)
        members = cluster_members(clusters, dataset)
        parts = [(dataset, clusters["assignments"].numpy(), condition.ids)]
        shape = clusters["data"]["shape"]
        seen = {"cluster_fingerprint": clusters["fingerprint"], "data": dataset.fingerprint,
                "vae": getattr(dataset, "vae", None),
                "source": "data"}
    else:   # contributors only: the first one's images and condition set what the others must match
        first = next(iter(others.values()))
        condition = condition_from_spec(first["condition"]).for_router(kind)
        shape = first["data"]["shape"]
        seen = {"cluster_fingerprint": None, "data": None, "vae": None, "source": "data"}
    for name, config in others.items():
        theirs = Contribution.recorded(name, config, shape, flags.download)
        data, owned = theirs.dataset, theirs.indices
        labels = data.labels[owned] if data.labels is not None else np.zeros(len(owned), dtype=np.int64)
        ids = condition.of_labels(labels, data.num_classes)
        parts.append((Subset(data, owned), np.full(len(owned), len(members)), lambda local,
                      ids=ids: ids[torch.as_tensor(local)]))
        members.append({"name": name, "trained_on": config["member"]["trained_on"],
                        "size": len(owned),
                        "label_counts": config["member"].get("label_counts")})
    if len(members) < 2:
        raise UsageError("a router needs at least two experts to choose between; this "
                         f"run has {', '.join(m['name'] for m in members)}")
    return RoutingExamples(parts), members, condition, seen


class Subset:
    def __init__(self, dataset, owned):
        self.dataset, self.owned = dataset, owned

    def batch(self, idx, rng=None):
        return self.dataset.batch(self.owned[idx])
