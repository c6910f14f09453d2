"""Networks: the DiT expert (adaLN-Zero or AdaLN-Single), the router, and the size
registry.

This file imports nothing of the project: copy it elsewhere and the networks come with it.
Reading them from checkpoints (ours or facebookresearch/DiT's) is checkpoint.py's job.

Module names follow facebookresearch/DiT exactly (`x_embedder.proj`, `t_embedder.mlp`,
`y_embedder.embedding_table`, `blocks.N.attn.qkv`, `blocks.N.adaLN_modulation.1`,
`final_layer`), so its official checkpoints load with strict key matching. The
AdaLN-Single parts take PixArt-alpha's names (`t_block`, `scale_shift_table`).

How the class label enters AdaLN-Single: PixArt feeds only the timestep to `t_block`,
because its condition (text) enters through cross-attention. A class-conditional DiT has
no cross-attention, so the label must reach the trunk through the modulation: we feed c =
t_emb + y_emb to `t_block` (and to the final layer), exactly the c that DiT feeds to every
adaLN-Zero block. That keeps the label effective in every block, and keeps
`t_embedder`/`y_embedder` identical between the variants, so a DiT checkpoint's embedders
carry over unchanged when it is converted.

Text: a text-conditional DiT (`text_dim` > 0) follows PixArt-alpha. The caption's token
embeddings (N, L, text_dim) from a frozen text encoder pass through `y_embedder.y_proj`
and every block reads them by cross-attention
(`blocks.N.cross_attn.{q_linear,kv_linear,proj}`), between self-attention and the MLP; the
modulation then carries t alone. An all-zero caption means "no caption" and is replaced by
the learned `y_embedder.y_embedding`, the null caption of classifier-free guidance (the
text counterpart of the null class index).

The AdaLN variant is the constructor's `modulation` ('adaln-single' or 'adaln-zero'); what
the network is conditioned on is its `num_classes` / `text_dim`, set from condition.py's
objects.

Time: the network embeds `t * t_scale`. A DDPM network (and every official DiT) takes the
DDPM step 0..999 (t_scale = 1); a flow-matching network takes flow time t in [0, 1] and
scales it to 0..1000 (t_scale = 1000) so the sinusoidal frequencies span the same range.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter



def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def sincos_pos_embed(dim, grid_size):
    """DiT's fixed 2-D sin-cos table (grid_size**2, dim), first half from the column
    index."""
    def one_axis(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        angles = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    col, row = np.meshgrid(np.arange(grid_size, dtype=np.float64),
                           np.arange(grid_size, dtype=np.float64))
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
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    @staticmethod
    def sinusoid(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(
            half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.sinusoid(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class label to a D-vector; row `num_classes` is the null class used for
    guidance."""
    def __init__(self, num_classes, hidden_size):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, y):
        return self.embedding_table(y)


