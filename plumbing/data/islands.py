"""Writing shard sets, and the islands made of them.

`--to-shards` writes any data set held in memory as a WebDataset shard set.
cluster.py --export-shards DIR writes each cluster's samples, byte for byte and in the
order of the full set, as DIR/<k>/*.tar with DIR/<k>/manifest.json. An island that
holds only DIR/<k>/ and clusters.pt trains expert k from them: `cluster_shards` checks
that they are exactly cluster k's samples (keys and content digests, both recorded in
the cluster file), and the expert's weights equal those of the same expert trained from
the full set. webdataset's ShardWriter writes every shard, so the files are its files."""
import io
import json
import os

import numpy as np
import torch
from tqdm import tqdm

from plumbing.command_line import UsageError, checked_record, first_line
from plumbing.run_dir import staged
from plumbing.data.shards import ShardSet, read_member, shard_samples

MANIFEST_FORMAT = 1


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
    with staged(out, "--to-shards") as staging:
        paths = write_shards(staging, samples(), per_shard)
    return [os.path.join(out, os.path.basename(p)) for p in paths]


def export_shards(dataset, clusters, out, shard_size, commit=None):
    """Each cluster's samples, every member byte for byte, as OUT/<k>/000000.tar ... in
    the full set's order, with OUT/<k>/manifest.json; written beside OUT and moved into
    place at the end, so a killed export leaves no OUT. `commit()` runs once every shard
    is written, before they move into place (cluster.py saves its cluster file there)."""
    with staged(out, "--export-shards") as staging:
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
    checked_record(manifest, {"format": int, "data": dict, "cluster_fingerprint": str}, path)
    if manifest["format"] > MANIFEST_FORMAT:
        raise UsageError(f"{path} is a shard manifest of format {manifest['format']}; this "
                         f"version reads {MANIFEST_FORMAT} and older")
    return manifest
