"""Small on-disk fixtures in the real formats, and a way to run a stage's main() in-process."""
import contextlib
import hashlib
import io
import json
import os
import socket
import pickle
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_stage(module, argv):
    """Run a stage script's main() in-process with these command-line arguments."""
    return module.main(module.build_parser().parse_args(argv))


def run_script(script, *argv):
    """Run a stage's command line in-process (run_main, as `python SCRIPT ARGV` does):
    (exit code, "", stderr).

    Far cheaper than a new interpreter per case; an unexpected exception propagates as the
    test's failure.
    """
    import importlib
    code, err = cli(importlib.import_module(script[:-3]), argv)
    return code, "", err


def run_command(script, *argv, env=None):
    """Run a stage script as a user would, in a new process; returns (exit code, stdout,
    stderr)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, argv)],
                          capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def snapshot(folder):
    """{relative path: content hash} of every file under folder."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha1(f.read()).hexdigest()
    return out


def cli(module, argv):
    """Run a stage as its command line does (run_main), in-process: (exit code, stderr).
    Any traceback propagates."""
    stderr = io.StringIO()
    old_argv = sys.argv
    sys.argv = [module.__name__ + ".py", *map(str, argv)]
    from plumbing.command_line import run_main
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            run_main(module.main, module.build_parser())
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = old_argv
    return code, stderr.getvalue()


def fake_cifar10(root, per_batch=20, seed=0):
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    for i in range(1, 6):
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist(),
                 b"batch_label": f"training batch {i} of 5".encode()}
        with open(os.path.join(folder, f"data_batch_{i}"), "wb") as f:
            pickle.dump(batch, f)
    return folder


def fake_imagenet64(root, n=24, batches=2, seed=0, side=64):
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    for i in range(1, batches + 1):
        np.savez(os.path.join(root, f"train_data_batch_{i}.npz"),
                 data=rng.integers(0, 256, (n, 3 * side * side), dtype=np.uint8),
                 labels=rng.integers(1, 1001, n), mean=np.zeros(3 * side * side))
    return root


def write_idx(path, array, magic=None, gz=True):
    """One IDX file (LeCun's format: magic 0x0803 for images, 0x0801 for labels,
    big-endian sizes, unsigned bytes)."""
    import gzip
    array = np.asarray(array, dtype=np.uint8)
    header = (magic if magic is not None else 0x800 + array.ndim).to_bytes(4, "big")
    header += b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with (gzip.open(path + ".gz", "wb") if gz else open(path, "wb")) as f:
        f.write(header + array.tobytes())


def fake_idx_set(root, n_train=40, n_test=20, seed=0, gz=True):
    """Fashion-MNIST's four IDX files with random 28x28 images: training images dark
    (0..127), test images bright (128..255), so that a test can tell which split it was
    compared against."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    for split, n, low in (("train", n_train, 0), ("t10k", n_test, 128)):
        write_idx(os.path.join(root, f"{split}-images-idx3-ubyte"),
                  rng.integers(low, low + 128, (n, 28, 28)), gz=gz)
        write_idx(os.path.join(root, f"{split}-labels-idx1-ubyte"), np.arange(n) % 10, gz=gz)
    return root


def fake_folder(root, classes=("cat", "dog"), per_class=6, seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c in classes:
        os.makedirs(os.path.join(root, c))
        for i in range(per_class):
            w, h = rng.integers(20, 48, 2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                os.path.join(root, c, f"{i}.png"))
    return root


TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64,
                          "heads": 2, "layers": 1}}


def tiny_clip(tmp_path):
    """A randomly initialised small open_clip model saved as a config JSON plus a local
    weights file."""
    import open_clip
    import torch
    config = os.path.join(tmp_path, "tiny-clip.json")
    with open(config, "w") as f:
        json.dump(TINY_CLIP, f)
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-clip")
    weights = os.path.join(tmp_path, "tiny-clip.pt")
    torch.save(model.state_dict(), weights)
    return config, weights


def random_official_state_dict(seed=0, hidden=64, depth=2, patch=2, C=4, size=8, classes=10):
    """A state dict with facebookresearch/DiT's keys and shapes (learned sigma,
    adaLN-Zero) and random values."""
    import torch
    from model import sincos_pos_embed
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2
    sd = {"pos_embed": torch.from_numpy(sincos_pos_embed(hidden, size // patch)).float()[None],
          "x_embedder.proj.weight": r(hidden, C, patch, patch),
          "x_embedder.proj.bias": r(hidden),
          "t_embedder.mlp.0.weight": r(hidden, 256), "t_embedder.mlp.0.bias": r(hidden),
          "t_embedder.mlp.2.weight": r(hidden, hidden), "t_embedder.mlp.2.bias": r(hidden),
          "y_embedder.embedding_table.weight": r(classes + 1, hidden),
          "final_layer.linear.weight": r(patch * patch * 2 * C, hidden),
          "final_layer.linear.bias": r(patch * patch * 2 * C),
          "final_layer.adaLN_modulation.1.weight": r(2 * hidden, hidden),
          "final_layer.adaLN_modulation.1.bias": r(2 * hidden)}
    for i in range(depth):
        for name, shape in [("attn.qkv", (3 * hidden, hidden)),
                            ("attn.proj", (hidden, hidden)), ("mlp.fc1", (4 * hidden, hidden)),
                            ("mlp.fc2", (hidden, 4 * hidden)),
                            ("adaLN_modulation.1", (6 * hidden, hidden))]:
            sd[f"blocks.{i}.{name}.weight"], sd[f"blocks.{i}.{name}.bias"] = r(
                *shape), r(shape[0])
    return {k: v.float() for k, v in sd.items()}


def free_port():
    """A port nothing listens on now: a fixed one collides with a previous run's socket
    still in TIME_WAIT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A release's user: a fresh interpreter in isolated mode (-I: no script folder, no
