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
import inspect
import os

import torch

from diffusion import DDPM, objective_from_spec
from model import DiT, Router, renamed_args
from plumbing.command_line import UsageError
from plumbing.condition import condition_from_spec
from plumbing.release.layout import ReleaseError, read_network
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


# what a checkpoint's constructor arguments may say, whole numbers in [low, high]: anything
# beyond is damage or a hostile file, refused before a network is built from it
LIMITS = {"input_size": (1, 4096), "patch_size": (1, 256), "in_channels": (1, 256),
          "hidden_size": (1, 16384), "depth": (1, 512), "num_heads": (1, 1024),
          "num_classes": (0, 10 ** 6), "text_dim": (0, 16384), "text_len": (1, 4096),
          "cluster_classes": (0, 10 ** 6), "num_experts": (1, 10 ** 5), "downsample": (1, 4096)}
MAX_TOKEN_WIDTH = 2 ** 28   # a pos_embed of more elements (1 GiB in fp32) is no image model here


def check_model_args(model_args, network):
    """Refuse, in one line, constructor arguments that build no `network` ('dit' or
    'router') or one this machine cannot hold: unknown names, numbers out of range or of the
    wrong type, sizes that do not divide, an unknown modulation, classes and text together;
    then the parameter count, on the meta device (no memory), against half of the
    machine's."""
    if not isinstance(model_args, dict):
        raise CheckpointError(f"its model_args are a {type(model_args).__name__}, not constructor arguments")
    cls = Router if network == "router" else DiT
    known = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise CheckpointError(f"its model_args name {unknown[0]}, which a {cls.__name__} does not take")
    args = {**{k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
               if k != "self"}, **model_args}
    for key, (low, high) in LIMITS.items():
        value = args.get(key, low)
        if key in args and (type(value) is not int or not low <= value <= high):
            raise CheckpointError(f"its model_args say {key} {value!r}: a whole number in "
                                  f"{low}..{high} builds a network")
    for key, low, high in (("mlp_ratio", 0, 64), ("t_scale", 0, 1e6)):
        value = args[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
            raise CheckpointError(f"its model_args say {key} {value!r}: a number in ({low}, {high}]")
    side = args["input_size"] // args.get("downsample", 1)
    if args["input_size"] % args.get("downsample", 1) or side % args["patch_size"]:
        raise CheckpointError(f"its model_args cut {side}-pixel inputs into {args['patch_size']}-pixel "
                              "patches, which do not divide them")
    if args["hidden_size"] % args["num_heads"]:
        raise CheckpointError(f"its model_args split width {args['hidden_size']} into "
                              f"{args['num_heads']} heads, which do not divide it")
    if network != "router" and (args["modulation"] not in ("adaln-single", "adaln-zero")
                                or not isinstance(args["learn_sigma"], bool)):
        raise CheckpointError(f"its model_args say modulation {args['modulation']!r} and learn_sigma "
                              f"{args['learn_sigma']!r} (adaln-single or adaln-zero; true or false)")
    if args["num_classes"] and args["text_dim"] or args.get("cluster_classes") and not args["num_classes"]:
        raise CheckpointError("its model_args condition a network on classes and text at once, "
                              "or on clusters without classes")
    if (side // args["patch_size"]) ** 2 * args["hidden_size"] > MAX_TOKEN_WIDTH:
        raise CheckpointError(f"its model_args make {(side // args['patch_size']) ** 2} tokens of "
                              f"width {args['hidden_size']}: no network this project builds")
    with torch.device("meta"):
        parameters = sum(p.numel() for p in cls(**model_args).parameters())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * parameters > memory // 2:
        raise CheckpointError(f"its model_args build {parameters:,} parameters, "
                              f"{4 * parameters / 2 ** 30:.1f} GiB in fp32: more than half of this "
                              f"machine's {memory / 2 ** 30:.0f} GiB")


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
            return read_network(os.path.dirname(path), what)
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
        raise CheckpointError(f"this is a {'router' if kind == 'router' else 'expert'} "
                              "checkpoint, not "
                              f"{'a router' if expect == 'router' else 'an expert'}")
    bad = next((name for name, t in state.items() if not t.is_floating_point()
                or not torch.isfinite(t).all()), None)
    if bad is not None:   # load_state_dict would cast integers and keep NaN: wrong samples
        what = "not finite" if state[bad].is_floating_point() else f"of {state[bad].dtype}"
        raise CheckpointError(f"its weight {bad} is {what}: damaged, not a trained network")
    net = (Router if kind == "router" else DiT)(**model_args)
    net.load_state_dict(state, strict=True)
    # pixels are bounded to [-1, 1], latents are not
    objective = objective_from_spec(config["objective"], clip_x0=config.get("vae") is None) \
        if kind == "dit" else None
    return Network(net.eval(), condition_from_spec(config["condition"]), config, objective)
