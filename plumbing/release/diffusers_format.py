"""Our DiT's weights in diffusers' layout and back: `DiTTransformer2DModel` (adaLN-Zero,
class labels: facebookresearch/DiT's architecture) and `PixArtTransformer2DModel`
(AdaLN-Single, caption cross-attention: PixArt-alpha's). One key table serves both
directions; nothing here imports diffusers.

Where the architectures match, every tensor has exactly one counterpart, so a model loaded by
diffusers computes what ours computes. Where they do not, `to_diffusers` raises
DiffusersFormatError naming the part that has none, rather than writing a model that diffusers would
fill with random weights:
  - a class-conditional AdaLN-Single DiT (this project's default): its `t_block` reads t + y, and
    neither diffusers class has a shared modulation fed by a class label;
  - a DiT conditioned on nothing: DiTTransformer2DModel always adds a class embedding;
  - an MLP ratio other than 4 (diffusers' FeedForward fixes it).
Two parts are not weights in diffusers and travel beside them instead:
  - the learned null caption `y_embedder.y_embedding` (what an all-zero caption stands for) has no
    parameter in PixArtTransformer2DModel: it is returned as an extra tensor, the
    `encoder_hidden_states` to pass for "no caption";
  - diffusers' DiT embeds time with `downscale_freq_shift=1` (frequencies 10000^(-i/127)), where
    facebookresearch/DiT and this project use 10000^(-i/128); no weight can absorb that, so
    `use_dit_time_embedding(model)` sets the shift to 0 on a loaded DiTTransformer2DModel
    (diffusers runs the official DiT weights it converted with the same offset).
"""
import torch

from model import sincos_pos_embed

DIT_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")
PIXART_CLASS = "PixArtTransformer2DModel"


class DiffusersFormatError(ValueError):
    """A network with no exact counterpart in diffusers, or a diffusers folder we
    cannot read; one line for the user."""


def key_table(depth, single, text):
    """[(our key, diffusers' keys)] of every tensor: one diffusers key where the tensor
    moves as it is, several where ours is theirs concatenated (fused qkv, kv), or
    repeated in every block (DiT's time and class embedders, which diffusers holds per
    block and we once)."""
    table = [("x_embedder.proj.{}", ["pos_embed.proj.{}"])]
    every_block = lambda key: [f"transformer_blocks.{i}.{key}" for i in range(depth)]
    if single:
        table += [("t_embedder.mlp.0.{}", ["adaln_single.emb.timestep_embedder.linear_1.{}"]),
                  ("t_embedder.mlp.2.{}", ["adaln_single.emb.timestep_embedder.linear_2.{}"]),
                  ("t_block.1.{}", ["adaln_single.linear.{}"]),
                  ("final_layer.linear.{}", ["proj_out.{}"])]
    else:
        table += [("t_embedder.mlp.0.{}", every_block("norm1.emb.timestep_embedder.linear_1.{}")),
                  ("t_embedder.mlp.2.{}", every_block("norm1.emb.timestep_embedder.linear_2.{}")),
                  ("final_layer.adaLN_modulation.1.{}", ["proj_out_1.{}"]),
                  ("final_layer.linear.{}", ["proj_out_2.{}"])]
    if text:
        table += [("y_embedder.y_proj.fc1.{}", ["caption_projection.linear_1.{}"]),
                  ("y_embedder.y_proj.fc2.{}", ["caption_projection.linear_2.{}"])]
    for i in range(depth):
        ours, theirs = f"blocks.{i}.", f"transformer_blocks.{i}."
        table += [(ours + "attn.qkv.{}", [theirs + f"attn1.to_{p}.{{}}" for p in "qkv"]),
                  (ours + "attn.proj.{}", [theirs + "attn1.to_out.0.{}"]),
                  (ours + "mlp.fc1.{}", [theirs + "ff.net.0.proj.{}"]),
                  (ours + "mlp.fc2.{}", [theirs + "ff.net.2.{}"])]
        if text:
            table += [(ours + "cross_attn.q_linear.{}", [theirs + "attn2.to_q.{}"]),
                      (ours + "cross_attn.kv_linear.{}",
                       [theirs + "attn2.to_k.{}", theirs + "attn2.to_v.{}"]),
                      (ours + "cross_attn.proj.{}", [theirs + "attn2.to_out.0.{}"])]
        if not single:
            table.append((ours + "adaLN_modulation.1.{}", [theirs + "norm1.linear.{}"]))
    rows = [(o.format(kind), [t.format(kind) for t in ts]) for o, ts in table
            for kind in ("weight", "bias")]
    if single:
        rows += [(f"blocks.{i}.scale_shift_table", [f"transformer_blocks.{i}.scale_shift_table"])
                 for i in range(depth)] + [("final_layer.scale_shift_table", ["scale_shift_table"])]
    else:
        rows.append(("y_embedder.embedding_table.weight",
                     every_block("norm1.emb.class_embedder.embedding_table.weight")))
    return rows


