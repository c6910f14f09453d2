"""Metrics against closed forms and hand-made sets; the classifier, FID and table paths; bad inputs."""
import json

import numpy as np
import pytest
import scipy.linalg
import torch

import eval as evaluate
from data import load_dataset
from helpers import run_script, run_stage, tiny_clip


def test_frechet_distance_of_gaussians_closed_form():
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    s1, s2 = np.diag([1.0, 4.0, 9.0]), np.diag([4.0, 1.0, 1.0])
    # commuting covariances: sum of (sqrt a - sqrt b)^2 per axis
    expected = 1 + 0 + 4 + (1 - 2) ** 2 + (2 - 1) ** 2 + (3 - 1) ** 2
    assert abs(evaluate.frechet_distance(mu1, s1, mu2, s2) - expected) < 1e-9
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 6)), rng.normal(size=(6, 6))
    s1, s2 = a @ a.T + np.eye(6), b @ b.T + 0.1 * np.eye(6)     # non-commuting
    reference = 6 * 0 + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    assert abs(evaluate.frechet_distance(np.zeros(6), s1, np.zeros(6), s2) - reference) < 1e-6
    assert abs(evaluate.frechet_distance(mu1, s1[:3, :3], mu1, s1[:3, :3])) < 1e-9


def test_precision_recall_on_hand_made_sets():
    real = np.array([[0.0, 0], [1, 0], [0, 1], [1, 1]])     # 1-NN radius of every real point: 1
    fake = np.array([[0.1, 0.0], [0.9, 0.1], [0.1, 0.9], [5.0, 5.0]])
    p, r = evaluate.precision_recall(real, fake, k=1)
    assert p == 0.75     # (5, 5) is 5.66 from the nearest real point, outside every real ball
    # fake 1-NN radii: 0.81, 0.81, 0.9 and 6.39 for the outlier; real (1, 1) lies 5.66 from (5, 5),
    # inside the outlier's ball: recall is 1, the metric's known sensitivity to outliers
    assert r == 1.0
    p, r = evaluate.precision_recall(real, fake[:3], k=1)
    assert p == 1.0 and r == 0.75   # without the outlier, (1, 1) lies outside every fake ball (0.91 > 0.81, 0.91 > 0.9)
    assert evaluate.precision_recall(real, real, k=1) == (1.0, 1.0)


def test_diversity_is_mean_pairwise_distance_within_labels():
    f = np.array([[0.0, 0], [3, 4], [10, 10], [10, 10]])
    assert evaluate.diversity(f, np.array([0, 0, 1, 1])) == pytest.approx((5 + 0) / 2)
    assert evaluate.diversity(f[:2], None) == pytest.approx(5)


@pytest.fixture(scope="module")
def eval_run(digits_run, tmp_path_factory):
    """Real digits written as a sample batch (with labels), a corrupted copy, and the cached classifier."""
    run = digits_run
    d = load_dataset("digits")
    idx = np.random.default_rng(1).choice(len(d), 200, replace=False)
    real = ((d.batch(idx) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "real.npz", arr_0=real, arr_1=d.labels[idx])
    np.savez(folder / "noise.npz", arr_0=np.random.default_rng(2).integers(0, 256, real.shape, dtype=np.uint8), arr_1=d.labels[idx])
    with open(folder / "real.json", "w") as f:
        json.dump({"routing": "top1", "missing": [], "usage_per_t_bin": {"counts": [[1, 3], [1, 3]]}}, f)
    return run, folder


def test_classifier_metrics_separate_real_from_noise(eval_run, capsys):
    run, folder = eval_run
    run_stage(evaluate, [str(folder / "real.npz"), str(folder / "noise.npz"), "--run-dir", str(run)])
    real = json.load(open(folder / "real.eval.json"))
    noise = json.load(open(folder / "noise.eval.json"))
    assert real["classifier_accuracy_on_real"] > 0.95
    assert real["conditional_accuracy"] > 0.95 and noise["conditional_accuracy"] < 0.3
    assert real["fd_classifier"] < 0.1 * noise["fd_classifier"]
    assert real["precision"] > 0.8 and noise["precision"] < 0.2
    assert real["routing"]["expert_share_percent"] == "25/75" and "FID" in real["notes"]
    out = capsys.readouterr().out
    assert "real.npz" in out and "noise.npz" in out and "25/75" in out and "FD-clf" in out
    # a batch's precision and recall are its own: the same with or without another file evaluated beside it
    run_stage(evaluate, [str(folder / "noise.npz"), "--run-dir", str(run)])
    alone = json.load(open(folder / "noise.eval.json"))
    assert (alone["precision"], alone["recall"]) == (noise["precision"], noise["recall"])


def test_fid_and_clip_paths_with_random_local_weights(eval_run, tmp_path):
    from torchvision.models.inception import Inception3
    run, folder = eval_run
    torch.manual_seed(0)
    weights = tmp_path / "pt_inception-random.pth"
    torch.save(Inception3(num_classes=1008, aux_logits=False, init_weights=True).state_dict(), weights)
    config, clip_weights = tiny_clip(tmp_path)
    small = tmp_path / "small.npz"
    with np.load(folder / "real.npz") as b:
        np.savez(small, arr_0=b["arr_0"][:12], arr_1=b["arr_1"][:12])
    run_stage(evaluate, [str(small), "--run-dir", str(run), "--inception-weights", str(weights), "--max-real", "40",
                         "--clip-model", config, "--clip-pretrained", clip_weights])
    result = json.load(open(tmp_path / "small.eval.json"))
    assert np.isfinite(result["fid"]) and result["fid"] >= 0 and np.isfinite(result["clip_fd"])
    assert "FID" not in result["notes"] and "CLIP-FD" not in result["notes"]


def test_bad_inputs(eval_run, tmp_path):
    run, folder = eval_run
    np.savez(tmp_path / "floats.npz", arr_0=np.zeros((4, 8, 8, 1), dtype=np.float32))
    np.savez(tmp_path / "flat.npz", arr_0=np.zeros((4, 64), dtype=np.uint8))
    np.savez(tmp_path / "big.npz", arr_0=np.zeros((4, 16, 16, 1), dtype=np.uint8))
    np.savez(tmp_path / "nolabels.npz", images=np.zeros((4, 8, 8, 1), dtype=np.uint8))
    cases = [(tmp_path / "missing.npz", "no sample file"), (tmp_path / "floats.npz", "expected uint8"),
             (tmp_path / "flat.npz", "expected N x H x W x C"), (tmp_path / "big.npz", "the data set's are 8x8x1"),
             (tmp_path / "nolabels.npz", "has no arr_0")]
    for path, message in cases:
        code, _, err = run_script("eval.py", path, "--run-dir", run)
        assert code == 2 and message in err and "Traceback" not in err, (path, err[-1500:])


def test_against_one_clusters_own_images(eval_run):
    run, folder = eval_run
    run_stage(evaluate, [str(folder / "real.npz"), "--run-dir", str(run), "--cluster", "1"])
    result = json.load(open(folder / "real.eval.json"))
    sizes = torch.load(run / "clusters.pt", weights_only=True)["sizes"]
    assert result["reference"].startswith("c1-") and result["n_real"] == sizes[1]
    code, _, err = run_script("eval.py", folder / "real.npz", "--run-dir", run, "--cluster", "9")
    assert code == 2 and "clusters 0..3" in err
