"""Networks from checkpoint files: ours (training checkpoints with their config) and
facebookresearch/DiT's bare state dicts, plus DDPM -> flow conversion.

`load(path)` is the one way every stage reads a trained network: it returns a
`Network`, the module together with the condition it reads and (for an expert) the
objective it was trained under, each rebuilt from the typed specs in the checkpoint's
config (`objective.spec()`, `condition.spec()`). An official facebookresearch/DiT state
dict loads as a class-conditional DDPM expert. Files are read with `weights_only=True`:
checkpoints come from other machines."""
import hashlib

import torch

from diffusion import DDPM, RectifiedFlow, objective_from_spec
from model import DiT, Router, renamed_args
from .condition import condition_from_spec


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
        hidden_size=hidden, depth=depth, num_heads=num_heads
        or (16 if hidden == 1152 else hidden // 64),
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / hidden,
        num_classes=sd["y_embedder.embedding_table.weight"].shape[0] - 1
        if "y_embedder.embedding_table.weight" in sd else 0,
        text_dim=sd["y_embedder.y_embedding"].shape[1] if "y_embedder.y_embedding" in sd else 0,
        text_len=sd["y_embedder.y_embedding"].shape[0] if "y_embedder.y_embedding" in sd else 77,
        learn_sigma=out_channels == 2 * in_channels,
        modulation="adaln-single" if "t_block.1.weight" in sd else "adaln-zero")


