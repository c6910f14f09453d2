"""Data loaders on fake files in the real on-disk formats, and the clustering stage."""
import os

import numpy as np
import pytest
import torch

import cluster
from plumbing.command_line import UsageError
from plumbing.data.datasets import load_dataset
from helpers import (cli, fake_cifar10, fake_folder, fake_imagenet64, run_command, run_stage,
                     tiny_clip)


def test_digits_loader():
    d = load_dataset("digits")
    assert len(d) == 1797 and d.images.dtype == np.uint8 and d.images.shape == (1797, 1, 8, 8)
    x = d.batch(np.arange(10))
    assert x.shape == (10, 1, 8, 8) and x.min() >= -1 and x.max() <= 1 and x.min() == -1
    assert load_dataset("digits", image_size=16).batch(np.arange(3)).shape == (3, 1, 16, 16)
    assert load_dataset("digits").fingerprint == d.fingerprint != load_dataset(
        "digits", image_size=16).fingerprint


@pytest.mark.fast
def test_cifar10_loader(tmp_path):
    fake_cifar10(tmp_path)
    d = load_dataset(f"cifar10:{tmp_path}")
    assert (len(d) == 100 and d.batch(np.arange(4)).shape == (4, 3, 32, 32)
            and d.num_classes == 10)
    assert len(load_dataset(f"cifar10:{tmp_path}/cifar-10-batches-py")) == 100
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(UsageError, match="not a usable"):
        load_dataset(f"cifar10:{tmp_path}")


@pytest.mark.fast
def test_imagenet64_loader_memory_maps(tmp_path):
    fake_imagenet64(tmp_path)
    d = load_dataset(f"imagenet64:{tmp_path}")
    assert (len(d) == 48 and d.images.dtype == np.uint8
            and d.batch(np.arange(2)).shape == (2, 3, 64, 64))
    assert d.labels.min() >= 0 and d.labels.max() <= 999          # 1-based on disk
    one = load_dataset(f"imagenet64:{tmp_path}/train_data_batch_1.npz")
    assert isinstance(one.images.base, np.memmap) or isinstance(one.images, np.memmap)
    raw = np.load(tmp_path / "train_data_batch_1.npz")
    # channel-planar layout kept
    np.testing.assert_array_equal(one.images.reshape(24, -1), raw["data"])
    np.testing.assert_array_equal(one.labels, raw["labels"] - 1)


@pytest.mark.fast
def test_folder_loader(tmp_path):
    fake_folder(tmp_path)
    d = load_dataset(f"folder:{tmp_path}", image_size=16)
    assert (len(d) == 12 and d.num_classes == 2 and d.images.shape == (12, 3, 16, 16)
            and list(np.unique(d.labels)) == [0, 1])
    with pytest.raises(UsageError, match="--image-size"):
        load_dataset(f"folder:{tmp_path}")


def test_pixel_clustering_recovers_digit_classes(tmp_path):
    run_stage(cluster, ["--k", "10", "--run-dir", str(tmp_path)])
    c = torch.load(tmp_path / "clusters.pt", weights_only=True)
    labels = load_dataset("digits").labels
    assign = c["assignments"].numpy()
    purity = sum(np.bincount(labels[assign == j]).max() for j in range(10)) / len(labels)
    assert purity > 0.7
    assert c["k"] == 10 and sum(c["sizes"]) == 1797 and c["centroids"].shape == (10, 16)
    assert (c["data"] == load_dataset("digits").fingerprint
            and os.path.isfile(tmp_path / "clusters.png"))


@pytest.mark.fast
def test_two_stage_min_size_and_determinism(tmp_path):
    run_stage(cluster, ["--k", "4", "--fine-k", "64", "--min-size", "300",
                        "--run-dir", str(tmp_path / "a")])
    run_stage(cluster, ["--k", "4", "--fine-k", "64", "--min-size", "300",
                        "--run-dir", str(tmp_path / "b")])
    a = torch.load(tmp_path / "a" / "clusters.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "clusters.pt", weights_only=True)
    assert (torch.equal(a["assignments"], b["assignments"])
            and a["fingerprint"] == b["fingerprint"])
    assert min(a["sizes"]) >= 300 and a["fine_k"] == 64


def test_clip_features_from_a_local_file(tmp_path):
    config, weights = tiny_clip(tmp_path)
    fake_cifar10(tmp_path / "c")
    run_stage(cluster, ["--data", f"cifar10:{tmp_path / 'c'}", "--features", "clip",
                        "--clip-model", config,
                        "--clip-pretrained", weights, "--run-dir", str(tmp_path / "runs"),
                        "--k", "3"])
    c = torch.load(tmp_path / "runs" / "clusters.pt", weights_only=True)
    assert c["features"]["features"] == "clip" and c["centroids"].shape == (3, 32)
    feats = np.load(next((tmp_path / "runs" / "features").iterdir()))
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1, atol=1e-5)


