"""Networks from checkpoint files: ours (training checkpoints with their config, or a
release's config.json and weights) and facebookresearch/DiT's bare state dicts, and the
weights digest that identifies a network. (Whether a run may resume a checkpoint:
training/plan.py; starting from one with --init, DDPM -> flow conversion included:
training/warm_start.py.)

`load(path)` is the one way every stage reads a trained network: it returns a
`Network`, the module together with the condition it reads and (for an expert) the
objective it was trained under, each rebuilt from the typed specs in the checkpoint's
config (`objective.spec()`, `condition.spec()`). An official facebookresearch/DiT state
dict loads as a class-conditional DDPM expert. Files are read with `weights_only=True`:
checkpoints come from other machines."""
import hashlib
import os

import torch

from diffusion import DDPM, objective_from_spec
from model import DiT, Router, renamed_args, shape_disagreement
from plumbing.command_line import UsageError
from plumbing.condition import condition_from_spec
from plumbing.release import reader
from plumbing.release.reader import ReleaseError
from plumbing.run_dir import load_checkpoint, network_path


# a checkpoint's `config` carries its format (2: typed `objective` and `condition` specs and
# the `network` kind); a resume refuses any other
CHECKPOINT_FORMAT = 2

def strip_prefixes(state_dict):
    """Remove wrappers' prefixes: DistributedDataParallel's `module.` and torch.compile's
    `_orig_mod.`."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def infer_dit_args(state_dict, num_heads=None):
    """Every DiT constructor argument read off a bare state dict's tensor shapes.

    The head count is not in the tensors: DiT's registry uses 64-dim heads, except 16
    heads at width 1152 (XL). Pass `num_heads` for anything else. The label table is
    assumed to hold DiT's extra null-class row, as every official checkpoint does."""
    sd = state_dict
    # a state dict maps names to tensors: anything else (a number, a string, a nested
    # dict) came from some other file, and its .shape would be a traceback
    stranger = next((k for k, t in sd.items() if not torch.is_tensor(t)), None)
    if stranger is not None:
        raise CheckpointError(f"its entry {stranger!r} is a {type(sd[stranger]).__name__}, "
                              "not a tensor: not a DiT's state dict")
    empty = next((k for k, t in sd.items() if torch.is_tensor(t) and t.numel() == 0), None)
    if empty is not None:   # a tensor with no elements can claim any shape
        raise CheckpointError(f"its tensor {empty} holds no elements: not a trained network")
    hidden, in_channels, patch, _ = sd["x_embedder.proj.weight"].shape
    blocks = {int(k.split(".")[1]) for k in sd if k.startswith("blocks.")}
    if blocks != set(range(len(blocks))):   # a stray key would size a network of its own
        raise CheckpointError(f"its blocks are numbered up to {max(blocks, default=-1)} but "
                              f"{len(blocks)} are present: not a DiT's state dict")
    depth = len(blocks)
    out_channels = sd["final_layer.linear.weight"].shape[0] // patch ** 2
    return dict(
        input_size=int(round(sd["pos_embed"].shape[1] ** 0.5)) * patch, patch_size=patch,
        in_channels=in_channels,
        hidden_size=hidden, depth=depth, num_heads=num_heads or heads_of(hidden),
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / hidden,
        num_classes=sd["y_embedder.embedding_table.weight"].shape[0] - 1
        if "y_embedder.embedding_table.weight" in sd else 0,
        text_dim=sd["y_embedder.y_embedding"].shape[1] if "y_embedder.y_embedding" in sd else 0,
        text_len=sd["y_embedder.y_embedding"].shape[0] if "y_embedder.y_embedding" in sd else 77,
        learn_sigma=out_channels == 2 * in_channels,
        modulation="adaln-single" if "t_block.1.weight" in sd else "adaln-zero")


def heads_of(width):
    """DiT's head count at a width: 64-dim heads, 16 at XL's 1152; None where that rule
    gives none (the tensors do not say)."""
    if width == 1152:
        return 16
    return None if width % 64 else width // 64


class CheckpointError(UsageError, ValueError):
    """A checkpoint that cannot be used where it was given; its message is one line for
    the user (a UsageError: wherever it is not caught, the stage says it in one line)."""