class CaptionEmbedder(nn.Module):
    """Caption tokens (N, L, text_dim) to the trunk's width, with a learned null
    caption for guidance."""
    def __init__(self, text_dim, hidden_size, text_len):
        super().__init__()
        self.y_proj = Mlp(text_dim, hidden_size, hidden_size)
        self.y_embedding = nn.Parameter(torch.randn(text_len, text_dim) / text_dim ** 0.5)

    def forward(self, y):
        # (N,) an all-zero caption is "none"
        null = (y == 0).flatten(1).all(1)
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
        n, t, d = x.shape
        q = self.q_linear(x).reshape(n, t, self.num_heads, -1).transpose(1, 2)       # (N, H, T, Dh)
        k, v = self.kv_linear(cond).reshape(n, cond.shape[1], 2, self.num_heads, -1).permute(
            2, 0, 3, 1, 4)                                                          # (N, H, L, Dh) each
        x = F.scaled_dot_product_attention(q, k, v)                                 # (N, H, T, Dh)
        return self.proj(x.transpose(1, 2).reshape(n, t, d))


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection and PyTorch's fused
    kernel."""
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)   # (N, H, T, Dh)
        return self.proj(x.transpose(1, 2).reshape(n, t, d))


class Mlp(nn.Module):
    """The transformer MLP with DiT's tanh-approximated GELU."""
    def __init__(self, dim, hidden, out=None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out or dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """Transformer block whose norms are modulated by the condition (adaLN-Zero or
    AdaLN-Single)."""
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
        # c: (N, D) for adaLN-Zero; for AdaLN-Single the shared t_block output (N, 6, D);
        # text: (N, L, D) or None
        if hasattr(self, "scale_shift_table"):
            mod = self.scale_shift_table[None] + c                           # (N, 6, D)
        else:
            mod = self.adaLN_modulation(c).unflatten(1, (6, -1))            # (N, 6, D)
        # (N, 1, D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.unsqueeze(2).unbind(1)
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
    """Diffusion transformer: patchify, blocks modulated by (t, y), final layer,
    unpatchify."""
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152,
                 depth=28, num_heads=16,
                 mlp_ratio=4.0, num_classes=1000, learn_sigma=True,
                 modulation="adaln-single", t_scale=1.0,
                 text_dim=0, text_len=77, cluster_classes=0):
        super().__init__()
        assert modulation in ("adaln-single", "adaln-zero"), modulation
        assert input_size % patch_size == 0 and hidden_size % num_heads == 0
        assert not (num_classes and text_dim), "a DiT is conditioned on classes or on text, not both"
        self.in_channels, self.patch_size = in_channels, patch_size
        self.num_classes, self.text_dim = num_classes, text_dim
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
        # The information control (docs/x16-protocol.md): one network told each image's
        # k-means cluster as a second label, added to the class's embedding as DiT adds y's
        self.cluster_classes = cluster_classes
        if cluster_classes > 0:
            assert num_classes > 0, "the cluster is a second label beside the class"
            self.cluster_embedder = LabelEmbedder(cluster_classes, hidden_size)
        # A buffer, not a parameter: it is fixed, so optimisers and EMA never touch it,
        # yet it stays in the state dict under DiT's name.
        self.register_buffer("pos_embed",
                             torch.from_numpy(sincos_pos_embed(hidden_size, grid)).float()[None])
        if single:   # PixArt's shared modulation, computed once per forward for all blocks
            self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, single,
                                             cross=text_dim > 0) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size,
                                      patch_size * patch_size * self.out_channels, single)
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
        if self.cluster_classes > 0:
            nn.init.normal_(self.cluster_embedder.embedding_table.weight, std=0.02)
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
        """x: (N, C, H, W); t: (N,) time in the model's native units; y: (N,) labels
        (`num_classes` = null), (N, 2) labels and clusters with `cluster_classes`
        (`cluster_classes` = null), or (N, L, text_dim) caption tokens (all zeros = null)."""
        h = x.shape[-2] // self.patch_size
        x = self.x_embedder(x) + self.pos_embed                    # (N, T, D)
        c = self.t_embedder(t * self.t_scale)                       # (N, D)
        text = None
        if self.cluster_classes > 0:
            c = c + self.cluster_embedder(y[:, 1])
            y = y[:, 0]
        if self.num_classes > 0:
            c = c + self.y_embedder(y)
        elif self.text_dim > 0:
            text = self.y_embedder(y)                               # (N, L, D)
        # (N, 6, D) or (N, D)
        mod = self.t_block(c).unflatten(1, (6, -1)) if hasattr(self, "t_block") else c
        for block in self.blocks:
            x = block(x, mod, text)                                 # (N, T, D)
        x = self.final_layer(x, c)                                  # (N, T, p*p*C_out)
        p = self.patch_size
        x = x.reshape(x.shape[0], h, -1, p, p, x.shape[-1] // (p * p))   # (N, h, w, p, q, C_out)
        return x.permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)   # (N, C_out, H, W)


def renamed_args(model_args):
    """Constructor args as model.py names them today: a router's head was sized by
    `num_clusters` until it was named for what it counts, the experts (num_experts)."""
    model_args = dict(model_args)
    if "num_clusters" in model_args:
        model_args["num_experts"] = model_args.pop("num_clusters")
    return model_args


