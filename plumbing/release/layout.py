"""A trained ensemble as the field shares models: safetensors weights in one folder per
network, a JSON index and a model card, nothing pickled and no optimizer state.

    release/model_index.json                 the index: experts by name, router, routing default,
                                             condition, VAE, data fingerprints, FLOPs, measured FD
    release/README.md                        the model card, generated from what the run recorded
    release/experts/<name>/config.json       the network's constructor arguments and its checkpoint
                                             config (objective, condition, membership, flags)
    release/experts/<name>/diffusion_pytorch_model.safetensors   its EMA weights
    release/router/config.json, .../diffusion_pytorch_model.safetensors

The layout is a run folder's (`experts/<name>/`, `router/`), so every stage that reads
a run folder reads a release in its place; a network folder holds either a training
checkpoint (ckpt.pt) or these two files. An expert exported for diffusers (`layout:
diffusers`) has diffusers' config and keys (diffusers_format.py), our own config under
the key `_ddm`, and loads with `DiTTransformer2DModel.from_pretrained` or
`PixArtTransformer2DModel.from_pretrained`."""
import json
import os
import re

import torch

from model import DiT, Router, renamed_args
from plumbing.release import diffusers_format

# 2: model_index.json is diffusers' pipeline index, this project's index under its "_ddm"
RELEASE_FORMAT = 2
# an expert's name in a release: a cluster id, a contribution name, 'all' or 'distilled'
PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
INDEX = "model_index.json"
CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
NULL_CAPTION = "null_caption.safetensors"   # a PixArt-layout text expert's "no caption" input


class ReleaseError(ValueError):
    """A release or network folder that cannot be read; its message is one line for the
    user."""


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ReleaseError(f"{what}: no {os.path.basename(path)} in {os.path.dirname(path)}")
    except (OSError, ValueError) as e:
        raise ReleaseError(f"{what}: {path} is not readable JSON ({type(e).__name__}: {e})")


def read_tensors(path, what):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise ReleaseError(f"{what}: no {os.path.basename(path)} in {os.path.dirname(path)}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ReleaseError(f"{what}: {path} is not a complete safetensors file "
                           "(truncated or damaged: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__})")


def time_convention(objective, model_args):
    """How an expert reads time, in words: what a user of the weights alone must know."""
    scale = model_args.get("t_scale", 1.0)
    if objective["name"] == "fm":
        return ("rectified flow: x_t = (1 - t) x0 + t eps, t in [0, 1] (1 = noise), "
                f"predicts v = eps - x0; the network's time input is {scale:g} * t")
    return ("DDPM epsilon-prediction: step s in 0..999 (999 = noisiest), "
            f"{objective.get('beta_schedule', 'linear')} betas; the network's time input "
            "is s")


def network_files(state, model_args, config, source, diffusers=False):
    """{file name: content} of one network folder: config.json (text) and the weights
    (tensors)."""
    ddm = {"format": RELEASE_FORMAT, "model_args": model_args, "config": config, "source": source}
    if not diffusers:
        kind = "Router" if config.get("network") == "router" else "DiT"
        return {CONFIG: {"_class_name": kind, "_ddm": {**ddm, "layout": "ddm"}}, WEIGHTS: state}
    theirs, their_config, extras = diffusers_format.to_diffusers(state, model_args)
    if their_config["_class_name"] in diffusers_format.DIT_CLASSES:
        ddm["time_embedding"] = ("diffusers' DiT embeds time with "
                                 "downscale_freq_shift=1, this network was trained with "
                                 "0: call diffusers_format.use_dit_time_embedding(model) "
                                 "after loading")
    files = {CONFIG: {**their_config, "_ddm": {**ddm, "layout": "diffusers"}}, WEIGHTS: theirs}
    if "null_caption" in extras:
        files[NULL_CAPTION] = {"null_caption": extras["null_caption"].contiguous()}
    return files


def write_network(folder, files):
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    for name, content in files.items():
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            with open(path, "w") as f:
                json.dump(content, f, indent=1)
        else:
            save_file({k: v.detach().cpu().contiguous() for k, v in content.items()}, path,
                      metadata={"format": "pt"})


def check_shapes(state, model_args, network, what):
    """Every tensor the config's network holds, at its shape, and nothing else."""
    try:
        with torch.device("meta"):
            want = {k: v.shape for k, v in (Router if network == "router" else DiT)(**model_args)
                    .state_dict().items()}
    except (TypeError, ValueError, ZeroDivisionError, AssertionError, RuntimeError) as e:
        raise ReleaseError(f"{what}: config.json's model_args build no network "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    misfit = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k])]
    if missing or unexpected or misfit:
        detail = (f"{misfit[0]} has shape {tuple(state[misfit[0]].shape)}, config.json's "
                  f"network {tuple(want[misfit[0]])}" if misfit else
                  f"{missing[0]} is missing" if missing else
                  f"{unexpected[0]} is not in its network")
        raise ReleaseError(f"{what}: the weights disagree with config.json ({detail})")