def repeated(their_keys):
    """Whether diffusers holds a copy of the tensor in every block, rather than its
    pieces."""
    return len(their_keys) > 1 and ".emb." in their_keys[0]


def check_exportable(model_args):
    a = model_args
    if a.get("mlp_ratio", 4.0) != 4.0:
        raise DiffusersFormatError(f"MLP ratio {a['mlp_ratio']}: diffusers' FeedForward has 4")
    single, text = a.get("modulation", "adaln-single") == "adaln-single", a.get("text_dim", 0) > 0
    if single and not text:
        raise DiffusersFormatError(
            "a class-conditional AdaLN-Single DiT (t_block fed t + y) has no diffusers "
            "counterpart: DiTTransformer2DModel is adaLN-Zero, PixArtTransformer2DModel "
            "reads no class label; train the expert with --modulation adaln-zero to "
            "export it for diffusers")
    if not single and text:
        raise DiffusersFormatError("an adaLN-Zero DiT with cross-attention has no "
                                   "diffusers counterpart (PixArtTransformer2DModel is "
                                   "AdaLN-Single)")
    if not single and not a.get("num_classes"):
        raise DiffusersFormatError("DiTTransformer2DModel always adds a class embedding; "
                                   "a DiT conditioned on nothing has no counterpart")
    return single, text


def to_diffusers(state, model_args):
    """(state dict, config.json dict, extra tensors) of our DiT in diffusers' layout."""
    single, text = check_exportable(model_args)
    a = model_args
    out = {}
    for ours, theirs in key_table(a["depth"], single, text):
        # a per-block copy is its own tensor: safetensors refuses tensors that share
        # memory
        pieces = [state[ours].clone() for _ in theirs] if repeated(theirs) else \
            state[ours].chunk(len(theirs), dim=0)
        out.update({key: piece.contiguous() for key, piece in zip(theirs, pieces)})
    config = {"_class_name": PIXART_CLASS if single else DIT_CLASSES[0],
              "num_attention_heads": a["num_heads"],
              "attention_head_dim": a["hidden_size"] // a["num_heads"],
              "in_channels": a["in_channels"],
              "out_channels": a["in_channels"] * (2 if a.get("learn_sigma") else 1),
              "num_layers": a["depth"], "sample_size": a["input_size"],
              "patch_size": a["patch_size"], "activation_fn": "gelu-approximate",
              "attention_bias": True, "norm_elementwise_affine": False, "norm_eps": 1e-6,
              "upcast_attention": False, "dropout": 0.0}
    if single:
        config.update(norm_type="ada_norm_single", cross_attention_dim=a["hidden_size"],
                      caption_channels=a["text_dim"], interpolation_scale=1,
                      use_additional_conditions=False, num_embeds_ada_norm=1000)
        return out, config, {"null_caption": state["y_embedder.y_embedding"].contiguous()}
    config.update(norm_type="ada_norm_zero", num_embeds_ada_norm=a["num_classes"])
    return out, config, {}


# what a config.json may say before anything is allocated from it (ranges far beyond any DiT)
CONFIG_RANGES = {"sample_size": (1, 4096), "patch_size": (1, 64), "in_channels": (1, 64),
                 "num_attention_heads": (1, 256), "attention_head_dim": (1, 1024),
                 "num_layers": (1, 256), "num_embeds_ada_norm": (0, 100_000)}


