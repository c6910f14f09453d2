"""The papers' configuration at toy scale, with tiny random models saved in the real
formats (no weights can be downloaded here): a diffusers AutoencoderKL folder, an
official-format DiT in latent shape, a DINOv2 state dict."""
import glob
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import cluster
import eval as evaluate
import export
from plumbing.data import latents
import sample
import import_dit
import train_expert
import train_router
from plumbing.data.datasets import TrainingBatches, load_dataset
from helpers import (cli, random_official_state_dict, run_in_diffusers, run_stage,
                     sample_py_images, snapshot)

pytest.importorskip("diffusers", reason="the latent path's optional dependency: "
                                         "pip install -r requirements-latent.txt")


def save_tiny_vae(folder, seed):
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                  layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """A random AutoencoderKL (SD-VAE's layout, 2x downsampling, 4 latent channels) saved
    as a diffusers folder."""
    return save_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae", seed=0)


@pytest.fixture(scope="module")
def latent_run(tmp_path_factory, tiny_vae):
    """digits at 16 px through the VAE (4x8x8 latents), K=2: a DDPM expert, a flow expert
    and a router."""
    run = tmp_path_factory.mktemp("latent") / "runs"
    run_stage(cluster, ["--k", "2", "--image-size", "16", "--vae", str(tiny_vae),
                        "--run-dir", str(run)])
    tiny = ["--model", "DiT-M/2", "--steps", "20", "--batch-size", "16", "--run-dir", str(run)]
    run_stage(train_expert, ["--cluster", "0", "--objective", "ddpm", *tiny])
    run_stage(train_expert, ["--cluster", "1", "--objective", "fm", *tiny])
    run_stage(train_router, ["--steps", "10", "--run-dir", str(run)])
    return run


def test_a_latent_cache_of_another_vae_is_encoded_again_not_trained_on(tmp_path, tiny_vae):
    """Another VAE's cache of the same shape placed under this cache's name (with its
    record): encoded anew."""
    images = load_dataset("digits", 16)
    mine, other = latents.VAE(str(tiny_vae)), latents.VAE(
        str(save_tiny_vae(tmp_path / "other-vae", seed=1)))
    ours = np.array(latents.latent_set(images, mine, str(tmp_path / "a")).moments)
    theirs = np.array(latents.latent_set(images, other, str(tmp_path / "b")).moments)
    (path,) = glob.glob(str(tmp_path / "a" / "latents" / "*.npy"))
    (foreign,) = glob.glob(str(tmp_path / "b" / "latents" / "*.npy"))
    for ext in (".npy", ".json"):
        shutil.copy(foreign[:-4] + ext, path[:-4] + ext)
    again = latents.latent_set(images, mine, str(tmp_path / "a"))
    assert np.array_equal(np.asarray(again.moments), ours) and not np.array_equal(ours, theirs)
    os.remove(path[:-4] + ".json")   # a cache without its record is not trusted either
    assert np.array_equal(np.asarray(latents.latent_set(images,
                                                        mine, str(tmp_path / "a")).moments), ours)


def test_digits_to_latents_to_experts_router_sample_decode_and_eval(latent_run, tiny_vae):
    clusters = torch.load(latent_run / "clusters.pt", weights_only=True)
    assert (clusters["data"]["shape"] == [1, 16, 16]
            and clusters["vae"]["scaling_factor"] == 0.18215)
    (cache,) = glob.glob(str(latent_run / "latents" / "*.npy"))
    moments = np.load(cache, mmap_mode="r")
    assert moments.shape == (1797, 2, 4, 8, 8)
    # the cache holds the scaled posterior mean and std of the grey digits repeated to RGB
    vae = latents.VAE(str(tiny_vae))
    images = load_dataset("digits", 16)
    posterior = vae.net.encode(images.batch(np.arange(4)).expand(-1, 3, -1, -1)).latent_dist
    assert np.allclose(moments[:4, 0], (posterior.mean * 0.18215).detach().numpy(), atol=2e-3)
    assert np.allclose(moments[:4, 1], (posterior.std * 0.18215).detach().numpy(), atol=2e-3)

    for k, objective in (("0", "ddpm"), ("1", "fm")):
        config = torch.load(latent_run / "experts" / k / "ckpt.pt", weights_only=True)["config"]
        assert (config["vae"]["fingerprint"] == clusters["vae"]["fingerprint"]
                and config["objective"]["name"] == objective)
        assert (config["image_size"], config["channels"]) == (
            8, 4) and config["data"] == clusters["data"]
    router = torch.load(latent_run / "router" / "ckpt.pt", weights_only=True)
    assert (router["config"]["vae"]["fingerprint"] == clusters["vae"]["fingerprint"]
            and router["model_args"]["in_channels"] == 4)

    out = latent_run / "samples" / "full.npz"
    run_stage(sample, ["--routing", "full", "--n", "16", "--steps", "4",
                       "--run-dir", str(latent_run), "--out", str(out)])
    with np.load(out) as batch:
        # decoded to the digits' images
        assert batch["arr_0"].shape == (16, 16, 16, 1) and batch["arr_0"].dtype == np.uint8
    with open(out.with_suffix(".json")) as f:
        assert json.load(f)["vae"]["fingerprint"] == clusters["vae"]["fingerprint"]
    run_stage(evaluate, [str(out), "--run-dir", str(latent_run), "--classifier-steps", "20"])
    with open(latent_run / "samples" / "full.eval.json") as f:
        assert np.isfinite(json.load(f)["fd_classifier"])