def test_bad_inputs_one_line_no_traceback_no_file(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    cases = [(["--k", "1"], "must be at least 2"), (["--k", "5000"], "--k must be"),
             (["--data", "svhn"], "unknown data set"),
             (["--data", f"cifar10:{tmp_path}/none"], "no CIFAR-10"),
             (["--features", "clip"], "needs weights"),
             (["--data", f"imagenet64:{tmp_path}"], "no downsampled ImageNet"),
             (["--features", "dino"], "invalid choice"),
             (["--data", f"imagenet64:{tmp_path}/bad.npz"],
              "not a usable downsampled-ImageNet file")]
    for argv, message in cases:
        code, err = cli(cluster, [*argv, "--run-dir", tmp_path / "runs"])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not os.path.exists(tmp_path / "runs" / "clusters.pt")
    # and as a real command line
    code, _, err = run_command("cluster.py", "--k", "1", "--run-dir", tmp_path / "runs")
    assert code == 2
    assert err.strip() == "cluster.py: error: argument --k: must be at least 2, got 1 (see --help)"


def test_the_old_name_of_clustering_is_one_line_naming_the_new_one(tmp_path):
    """cluster.py's --partition (kmeans|random) became --clustering: train_expert.py's
    --partition names a contributor."""
    code, _, err = run_command("cluster.py", "--partition", "random",
                               "--run-dir", tmp_path / "runs")
    assert (code == 2 and len(err.strip().splitlines()) == 1
            and "--partition is now --clustering" in err)
    assert not (tmp_path / "runs").exists()


@pytest.mark.fast
def test_random_partition_is_the_equal_size_control(tmp_path):
    run_stage(cluster, ["--k", "4", "--clustering", "random", "--run-dir", str(tmp_path)])
    c = torch.load(tmp_path / "clusters.pt", weights_only=True)
    assert c["clustering"] == "random" and max(c["sizes"]) - min(c["sizes"]) <= 1
    labels = load_dataset("digits").labels
    purity = sum(np.bincount(labels[c["assignments"].numpy() == j]).max()
                 for j in range(4)) / len(labels)
    assert purity < 0.2    # no semantics: close to the largest class's share (~10%)


@pytest.mark.fast
def test_a_folder_at_the_feature_caches_path_is_one_line(tmp_path):
    run_stage(cluster, ["--k", "2", "--run-dir", str(tmp_path)])
    cache = next((tmp_path / "features").glob("*.npy"))
    cache.unlink()
    cache.mkdir()
    code, err = cli(cluster, ["--k", "2", "--recluster", "--run-dir", str(tmp_path)])
    assert code == 2 and "feature cache" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.fast
def test_a_pca_dim_the_pixels_cannot_hold_is_refused_and_the_largest_one_kept(tmp_path):
    # the PCA keeps at most min(values per image, images fitted - 1) meaningful components:
    # asked for more, it kept fewer (or whitened a direction of no variance), without a word
    fake_imagenet64(tmp_path / "imagenet")
    asks = [(["--pca-dim", "65"], "at most 64 (64 values per image; 1797 images fitted"),
            # 48 centred images span 47 directions: a 48th would whiten noise to unit variance
            (["--data", f"imagenet64:{tmp_path / 'imagenet'}", "--k", "2", "--pca-dim", "48"],
             "at most 47 (12288 values per image; 48 images fitted, which span 47 directions)")]
    for argv, says in asks:
        code, err = cli(cluster, [*argv, "--run-dir", tmp_path / "runs"])
        assert code == 2 and f"--pca-dim {argv[-1]} is more than" in err and says in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs" / "clusters.pt").exists()
    run_stage(cluster, ["--k", "2", "--pca-dim", "64", "--run-dir", str(tmp_path / "runs")])
    c = torch.load(tmp_path / "runs" / "clusters.pt", weights_only=True)
    assert c["features"]["pca_dim"] == 64 and c["centroids"].shape == (2, 64)
