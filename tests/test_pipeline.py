"""The diffusers pipeline shipped inside every release (plumbing/release/hub_pipeline.py): loaded by
diffusers alone, in a process that cannot import this project, it samples the routed ensemble
exactly as sample.py does; the release's model card parses as the Hub reads it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cluster
import export
import routing
import sample
import train_expert
import train_router
from helpers import ROOT, run_stage

diffusers = pytest.importorskip("diffusers")
TINY = ["--model", "DiT-M/2", "--steps", "5", "--batch-size", "16"]
CASES = [("top1", 1.0), ("full", 1.0), ("top1", 2.0), ("full", 2.0), ("draw", 2.0)]
STEPS = 4

# run by a fresh interpreter in isolated mode (-I: no script folder, no PYTHONPATH, no user site)
# from a folder outside the project, so nothing of this project can be imported
PIPELINE_RUN = """
import importlib.util, sys
import numpy as np, torch
from diffusers import DiffusionPipeline
assert not any(importlib.util.find_spec(m) for m in ("sample", "routing", "plumbing")), sys.path
release, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
cases, steps = eval(sys.argv[4]), int(sys.argv[5])
pipe = DiffusionPipeline.from_pretrained(release, trust_remote_code=True)
data = np.load(inputs)
images = {f"{rule}-{scale}": pipe(class_labels=data["labels"].tolist(),
                                  latents=torch.from_numpy(data["noise"]),
                                  draws=torch.from_numpy(data["draws"]),
                                  num_inference_steps=steps, routing=rule, guidance_scale=scale,
                                  output_type="np").images for rule, scale in cases}
np.savez(out, **images, kind=type(pipe).__name__)
"""


def run_pipeline(release, tmp_path, noise, labels, draws):
    np.savez(tmp_path / "inputs.npz", noise=noise.numpy(), labels=labels.numpy(),
             draws=draws.numpy())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-c", PIPELINE_RUN, str(release),
                           str(tmp_path / "inputs.npz"),
                           str(tmp_path / "pipeline.npz"), repr(CASES), str(STEPS)],
                          cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(tmp_path / "pipeline.npz")


def project_images(run_dir, noise, labels, rule, scale, draws):
    """What sample.py computes for this noise and these labels: its own setup and sampler."""
    experts, router, parsed, names = sample.setup(str(run_dir), "", None, rule)
    condition = next(iter(experts.values())).condition
    ensemble = routing.Ensemble(experts, routing.routing_function(router, condition),
                                parsed, condition,
                                len(names), scale, "shared")
    x, _ = routing.sample(ensemble, noise, labels, STEPS, draws=draws)
    return ((x.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()


def check_equal(run_dir, tmp_path):
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(run_dir), "--out", str(release)])
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(10, (6,), generator=g)
    noise = torch.randn(6, 1, 8, 8, generator=g)
    draws = torch.rand(6, generator=g, dtype=torch.float64)
    images = run_pipeline(release, tmp_path, noise, labels, draws)
    assert str(images["kind"]) == "DecentralizedDiffusionPipeline"
    for rule, scale in CASES:
        ours = project_images(release, noise, labels, rule, scale, draws)
        assert np.abs(images[f"{rule}-{scale}"] - ours).max() < 1e-5, (rule, scale)
    return release


def test_a_heterogeneous_release_samples_in_diffusers_as_sample_py_does(tiny_ensemble, tmp_path):
    """DDPM experts read as flow velocities by the same SNR match, top-1 and full, with
    guidance."""
    check_equal(tiny_ensemble, tmp_path)


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
    release = check_equal(grown_flow_run, tmp_path)
    index = json.loads((release / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_ddm", "DecentralizedDiffusionPipeline"]
    assert [e["name"] for e in index["_ddm"]["experts"]] == ["0", "1", "eights"]


def test_the_release_reads_as_before_and_runs_no_code_of_its_own_here(grown_flow_run, tmp_path):
    """sample.py reads the release bit-identically to its run; the shipped .py files are
    only read by diffusers."""
    release = tmp_path / "release"
    run_stage(export, ["--run-dir", str(grown_flow_run), "--out", str(release)])
    draws = {}
    for name, folder in (("run", grown_flow_run), ("release", release)):
        run_stage(sample, ["--run-dir", str(folder), "--n", "8", "--steps", "3",
                           "--solver", "euler", "--time-shift", "1",
                           "--out", str(tmp_path / f"{name}.npz")])
        draws[name] = np.load(tmp_path / f"{name}.npz")["arr_0"]
    assert np.array_equal(draws["run"], draws["release"])
    shipped = sorted(os.path.relpath(os.path.join(r, f), release)
                     for r, _, fs in os.walk(release) for f in fs
                     if f.endswith(".py"))
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
