"""Our DiT's weights in diffusers' layout and back: `DiTTransformer2DModel` (adaLN-Zero, class labels:
facebookresearch/DiT's architecture) and `PixArtTransformer2DModel` (AdaLN-Single, caption
cross-attention: PixArt-alpha's). Pure key and config maps: nothing here imports diffusers.

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
    `use_dit_time_embedding(model)` sets the shift to 0 on a loaded DiTTransformer2DModel (diffusers'
    own conversion of the official DiT checkpoints carries the same offset).
"""
import torch

from model import sincos_pos_embed

DIT_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")
PIXART_CLASS = "PixArtTransformer2DModel"


class DiffusersFormatError(ValueError):
    """A network with no exact counterpart in diffusers, or a diffusers folder we cannot read; one
    line for the user."""


def _split(tensor, parts):
    return [t.clone() for t in tensor.chunk(parts, dim=0)]


def _shared_blocks(state, depth, prefix, what):
    """Block 0's copy of a tensor that diffusers repeats in every block, checked equal in all."""
    first = state[f"transformer_blocks.0.{prefix}"]
    for i in range(1, depth):
        if not torch.equal(state[f"transformer_blocks.{i}.{prefix}"], first):
            raise DiffusersFormatError(f"block {i}'s {what} differs from block 0's; our DiT shares "
                                       "one across blocks")
    return first


def to_diffusers(state, model_args):
    """(state dict, config.json dict, extra tensors) of our DiT in diffusers' layout."""
    a = model_args
    if a.get("mlp_ratio", 4.0) != 4.0:
        raise DiffusersFormatError(f"MLP ratio {a['mlp_ratio']}: diffusers' FeedForward has 4")
    single = a.get("modulation", "adaln-single") == "adaln-single"
    text = a.get("text_dim", 0) > 0
    if single and not text:
        raise DiffusersFormatError(
            "a class-conditional AdaLN-Single DiT (t_block fed t + y) has no diffusers counterpart: "
            "DiTTransformer2DModel is adaLN-Zero, PixArtTransformer2DModel reads no class label; "
            "train the expert with --modulation adaln-zero to export it for diffusers")
    if not single and text:
        raise DiffusersFormatError("an adaLN-Zero DiT with cross-attention has no diffusers "
                                   "counterpart (PixArtTransformer2DModel is AdaLN-Single)")
    if not single and not a.get("num_classes"):
        raise DiffusersFormatError("DiTTransformer2DModel always adds a class embedding; a DiT "
                                   "conditioned on nothing has no counterpart")
    depth, width, heads = a["depth"], a["hidden_size"], a["num_heads"]
    out_channels = a["in_channels"] * (2 if a.get("learn_sigma") else 1)
    config = {"_class_name": PIXART_CLASS if single else DIT_CLASSES[0],
              "num_attention_heads": heads, "attention_head_dim": width // heads,
              "in_channels": a["in_channels"], "out_channels": out_channels, "num_layers": depth,
              "sample_size": a["input_size"], "patch_size": a["patch_size"],
              "activation_fn": "gelu-approximate", "attention_bias": True,
              "norm_elementwise_affine": False, "norm_eps": 1e-6, "upcast_attention": False,
              "dropout": 0.0}
    out = {"pos_embed.proj.weight": state["x_embedder.proj.weight"],
           "pos_embed.proj.bias": state["x_embedder.proj.bias"]}
    for i in range(depth):
        ours, theirs = f"blocks.{i}.", f"transformer_blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = _split(state[ours + f"attn.qkv.{kind}"], 3)
            out.update({theirs + f"attn1.to_q.{kind}": q, theirs + f"attn1.to_k.{kind}": k,
                        theirs + f"attn1.to_v.{kind}": v,
                        theirs + f"attn1.to_out.0.{kind}": state[ours + f"attn.proj.{kind}"],
                        theirs + f"ff.net.0.proj.{kind}": state[ours + f"mlp.fc1.{kind}"],
                        theirs + f"ff.net.2.{kind}": state[ours + f"mlp.fc2.{kind}"]})
            if text:
                k, v = _split(state[ours + f"cross_attn.kv_linear.{kind}"], 2)
                out.update({theirs + f"attn2.to_q.{kind}": state[ours + f"cross_attn.q_linear.{kind}"],
                            theirs + f"attn2.to_k.{kind}": k, theirs + f"attn2.to_v.{kind}": v,
                            theirs + f"attn2.to_out.0.{kind}": state[ours + f"cross_attn.proj.{kind}"]})
            if not single:   # DiT: every block holds its own copy of the time and class embedders
                emb = theirs + "norm1.emb."
                out[emb + f"timestep_embedder.linear_1.{kind}"] = state[f"t_embedder.mlp.0.{kind}"].clone()
                out[emb + f"timestep_embedder.linear_2.{kind}"] = state[f"t_embedder.mlp.2.{kind}"].clone()
                out[theirs + f"norm1.linear.{kind}"] = state[ours + f"adaLN_modulation.1.{kind}"]
        if single:
            out[theirs + "scale_shift_table"] = state[ours + "scale_shift_table"]
        else:
            out[theirs + "norm1.emb.class_embedder.embedding_table.weight"] = \
                state["y_embedder.embedding_table.weight"].clone()
    extras = {}
    for kind in ("weight", "bias"):
        if single:
            out[f"adaln_single.emb.timestep_embedder.linear_1.{kind}"] = state[f"t_embedder.mlp.0.{kind}"]
            out[f"adaln_single.emb.timestep_embedder.linear_2.{kind}"] = state[f"t_embedder.mlp.2.{kind}"]
            out[f"adaln_single.linear.{kind}"] = state[f"t_block.1.{kind}"]
            out[f"caption_projection.linear_1.{kind}"] = state[f"y_embedder.y_proj.fc1.{kind}"]
            out[f"caption_projection.linear_2.{kind}"] = state[f"y_embedder.y_proj.fc2.{kind}"]
            out[f"proj_out.{kind}"] = state[f"final_layer.linear.{kind}"]
        else:
            out[f"proj_out_1.{kind}"] = state[f"final_layer.adaLN_modulation.1.{kind}"]
            out[f"proj_out_2.{kind}"] = state[f"final_layer.linear.{kind}"]
    if single:
        out["scale_shift_table"] = state["final_layer.scale_shift_table"]
        extras["null_caption"] = state["y_embedder.y_embedding"]
        config.update(norm_type="ada_norm_single", cross_attention_dim=width,
                      caption_channels=a["text_dim"], interpolation_scale=1,
                      use_additional_conditions=False, num_embeds_ada_norm=1000)
    else:
        config.update(norm_type="ada_norm_zero", num_embeds_ada_norm=a["num_classes"])
    return {k: v.contiguous() for k, v in out.items()}, config, extras