# PYTHONPATH, no user site) in a folder outside the project, so that nothing of the project
# can be imported, loading each release with diffusers alone. Arguments named "@KEY" are
# the array KEY of the inputs; a scheduler is [class name, from_config keywords]. Writes
# each case's images, or the error it raised.
PIPELINE_USER = """
import importlib.util, json, sys
import numpy as np, torch
import diffusers
from diffusers import DiffusionPipeline
assert not any(importlib.util.find_spec(m) for m in ("sample", "routing", "plumbing")), sys.path
cases, inputs = json.load(open(sys.argv[1])), np.load(sys.argv[2])
images, errors, pipes = {}, {}, {}
for name, case in cases.items():
    try:
        if case["release"] not in pipes:
            pipes[case["release"]] = DiffusionPipeline.from_pretrained(case["release"],
                                                                       trust_remote_code=True)
        pipe, default = pipes[case["release"]], pipes[case["release"]].scheduler
        if case.get("scheduler"):
            kind, options = case["scheduler"]
            pipe.scheduler = getattr(diffusers, kind).from_config(default.config, **options)
        call = {k: torch.from_numpy(inputs[v[1:]]) if isinstance(v, str) and v[:1] == "@"
                else v for k, v in case["call"].items()}
        try:
            images[name] = pipe(**{"output_type": "np", **call}).images
        finally:
            pipe.scheduler = default
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"
np.savez(sys.argv[3], **images)
json.dump({"errors": errors, "kinds": {r: type(p).__name__ for r, p in pipes.items()}},
          open(sys.argv[4], "w"))
"""


def run_in_diffusers(folder, cases, **arrays):
    """({case: images}, {case: "ErrorType: message"}) of each case run by a release's user
    (PIPELINE_USER) in a fresh interpreter: case = {"release": path, "call": keywords,
    "scheduler": optional}."""
    folder = os.fspath(folder)
    paths = [os.path.join(folder, name) for name in ("cases.json", "inputs.npz",
                                                     "images.npz", "errors.json")]
    with open(paths[0], "w") as f:
        json.dump({k: {**c, "release": os.fspath(c["release"])} for k, c in cases.items()}, f)
    np.savez(paths[1], **{k: np.asarray(v) for k, v in arrays.items()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-c", PIPELINE_USER, *paths], cwd=folder,
                          env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(paths[3]) as f:
        report = json.load(f)
    assert set(report["kinds"].values()) <= {"DecentralizedDiffusionPipeline"}, report
    return dict(np.load(paths[2])), report["errors"]


def sample_py_images(run_dir, noise, steps, *, labels=None, prompts=None, negative=None,
                     clip=(None, None), rule="top1", scale=1.0, draws=None, shift=1.0,
                     which=""):
    """What sample.py computes for this noise (its own setup, condition, Euler sampler on
    the grid of this shift and decoder), as floats in [0, 1], N x H x W x C."""
    import torch
    import routing
    import sample
    from plumbing.data.latents import VAE
    experts, router, rule, names = sample.setup(os.fspath(run_dir), which, None, rule)
    ref = next(iter(experts.values()))
    condition = ref.condition
    if prompts is not None:
        condition = condition.with_prompts(prompts, negative, data_spec=ref.config.get("data_spec"),
                                           run_dir=os.fspath(run_dir), clip_model=clip[0],
                                           clip_pretrained=clip[1])
        labels = torch.arange(len(prompts))
    ids = labels if labels is not None else condition.null(len(noise))
    ensemble = routing.Ensemble(experts, routing.routing_function(router, condition), rule,
                                condition, len(names), scale, "shared")
    x, _ = routing.sample(ensemble, noise, ids, steps, time_shift=shift, draws=draws)
    if ref.config.get("vae"):
        x = VAE(os.path.join(run_dir, "vae")).decode(x, ref.config["data"]["shape"][0])
    return ((x.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
