"""The diffusers pipeline shipped inside every release (plumbing/release/hub_pipeline.py): loaded by
diffusers alone, in a process that cannot import this project, it samples the routed ensemble
exactly as sample.py does; the release's model card parses as the Hub reads it."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import cluster
import distill
import eval as evaluate
import export
import sample
import train_expert
import train_router
from helpers import ROOT, cli, run_in_diffusers, run_stage, sample_py_images

diffusers = pytest.importorskip("diffusers")
TINY = ["--model", "DiT-M/2", "--steps", "5", "--batch-size", "16"]
CASES = [("top1", 1.0), ("full", 1.0), ("top1", 2.0), ("full", 2.0), ("draw", 2.0)]
STEPS = 4


def check_equal(run_dir, tmp_path, export_flags=(), which=""):
    """The release of run_dir, sampled by diffusers alone in a fresh interpreter, equals
    sample.py's images for every routing rule and guidance scale of CASES (to 1e-5);
    returns the release and the worst difference."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(run_dir), "--out", str(release), *export_flags])
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(10, (6,), generator=g)
    noise = torch.randn(6, 1, 8, 8, generator=g)
    draws = torch.rand(6, generator=g, dtype=torch.float64)
    cases = {f"{rule}-{scale}": {"release": release, "call": {
        "class_labels": labels.tolist(), "latents": "@noise",
        **({"draws": "@draws"} if rule == "draw" else {}),
        "num_inference_steps": STEPS, "routing": rule, "guidance_scale": scale}}
        for rule, scale in CASES}
    images, errors = run_in_diffusers(tmp_path, cases, noise=noise, draws=draws)
    assert not errors, errors
    worst = 0.0
    for rule, scale in CASES:
        ours = sample_py_images(release, noise, STEPS, labels=labels, rule=rule, scale=scale,
                                draws=draws, which=which)
        worst = max(worst, float(np.abs(images[f"{rule}-{scale}"] - ours).max()))
    assert worst < 1e-5, worst
    return release, worst


def test_a_heterogeneous_release_samples_in_diffusers_as_sample_py_does(tiny_ensemble, tmp_path):
    """DDPM experts read as flow velocities by the same SNR match, top-1 and full, with
    guidance."""
    check_equal(tiny_ensemble, tmp_path)


@pytest.mark.parametrize("which", ["all", "distilled"])
def test_a_single_model_release_samples_in_diffusers_as_sample_py_does(which, tiny_ensemble,
                                                                       tmp_path):
    """The monolith and a distilled student: no router (the index's router is null, an
    optional component), every routing rule one model, guidance on it."""
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    if which == "distilled":
        run_stage(distill, ["--steps", "4", "--batch-size", "8", "--experts", "0,1",
                            "--model", "DiT-M/2", "--run-dir", str(run)])
    release, _ = check_equal(run, tmp_path, ["--experts", which], which)
    index = json.loads((release / "model_index.json").read_text())
    assert index["router"] == [None, None] and index["_ddm"]["router"] is None


@pytest.fixture(scope="module")
def grown_flow_run(tmp_path_factory):
    """Digits, K = 2 flow experts, a contributor's expert of the eights, and a router of
    all three."""
    run = tmp_path_factory.mktemp("pipeline") / "run"
    run_stage(cluster, ["--k", "2", "--run-dir", str(run)])
    for k in range(2):
        run_stage(train_expert, ["--cluster", str(k), *TINY, "--run-dir", str(run)])
    run_stage(train_expert, ["--contribution", "eights", "--classes", "8", *TINY,
                             "--run-dir", str(run)])
    run_stage(train_router, ["--model", "DiT-M/2", "--steps", "20", "--run-dir", str(run)])
    return run


