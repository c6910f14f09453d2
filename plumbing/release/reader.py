"""The one checked reader of networks made on other machines: a release's index and
network folders, and the constructor arguments and weights of any checkpoint.

Two programs read releases: this project's stages (through checkpoint.py, ensemble.py and
eval.py) and the diffusers pipeline every release ships (hub_pipeline.py), which runs
with no copy of the project. Both call this file, so a release one refuses the other
refuses too, with the same line. export.py ships it beside the pipeline; it therefore
imports nothing of the project but the files shipped with it (model.py, diffusion.py,
diffusers_format.py).

What is checked, before anything is built from it:
  - the index: a format this version reads, each expert listed once under a plain name in
    its own folder of the release (never a path elsewhere), every listed folder present;
  - a network's config.json: its release record whole, in a format this version reads,
    of the kind asked for (an expert, the router), with an objective this project knows;
  - its constructor arguments: known names, whole numbers in range, sizes that divide, a
    parameter count this machine can hold (counted on the meta device: no memory);
  - its weights: a complete safetensors file, every tensor floating point and finite,
    every tensor of the network at its shape and nothing else.
Each refusal is a ReleaseError whose message is one line naming the file and the field."""
import inspect
import json
import os
import re
import tempfile

import torch

from diffusion import objective_from_spec
from model import DiT, Router, renamed_args, shape_disagreement
from plumbing.release.diffusers_format import PIXART_CLASS, DiffusersFormatError, from_diffusers

# 2: model_index.json is diffusers' pipeline index, this project's index under its "_ddm"
RELEASE_FORMAT = 2
# an expert's name in a release: a cluster id, a contribution name, 'all' or 'distilled'
PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
INDEX = "model_index.json"
CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
# a PixArt-layout text expert's "no caption" input
NULL_CAPTION = "null_caption.safetensors"


class ReleaseError(ValueError):
    """A release, network folder or checkpoint that cannot be used; its message is one
    line for the user."""


def absent(path, what):
    return ReleaseError(f"{what}: no {os.path.basename(path)} in {os.path.dirname(path)}")


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise absent(path, what)
    except (OSError, ValueError) as e:
        raise ReleaseError(f"{what}: {path} is not readable JSON "
                           f"({type(e).__name__}: {e})")


def read_tensors(path, what):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise absent(path, what)
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ReleaseError(f"{what}: {path} is not a complete safetensors file "
                           "(truncated or damaged: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__})")


# what a network's constructor arguments may say, whole numbers in [low, high]: anything
# beyond is damage or a hostile file, refused before a network is built from it
LIMITS = {"input_size": (1, 4096), "patch_size": (1, 256), "in_channels": (1, 256),
          "hidden_size": (1, 16384), "depth": (1, 512), "num_heads": (1, 1024),
          "num_classes": (0, 10 ** 6), "text_dim": (0, 16384), "text_len": (1, 4096),
          "cluster_classes": (0, 10 ** 6), "num_experts": (1, 10 ** 5),
          "downsample": (1, 4096)}
# a pos_embed of more elements (1 GiB in fp32) is no image model here
MAX_TOKEN_WIDTH = 2 ** 28