def check_numbers(config):
    for key, (low, high) in CONFIG_RANGES.items():
        value = config.get(key, low if key == "num_embeds_ada_norm" else None)
        if type(value) is not int or not low <= value <= high:
            raise DiffusersFormatError(f"config.json's {key} is {value!r}, not a whole number "
                                       f"in {low}..{high}")
    if config["sample_size"] % config["patch_size"]:
        raise DiffusersFormatError(f"config.json's patch_size {config['patch_size']} does not "
                                   f"divide its sample_size {config['sample_size']}")


def model_args_of(config, extras):
    """Our DiT's constructor arguments for a diffusers DiT or PixArt config.json; the
    time input stays as diffusers feeds it (t_scale 1: the DDPM step)."""
    kind, norm = config.get("_class_name"), config.get("norm_type", "ada_norm_zero")
    single = kind == PIXART_CLASS
    if kind not in DIT_CLASSES + (PIXART_CLASS,) or not single and norm != "ada_norm_zero":
        raise DiffusersFormatError(f"a diffusers {kind} ({norm}) is not a DiT or PixArt "
                                   "transformer")
    check_numbers(config)
    scale = config.get("interpolation_scale") or max(config["sample_size"] // 64, 1)
    if single and (config.get("use_additional_conditions") or scale != 1):
        raise DiffusersFormatError("PixArt's resolution/aspect-ratio embeddings and "
                                   "interpolated positions have no counterpart in our "
                                   "DiT")
    text_dim = (config.get("caption_channels") or 0) if single else 0
    if single and (not text_dim or "null_caption" not in (extras or {})):
        raise DiffusersFormatError("a PixArt transformer without its caption projection "
                                   "and null caption (null_caption.safetensors) does not "
                                   "map onto our DiT")
    out_channels = config.get("out_channels") or config["in_channels"]
    args = dict(input_size=config["sample_size"], patch_size=config["patch_size"],
                in_channels=config["in_channels"],
                hidden_size=config["num_attention_heads"] * config["attention_head_dim"],
                depth=config["num_layers"], num_heads=config["num_attention_heads"],
                mlp_ratio=4.0, learn_sigma=out_channels == 2 * config["in_channels"],
                modulation="adaln-single" if single else "adaln-zero", t_scale=1.0,
                num_classes=0 if single else config["num_embeds_ada_norm"], text_dim=text_dim)
    if text_dim:
        args["text_len"] = extras["null_caption"].shape[0]
    return args


def from_diffusers(state, config, extras=None):
    """(state dict, model args) of our DiT from a diffusers DiT or PixArt transformer's
    weights and config.json (and, for PixArt, the null caption `to_diffusers` wrote
    beside them). A folder this project exported records its own t_scale, which the
    caller applies."""
    args = model_args_of(config, extras)
    single, text = args["modulation"] == "adaln-single", args["text_dim"] > 0
    grid = args["input_size"] // args["patch_size"]
    # diffusers computes the fixed sin-cos table and does not store it; ours is a buffer
    out = {"pos_embed": torch.from_numpy(sincos_pos_embed(args["hidden_size"], grid)).float()[None]}
    for ours, theirs in key_table(args["depth"], single, text):
        if repeated(theirs):
            if any(not torch.equal(state[key], state[theirs[0]]) for key in theirs):
                raise DiffusersFormatError(
                    f"the blocks' copies of {ours} differ; our DiT shares one across "
                    "blocks")
            out[ours] = state[theirs[0]]
        else:
            out[ours] = torch.cat([state[key] for key in theirs]) if len(theirs) > 1 \
                else state[theirs[0]]
    if text:
        out["y_embedder.y_embedding"] = extras["null_caption"]
    return out, args


def use_dit_time_embedding(model):
    """Make a loaded diffusers DiTTransformer2DModel embed time as facebookresearch/DiT
    and this project do (downscale_freq_shift 0); returns the model."""
    for block in model.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return model