def test_a_latent_release_ships_its_vae_and_samples_in_diffusers_as_sample_py_does(
        latent_run, tmp_path, monkeypatch):
    """The VAE is the release's `vae` component (diffusers' AutoencoderKL, its folder copied
    byte for byte, so it keeps the fingerprint the experts recorded); the pipeline samples
    latents and decodes them as sample.py does, to 1e-5; sample.py reads the release's own
    VAE, wherever the experts' was."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(latent_run), "--out", str(release)])
    index = json.loads((release / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert latents.VAE(str(release / "vae")).spec["fingerprint"] == \
        index["_ddm"]["vae"]["fingerprint"]
    g = torch.Generator().manual_seed(5)
    labels, noise = torch.randint(10, (4,), generator=g), torch.randn(4, 4, 8, 8, generator=g)
    cases = {f"{rule}-{scale}": {"release": release, "call": {
        "class_labels": labels.tolist(), "latents": "@noise", "num_inference_steps": 4,
        "routing": rule, "guidance_scale": scale}} for rule, scale in (("top1", 1.0), ("full", 2.0))}
    images, errors = run_in_diffusers(tmp_path, cases, noise=noise)
    assert not errors, errors
    for rule, scale in (("top1", 1.0), ("full", 2.0)):
        ours = sample_py_images(release, noise, 4, labels=labels, rule=rule, scale=scale)
        got = images[f"{rule}-{scale}"]
        assert got.shape == (4, 16, 16, 1) and np.abs(got - ours).max() < 1e-5
    for config in glob.glob(str(release / "*" / "*" / "config.json")) + \
            glob.glob(str(release / "router" / "config.json")):   # as on another machine
        data = json.loads(open(config).read())
        if (data.get("_ddm") or {}).get("config", {}).get("vae"):
            data["_ddm"]["config"]["vae"]["path"] = str(tmp_path / "gone")
            open(config, "w").write(json.dumps(data))
    code, err = cli(sample, ["--run-dir", str(release), "--n", "2", "--steps", "2",
                             "--out", str(tmp_path / "s.npz")])
    assert code == 0, err


def test_experts_draw_latents_from_the_posterior_as_a_function_of_seed_and_step(
        latent_run, tiny_vae):
    images = load_dataset("digits", 16)
    # from the cache
    data = latents.latent_set(images, latents.VAE(str(tiny_vae)), str(latent_run))
    batches = TrainingBatches(data, np.arange(len(data)), 8, seed=3)
    idx, x = batches[5]
    again = TrainingBatches(data, np.arange(len(data)), 8, seed=3)[5][1]
    assert torch.equal(x, again)
    mean, std = (torch.from_numpy(data.moments[idx, j].astype(np.float32)) for j in (0, 1))
    z = (x - mean) / std
    # mean + std * N(0, 1)
    assert not torch.equal(x, mean) and abs(z.mean()) < 0.2 and 0.8 < z.std() < 1.2


def test_ddpm_expert_in_latents_reads_as_a_flow_without_the_pixel_clamp(latent_run):
    from plumbing.checkpoint import load
    expert = load(torch.load(latent_run / "experts" / "0" / "ckpt.pt", weights_only=True))
    assert expert.objective.clip_x0 is False
    x = torch.randn(4, 4, 8, 8) * 5
    v = expert.velocity(x, torch.full((4,), 0.9995), torch.zeros(4, dtype=torch.long))
    eps = expert.net(*expert.objective.matched_state(x, torch.full((4,), 0.9995))[:2],
                     torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(v).all() and eps.shape[1] == 4


def test_an_official_dit_in_latent_shape_is_imported_sampled_decoded_and_converted(
        latent_run, tmp_path):
    official = tmp_path / "DiT-tiny-official.pt"
    # learned sigma, adaLN-Zero, latent shape
    torch.save(random_official_state_dict(C=4, size=8, classes=10), official)
    run_stage(import_dit, [str(official), "--cluster", "all", "--run-dir", str(latent_run)])
    imported = torch.load(latent_run / "experts" / "all" / "ckpt.pt", weights_only=True)
    assert (imported["config"]["imported"]["file"] == official.name
            and imported["config"]["objective"]["name"] == "ddpm")
    assert imported["config"]["vae"]["fingerprint"] == torch.load(
        latent_run / "clusters.pt", weights_only=True)["vae"]["fingerprint"]
    out = tmp_path / "official.npz"
    run_stage(sample, ["--experts", "all", "--n", "6", "--steps", "3", "--cfg-scale", "2",
                       "--run-dir", str(latent_run), "--out", str(out)])
    with np.load(out) as batch:
        assert batch["arr_0"].shape == (6, 16, 16, 1)

    # HDDM's recipe: the DDPM checkpoint converted to a flow expert and fine-tuned on one
    # cluster's latents
    run_stage(train_expert, ["--objective", "fm", "--init", str(official),
                             "--cluster", "1", "--steps", "3", "--batch-size", "8",
                             "--out-dir", str(tmp_path / "converted"),
                             "--run-dir", str(latent_run)])
    converted = torch.load(tmp_path / "converted" / "ckpt.pt", weights_only=True)
    assert (converted["config"]["init"].startswith("convert_ddpm_to_fm")
            and converted["model_args"]["learn_sigma"] is False)
    assert converted["config"]["vae"] == imported["config"]["vae"]

    # a heterogeneous ensemble: the official DDPM network as expert 0, the converted flow
    # expert as expert 1
    mixed = tmp_path / "mixed"
    (mixed / "experts").mkdir(parents=True)
    for name in ("clusters.pt", "router"):
        (mixed / name).symlink_to(latent_run / name)
    run_stage(import_dit, [str(official), "--cluster", "0", "--run-dir", str(mixed)])
    (mixed / "experts" / "1").symlink_to(tmp_path / "converted")
    run_stage(sample, ["--routing", "full", "--n", "6", "--steps", "3",
                       "--run-dir", str(mixed), "--out", str(tmp_path / "mixed.npz")])
    with open(tmp_path / "mixed.json") as f:
        assert json.load(f)["objectives"] == {"0": "ddpm", "1": "fm"}


def test_a_dinov2_state_dict_in_the_release_format_clusters_digits(tmp_path):
    from timm.models.vision_transformer import VisionTransformer
    from plumbing.data.encoders import dinov2_features, load_dinov2
    torch.manual_seed(0)
    model = VisionTransformer(img_size=28, patch_size=14, embed_dim=64, depth=2,
                              num_heads=1, init_values=1.0, num_classes=0).eval()
    # the release's names: timm's plus the mask token
    state = {**model.state_dict(), "mask_token": torch.zeros(1, 64)}
    weights = tmp_path / "dinov2_tiny_pretrain.pth"
    torch.save(state, weights)
    loaded = load_dinov2(str(weights), 28, "cpu")
    x = load_dataset("digits").batch(np.arange(5))
    assert torch.allclose(dinov2_features(loaded, x, "cpu"),
                          dinov2_features(model, x, "cpu"), atol=1e-6)
    run = tmp_path / "runs"
    run_stage(cluster, ["--features", "dinov2", "--dinov2-weights", str(weights),
                        "--dinov2-size", "28", "--k", "3", "--fine-k", "20",
                        "--run-dir", str(run)])
    clusters = torch.load(run / "clusters.pt", weights_only=True)
    assert clusters["features"]["features"] == "dinov2"
    assert sum(clusters["sizes"]) == 1797 and min(clusters["sizes"]) > 0
    # other weights under the same file name: the cached features are keyed by content, so
    # they are computed anew
    torch.manual_seed(1)
    other = VisionTransformer(img_size=28, patch_size=14, embed_dim=64, depth=2,
                              num_heads=1, init_values=1.0, num_classes=0)
    torch.save({**other.state_dict(), "mask_token": torch.zeros(1, 64)}, weights)
    os.remove(run / "clusters.pt")
    run_stage(cluster, ["--features", "dinov2", "--dinov2-weights", str(weights),
                        "--dinov2-size", "28", "--k", "3", "--fine-k", "20",
                        "--run-dir", str(run)])
    assert len(os.listdir(run / "features")) == 2


def test_bad_latent_inputs_are_one_line_and_write_nothing(
        tmp_path, tiny_vae, latent_run, monkeypatch):
    not_vae = tmp_path / "unet"
    not_vae.mkdir()
    (not_vae / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    run = tmp_path / "runs"
    run.mkdir()
    # a VAE whose latents would all be scaled to zero: black samples
    unscaled = save_tiny_vae(tmp_path / "unscaled-vae", seed=0)
    config = json.loads((unscaled / "config.json").read_text())
    (unscaled / "config.json").write_text(json.dumps({**config, "scaling_factor": 0}))
    def variant(name, config_json):   # the tiny VAE's weights beside another config.json
        folder = tmp_path / name
        shutil.copytree(tiny_vae, folder)
        (folder / "config.json").write_text(config_json)
        return folder
    # float() would read 1.0
    malformed = [({"scaling_factor": True}, "scaling_factor is True, not a number"),
                 ({"scaling_factor": "0.18"}, "scaling_factor is '0.18', not a number"),
                 ({"shift_factor": "x"}, "shift_factor is 'x', not a number"),
                 # loads, fails at encode
                 ({"layers_per_block": 0}, "the weights do not fit config.json"),
                 ({"down_block_types": ["DownEncoderBlock2D"]},
                  "the weights do not fit config.json"),
                 # loads, ignores two weights
                 ({"use_quant_conv": False}, "2 unused, e.g. quant_conv")]
    cases = [
        (cluster, ["--vae", str(variant(f"malformed-{i}", json.dumps(
            {**config, **change}))), "--run-dir", str(run)], message)
        for i, (change, message) in enumerate(malformed)] + [
        (cluster, ["--vae", str(variant("list-config", "[1, 2]")), "--run-dir", str(run)],
         "config.json holds a list"),
        (cluster, ["--vae", str(unscaled), "--run-dir", str(run)], "scaling_factor 0"),
        (cluster, ["--vae", str(tmp_path / "missing"), "--run-dir", str(run)], "no VAE folder"),
        (cluster, ["--vae", str(not_vae), "--run-dir", str(run)], "not an AutoencoderKL"),
        (cluster, ["--features", "dinov2", "--run-dir", str(run)], "--dinov2-weights"),
        (cluster, ["--vae", str(tiny_vae), "--image-size", "15", "--run-dir", str(run)],
         "do not divide"),
        (sample, ["--vae", str(save_tiny_vae(tmp_path / "other-vae", seed=1)),
                  "--routing", "full", "--n", "2", "--steps", "1",
                  "--run-dir", str(latent_run), "--out", str(run / "x.npz")], "not the one"),
    ]
    before = snapshot(run), snapshot(latent_run)
    for module, argv, message in cases:
        code, err = cli(module, argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    monkeypatch.setattr(latents.VAE, "decode",
                        lambda self, z, channels: torch.zeros(1, channels, 3, 3))
    # a network that does not give what its config says
    code, err = cli(cluster, ["--vae", str(tiny_vae), "--run-dir", str(run)])
    assert (code == 2 and "the network gives 4x2x2 latents and 3x3x3 images" in err
            and len(err.strip().splitlines()) == 1), err
    monkeypatch.setitem(sys.modules, "diffusers", None)   # the optional package absent
    code, err = cli(cluster, ["--vae", str(tiny_vae), "--run-dir", str(run)])
    assert code == 2 and "requirements-latent.txt" in err and len(err.strip().splitlines()) == 1
    assert (snapshot(run), snapshot(latent_run)) == before


def test_experts_of_two_vaes_do_not_mix(tmp_path, tiny_vae, digits_run):
    other = save_tiny_vae(tmp_path / "other-vae", seed=1)
    run = tmp_path / "runs"
    run.mkdir()
    # pixels: each expert chooses its own space
    (run / "clusters.pt").symlink_to(digits_run / "clusters.pt")
    for k, vae in (("0", tiny_vae), ("1", other)):
        run_stage(train_expert, ["--cluster", k, "--vae", str(vae), "--model", "DiT-M/2",
                                 "--steps", "2", "--batch-size", "8",
                                 "--run-dir", str(run)])
    code, err = cli(sample, ["--routing", "oracle:0", "--n", "2", "--steps", "1",
                             "--run-dir", str(run), "--out", str(tmp_path / "x.npz")])
    assert code == 2 and "different spaces" in err and not (tmp_path / "x.npz").exists()