def shape_disagreement(state, want, network):
    """The first way a state dict of tensors differs from the names and shapes `want` of
    `network`, in words, or None where it holds exactly those: the checkpoint loader and
    the release reader say it in one line where load_state_dict would raise many."""
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    misfit = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k])]
    if misfit:
        return (f"{misfit[0]} has shape {tuple(state[misfit[0]].shape)}, {network} "
                f"{tuple(want[misfit[0]])}")
    if missing:
        return f"{missing[0]} is missing"
    return f"{unexpected[0]} is not in its network" if unexpected else None


class Router(nn.Module):
    """A small DiT-style classifier: logits over the K experts of a noisy sample, p(k |
    x_t, t[, y])."""
    def __init__(self, input_size=8, patch_size=2, in_channels=1, hidden_size=64,
                 depth=2, num_heads=4, mlp_ratio=4.0, num_experts=4, num_classes=0,
                 t_scale=1000.0, text_dim=0, downsample=1):
        super().__init__()
        self.num_classes, self.t_scale, self.text_dim = num_classes, t_scale, text_dim
        # reading x_t average-pooled by `downsample` divides the tokens by its square:
        # the cluster of a noisy image shows in its coarse layout (docs/router.md)
        self.downsample = downsample
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        if num_classes > 0:
            self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        # the pooled caption embedding; an all-zero one (no caption) maps to the learned
        # bias
        if text_dim > 0:
            self.y_embedder = nn.Module()
            self.y_embedder.y_proj = nn.Linear(text_dim, hidden_size)
        grid = input_size // downsample // patch_size
        self.register_buffer("pos_embed",
                             torch.from_numpy(sincos_pos_embed(hidden_size, grid)).float()[None])
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, single=True)
                                    for _ in range(depth))
        self.norm_final = nn.LayerNorm(hidden_size, eps=1e-6)
        self.head = nn.Linear(hidden_size, num_experts)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.head.weight)   # start from the uniform posterior

    def forward(self, x, t, y=None):
        """x: (N, C, H, W) on the flow path; t: (N,) flow time in [0, 1]; y: what
        condition.py's `router_input` gives: labels (N,) (`num_classes` = null), pooled
        caption embeddings (N, text_dim) (all zeros = null), or None for a router that
        reads no condition."""
        if self.downsample > 1:
            x = F.avg_pool2d(x, self.downsample)
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


# Sizes in DiT's registry (depth, width, heads), plus CPU-sized ones: T and M for smoke
# tests, and N (one block, 30 k parameters at /4), a network too small for digits: the
# capacity-bound regime DDM's claim is about. Patches 7, 14 and 28 divide Fashion-MNIST's
# 28 px, which patch 8 does not (28 is one token per image, as 8 is on digits).
SIZES = {"XL": (28, 1152, 16), "L": (24, 1024, 16), "B": (12, 768, 12), "S": (12, 384, 6),
         "T": (4, 128, 4), "M": (2, 64, 4), "N": (1, 32, 2)}
PATCHES = (1, 2, 4, 7, 8, 14, 28)
DiT_models = {f"DiT-{name}/{p}": (depth, width, heads, p) for name,
              (depth, width, heads) in SIZES.items() for p in PATCHES}


# what train_expert.py trains without --model or --init, and what a router trained before
# its experts is sized for
DEFAULT_EXPERT_MODEL = "DiT-T/2"


def model_args_for(name, **kwargs):
    """Constructor arguments of a registry size, e.g. model_args_for('DiT-T/2',
    input_size=8, in_channels=1)."""
    if name not in DiT_models:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(DiT_models)}")
    depth, width, heads, patch = DiT_models[name]
    return dict(depth=depth, hidden_size=width, num_heads=heads, patch_size=patch, **kwargs)


def registry_name(model_args):
    """The registry size of these constructor arguments ('DiT-S/2'), or a spelled-out
    shape for one outside the registry."""
    shape = (model_args["depth"], model_args["hidden_size"], model_args["num_heads"],
             model_args["patch_size"])
    name = next((name for name, size in DiT_models.items() if size == shape),
                "depth {}, width {}, {} heads, patch {}".format(*shape))
    pooled = model_args.get("downsample", 1)
    return f"{name} on x_t pooled {pooled}x" if pooled > 1 else name


