"""Fashion-MNIST (and MNIST) from their IDX files: the layouts, the splits, and bad files
refused in one line.

The files are written here, small and random: the tests never need the Debian package."""
import gzip
import json
import os

import numpy as np
import pytest
import torch

import cluster
import eval as evaluate
import sample
from plumbing.command_line import UsageError
from plumbing.data.datasets import load_dataset
from helpers import cli, fake_idx_set, run_stage, snapshot, write_idx


@pytest.mark.parametrize("gz", [True, False])
def test_the_four_idx_files_load_as_a_training_set_with_its_test_split(tmp_path, gz):
    fake_idx_set(tmp_path, n_train=30, n_test=12, gz=gz)
    data = load_dataset(f"fashion-mnist:{tmp_path}")
    assert (data.images.shape == (30, 1, 28, 28) and data.images.dtype == np.uint8
            and data.images.max() < 128)
    assert data.test.images.shape == (12, 1, 28, 28) and data.test.images.min() >= 128
    assert (list(data.labels) == [i % 10 for i in range(30)] and data.num_classes == 10
            and data.test.num_classes == 10)
    assert (data.fingerprint["name"] == "fashion-mnist"
            and data.fingerprint["shape"] == [1, 28, 28])
    assert (data.batch(np.arange(3)).shape == (3, 1, 28, 28)
            and load_dataset(f"fashion-mnist:{tmp_path}", 16).batch([0]).shape[-1] == 16)


def test_torchvisions_layout_and_mnist_read_the_same_files(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    fake_idx_set(raw)
    same = load_dataset(f"fashion-mnist:{tmp_path}")
    assert np.array_equal(same.images, load_dataset(f"fashion-mnist:{raw}").images)
    fake_idx_set(tmp_path / "m" / "MNIST" / "raw", seed=1)
    mnist = load_dataset(f"mnist:{tmp_path / 'm'}")
    assert (mnist.fingerprint["name"] == "mnist" and len(mnist.test) == 20
            and mnist.fingerprint != same.fingerprint)


def corrupt(root, case):
    name = os.path.join(root, "train-images-idx3-ubyte.gz")
    if case == "wrong magic":
        write_idx(name[:-3], np.zeros((40, 28, 28)), magic=0x0801)
    elif case == "truncated gzip":
        blob = open(name, "rb").read()
        open(name, "wb").write(blob[: len(blob) // 2])
    elif case == "truncated data":
        with gzip.open(name, "rb") as f:
            blob = f.read()
        with gzip.open(name, "wb") as f:
            f.write(blob[:-100])
    elif case == "counts differ":
        write_idx(name[:-3], np.zeros((39, 28, 28)))
    elif case == "label out of range":
        write_idx(os.path.join(root, "t10k-labels-idx1-ubyte"), np.full(20, 10))
    elif case == "missing file":
        os.remove(name)


@pytest.mark.parametrize("case, message",
                         [("wrong magic", "magic number"), ("truncated gzip", "cannot read"),
                          ("truncated data", "truncated"), ("counts differ", "40 labels"),
                          ("label out of range", "out of range"),
                          ("missing file", "apt-get install dataset-fashion-mnist")])
def test_bad_idx_files_are_one_line_and_nothing_is_written(tmp_path, case, message):
    data = fake_idx_set(tmp_path / "fmnist")
    if case in ("wrong magic", "counts differ"):
        # the raw file written in its place is the one read
        os.remove(os.path.join(data, "train-images-idx3-ubyte.gz"))
    corrupt(data, case)
    run = tmp_path / "runs"
    code, err = cli(cluster, ["--data", f"fashion-mnist:{data}", "--run-dir", run])
    assert (code == 2 and message in err and len(err.strip().splitlines()) == 1
            and "Traceback" not in err), err
    assert not run.exists() or snapshot(run) == {}


def test_no_package_and_no_download_says_how_to_get_it(tmp_path):
    with pytest.raises(UsageError, match="apt-get install dataset-fashion-mnist"):
        load_dataset(f"fashion-mnist:{tmp_path / 'nothing'}")
    with pytest.raises(UsageError, match="mnist:DIR"):
        load_dataset("mnist")


def test_eval_compares_with_the_test_split_and_scores_its_classifier_there(tmp_path):
    """Samples that are exactly the test images have FD 0 against the reference; the
    training images do not."""
    data = fake_idx_set(tmp_path / "fmnist", n_train=60, n_test=30)
    run = tmp_path / "runs"
    run_stage(cluster, ["--data", f"fashion-mnist:{data}", "--k", "2", "--run-dir", str(run)])
    dataset = load_dataset(f"fashion-mnist:{data}")
    batches = {"test": dataset.test, "train": dataset}
    for name, split in batches.items():
        images = split.images[:30].transpose(0, 2, 3, 1)
        np.savez(tmp_path / f"{name}.npz", arr_0=images, arr_1=split.labels[:30])
    run_stage(evaluate, [str(tmp_path / "test.npz"), str(tmp_path / "train.npz"),
                         "--run-dir", str(run), "--classifier-steps", "5"])
    result = {name: json.load(open(tmp_path / f"{name}.eval.json")) for name in batches}
    assert result["test"]["reference"] == "test" and result["test"]["n_real"] == 30
    assert result["test"]["fd_classifier"] < 1e-6 < result["train"]["fd_classifier"]
    assert result["test"]["classifier_accuracy_measured_on"] == "the 30 test images"
    # 28 px: the network that keeps the last map's layout
    assert result["test"]["classifier"] == "flat-5"
    # --memorisation: the training images are copies of themselves, the test images of
    # nothing seen
    run_stage(evaluate, [str(tmp_path / "test.npz"), str(tmp_path / "train.npz"),
                         "--run-dir", str(run),
                         "--classifier-steps", "5", "--memorisation"])
    result = {name: json.load(open(tmp_path / f"{name}.eval.json"))["memorisation"]
              for name in batches}
    assert (result["train"]["pixels"]["memorised"] == 1.0
            and result["train"]["clf"]["median_nearest_train"] < 1e-6)
    assert (result["test"]["pixels"]["memorised"] == 0.0
            and result["test"]["pixels"]["nearer_train_than_test"] == 0.0)


def test_the_grid_has_one_row_per_requested_class():
    labels = torch.tensor([2, 0, 1, 2, 0, 1, 2, 0, 2])
    rows, row_length = sample.grid_rows(labels, len(labels))
    # class 0's first two, then 1's, then 2's
    assert row_length == 2 and rows.tolist() == [1, 4, 2, 5, 0, 3]
    assert sample.grid_rows(None, len(labels))[1] == 16