# 2: config holds typed `objective` and `condition` specs and the `network` kind
CHECKPOINT_FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be used where it was given; its message is one line for
    the user."""


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
        state = ckpt["ema"] if ckpt.get("ema") is not None else ckpt["model"]
        model_args, config = renamed_args(ckpt["model_args"]), dict(ckpt.get("config", {}))
        # no release ever used another format: no shim to keep
        if config.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError("written by an older version of this project (format "
                                  f"{config.get('format', 1)}, this version reads "
                                  f"{CHECKPOINT_FORMAT}): retrain it")
        return strip_prefixes(state), model_args, config
    # DiT's bare state dict, or one whose constructor arguments are known but that records
    # no training (release.read_network of a diffusers DiT folder): either is an
    # official-style DiT
    state, args = (ckpt["ema"], ckpt["model_args"]) if "model_args" in ckpt else \
        (strip_prefixes(ckpt), infer_dit_args(strip_prefixes(ckpt), num_heads))
    condition = {"kind": "class",
                 "num_classes": args["num_classes"]} if args["num_classes"] else {"kind": "none"}
    return state, args, {"format": CHECKPOINT_FORMAT, "network": "dit", "objective": DDPM().spec(),
                         "condition": condition,
                         "init": ckpt.get("init", "official facebookresearch/DiT state dict")}


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


def weights_digest(network):
    """A short digest of a Network's weights: a batch records its networks', so a study
    can tell that a checkpoint changed since the batch was drawn (retrained, or
    continued further) even where every sampler flag is the same."""
    h = hashlib.sha256()
    for name, tensor in sorted(network.net.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def networks_digests(experts, router, names):
    """{expert name (and 'router'): weights digest} of the networks a batch is drawn
    with."""
    digests = {names[output]: weights_digest(expert) for output, expert in experts.items()}
    if router is not None:
        digests["router"] = weights_digest(router)
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


def check_init_modulation(init, model_args, asked):
    """The recorded --modulation must be the network's: only a DDPM checkpoint
    converted to flow is re-parameterised to it."""
    own = model_args.get("modulation", "adaln-single")
    if own != asked:
        raise CheckpointError(f"--init {init} keeps its own modulation, {own} (only a "
                              "DDPM checkpoint converted to a flow model takes "
                              f"--modulation): pass --modulation {own}")


def split_expert_checkpoint(source):
    """split_checkpoint of an expert: a router's checkpoint is refused before its
    arguments reach a DiT."""
    state, model_args, config = split_checkpoint(source)
    if config.get("network") != "dit":
        raise CheckpointError("it is a router checkpoint, not an expert")
    return state, model_args, config


def init_from_checkpoint(source, objective, *, modulation, condition_args):
    """(state dict, model args, objective, how) to start an expert of `objective` from a
    checkpoint.

    A DDPM checkpoint (ours, or an official DiT) starting a flow expert goes through
    convert_ddpm_to_fm, with the flow objective's time map; a checkpoint of the same
    objective is fine-tuned as it is (its schedule kept)."""
    state, model_args, config = split_expert_checkpoint(source)
    source_objective = config["objective"]["name"]
    if objective.name == "fm" and source_objective == "ddpm":
        state, model_args, flow = convert_ddpm_to_fm(
            source, modulation=modulation, condition_args=condition_args,
            time_map=objective.time_map)
        flow = objective_from_spec(flow.spec(), clip_x0=objective.clip_x0)
        return state, model_args, flow, "convert_ddpm_to_fm"
    if source_objective != objective.name:
        raise CheckpointError(f"it is a {source_objective} checkpoint; it cannot start a "
                              f"{objective.name} expert")
    kept = objective_from_spec(config["objective"], clip_x0=objective.clip_x0)
    return state, model_args, kept, "weights"


def convert_ddpm_to_fm(source, *, modulation=None, condition_args=None, time_map="linear",
                       num_heads=None):
    """Initial weights of a rectified-flow expert from a DDPM DiT (official or ours).

    Returns (state_dict, model_args, objective): the flow objective to train it under.

    Time (`time_map`):
      'linear' (HDDM's map, the default): the flow expert embeds 999 * t (t_scale = 999), so
               t = 1 (pure noise) lands on the DDPM network's noisiest step and t = 0 on its
               cleanest. At t = 0.5 that is step 500, while the step with the flow state's SNR
               is about 258 (linear schedule), and the flow state is larger than the DDPM state
               by c = sqrt((1-t)^2 + t^2).
      'snr'    (this project's option): the network is shown the DDPM state with the same
               signal-to-noise ratio, x_t / c at the fractional step s(t) (t_scale = 1, see
               diffusion.RectifiedFlow), so the converted network starts on exactly the inputs
               it was pretrained on. Either way the output is re-read as a velocity and
               fine-tuned; the exact SNR match that *samples* an unconverted DDPM expert lives
               in diffusion.DDPM.velocity.

    Keys:
      kept     x_embedder.*, pos_embed, t_embedder.*, y_embedder.*, blocks.N.attn.*, blocks.N.mlp.*,
               and (adaLN-Zero target) blocks.N.adaLN_modulation.1.*,
               final_layer.adaLN_modulation.1.*
      changed  final_layer.linear.{weight,bias}: only the epsilon rows are kept, the learned-sigma
               rows dropped (the output is (p, q, c)-ordered, so every other group of C rows);
               model_args: learn_sigma=False, t_scale as above.
      dropped  nothing else for an adaLN-Zero target. For an AdaLN-Single target
               (`modulation='adaln-single'`), the per-block blocks.N.adaLN_modulation.1.* and
               final_layer.adaLN_modulation.1.* are dropped after re-parameterisation:
      created  (AdaLN-Single only) t_block.1.{weight,bias}: the least-squares shared modulation,
               i.e. the mean over blocks of the blocks' modulation weights and biases;
               blocks.N.scale_shift_table: block N's bias minus the shared bias, so that each
               block's modulation keeps its own offset exactly and only the weight residual is lost;
               final_layer.scale_shift_table: the final modulation's bias (its weight has no
               AdaLN-Single counterpart: PixArt's final layer adds the condition itself).
    For another condition (`condition_args`, e.g. a text condition's `expert_args()` for a
    class-conditional source):
      dropped  y_embedder.* of the source that the target lacks (the class table)
      created  what the target has and the source lacks: for text, y_embedder.y_proj.{fc1,fc2}.*,
               y_embedder.y_embedding (the caption projection and the null caption) and
               blocks.N.cross_attn.{q_linear,kv_linear,proj}.*, freshly initialised as in a new
               DiT (cross_attn.proj zero: the converted network starts out ignoring the caption
               and computing exactly what the class-free trunk computes).
    """
    state, args, config = split_checkpoint(source, num_heads)
    if config.get("network") != "dit" or config["objective"]["name"] != "ddpm":
        raise CheckpointError("convert_ddpm_to_fm needs a DDPM expert checkpoint; this one is "
                              + ("a router" if config.get("network") == "router"
                                 else "already flow matching"))
    schedule = objective_from_spec(config["objective"])
    state = {k: v.clone() for k, v in state.items()}
    C, p = args["in_channels"], args["patch_size"]
    if args["learn_sigma"]:
        rows = torch.arange(p * p * 2 * C)
        eps_rows = rows[rows % (2 * C) < C]
        state["final_layer.linear.weight"] = state["final_layer.linear.weight"][eps_rows]
        state["final_layer.linear.bias"] = state["final_layer.linear.bias"][eps_rows]
    source_modulation, target = args["modulation"], modulation or args["modulation"]
    if source_modulation == "adaln-zero" and target == "adaln-single":
        depth, D = args["depth"], args["hidden_size"]
        weights = torch.stack([state.pop(f"blocks.{i}.adaLN_modulation.1.weight")
                               for i in range(depth)])
        biases = torch.stack([state.pop(f"blocks.{i}.adaLN_modulation.1.bias")
                              for i in range(depth)])
        state["t_block.1.weight"], state["t_block.1.bias"] = weights.mean(0), biases.mean(0)
        for i in range(depth):
            state[f"blocks.{i}.scale_shift_table"] = (biases[i] - biases.mean(0)).view(6, D)
        state.pop("final_layer.adaLN_modulation.1.weight")
        state["final_layer.scale_shift_table"] = state.pop("final_layer.adaLN_modulation.1.bias").view(2, D)
    elif source_modulation != target:
        raise CheckpointError(f"cannot convert {source_modulation} to {target}")
    objective = RectifiedFlow(time_map=time_map, schedule=schedule)
    t_scale = 999.0 if time_map == "linear" else 1.0
    args.update(learn_sigma=False, modulation=target, t_scale=t_scale, **(condition_args or {}))
    fresh = DiT(**args).state_dict()
    conditional = lambda key: key.startswith("y_embedder.") or ".cross_attn." in key
    state = {k: v for k, v in state.items() if k in fresh or not conditional(k)}
    state.update({k: v for k, v in fresh.items() if k not in state and conditional(k)})
    misfits = [f"{k} {tuple(v.shape)} vs {tuple(fresh[k].shape)}" for k, v in state.items()
               if k in fresh and v.shape != fresh[k].shape]
    if misfits:
        raise CheckpointError(f"the checkpoint does not fit the target network: {misfits[0]}")
    return state, args, objective