def fit_state(net, state, what):
    """Load `state` into `net` once its every tensor is finite floating point and it holds
    each tensor the network has, at its shape, and nothing else. A file edited, damaged or
    written for another size under the same model_args is refused in one line naming the
    first disagreement (load_state_dict would cast integers, keep NaN, and refuse other
    shapes in a many-line RuntimeError from inside the stage)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{what} are a {type(state).__name__}, not a dict of tensors")
    try:
        reader.check_weights(state)
    except ReleaseError as e:
        raise CheckpointError(str(e))
    want = {name: tensor.shape for name, tensor in net.state_dict().items()}
    detail = shape_disagreement(state, want, f"the {type(net).__name__}'s")
    if detail:
        raise CheckpointError(f"{what} do not fit the network their config describes "
                              f"({detail})")
    net.load_state_dict(state, strict=True)


def check_model_args(model_args, network):
    """reader.check_model_args, refusing as a CheckpointError (one line)."""
    try:
        reader.check_model_args(model_args, network)
    except ReleaseError as e:
        raise CheckpointError(str(e))


def check_specs(config):
    """Refuse a config whose objective or condition spec names nothing this project knows
    (found here, not at sampling)."""
    try:
        if config.get("network") != "router":
            objective_from_spec(config["objective"])
        condition_from_spec(config["condition"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError("its config's objective or condition is not one this project knows "
                              f"({type(e).__name__}: {str(e)[:80]})")


def read_checkpoint(source):
    """A checkpoint from a path (tensors and plain data only) or an already-loaded
    dict."""
    if isinstance(source, dict):
        return source
    return torch.load(source, map_location="cpu", weights_only=True)


def split_checkpoint(source, num_heads=None):
    """(state dict, constructor args, config) of any checkpoint we accept, path or dict.

    Ours carry `model_args` and `config`, and their EMA weights are preferred; a bare
    facebookresearch/DiT state dict gets its args inferred from the tensors and is a
    class-conditional DDPM expert. Wrappers' prefixes are stripped either way.
    """
    ckpt = read_checkpoint(source)
    if "model_args" in ckpt and "config" in ckpt:
        if not isinstance(ckpt["model_args"], dict) or not isinstance(ckpt["config"], dict):
            raise CheckpointError("its model_args and config are not the dicts a checkpoint holds")
        state = ckpt["ema"] if ckpt.get("ema") is not None else ckpt["model"]
        model_args, config = renamed_args(ckpt["model_args"]), dict(ckpt.get("config", {}))
        # no release ever used another format: no shim to keep
        if config.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError("written by an older version of this project (format "
                                  f"{config.get('format', 1)}, this version reads "
                                  f"{CHECKPOINT_FORMAT}): retrain it")
        check_model_args(model_args, config.get("network"))
        check_specs(config)
        return strip_prefixes(state), model_args, config
    # DiT's bare state dict, or one whose constructor arguments are known but that records
    # no training (release.read_network of a diffusers DiT folder): either is an
    # official-style DiT
    state, args = (ckpt["ema"], ckpt["model_args"]) if "model_args" in ckpt else \
        (strip_prefixes(ckpt), infer_dit_args(strip_prefixes(ckpt), num_heads))
    if args.get("num_heads") is None:
        raise CheckpointError(f"its width {args.get('hidden_size')} is no multiple of DiT's 64-dim "
                              "heads, and a state dict does not record its head count: not an "
                              "official DiT")
    check_model_args(args, "dit")
    condition = {"kind": "class",
                 "num_classes": args["num_classes"]} if args["num_classes"] else {"kind": "none"}
    return state, args, {"format": CHECKPOINT_FORMAT, "network": "dit", "objective": DDPM().spec(),
                         "condition": condition,
                         "init": ckpt.get("init", "official facebookresearch/DiT state dict")}


def read_network_file(path, what):
    """A network's checkpoint dict, from its folder or its file: a training checkpoint
    (ckpt.pt), or a released network's config.json beside its safetensors weights, which
    reads as the same dict (release.py)."""
    if os.path.isdir(path) and network_path(path):
        path = network_path(path)
    if os.path.basename(path) == "config.json" and os.path.isfile(path):
        try:
            return reader.read_network(os.path.dirname(path), what)
        except ReleaseError as e:
            raise UsageError(str(e))
    return load_checkpoint(path, what)


class Network:
    """A trained network with what it takes to use it: the condition it reads, the
    objective it was trained under (experts; None for the router), and its checkpoint's
    config."""

    def __init__(self, net, condition, config, objective=None):
        self.net, self.condition, self.config, self.objective = net, condition, config, objective

    def velocity(self, x_t, t, y=None):
        """This expert's prediction as a rectified-flow velocity at flow time t."""
        return self.objective.velocity(self.net, x_t, t, y)

    def to(self, device):
        self.net.to(device)
        return self


def weights_digest(state):
    """A network's identity: SHA-1 of its tensors' names and bytes, 12 hex digits (the
    judges' published digests). A batch records its networks', so a study can tell that a
    checkpoint changed since the batch was drawn even where every sampler flag is the
    same."""
    h = hashlib.sha1()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def networks_digests(experts, router, names):
    """{expert name (and 'router'): weights digest} of the networks a batch is drawn
    with."""
    digests = {names[output]: weights_digest(e.net.state_dict()) for output, e in experts.items()}
    if router is not None:
        digests["router"] = weights_digest(router.net.state_dict())
    return digests


def load(source, expect=None, num_heads=None):
    """A Network in eval mode from a path or dict: our expert or router checkpoint, or an
    official DiT state dict.

    `expect` ('dit' or 'router') refuses the other kind with a CheckpointError. An
    official checkpoint is a DDPM epsilon-model with learned sigma whose time input is
    the DDPM step."""
    try:
        state, model_args, config = split_checkpoint(source, num_heads)
    except CheckpointError:
        raise
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise CheckpointError("not a checkpoint of this project or of "
                              f"facebookresearch/DiT ({type(e).__name__}: {e})")
    kind = config.get("network")
    if expect is not None and kind != expect:
        raise CheckpointError(f"this is {'a router' if kind == 'router' else 'an expert'} "
                              "checkpoint, not "
                              f"{'a router' if expect == 'router' else 'an expert'}")
    net = (Router if kind == "router" else DiT)(**model_args)
    fit_state(net, state, "its weights")
    # pixels are bounded to [-1, 1], latents are not
    objective = objective_from_spec(config["objective"], clip_x0=config.get("vae") is None) \
        if kind == "dit" else None
    return Network(net.eval(), condition_from_spec(config["condition"]), config, objective)