# PyTorch's counter knows the GPU attention kernels but not the CPU one; without these two
# formulas attention's FLOPs would silently vanish from every CPU count.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None,
    **kwargs: flop_counter.sdpa_backward_flop_count(g, q, k, v),
}


def count_flops(fn):
    """FLOPs of the matrix work fn() does (a forward, or a forward and backward), by
    PyTorch's FlopCounterMode."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn()
    return counter.get_total_flops()


@torch.no_grad()
def clip_text_embeddings(clip, tokenizer, texts, device="cpu"):
    """(tokens (N, L, W), pooled (N, E)) of a list of strings by an open_clip model: the
    token embeddings after the text tower's final LayerNorm (what a DiT's cross-attention
    reads, as in Paris) and the pooled, projected, L2-normalised embedding (what a router
    reads). One function for the project's text encoder and a release's pipeline, so both
    condition the networks on the same numbers."""
    captured = {}
    hook = clip.ln_final.register_forward_hook(
        lambda module, args, out: captured.__setitem__("tokens", out))
    try:
        pooled = clip.encode_text(tokenizer(texts).to(device), normalize=True)
    finally:
        hook.remove()
    return captured["tokens"].float().cpu(), pooled.float().cpu()


def forward_flops(network_class, model_args):
    """Matrix FLOPs of one forward pass on one image, counted on the meta device: no
    weights, no memory, so a DiT-XL costs the same few seconds to count as a DiT-N."""
    with torch.device("meta"):
        net = network_class(**model_args)
    net.to("meta")   # the sin-cos position table is built on the CPU
    meta = {"device": "meta"}
    size, channels = model_args["input_size"], model_args["in_channels"]
    text_dim = model_args.get("text_dim", 0)
    if model_args.get("num_classes", 0):
        y = torch.zeros(1, dtype=torch.long, **meta)
    elif text_dim and network_class is DiT:
        y = torch.zeros(1, model_args.get("text_len", 77), text_dim, **meta)
    elif text_dim:   # a router reads the pooled caption
        y = torch.zeros(1, text_dim, **meta)
    else:
        y = None
    x, t = torch.zeros(1, channels, size, size, **meta), torch.full((1,), 0.5, **meta)
    return count_flops(lambda: net(x, t, y))


# The router's default cost. DDM's top-1 ensemble samples at 1.08x its monolith's FLOPs
# (arXiv 2501.05450, Table 1); a router within 5 % of one expert's forward keeps top-1
# within 1.05x. Routers of 16 and 4 tokens at 1.6-8.8 % of a Fashion DiT-M/4 expert routed
# at least as well as one of the expert's own size at equal training FLOPs (better on one
# set of experts; the 16-token default over ten sets: no difference); one of a single
# token did too, on that one data set, so the rule keeps a margin of 4 tokens
# (docs/router.md, "What a router costs").
ROUTER_SHARE = 0.05
MIN_ROUTER_TOKENS = 4


def router_for(expert_flops, input_size, in_channels, share=ROUTER_SHARE, **router_args):
    """(registry name, forward FLOPs) of the router with the most forward FLOPs within
    `share` of one expert's (`expert_flops`), among those whose patch tiles the input
    into at least MIN_ROUTER_TOKENS tokens; the cheapest of them when none is within it."""
    options = []
    for size in SIZES.__reversed__():   # smallest first: N, M, T, S, B, L, XL
        within = False
        for patch in sorted(PATCHES, reverse=True):   # coarsest (cheapest) first
            if input_size % patch or (input_size // patch) ** 2 < MIN_ROUTER_TOKENS:
                continue
            name = f"DiT-{size}/{patch}"
            flops = forward_flops(Router, model_args_for(
                name, input_size=input_size, in_channels=in_channels, **router_args))
            options.append((flops, name))
            if flops > share * expert_flops:
                break   # a finer patch of this size costs more still
            within = True
        if not within and options:
            break       # a wider router costs more at every patch
    if not options:
        raise ValueError(f"no router patch tiles a {input_size}-px input into "
                         f"{MIN_ROUTER_TOKENS}+ tokens")
    fitting = [o for o in options if o[0] <= share * expert_flops]
    flops, name = max(fitting) if fitting else min(options)
    return name, flops
