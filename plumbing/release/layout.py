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

from plumbing.release import diffusers_format
from plumbing.release.reader import CONFIG, INDEX, NULL_CAPTION, RELEASE_FORMAT, WEIGHTS

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


# what a release ships for diffusers: the pipeline module at the release's root, the
# components' module in each custom component's folder (diffusers imports a component's
# class from a module in that component's own folder: pipeline_loading_utils.
# get_class_obj_and_candidates, 0.38-0.42), and beside each the standalone files it imports
PIPELINE_MODULE = "pipeline_ddm"
COMPONENTS_MODULE = "hub_components"
SHARED = {"model.py": "model.py", "diffusion.py": "diffusion.py",
          "reader.py": "plumbing/release/reader.py",
          "diffusers_format.py": "plumbing/release/diffusers_format.py",
          f"{COMPONENTS_MODULE}.py": f"plumbing/release/{COMPONENTS_MODULE}.py"}
ROOT_ONLY = {f"{PIPELINE_MODULE}.py": "plumbing/release/hub_pipeline.py",
             "routing.py": "routing.py"}
# the project's root: this file is plumbing/release/layout.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a shipped file's imports of the others, made relative as diffusers' remote-code loader
# needs ("from model import" -> "from .model import", "from plumbing.release.reader import"
# -> "from .reader import")
PROJECT_IMPORT = re.compile(r"^from (?:plumbing\.release\.)?(diffusion|model|routing|reader|"
                            r"diffusers_format|hub_components) import", re.MULTILINE)


def shipped_text(path):
    """A shipped file's text as the release holds it: its imports of the others relative."""
    with open(os.path.join(ROOT, path)) as f:
        return PROJECT_IMPORT.sub(r"from .\1 import", f.read())


def pipeline_files(components):
    """{path in the release: text} of the shipped code: the pipeline and what it imports at
    the root, the components' module and what it imports in the folder of each custom
    component (`components`: experts, router, text_encoder)."""
    shared = {name: shipped_text(path) for name, path in SHARED.items()}
    files = {name: shipped_text(path) for name, path in ROOT_ONLY.items()} | shared
    for folder in components:
        files |= {os.path.join(folder, name): text for name, text in shared.items()}
    return files


def pipeline_index(index, text_encoder):
    """model_index.json of a release: diffusers' pipeline index (the pipeline class and its
    components: experts, flow scheduler, and where the release has them the router, the
    VAE and the text encoder), this project's index under "_ddm"."""
    module = PIPELINE_MODULE
    return {"_class_name": [module, "DecentralizedDiffusionPipeline"], "_diffusers_version": "0.38.0",
            "experts": [COMPONENTS_MODULE, "ExpertSet"],
            "router": [COMPONENTS_MODULE, "RouterNetwork"] if index.get("router") else [None, None],
            "vae": ["diffusers", "AutoencoderKL"] if index.get("vae") else [None, None],
            "text_encoder": [COMPONENTS_MODULE, "TextTower"] if text_encoder else [None, None],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "_ddm": index}


# diffusers' FlowMatchEulerDiscreteScheduler at shift 1: Euler steps on the pipeline's own
# time grid (sample.py's), which it passes as sigmas
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.38.0",
                    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}