def check_model_args(model_args, network):
    """Refuse, in one line starting "its model_args", constructor arguments that build no
    `network` ('dit' or 'router') or one this machine cannot hold: unknown names, numbers
    out of range or of the wrong type, sizes that do not divide, an unknown modulation,
    classes and text together; then the parameter count, on the meta device (no memory),
    against half of the machine's."""
    if not isinstance(model_args, dict):
        raise ReleaseError(f"its model_args are a {type(model_args).__name__}, not "
                           "constructor arguments")
    cls = Router if network == "router" else DiT
    known = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise ReleaseError(f"its model_args name {unknown[0]}, which a {cls.__name__} "
                           "does not take")
    args = {**{k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
               if k != "self"}, **model_args}
    for key, (low, high) in LIMITS.items():
        value = args.get(key, low)
        if key in args and (type(value) is not int or not low <= value <= high):
            raise ReleaseError(f"its model_args say {key} {value!r}: a whole number in "
                               f"{low}..{high} builds a network")
    for key, low, high in (("mlp_ratio", 0, 64), ("t_scale", 0, 1e6)):
        value = args[key]
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not low < value <= high:
            raise ReleaseError(f"its model_args say {key} {value!r}: a number in "
                               f"({low}, {high}]")
    side = args["input_size"] // args.get("downsample", 1)
    if args["input_size"] % args.get("downsample", 1) or side % args["patch_size"]:
        raise ReleaseError(f"its model_args cut {side}-pixel inputs into "
                           f"{args['patch_size']}-pixel patches, which do not divide them")
    if args["hidden_size"] % args["num_heads"]:
        raise ReleaseError(f"its model_args split width {args['hidden_size']} into "
                           f"{args['num_heads']} heads, which do not divide it")
    if network != "router" and (args["modulation"] not in ("adaln-single", "adaln-zero")
                                or not isinstance(args["learn_sigma"], bool)):
        raise ReleaseError(f"its model_args say modulation {args['modulation']!r} and "
                           f"learn_sigma {args['learn_sigma']!r} (adaln-single or "
                           "adaln-zero; true or false)")
    classes, clusters = args["num_classes"], args.get("cluster_classes")
    if classes and args["text_dim"] or clusters and not classes:
        raise ReleaseError("its model_args condition a network on classes and text at once, "
                           "or on clusters without classes")
    if (side // args["patch_size"]) ** 2 * args["hidden_size"] > MAX_TOKEN_WIDTH:
        raise ReleaseError(f"its model_args make {(side // args['patch_size']) ** 2} tokens "
                           f"of width {args['hidden_size']}: no network this project builds")
    with torch.device("meta"):
        parameters = sum(p.numel() for p in cls(**model_args).parameters())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * parameters > memory // 2:
        raise ReleaseError(f"its model_args build {parameters:,} parameters, "
                           f"{4 * parameters / 2 ** 30:.1f} GiB in fp32: more than half of "
                           f"this machine's {memory / 2 ** 30:.0f} GiB")


def check_weights(state):
    """Refuse, in one line starting "its weight", a state dict with a tensor that is not
    floating point or not finite: load_state_dict would cast integers and keep NaN, and
    the network would sample wrong images without a word."""
    bad = next((name for name, t in state.items() if not torch.is_tensor(t)
                or not t.is_floating_point() or not torch.isfinite(t).all()), None)
    if bad is not None:
        t = state[bad]
        what = (f"a {type(t).__name__}" if not torch.is_tensor(t) else
                "not finite" if t.is_floating_point() else f"of {t.dtype}")
        raise ReleaseError(f"its weight {bad} is {what}: damaged, not a trained network")


def check_shapes(state, model_args, network, what):
    """Every tensor the config's network holds, at its shape, and nothing else."""
    with torch.device("meta"):
        net = (Router if network == "router" else DiT)(**model_args)
        want = {k: v.shape for k, v in net.state_dict().items()}
    detail = shape_disagreement(state, want, "config.json's network")
    if detail:
        raise ReleaseError(f"{what}: the weights disagree with config.json ({detail})")


def release_record(config_json, folder, what):
    """The `_ddm` record of a network folder's config.json, checked whole; None for a
    plain diffusers folder (no record)."""
    if not isinstance(config_json, dict) or not isinstance(config_json.get("_ddm", {}), dict):
        raise ReleaseError(f"{what}: {folder}/{CONFIG} is not a network's config "
                           "(a JSON object)")
    ddm = config_json.get("_ddm")
    if ddm is None:
        return None
    if not isinstance(ddm.get("format"), int):
        raise ReleaseError(f"{what}: {folder}/{CONFIG} has no release format number")
    missing = [k for k in ("layout", "model_args", "config")
               if not isinstance(ddm.get(k), str if k == "layout" else dict)]
    if missing:   # a release's record is all or nothing: a part of one is damage
        raise ReleaseError(f"{what}: {folder}/{CONFIG}'s _ddm record has no {missing[0]}")
    if ddm["format"] > RELEASE_FORMAT:
        raise ReleaseError(f"{what}: {folder} was written in release format "
                           f"{ddm['format']}; this version reads {RELEASE_FORMAT} and "
                           "older: update this project")
    return ddm


def read_network(folder, what="network", expect=None):
    """A network folder of a release as a checkpoint dict ({model_args, config, ema,
    source}), which checkpoint.load reads like a training checkpoint; `expect` ('dit' or
    'router') refuses the other kind. A plain diffusers DiT folder (no `_ddm`, e.g. a
    converted facebookresearch/DiT) has no training record: {model_args, ema, init},
    which checkpoint.load takes for a class-conditional DDPM expert, as it takes DiT's
    own."""
    config_json = read_json(os.path.join(folder, CONFIG), what)
    ddm = release_record(config_json, folder, what)
    state = read_tensors(os.path.join(folder, WEIGHTS), what)
    layout = ddm["layout"] if ddm else "diffusers"
    try:
        if layout == "diffusers":
            extras = read_tensors(os.path.join(folder, NULL_CAPTION), what) \
                if config_json.get("_class_name") == PIXART_CLASS else None
            state, inferred = from_diffusers(state, config_json, extras)
    except (DiffusersFormatError, KeyError) as e:
        raise ReleaseError(f"{what}: {folder} is not a DiT this project reads ({e})")
    # no training record: checkpoint.load takes it for an official-style DiT
    if ddm is None:
        return {"model_args": inferred, "ema": state,
                "init": f"diffusers {config_json.get('_class_name')} folder"}
    model_args, config = renamed_args(ddm["model_args"]), ddm["config"]
    network = config.get("network")
    if expect is not None and network != expect:
        raise ReleaseError(f"{what}: {folder}/{CONFIG} describes a "
                           f"{'router' if network == 'router' else 'expert'}, not "
                           f"{'a router' if expect == 'router' else 'an expert'}")
    try:
        check_model_args(model_args, network)
        if network != "router":
            objective_from_spec(config["objective"])
    except ReleaseError as e:
        raise ReleaseError(f"{what}: {folder}/{CONFIG}: {e}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReleaseError(f"{what}: {folder}/{CONFIG}'s objective is not one this "
                           f"project knows ({type(e).__name__}: {str(e)[:80]})")
    try:
        check_weights(state)
    except ReleaseError as e:
        raise ReleaseError(f"{what}: {folder}/{WEIGHTS}: {e}")
    check_shapes(state, model_args, network, what)
    return {"model_args": model_args, "config": config, "ema": state,
            "source": ddm.get("source")}


def check_index(folder):
    """A release's index: a format this version reads, each expert named once, every
    folder it names present. Returns the index (this project's part of
    model_index.json)."""
    index = read_json(os.path.join(folder, INDEX), "release")
    # format 2: this project's index beside diffusers' pipeline index, whose components
    # ([library, class], or [null, null] for none) each have their folder
    if isinstance(index, dict) and "_ddm" in index:
        for name, value in index.items():
            named = isinstance(value, list) and len(value) == 2 and value[0] is not None
            if named and not name.startswith("_") and not os.path.isdir(
                    os.path.join(folder, name)):
                raise ReleaseError(f"release {folder}: {INDEX} names its {name} component, "
                                   f"but its folder {name}/ is missing")
        index = index["_ddm"]
    if not isinstance(index, dict):
        raise ReleaseError(f"release {folder}: {INDEX} is not an index (a JSON object)")
    version = index.get("_ddm_release_format")
    if not isinstance(version, int):
        raise ReleaseError(f"release {folder}: {INDEX} has no _ddm_release_format (not a "
                           "release export.py wrote)")
    if version > RELEASE_FORMAT:
        raise ReleaseError(f"release {folder} is in format {version}; this version reads "
                           f"{RELEASE_FORMAT} and older: update this project")
    experts, router = index.get("experts"), index.get("router")
    # the index is the one list of what the release holds: each entry names its folder as
    # a plain name under the release, never a path elsewhere on the machine
    def plain(entry):
        return isinstance(entry, dict) and isinstance(entry.get("name"), str) \
            and PLAIN.fullmatch(entry["name"]) and entry.get("folder") == f"experts/{entry['name']}"
    if not isinstance(experts, list) or not experts or not all(plain(e) for e in experts):
        raise ReleaseError(f"release {folder}: {INDEX} must list its experts as "
                           '{"name": NAME, "folder": "experts/NAME"}, NAME a plain name')
    if router is not None and (not isinstance(router, dict)
                               or router.get("folder") != "router"):
        raise ReleaseError(f"release {folder}: {INDEX}'s router must be "
                           '{"folder": "router"}')
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


# an open_clip model's weights that are not its text tower's
NOT_TEXT = ("visual.", "logit_")


def text_tower_state(clip):
    """The text tower's part of an open_clip model's weights: what a text release ships
    (the image tower and the contrastive temperature condition nothing)."""
    return {k: v for k, v in clip.state_dict().items() if not k.startswith(NOT_TEXT)}


def build_clip(architecture, open_clip_config, state=None):
    """(open_clip model, its tokenizer) of `architecture` built from its model config (a
    dict), with the text tower's weights `state` where given; open_clip is imported here,
    as only text releases need it."""
    import open_clip
    if not isinstance(architecture, str) or not PLAIN.fullmatch(architecture) \
            or not isinstance(open_clip_config, dict):
        raise ReleaseError(f"the text encoder: {architecture!r} and its config name no "
                           "open_clip architecture")
    # open_clip registers model configs by file name
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{architecture}.json")
        with open(path, "w") as f:
            json.dump(open_clip_config, f)
        open_clip.add_model_config(path)
    try:
        # its random initialisation leaves the caller's random state as it was
        with torch.random.fork_rng():
            clip = open_clip.create_model(architecture, pretrained=None).eval()
    except Exception as e:
        raise ReleaseError(f"the text encoder: open_clip builds no {architecture} from "
                           f"its config ({type(e).__name__}: {str(e)[:80]})")
    if state is not None:
        check_weights(state)
        missing, unexpected = clip.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(NOT_TEXT)]
        if unexpected or missing:
            raise ReleaseError(f"the text encoder: its weights do not fit {architecture} "
                               f"({(unexpected or missing)[0]})")
    return clip.requires_grad_(False), open_clip.get_tokenizer(architecture)


def read_text_tower(folder):
    """(its config.json, open_clip model, tokenizer) of a release's text_encoder/ folder:
    the experts' open_clip text tower, checked to name an architecture, its config and the
    encoder spec the experts recorded, its weights floating point, finite and fitting."""
    config = read_json(os.path.join(folder, CONFIG), "the text encoder")
    if not isinstance(config, dict) or not all(
            k in config for k in ("architecture", "open_clip_config", "encoder")):
        raise ReleaseError(f"the text encoder: {folder}/{CONFIG} names no open_clip "
                           "architecture, config and encoder")
    state = read_tensors(os.path.join(folder, WEIGHTS), "the text encoder")
    clip, tokenizer = build_clip(config["architecture"], config["open_clip_config"], state)
    return config, clip, tokenizer