def from_diffusers(state, config, extras=None):
    """(state dict, model args) of our DiT from a diffusers DiT or PixArt transformer's weights and
    config.json (and, for PixArt, the null caption `to_diffusers` wrote beside them).

    The time input stays as diffusers feeds it (t_scale 1: the DDPM step); a folder this project
    exported records its own t_scale, which the caller applies."""
    kind = config.get("_class_name")
    single = kind == PIXART_CLASS
    if kind not in DIT_CLASSES + (PIXART_CLASS,) or not single and config.get("norm_type",
                                                                             "ada_norm_zero") != "ada_norm_zero":
        raise DiffusersFormatError(f"a diffusers {kind} ({config.get('norm_type')}) is not a DiT "
                                   "or PixArt transformer")
    if single and (config.get("use_additional_conditions") or (config.get("interpolation_scale")
                                                               or max(config["sample_size"] // 64, 1)) != 1):
        raise DiffusersFormatError("PixArt's resolution/aspect-ratio embeddings and interpolated "
                                   "positions have no counterpart in our DiT")
    depth, heads = config["num_layers"], config["num_attention_heads"]
    width = heads * config["attention_head_dim"]
    text_dim = (config.get("caption_channels") or 0) if single else 0
    if single and (not text_dim or "null_caption" not in (extras or {})):
        raise DiffusersFormatError("a PixArt transformer without its caption projection and null "
                                   "caption (null_caption.safetensors) does not map onto our DiT")
    out_channels = config.get("out_channels") or config["in_channels"]
    args = dict(input_size=config["sample_size"], patch_size=config["patch_size"],
                in_channels=config["in_channels"], hidden_size=width, depth=depth, num_heads=heads,
                mlp_ratio=4.0, learn_sigma=out_channels == 2 * config["in_channels"],
                modulation="adaln-single" if single else "adaln-zero", t_scale=1.0,
                num_classes=0 if single else config["num_embeds_ada_norm"], text_dim=text_dim)
    if text_dim:
        args["text_len"] = extras["null_caption"].shape[0]
    grid = config["sample_size"] // config["patch_size"]
    # diffusers computes the fixed sin-cos table and does not store it; ours is a buffer
    out = {"x_embedder.proj.weight": state["pos_embed.proj.weight"],
           "x_embedder.proj.bias": state["pos_embed.proj.bias"],
           "pos_embed": torch.from_numpy(sincos_pos_embed(width, grid)).float()[None]}
    for i in range(depth):
        ours, theirs = f"blocks.{i}.", f"transformer_blocks.{i}."
        for kind in ("weight", "bias"):
            out[ours + f"attn.qkv.{kind}"] = torch.cat([state[theirs + f"attn1.to_{p}.{kind}"]
                                                        for p in "qkv"])
            out[ours + f"attn.proj.{kind}"] = state[theirs + f"attn1.to_out.0.{kind}"]
            out[ours + f"mlp.fc1.{kind}"] = state[theirs + f"ff.net.0.proj.{kind}"]
            out[ours + f"mlp.fc2.{kind}"] = state[theirs + f"ff.net.2.{kind}"]
            if text_dim:
                out[ours + f"cross_attn.q_linear.{kind}"] = state[theirs + f"attn2.to_q.{kind}"]
                out[ours + f"cross_attn.kv_linear.{kind}"] = torch.cat(
                    [state[theirs + f"attn2.to_k.{kind}"], state[theirs + f"attn2.to_v.{kind}"]])
                out[ours + f"cross_attn.proj.{kind}"] = state[theirs + f"attn2.to_out.0.{kind}"]
            if not single:
                out[ours + f"adaLN_modulation.1.{kind}"] = state[theirs + f"norm1.linear.{kind}"]
        if single:
            out[ours + "scale_shift_table"] = state[theirs + "scale_shift_table"]
    for kind in ("weight", "bias"):
        if single:
            emb = "adaln_single.emb.timestep_embedder."
            out[f"t_embedder.mlp.0.{kind}"] = state[emb + f"linear_1.{kind}"]
            out[f"t_embedder.mlp.2.{kind}"] = state[emb + f"linear_2.{kind}"]
            out[f"t_block.1.{kind}"] = state[f"adaln_single.linear.{kind}"]
            out[f"y_embedder.y_proj.fc1.{kind}"] = state[f"caption_projection.linear_1.{kind}"]
            out[f"y_embedder.y_proj.fc2.{kind}"] = state[f"caption_projection.linear_2.{kind}"]
            out[f"final_layer.linear.{kind}"] = state[f"proj_out.{kind}"]
        else:
            for ours, theirs in (("mlp.0", "linear_1"), ("mlp.2", "linear_2")):
                out[f"t_embedder.{ours}.{kind}"] = _shared_blocks(
                    state, depth, f"norm1.emb.timestep_embedder.{theirs}.{kind}", "time embedder")
            out[f"final_layer.adaLN_modulation.1.{kind}"] = state[f"proj_out_1.{kind}"]
            out[f"final_layer.linear.{kind}"] = state[f"proj_out_2.{kind}"]
    if single:
        out["final_layer.scale_shift_table"] = state["scale_shift_table"]
        out["y_embedder.y_embedding"] = extras["null_caption"]
    else:
        out["y_embedder.embedding_table.weight"] = _shared_blocks(
            state, depth, "norm1.emb.class_embedder.embedding_table.weight", "class embedding")
    return out, args


def use_dit_time_embedding(model):
    """Make a loaded diffusers DiTTransformer2DModel embed time as facebookresearch/DiT and this
    project do (downscale_freq_shift 0); returns the model."""
    for block in model.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return model