def test_a_flow_release_grown_by_a_contributor_samples_in_diffusers_as_sample_py_does(
        grown_flow_run, tmp_path):
    release, _ = check_equal(grown_flow_run, tmp_path)
    index = json.loads((release / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_ddm", "DecentralizedDiffusionPipeline"]
    assert [e["name"] for e in index["_ddm"]["experts"]] == ["0", "1", "eights"]


def test_the_release_reads_as_before_and_runs_no_code_of_its_own_here(grown_flow_run, tmp_path,
                                                                      monkeypatch):
    """sample.py reads the release bit-identically to its run; the shipped .py files are
    only read by diffusers: with every one of them raising on import, sample.py, eval.py and
    a second export read the release as before (and run from inside its folder)."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(grown_flow_run), "--out", str(release)])
    shipped = sorted(os.path.relpath(os.path.join(r, f), release)
                     for r, _, fs in os.walk(release) for f in fs
                     if f.endswith(".py"))
    texts = {path: (release / path).read_text() for path in shipped}
    for path in shipped:
        (release / path).write_text("raise RuntimeError('a release's code ran')\n")
    monkeypatch.chdir(release)
    draws = {}
    for name, folder in (("run", grown_flow_run), ("release", release)):
        code, err = cli(sample, ["--run-dir", str(folder), "--n", "8", "--steps", "3",
                                 "--solver", "euler", "--time-shift", "1",
                                 "--out", str(tmp_path / f"{name}.npz")])
        assert code == 0, err
        draws[name] = np.load(tmp_path / f"{name}.npz")["arr_0"]
    assert np.array_equal(draws["run"], draws["release"])
    code, err = cli(evaluate, [str(tmp_path / "release.npz"), "--run-dir", str(release),
                               "--classifier-steps", "5", "--max-real", "50"])
    assert code == 0, err
    code, err = cli(export, ["--run-dir", str(release), "--out", str(tmp_path / "again")])
    assert code == 0, err
    for path in shipped:
        (release / path).write_text(texts[path])
    # the pipeline once, at the root; the components' module in each component's folder,
    # as diffusers needs
    shared = ("diffusion.py", "model.py", "reader.py", "diffusers_format.py",
              "hub_components.py")
    assert shipped == sorted([*(os.path.join(folder, f) for folder in ("", "experts", "router")
                                for f in shared), "pipeline_ddm.py", "routing.py"])
    # every file trust_remote_code runs is pinned in the index by its digest and named,
    # with it, on the card
    import hashlib
    pinned = json.loads((release / "model_index.json").read_text())["_ddm"]["code"]
    assert sorted(pinned) == shipped
    card = (release / "README.md").read_text()
    for path, digest in pinned.items():
        assert digest == hashlib.sha256((release / path).read_bytes()).hexdigest()
        assert f"`{path}` {digest}" in card
    # generated from this project's own files, nothing else changed than their imports
    # of each other
    for name, path in (("pipeline_ddm.py", "plumbing/release/hub_pipeline.py"),
                       ("experts/hub_components.py", "plumbing/release/hub_components.py"),
                       ("reader.py", "plumbing/release/reader.py")):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for module in ("diffusion", "model", "routing", "plumbing.release.reader",
                       "plumbing.release.diffusers_format", "plumbing.release.hub_components"):
            text = text.replace(f"from {module} import", f"from .{module.split('.')[-1]} import")
        assert (release / name).read_text() == text


def test_the_model_card_front_matter_is_what_the_hub_indexes(grown_flow_run, tmp_path):
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(grown_flow_run), "--out", str(release),
                       "--license", "mit"])
    text = (release / "README.md").read_text()
    assert text.startswith("---\n")
    yaml = pytest.importorskip("yaml")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["library_name"] == "diffusers" and meta["license"] == "mit"
    assert meta["pipeline_tag"] == "unconditional-image-generation"
    assert {"decentralized-diffusion", "mixture-of-experts", "dit"} <= set(meta["tags"])
    try:
        from huggingface_hub import ModelCard
    except ImportError:
        return
    card = ModelCard.load(release / "README.md")
    assert card.data.library_name == "diffusers" and card.data.license == "mit"


def labelled_noise(n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, (n,), generator=g), torch.randn(n, 1, 8, 8, generator=g)


FLOW = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
SCHEDULERS = {"euler-shift-3": ["FlowMatchEulerDiscreteScheduler", {"shift": 3.0}],
              "unipc": ["UniPCMultistepScheduler", FLOW],
              "dpm-solver++": ["DPMSolverMultistepScheduler",
                               {**FLOW, "algorithm_type": "dpmsolver++"}]}


def test_every_flow_scheduler_family_samples_a_release(grown_flow_run, tmp_path):
    """Swapped in as in any diffusers pipeline: Euler with shift 3 is sample.py's --solver
    euler --time-shift 3 (to 1e-5); UniPC and DPM-Solver++ in their flow configuration land
    near sample.py's fine-grid reference; a noise-prediction scheduler is refused in one
    line."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(grown_flow_run), "--out", str(release)])
    labels, noise = labelled_noise()
    cases = {f"{name}-{rule}": {"release": release, "scheduler": scheduler, "call": {
        "class_labels": labels.tolist(), "latents": "@noise", "num_inference_steps": 8,
        "routing": rule, "guidance_scale": 2.0}}
        for name, scheduler in SCHEDULERS.items() for rule in ("top1", "full")}
    cases["epsilon"] = {**cases["unipc-top1"], "scheduler": ["UniPCMultistepScheduler", {}]}
    images, errors = run_in_diffusers(tmp_path, cases, noise=noise)
    assert list(errors) == ["epsilon"] and "flow velocity" in errors["epsilon"] \
        and "\n" not in errors["epsilon"], errors
    for rule in ("top1", "full"):
        euler = sample_py_images(release, noise, 8, labels=labels, rule=rule, scale=2.0, shift=3.0)
        assert np.abs(images[f"euler-shift-3-{rule}"] - euler).max() < 1e-5
        fine = sample_py_images(release, noise, 64, labels=labels, rule=rule, scale=2.0, shift=3.0)
        # the noise itself, shown as an image: how far a sampler that did nothing would be
        nothing = np.abs((noise.clamp(-1, 1) + 1).permute(0, 2, 3, 1).numpy() / 2 - fine).mean()
        for name in ("unipc", "dpm-solver++"):
            got = images[f"{name}-{rule}"]
            assert got.shape == (6, 8, 8, 1) and np.isfinite(got).all()
            assert np.abs(got - fine).mean() < 0.25 * nothing, (name, rule)


def damage(release, tmp_path, name, change):
    """A copy of the release with one thing changed by `change(copy)`."""
    copy = tmp_path / name
    shutil.copytree(release, copy)
    change(copy)
    return copy


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_weights(path, edit):
    from safetensors.torch import load_file, save_file
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_a_damaged_release_or_call_is_refused_by_the_pipeline_in_one_line(grown_flow_run,
                                                                          tmp_path):
    """The pipeline reads a release with the checks sample.py's reader makes (reader.py)
    and bounds its arguments as sample.py bounds its flags: each case one line naming what
    is wrong, and nothing sampled."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(grown_flow_run), "--out", str(release)])
    weights = "experts/1/diffusion_pytorch_model.safetensors"
    first = "blocks.0.attn.qkv.weight"
    releases = {
        "int32": damage(release, tmp_path, "int", lambda r: edit_weights(
            r / weights, lambda s: s.update({first: s[first].to(torch.int32)}))),
        "not finite": damage(release, tmp_path, "nan", lambda r: edit_weights(
            r / weights, lambda s: s[first].view(-1).__setitem__(0, float("nan")))),
        "depth": damage(release, tmp_path, "deep", lambda r: edit_json(
            r / "experts/1/config.json",
            lambda c: c["_ddm"]["model_args"].update(depth=200_000))),
        "_ddm_release_format": damage(release, tmp_path, "bare", lambda r: edit_json(
            r / "model_index.json", lambda c: c.pop("_ddm"))),
        "plain name": damage(release, tmp_path, "elsewhere", lambda r: edit_json(
            r / "model_index.json",
            lambda c: c["_ddm"]["experts"][0].update(folder=str(release / "experts/0")))),
    }
    labels, noise = labelled_noise()
    good = {"class_labels": labels.tolist(), "num_inference_steps": 2}
    calls = {"guidance": {"guidance_scale": 1e6}, "guidance ": {"guidance_scale": float("nan")},
             "num_inference_steps": {"num_inference_steps": 0},
             "num_inference_steps ": {"num_inference_steps": 3_000_000_000},
             "class_labels": {"class_labels": [1, 10]}, "class_labels ": {"class_labels": [1.5]},
             "output_type": {"output_type": "bmp"}, "latents": {"latents": "@wrong"},
             "draws": {"routing": "draw", "draws": "@nan"},
             "draws ": {"routing": "top1", "draws": "@nan"},   # read by no other rule
             "prompt": {"prompt": "a cat"},
             "routing": {"routing": "best"}}
    cases = {**{key: {"release": path, "call": good} for key, path in releases.items()},
             **{key: {"release": release, "call": {**good, **change}}
                for key, change in calls.items()}}
    images, errors = run_in_diffusers(tmp_path, cases, wrong=noise[:, :, :4],
                                      nan=torch.full((6,), float("nan")))
    assert not images and sorted(errors) == sorted(cases), (list(images), errors)
    for key, message in errors.items():
        assert "\n" not in message and key.strip() in message, (key, message)
