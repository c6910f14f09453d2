"""Networks: the DiT expert (adaLN-Zero or AdaLN-Single), the router, and loading either from a checkpoint.

`load(path)` is the one way every stage reads a trained network: it returns a `Network`, the
module together with the condition it reads and (for an expert) the objective it was trained
under, each rebuilt from the typed specs in the checkpoint's config (`objective.spec()`,
`condition.spec()`). An official facebookresearch/DiT state dict loads as a class-conditional
DDPM expert.

Module names follow facebookresearch/DiT exactly (`x_embedder.proj`, `t_embedder.mlp`,
`y_embedder.embedding_table`, `blocks.N.attn.qkv`, `blocks.N.adaLN_modulation.1`,
`final_layer`), so its official checkpoints load with strict key matching. The AdaLN-Single
parts take PixArt-alpha's names (`t_block`, `scale_shift_table`).

How the class label enters AdaLN-Single: PixArt feeds only the timestep to `t_block`,
because its condition (text) enters through cross-attention. A class-conditional DiT has no
cross-attention, so the label must reach the trunk through the modulation: we feed
c = t_emb + y_emb to `t_block` (and to the final layer), exactly the c that DiT feeds to
every adaLN-Zero block. That keeps the label effective in every block, and keeps
`t_embedder`/`y_embedder` identical between the variants, so a DiT checkpoint's
embedders carry over unchanged when it is converted.

Text: a text-conditional DiT (`text_dim` > 0) follows PixArt-alpha. The caption's token
embeddings (N, L, text_dim) from a frozen text encoder pass through `y_embedder.y_proj` and
every block reads them by cross-attention (`blocks.N.cross_attn.{q_linear,kv_linear,proj}`),
between self-attention and the MLP; the modulation then carries t alone. An all-zero caption
means "no caption" and is replaced by the learned `y_embedder.y_embedding`, the null caption
of classifier-free guidance (the text counterpart of the null class index).

The AdaLN variant is the constructor's `modulation` ('adaln-single' or 'adaln-zero'); what the
network is conditioned on is its `num_classes` / `text_dim`, set from condition.py's objects.

Time: the network embeds `t * t_scale`. A DDPM network (and every official DiT) takes the
DDPM step 0..999 (t_scale = 1); a flow-matching network takes flow time t in [0, 1] and
scales it to 0..1000 (t_scale = 1000) so the sinusoidal frequencies span the same range.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils import flop_counter

from condition import condition_from_spec
from diffusion import DDPM, RectifiedFlow, objective_from_spec


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def sincos_pos_embed(dim, grid_size):
    """DiT's fixed 2-D sin-cos table (grid_size**2, dim), first half from the column index."""
    def one_axis(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        angles = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    col, row = np.meshgrid(np.arange(grid_size, dtype=np.float64), np.arange(grid_size, dtype=np.float64))
    return np.concatenate([one_axis(dim // 2, col), one_axis(dim // 2, row)], axis=1)


class PatchEmbed(nn.Module):
    """Image (N, C, H, W) to patch tokens (N, T, D)."""
    def __init__(self, patch_size, in_channels, hidden_size):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Scalar time to a D-vector: sinusoidal features, then a two-layer MLP."""
    def __init__(self, hidden_size, frequency_size=256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    @staticmethod
    def sinusoid(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.sinusoid(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class label to a D-vector; row `num_classes` is the null class used for guidance."""
    def __init__(self, num_classes, hidden_size):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, y):
        return self.embedding_table(y)


class CaptionEmbedder(nn.Module):
    """Caption tokens (N, L, text_dim) to the trunk's width, with a learned null caption for guidance."""
    def __init__(self, text_dim, hidden_size, text_len):
        super().__init__()
        self.y_proj = Mlp(text_dim, hidden_size, hidden_size)
        self.y_embedding = nn.Parameter(torch.randn(text_len, text_dim) / text_dim ** 0.5)

    def forward(self, y):
        null = (y == 0).flatten(1).all(1)                               # (N,) an all-zero caption is "none"
        y = torch.where(null[:, None, None], self.y_embedding.to(y.dtype)[None], y)
        return self.y_proj(y)                                           # (N, L, D)


class CrossAttention(nn.Module):
    """Image tokens attend to caption tokens (PixArt's names)."""
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q_linear = nn.Linear(dim, dim)
        self.kv_linear = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cond):
        q = rearrange(self.q_linear(x), "n t (h d) -> n h t d", h=self.num_heads)
        k, v = rearrange(self.kv_linear(cond), "n l (two h d) -> two n h l d", two=2, h=self.num_heads)
        return self.proj(rearrange(F.scaled_dot_product_attention(q, k, v), "n h t d -> n t (h d)"))


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection and PyTorch's fused kernel."""
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = rearrange(self.qkv(x), "n t (three h d) -> three n h t d", three=3, h=self.num_heads)
        x = F.scaled_dot_product_attention(q, k, v)   # (N, H, T, Dh)
        return self.proj(rearrange(x, "n h t d -> n t (h d)"))


class Mlp(nn.Module):
    """The transformer MLP with DiT's tanh-approximated GELU."""
    def __init__(self, dim, hidden, out=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out or dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """Transformer block whose norms are modulated by the condition (adaLN-Zero or AdaLN-Single)."""
    def __init__(self, hidden_size, num_heads, mlp_ratio, single, cross=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        if cross:
            self.cross_attn = CrossAttention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        if single:   # PixArt: only a learned per-block offset to the shared modulation
            self.scale_shift_table = nn.Parameter(torch.randn(6, hidden_size) / hidden_size ** 0.5)
        else:        # DiT: a modulation MLP per block
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c, text=None):
        # c: (N, D) for adaLN-Zero; for AdaLN-Single the shared t_block output (N, 6, D); text: (N, L, D) or None
        if hasattr(self, "scale_shift_table"):
            mod = self.scale_shift_table[None] + c                           # (N, 6, D)
        else:
            mod = self.adaLN_modulation(c).unflatten(1, (6, -1))            # (N, 6, D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.unsqueeze(2).unbind(1)  # (N, 1, D)
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        if text is not None:
            x = x + self.cross_attn(x, text)
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """Modulated norm and a linear map from tokens to patches of output channels."""
    def __init__(self, hidden_size, out_features, single):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_features)
        if single:
            self.scale_shift_table = nn.Parameter(torch.randn(2, hidden_size) / hidden_size ** 0.5)
        else:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        if hasattr(self, "scale_shift_table"):   # PixArt: offset by the condition embedding itself
            shift, scale = (self.scale_shift_table[None] + c[:, None]).unsqueeze(2).unbind(1)
        else:
            shift, scale = self.adaLN_modulation(c).unflatten(1, (2, -1)).unsqueeze(2).unbind(1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Diffusion transformer: patchify, blocks modulated by (t, y), final layer, unpatchify."""
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, num_classes=1000, learn_sigma=True, modulation="adaln-single", t_scale=1.0,
                 text_dim=0, text_len=77):
        super().__init__()
        assert modulation in ("adaln-single", "adaln-zero"), modulation
        assert input_size % patch_size == 0 and hidden_size % num_heads == 0
        assert not (num_classes and text_dim), "a DiT is conditioned on classes or on text, not both"
        self.in_channels, self.patch_size, self.num_classes, self.text_dim = in_channels, patch_size, num_classes, text_dim
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.t_scale = t_scale
        single = modulation == "adaln-single"
        grid = input_size // patch_size

        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        if num_classes > 0:
            self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        if text_dim > 0:
            self.y_embedder = CaptionEmbedder(text_dim, hidden_size, text_len)
        # A buffer, not a parameter: it is fixed, so optimisers and EMA never touch it,
        # yet it stays in the state dict under DiT's name.
        self.register_buffer("pos_embed", torch.from_numpy(sincos_pos_embed(hidden_size, grid)).float()[None])
        if single:   # PixArt's shared modulation, computed once per forward for all blocks
            self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, single, cross=text_dim > 0) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size * patch_size * self.out_channels, single)
        self.initialize_weights()

    def initialize_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        if self.num_classes > 0:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        if self.text_dim > 0:
            nn.init.normal_(self.y_embedder.y_proj.fc1.weight, std=0.02)
            nn.init.normal_(self.y_embedder.y_proj.fc2.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        if hasattr(self, "t_block"):
            nn.init.normal_(self.t_block[1].weight, std=0.02)
        for block in self.blocks:   # adaLN-Zero: every residual branch starts switched off
            if hasattr(block, "cross_attn"):   # PixArt: cross-attention starts as a no-op
                nn.init.zeros_(block.cross_attn.proj.weight)
                nn.init.zeros_(block.cross_attn.proj.bias)
            if hasattr(block, "adaLN_modulation"):
                nn.init.zeros_(block.adaLN_modulation[-1].weight)
                nn.init.zeros_(block.adaLN_modulation[-1].bias)
        if hasattr(self.final_layer, "adaLN_modulation"):
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        # A zero output layer: a new model predicts 0 everywhere, whatever its objective.
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(self, x, t, y=None):
        """x: (N, C, H, W); t: (N,) time in the model's native units; y: (N,) labels (`num_classes` = null)
        or (N, L, text_dim) caption tokens (all zeros = null)."""
        h = x.shape[-2] // self.patch_size
        x = self.x_embedder(x) + self.pos_embed                    # (N, T, D)
        c = self.t_embedder(t * self.t_scale)                       # (N, D)
        text = None
        if self.num_classes > 0:
            c = c + self.y_embedder(y)
        elif self.text_dim > 0:
            text = self.y_embedder(y)                               # (N, L, D)
        mod = self.t_block(c).unflatten(1, (6, -1)) if hasattr(self, "t_block") else c   # (N, 6, D) or (N, D)
        for block in self.blocks:
            x = block(x, mod, text)                                 # (N, T, D)
        x = self.final_layer(x, c)                                  # (N, T, p*p*C_out)
        p = self.patch_size
        return rearrange(x, "n (h w) (p q c) -> n c (h p) (w q)", h=h, p=p, q=p)   # (N, C_out, H, W)


class Router(nn.Module):
    """A small DiT-style classifier: logits over K clusters of a noisy sample, p(k | x_t, t[, y])."""
    def __init__(self, input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=2, num_heads=4,
                 mlp_ratio=4.0, num_clusters=4, num_classes=0, t_scale=1000.0, text_dim=0):
        super().__init__()
        self.num_classes, self.t_scale, self.text_dim = num_classes, t_scale, text_dim
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        if num_classes > 0:
            self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        if text_dim > 0:   # the pooled caption embedding; an all-zero one (no caption) maps to the learned bias
            self.y_embedder = nn.Module()
            self.y_embedder.y_proj = nn.Linear(text_dim, hidden_size)
        grid = input_size // patch_size
        self.register_buffer("pos_embed", torch.from_numpy(sincos_pos_embed(hidden_size, grid)).float()[None])
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, single=True) for _ in range(depth))
        self.norm_final = nn.LayerNorm(hidden_size, eps=1e-6)
        self.head = nn.Linear(hidden_size, num_clusters)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.head.weight)   # start from the uniform posterior

    def forward(self, x, t, y=None):
        """x: (N, C, H, W) on the flow path; t: (N,) flow time in [0, 1]; y: what condition.py's
        `router_input` gives: labels (N,) (`num_classes` = null), pooled caption embeddings
        (N, text_dim) (all zeros = null), or None for a router that reads no condition."""
        x = self.x_embedder(x) + self.pos_embed                    # (N, T, D)
        c = self.t_embedder(t * self.t_scale)                       # (N, D)
        if self.num_classes > 0:
            c = c + self.y_embedder(y)
        elif self.text_dim > 0:
            c = c + self.y_embedder.y_proj(y)
        mod = self.t_block(c).unflatten(1, (6, -1))                 # (N, 6, D)
        for block in self.blocks:
            x = block(x, mod)
        return self.head(self.norm_final(x).mean(dim=1))            # (N, K)


# Sizes in DiT's registry (depth, width, heads), plus CPU-sized ones: T and M for smoke tests, and N (one block,
# 30 k parameters at /4), a network too small for digits: the capacity-bound regime DDM's claim is about.
# Patches 7, 14 and 28 divide Fashion-MNIST's 28 px, which patch 8 does not (28 is one token per image, as 8 is on digits).
SIZES = {"XL": (28, 1152, 16), "L": (24, 1024, 16), "B": (12, 768, 12), "S": (12, 384, 6),
         "T": (4, 128, 4), "M": (2, 64, 4), "N": (1, 32, 2)}
PATCHES = (1, 2, 4, 7, 8, 14, 28)
DiT_models = {f"DiT-{name}/{p}": (depth, width, heads, p) for name, (depth, width, heads) in SIZES.items() for p in PATCHES}


def model_args_for(name, **kwargs):
    """Constructor arguments of a registry size, e.g. model_args_for('DiT-T/2', input_size=8, in_channels=1)."""
    if name not in DiT_models:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(DiT_models)}")
    depth, width, heads, patch = DiT_models[name]
    return dict(depth=depth, hidden_size=width, num_heads=heads, patch_size=patch, **kwargs)


def registry_name(model_args):
    """The registry size of these constructor arguments ('DiT-S/2'), or a spelled-out shape for one outside the registry."""
    shape = (model_args["depth"], model_args["hidden_size"], model_args["num_heads"], model_args["patch_size"])
    return next((name for name, size in DiT_models.items() if size == shape), "depth {}, width {}, {} heads, patch {}".format(*shape))


# PyTorch's counter knows the GPU attention kernels but not the CPU one; without these two
# formulas attention's FLOPs would silently vanish from every CPU count.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(g, q, k, v),
}


def count_flops(fn):
    """FLOPs of the matrix work fn() does (a forward, or a forward and backward), by PyTorch's FlopCounterMode."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn()
    return counter.get_total_flops()


def strip_prefixes(state_dict):
    """Remove wrappers' prefixes: DistributedDataParallel's `module.` and torch.compile's `_orig_mod.`."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def infer_dit_args(state_dict, num_heads=None):
    """Every DiT constructor argument read off a bare state dict's tensor shapes.

    The head count is not in the tensors: DiT's registry uses 64-dim heads, except 16 heads
    at width 1152 (XL). Pass `num_heads` for anything else. The label table is assumed to
    hold DiT's extra null-class row, as every official checkpoint does.
    """
    sd = state_dict
    hidden, in_channels, patch, _ = sd["x_embedder.proj.weight"].shape
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    out_channels = sd["final_layer.linear.weight"].shape[0] // patch ** 2
    return dict(
        input_size=int(round(sd["pos_embed"].shape[1] ** 0.5)) * patch, patch_size=patch, in_channels=in_channels,
        hidden_size=hidden, depth=depth, num_heads=num_heads or (16 if hidden == 1152 else hidden // 64),
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / hidden,
        num_classes=sd["y_embedder.embedding_table.weight"].shape[0] - 1 if "y_embedder.embedding_table.weight" in sd else 0,
        text_dim=sd["y_embedder.y_embedding"].shape[1] if "y_embedder.y_embedding" in sd else 0,
        text_len=sd["y_embedder.y_embedding"].shape[0] if "y_embedder.y_embedding" in sd else 77,
        learn_sigma=out_channels == 2 * in_channels,
        modulation="adaln-single" if "t_block.1.weight" in sd else "adaln-zero")


CHECKPOINT_FORMAT = 2   # 2: config holds typed `objective` and `condition` specs and the `network` kind


class CheckpointError(ValueError):
    """A checkpoint that cannot be used where it was given; its message is one line for the user."""


def read_checkpoint(source):
    """A checkpoint from a path (tensors and plain data only) or an already-loaded dict."""
    if isinstance(source, dict):
        return source
    return torch.load(source, map_location="cpu", weights_only=True)


def upgrade_format_1(model_args, config):
    """Read a checkpoint written before format 2 (free-text objective and conditioning, `conditioning` = AdaLN variant)."""
    model_args, config = dict(model_args), dict(config)
    if "conditioning" in model_args:
        model_args["modulation"] = model_args.pop("conditioning")
    router = "num_clusters" in model_args
    kind = config.get("conditioning") or ("class" if model_args.get("num_classes") else "text" if model_args.get("text_dim") else "none")
    if kind == "class":
        condition = {"kind": "class", "num_classes": model_args["num_classes"]}
    elif kind == "text":   # the widths format 1 did not record stay unknown (None); the encoder is what gets compared
        condition = {"kind": "text", "encoder": config.get("text_encoder"), "length": None if router else model_args["text_len"],
                     "width": None if router else model_args["text_dim"], "pooled_width": model_args["text_dim"] if router else None}
    else:
        condition = {"kind": "none"}
    config.update(format=CHECKPOINT_FORMAT, network="router" if router else "dit", condition=condition)
    if not router:
        config["objective"] = {"name": config.get("objective", "ddpm"), **config.get("schedule", {})}
    return model_args, config


def split_checkpoint(source, num_heads=None):
    """(state dict, constructor args, config) of any checkpoint we accept, path or dict.

    Ours carry `model_args` and `config`, and their EMA weights are preferred; a bare
    facebookresearch/DiT state dict gets its args inferred from the tensors and is a
    class-conditional DDPM expert. Wrappers' prefixes are stripped either way.
    """
    ckpt = read_checkpoint(source)
    if "model_args" in ckpt:
        state = ckpt["ema"] if ckpt.get("ema") is not None else ckpt["model"]
        model_args, config = dict(ckpt["model_args"]), dict(ckpt.get("config", {}))
        if config.get("format") != CHECKPOINT_FORMAT:
            model_args, config = upgrade_format_1(model_args, config)
        return strip_prefixes(state), model_args, config
    state = strip_prefixes(ckpt)
    args = infer_dit_args(state, num_heads)
    condition = {"kind": "class", "num_classes": args["num_classes"]} if args["num_classes"] else {"kind": "none"}
    return state, args, {"format": CHECKPOINT_FORMAT, "network": "dit", "objective": DDPM().spec(), "condition": condition,
                         "init": "official facebookresearch/DiT state dict"}


class Network:
    """A trained network with what it takes to use it: the condition it reads, the objective it was
    trained under (experts; None for the router), and its checkpoint's config."""

    def __init__(self, net, condition, config, objective=None):
        self.net, self.condition, self.config, self.objective = net, condition, config, objective

    def velocity(self, x_t, t, y=None):
        """This expert's prediction as a rectified-flow velocity at flow time t."""
        return self.objective.velocity(self.net, x_t, t, y)

    def to(self, device):
        self.net.to(device)
        return self


def load(source, expect=None, num_heads=None):
    """A Network in eval mode from a path or dict: our expert or router checkpoint, or an official DiT state dict.

    `expect` ('dit' or 'router') refuses the other kind with a CheckpointError. An official
    checkpoint is a DDPM epsilon-model with learned sigma whose time input is the DDPM step.
    """
    try:
        state, model_args, config = split_checkpoint(source, num_heads)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise CheckpointError(f"not a checkpoint of this project or of facebookresearch/DiT ({type(e).__name__}: {e})")
    kind = config.get("network")
    if expect is not None and kind != expect:
        raise CheckpointError(f"this is a {'router' if kind == 'router' else 'expert'} checkpoint, "
                              f"not {'a router' if expect == 'router' else 'an expert'}")
    net = (Router if kind == "router" else DiT)(**model_args)
    net.load_state_dict(state, strict=True)
    objective = objective_from_spec(config["objective"]) if kind == "dit" else None
    if objective is not None:
        objective.clip_x0 = config.get("vae") is None   # pixels are bounded to [-1, 1], latents are not
    return Network(net.eval(), condition_from_spec(config["condition"]), config, objective)


def check_init_modulation(init, model_args, asked):
    """The recorded --modulation must be the network's: only a DDPM checkpoint converted to flow is re-parameterised to it."""
    own = model_args.get("modulation", "adaln-single")
    if own != asked:
        raise CheckpointError(f"--init {init} keeps its own modulation, {own} (only a DDPM checkpoint converted to a flow "
                              f"model takes --modulation): pass --modulation {own}")


def split_expert_checkpoint(source):
    """split_checkpoint of an expert: a router's checkpoint is refused before its arguments reach a DiT."""
    state, model_args, config = split_checkpoint(source)
    if config.get("network") != "dit":
        raise CheckpointError("it is a router checkpoint, not an expert")
    return state, model_args, config


def init_from_checkpoint(source, objective, *, modulation, condition_args):
    """(state dict, model args, objective, how) to start an expert of `objective` from a checkpoint.

    A DDPM checkpoint (ours, or an official DiT) starting a flow expert goes through
    convert_ddpm_to_fm, with the flow objective's time map; a checkpoint of the same objective
    is fine-tuned as it is (its schedule kept).
    """
    state, model_args, config = split_expert_checkpoint(source)
    source_objective = config["objective"]["name"]
    if objective.name == "fm" and source_objective == "ddpm":
        state, model_args, objective = convert_ddpm_to_fm(source, modulation=modulation, condition_args=condition_args,
                                                          time_map=objective.time_map)
        return state, model_args, objective, "convert_ddpm_to_fm"
    if source_objective != objective.name:
        raise CheckpointError(f"it is a {source_objective} checkpoint; it cannot start a {objective.name} expert")
    return state, model_args, objective_from_spec(config["objective"]), "weights"


def convert_ddpm_to_fm(source, *, modulation=None, condition_args=None, time_map="linear", num_heads=None):
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
               and (adaLN-Zero target) blocks.N.adaLN_modulation.1.*, final_layer.adaLN_modulation.1.*
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
                              + ("a router" if config.get("network") == "router" else "already flow matching"))
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
        weights = torch.stack([state.pop(f"blocks.{i}.adaLN_modulation.1.weight") for i in range(depth)])
        biases = torch.stack([state.pop(f"blocks.{i}.adaLN_modulation.1.bias") for i in range(depth)])
        state["t_block.1.weight"], state["t_block.1.bias"] = weights.mean(0), biases.mean(0)
        for i in range(depth):
            state[f"blocks.{i}.scale_shift_table"] = (biases[i] - biases.mean(0)).view(6, D)
        state.pop("final_layer.adaLN_modulation.1.weight")
        state["final_layer.scale_shift_table"] = state.pop("final_layer.adaLN_modulation.1.bias").view(2, D)
    elif source_modulation != target:
        raise CheckpointError(f"cannot convert {source_modulation} to {target}")
    objective = RectifiedFlow(time_map=time_map, schedule=schedule)
    args.update(learn_sigma=False, modulation=target, t_scale=999.0 if time_map == "linear" else 1.0, **(condition_args or {}))
    fresh = DiT(**args).state_dict()
    conditional = lambda key: key.startswith("y_embedder.") or ".cross_attn." in key
    state = {k: v for k, v in state.items() if k in fresh or not conditional(k)}
    state.update({k: v for k, v in fresh.items() if k not in state and conditional(k)})
    misfits = [f"{k} {tuple(v.shape)} vs {tuple(fresh[k].shape)}" for k, v in state.items() if k in fresh and v.shape != fresh[k].shape]
    if misfits:
        raise CheckpointError(f"the checkpoint does not fit the target network: {misfits[0]}")
    return state, args, objective
