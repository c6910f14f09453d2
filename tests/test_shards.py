"""Sharded data (--data wds:PATTERN): clustering in a stream, per-cluster shard sets, and
an island that trains its expert from its own cluster's shards alone, bit for bit as from
the full data set."""
import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch

import cluster
import train_expert
from plumbing.data.datasets import load_dataset
from helpers import cli, run_stage, snapshot
from plumbing.data.islands import png_bytes, write_shards

EXPERT = ["--model", "DiT-N/4", "--steps", "12", "--batch-size", "16", "--precision", "fp32",
          "--log-every", "12", "--workers", "2"]


def digit_samples(keys=None, labels=None):
    digits = load_dataset("digits")
    for i in range(len(digits)):
        yield {"__key__": keys[i] if keys else f"{i:06d}", "png": png_bytes(digits.images[i, 0]),
               "cls": str(digits.labels[i] if labels is None else labels[i]).encode()}


@pytest.fixture(scope="module")
def islands(tmp_path_factory):
    """Digits as four shards, clustered from them (--export-shards), and digits in
    memory clustered alike."""
    root = tmp_path_factory.mktemp("shards")
    write_shards(root / "digits", digit_samples(), 500)
    pattern = f"wds:{root}/digits/{{000000..000003}}.tar"
    run_stage(cluster, ["--data", pattern, "--run-dir", str(root / "full"),
                        "--export-shards", str(root / "islands"), "--shard-size", "200"])
    run_stage(cluster, ["--run-dir", str(root / "memory")])
    return root, pattern


def test_clustering_shards_gives_digits_in_memory_assignments(islands):
    """Same pixels (PNG is lossless), same features, same seed: the same partition. The sharded
    file also names every image by its key and content digest."""
    root, _ = islands
    sharded = torch.load(root / "full" / "clusters.pt", weights_only=True)
    memory = torch.load(root / "memory" / "clusters.pt", weights_only=True)
    assert torch.equal(sharded["assignments"], memory["assignments"])
    assert sharded["sizes"] == memory["sizes"] and sharded["data"]["name"] == "wds"
    assert sharded["keys"].split("\n") == [f"{i:06d}" for i in range(1797)]
    assert len(set(sharded["sample_digests"].tolist())) == 1797 - duplicate_digits()


def duplicate_digits():
    """Digits holds a few images twice with the same label; their samples' digests coincide."""
    digits = load_dataset("digits")
    rows = {(digits.images[i].tobytes(), int(digits.labels[i])) for i in range(len(digits))}
    return len(digits) - len(rows)


def test_a_fitted_sample_and_nearest_centroids_recover_separated_clusters(tmp_path):
    """--fit-sample 40 of 400 images in four well-separated groups (grey levels): k-means sees a
    tenth of them, every image goes to its nearest centroid, and the partition is the groups."""
    rng = np.random.default_rng(0)
    group = np.arange(400) % 4
    write_shards(tmp_path / "blobs", ({"__key__": f"{i:04d}", "png": png_bytes(
        (40 + 55 * group[i] + rng.integers(-8, 9, (8, 8))).astype(np.uint8))}
        for i in range(400)), 100)
    run_stage(cluster, ["--data", f"wds:{tmp_path}/blobs/*.tar",
                        "--run-dir", str(tmp_path / "r"),
                        "--fit-sample", "40", "--fine-k", "8", "--pca-dim", "1"])
    found = torch.load(tmp_path / "r" / "clusters.pt", weights_only=True)
    assert found["fit_sample"] == 40 and found["sizes"] == [100] * 4
    together = np.zeros((4, 4), int)
    np.add.at(together, (found["assignments"].numpy(), group), 1)
    assert sorted(together.max(1)) == [100] * 4, together