def read_network(folder, what="network"):
    """A network folder of a release as a checkpoint dict ({model_args, config, ema,
    source}), which checkpoint.load reads like a training checkpoint. A plain diffusers
    DiT folder (no `_ddm`, e.g. a converted facebookresearch/DiT) has no training
    record: {model_args, ema, init}, which checkpoint.load takes for a
    class-conditional DDPM expert, as it takes DiT's own."""
    config_json = read_json(os.path.join(folder, CONFIG), what)
    if not isinstance(config_json, dict) or not isinstance(config_json.get("_ddm", {}), dict):
        raise ReleaseError(f"{what}: {folder}/{CONFIG} is not a network's config (a JSON object)")
    ddm = config_json.get("_ddm")
    if ddm is not None and not isinstance(ddm.get("format"), int):
        raise ReleaseError(f"{what}: {folder}/{CONFIG} has no release format number")
    missing = [k for k in ("layout", "model_args", "config") if ddm is not None and
               not isinstance(ddm.get(k), str if k == "layout" else dict)]
    if missing:   # a release's record is all or nothing: a part of one is damage
        raise ReleaseError(f"{what}: {folder}/{CONFIG}'s _ddm record has no {missing[0]}")
    if ddm is not None and ddm["format"] > RELEASE_FORMAT:
        raise ReleaseError(f"{what}: {folder} was written in release format "
                           f"{ddm['format']}; this version reads {RELEASE_FORMAT} and "
                           "older: update this project")
    state = read_tensors(os.path.join(folder, WEIGHTS), what)
    layout = ddm["layout"] if ddm else "diffusers"
    try:
        if layout == "diffusers":
            extras = read_tensors(os.path.join(folder, NULL_CAPTION), what) \
                if config_json.get("_class_name") == diffusers_format.PIXART_CLASS else None
            state, inferred = diffusers_format.from_diffusers(state, config_json, extras)
    except (diffusers_format.DiffusersFormatError, KeyError) as e:
        raise ReleaseError(f"{what}: {folder} is not a DiT this project reads ({e})")
    if ddm is None:   # no training record: checkpoint.load takes it for an official-style DiT
        return {"model_args": inferred, "ema": state,
                "init": f"diffusers {config_json.get('_class_name')} folder"}
    model_args, config, source = renamed_args(ddm["model_args"]), ddm["config"], ddm.get("source")
    check_shapes(state, model_args, config.get("network"), what)
    return {"model_args": model_args, "config": config, "ema": state, "source": source}


def check_index(folder):
    """A release's index: a format this version reads, each expert named once, every
    folder it names present. Returns the index."""
    index = read_json(os.path.join(folder, INDEX), "release")
    if isinstance(index, dict) and "_ddm" in index:   # format 2: beside diffusers' pipeline index
        index = index["_ddm"]
    if not isinstance(index, dict):
        raise ReleaseError(f"release {folder}: {INDEX} is not an index (a JSON object)")
    version = index.get("_ddm_release_format")
    if not isinstance(version, int):
        raise ReleaseError(f"release {folder}: {INDEX} has no _ddm_release_format")
    if version > RELEASE_FORMAT:
        raise ReleaseError(f"release {folder} is in format {version}; this version reads "
                           f"{RELEASE_FORMAT} and older: update this project")
    experts, router = index.get("experts"), index.get("router")
    # the index is the one list of what the release holds: each entry names its folder as
    # a plain name under the release, never a path elsewhere on the machine
    if not isinstance(experts, list) or not experts or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and PLAIN.fullmatch(e["name"])
            and e.get("folder") == f"experts/{e['name']}" for e in experts):
        raise ReleaseError(f"release {folder}: {INDEX} must list its experts as "
                           '{"name": NAME, "folder": "experts/NAME"}, NAME a plain name')
    if router is not None and (not isinstance(router, dict) or router.get("folder") != "router"):
        raise ReleaseError(f'release {folder}: {INDEX}\'s router must be {{"folder": "router"}}')
    names = [e["name"] for e in experts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ReleaseError(f"release {folder}: {INDEX} names expert {twice[0]} twice")
    for entry in experts + ([router] if router else []):
        path = os.path.join(folder, entry["folder"])
        if not os.path.isfile(os.path.join(path, CONFIG)):
            what = f"expert {entry['name']}" if "name" in entry else "the router"
            raise ReleaseError(f"release {folder}: {INDEX} lists {what} at "
                               f"{entry['folder']}, which is missing")
    return index


# what a release ships for diffusers: the pipeline module and the standalone method files
# it runs, in the release's root and in each custom component's folder (diffusers imports
# a component's class from a module in that component's folder)
PIPELINE_MODULE = "pipeline_ddm"
METHOD_FILES = ("model.py", "diffusion.py", "routing.py")
# the project's root: this file is plumbing/release/layout.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pipeline_files(router):
    """{path in the release: text} of the shipped pipeline code: plumbing/release/hub_pipeline.py and
    the method files, their imports of each other made relative, as diffusers' remote-code
    loader needs."""
    sources = {f"{PIPELINE_MODULE}.py": os.path.join(ROOT, "plumbing", "release", "hub_pipeline.py"),
               **{name: os.path.join(ROOT, name) for name in METHOD_FILES}}
    relative = re.compile(r"^from (diffusion|model|routing) import", re.MULTILINE)
    texts = {}
    for name, path in sources.items():
        with open(path) as f:
            texts[name] = relative.sub(r"from .\1 import", f.read())
    return {os.path.join(folder, name): text for folder in ("", "experts") + (("router",) if router else ())
            for name, text in texts.items()}


def pipeline_index(index):
    """model_index.json of a release: diffusers' pipeline index (the pipeline class, its
    experts, router and flow scheduler), this project's index under "_ddm"."""
    module = PIPELINE_MODULE
    return {"_class_name": [module, "DecentralizedDiffusionPipeline"], "_diffusers_version": "0.38.0",
            "experts": [module, "ExpertSet"],
            "router": [module, "RouterNetwork"] if index.get("router") else [None, None],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "_ddm": index}


# diffusers' FlowMatchEulerDiscreteScheduler at shift 1: Euler steps on the pipeline's own
# time grid (sample.py's), which it passes as sigmas
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.38.0",
                    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}