def test_exported_shard_sets_hold_each_cluster_in_order(islands):
    root, _ = islands
    clusters = torch.load(root / "full" / "clusters.pt", weights_only=True)
    keys = np.array(clusters["keys"].split("\n"))
    for k in range(4):
        island = load_dataset(f"wds:{root}/islands/{k}/*.tar")
        members = np.flatnonzero(clusters["assignments"].numpy() == k)
        assert list(island.keys) == list(keys[members])
        assert len(os.listdir(root / "islands" / str(k))) == 1 + -(-len(members) // 200)


def test_an_island_trains_bit_identically_from_its_shards_alone(islands, tmp_path):
    """Expert 2 from the full shard set with the cluster file, from digits in memory, and from
    islands/2/ with only clusters.pt beside it: the same weights and EMA, with two DataLoader
    workers reading the shards; an island's 6 + 6 resumed steps give its 12 straight."""
    root, pattern = islands
    island = tmp_path / "island"
    island.mkdir()
    shutil.copy(root / "full" / "clusters.pt", island)
    shutil.copytree(root / "islands" / "2", tmp_path / "my-shards")
    runs = {"full": ["--run-dir", str(tmp_path / "full")],
            "memory": ["--run-dir", str(tmp_path / "memory")],
            "island": ["--run-dir", str(island), "--data", f"wds:{tmp_path}/my-shards/*.tar"]}
    for name in ("full", "memory"):
        shutil.copytree(root / name, tmp_path / name)
    ckpts = {}
    for name, argv in runs.items():
        run_stage(train_expert, ["--cluster", "2", *EXPERT, *argv])
        ckpts[name] = torch.load(tmp_path / name / "experts" / "2" / "ckpt.pt",
                                 weights_only=True)
    for name in ("memory", "island"):
        for part in ("model", "ema"):
            assert all(torch.equal(ckpts["full"][part][n], ckpts[name][part][n])
                       for n in ckpts["full"][part]), (name, part)
    # and an island killed half-way resumes to the same weights: a batch is (seed, rank, step)'s
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(root / "full" / "clusters.pt", resumed)
    halfway = [a if a != "12" else "6" for a in EXPERT]
    for argv in (halfway, EXPERT):
        run_stage(train_expert, ["--cluster", "2", *argv, "--run-dir", str(resumed), "--data",
                                 f"wds:{tmp_path}/my-shards/*.tar"])
    again = torch.load(resumed / "experts" / "2" / "ckpt.pt", weights_only=True)
    assert again["step"] == 12 and all(torch.equal(ckpts["full"]["ema"][n], again["ema"][n])
                                       for n in again["ema"])
    full, isle = ckpts["full"]["config"], ckpts["island"]["config"]
    # the island records the whole set its shards are part of, and which samples of it it owns
    assert isle["data"] == full["data"] and isle["member"] == full["member"]
    assert isle["data_spec"] == pattern and isle["island_data"].endswith("my-shards/*.tar")


def corrupt_shards(root, case, islands_root):
    """A copy of the digits shards (or of island 2) damaged as `case` says; returns its
    --data."""
    folder = root / case.replace(" ", "-")
    if case in ("another data set", "another cluster", "another clustering"):
        source = islands_root / "islands" / ("1" if case == "another cluster" else "2")
        shutil.copytree(source, folder)
        if case == "another clustering":   # its manifest names another cluster file
            manifest = json.loads((folder / "manifest.json").read_text())
            manifest["cluster_fingerprint"] = "0" * 40
            (folder / "manifest.json").write_text(json.dumps(manifest))
        if case == "another data set":   # the same keys, other images (inverted digits)
            shutil.rmtree(folder)
            island = load_dataset(f"wds:{source}/*.tar")
            write_shards(folder,
                         ({"__key__": key, "png": png_bytes(255 - island.uint8([i])[0, 0]),
                           "cls": str(island.labels[i]).encode()}
                          for i, key in enumerate(island.keys)), 200)
        return f"wds:{folder}/*.tar"
    if case in ("a member outside", "an absolute member", "a name not in UTF-8"):
        name = {"a member outside": "../../x", "an absolute member": "/evil/abs",
                "a name not in UTF-8": "\udcff\udcfe"}[case]
        folder.mkdir()
        with tarfile.open(folder / "000000.tar", "w", encoding="utf-8",
                          errors="surrogateescape") as tar:
            for sample in [*list(digit_samples())[:3]]:
                for ext, data in (("png", sample["png"]), ("cls", sample["cls"])):
                    key = name if sample["__key__"] == "000001" else sample["__key__"]
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return f"wds:{folder}/*.tar"
    if case == "key twice":
        keys = [f"{i:06d}" for i in range(1797)]
        keys[1500] = keys[3]
        write_shards(folder, digit_samples(keys=keys), 500)
    elif case == "label out of range":
        write_shards(folder, digit_samples(labels=[-1] + [0] * 1796), 500)
    elif case == "no image":
        without_one = ({k: v for k, v in s.items() if k != "png" or s["__key__"] != "000007"}
                       for s in digit_samples())
        write_shards(folder, without_one, 500)
    elif case == "truncated tar":
        write_shards(folder, digit_samples(), 500)
        path = folder / "000001.tar"
        with tarfile.open(path) as tar:   # cut inside the data of the 40th member
            cut = tar.getmembers()[40].offset_data + 10
        os.truncate(path, cut)
    return f"wds:{folder}/*.tar"


@pytest.mark.parametrize("case, says", [
    ("truncated tar", "truncated"), ("no image", "sample 000007 has no images"),
    ("key twice", "key 000003 appears twice"), ("label out of range", "out of range"),
    ("another data set", "is not the one"), ("another cluster", "of cluster 1, not 2"),
    ("another clustering", "exported from another clustering"),
    ("a member outside", "not a plain relative name"),
    ("an absolute member", "not a plain relative name"),
    ("a name not in UTF-8", "not UTF-8")])
def test_bad_shards_are_one_line_and_nothing_is_written(islands, tmp_path, case, says):
    root, _ = islands
    data = corrupt_shards(tmp_path, case, root)
    run = tmp_path / "run"
    if case.startswith("another"):   # an island: its cluster file beside it, no expert written
        run.mkdir()
        shutil.copy(root / "full" / "clusters.pt", run)
        before = snapshot(run)
        code, err = cli(train_expert, ["--cluster", "2", "--data", data,
                                       "--run-dir", run, *EXPERT])
        assert snapshot(run) == before
    else:
        code, err = cli(cluster, ["--data", data, "--run-dir", run])
        assert not run.exists() or snapshot(run) == {}
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_refusals_before_work(islands, tmp_path):
    """--export-shards needs a sharded set and an empty folder; the router is pointed at
    --from-samples when given one island's shards."""
    root, pattern = islands
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    for argv, says in [(["--export-shards", str(tmp_path / "new")], "--data wds:PATTERN"),
                       (["--data", pattern, "--export-shards", str(tmp_path / "taken")],
                        "not an empty folder")]:
        code, err = cli(cluster, [*argv, "--run-dir", tmp_path / "run"])
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    code, err = cli(train_expert, ["--cluster", "all", "--data", f"wds:{root}/islands/2/*.tar",
                                   "--run-dir", root / "full", *EXPERT])
    assert code == 2 and "--from-samples" in err and len(err.strip().splitlines()) == 1, err


def test_any_data_set_in_memory_becomes_a_shard_set_with_the_same_images_and_labels(tmp_path):
    """cluster.py --to-shards writes what the island recipe starts from, so it runs on a fresh
    clone: the shards decode to the data set's own pixels and labels, in its order."""
    out = tmp_path / "digits-shards"
    run_stage(cluster, ["--data", "digits", "--to-shards", str(out), "--shard-size", "500"])
    assert sorted(os.listdir(out)) == [f"{i:06d}.tar" for i in range(4)]
    digits, shards = load_dataset("digits"), load_dataset(f"wds:{out}/*.tar")
    assert len(shards) == len(digits) and np.array_equal(shards.labels, digits.labels)
    every = np.arange(len(digits))
    assert torch.equal(shards.batch(every), digits.batch(every))
    code, err = cli(cluster, ["--data", "digits", "--to-shards", str(out)])   # not over a set
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(out) in err


def test_an_export_stopped_half_way_keeps_the_old_clustering_and_a_dead_writers_leftovers_go(
        islands, tmp_path, monkeypatch):
    """The cluster file is replaced only once every island is written; a stopped export leaves
    the old one and no partial folder, and what a killed one left is removed by the next."""
    from plumbing.data import islands as island_writer
    root, pattern = islands
    run, out = tmp_path / "run", tmp_path / "islands"
    run_stage(cluster, ["--data", pattern, "--run-dir", str(run), "--k", "3"])
    before = (run / "clusters.pt").read_bytes()
    from plumbing.run_dir import writer
    # this host's, above Linux's largest pid: no such process
    dead = tmp_path / f"islands.partial-{writer().rpartition('-')[0]}-4000000"
    (dead / "0").mkdir(parents=True)
    (dead / "0" / "000000.tar").write_bytes(b"half a shard")

    def stopped(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(island_writer, "write_cluster_shards", stopped)
    code, err = cli(cluster, ["--data", pattern, "--run-dir", str(run), "--k", "2",
                              "--recluster",
                              "--export-shards", str(out)])
    assert code == 130 and (run / "clusters.pt").read_bytes() == before and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # the dead writer's folder too
    monkeypatch.undo()
    run_stage(cluster, ["--data", pattern, "--run-dir", str(run), "--k", "2", "--recluster",
                        "--export-shards", str(out), "--shard-size", "400"])
    assert (torch.load(run / "clusters.pt", weights_only=True)["k"] == 2
            and (out / "1" / "manifest.json").is_file())


def png_header_claiming(width, height):
    """A PNG whose header claims width x height grey pixels and holds none: what a decompression
    bomb's first bytes say."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(
            kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR",
                                         struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_an_image_claiming_huge_size_is_refused_from_its_header(tmp_path):
    samples = list(digit_samples())[:4]
    samples[0] = {**samples[0], "png": png_header_claiming(12000, 12000)}
    write_shards(tmp_path / "bomb", samples, 10)
    code, err = cli(cluster, ["--data", f"wds:{tmp_path}/bomb/*.tar",
                              "--run-dir", tmp_path / "run", "--k", "2"])
    assert code == 2 and "12000x12000" in err and len(err.strip().splitlines()) == 1, err
    folder = tmp_path / "folder" / "a"
    folder.mkdir(parents=True)
    (folder / "x.png").write_bytes(png_header_claiming(12000, 12000))
    code, err = cli(cluster, ["--data", f"folder:{tmp_path / 'folder'}", "--image-size", "8",
                              "--run-dir", tmp_path / "run2", "--k", "2"])
    assert code == 2 and "12000x12000" in err and len(err.strip().splitlines()) == 1, err
