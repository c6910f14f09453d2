"""Frozen pretrained encoders: open_clip's image and text towers, the cached caption
embeddings, and DINOv2.

One module loads CLIP for every stage (cluster.py's image and caption features, the text
condition of experts and routers, eval.py's CLIP-FD and CLIP score), so no stage imports
another.

`load_clip(model, pretrained)` loads an open_clip model from a local file (a hub tag only with
--download); `clip_image_features` embeds images in [-1, 1].

`TextEncoder(model, pretrained)` gives, for a list of strings, the token embeddings (N, L,
W) after the tower's final LayerNorm (what cross-attention reads, as in Paris) and the
pooled, projected embedding (N, E) (what the router may read). The tokenizer ships with
open_clip and works offline. Weights: a local open_clip file, a hub tag only with
--download, or 'none' for a randomly initialised tower, which is only for smoke tests and
is recorded in every log and checkpoint as `pretrained: none (random)`.

`load_dinov2(weights)` builds the papers' clustering encoder from the official DINOv2
release's state dict through timm; `dinov2_features` gives its L2-normalised class tokens.

Captions are encoded once and cached in runs/text/KEY.pt (KEY hashes the encoder spec
and the distinct captions): expert training never runs the text tower."""
import os

import torch

from model import clip_text_embeddings
from plumbing.command_line import UsageError, first_line
from plumbing.run_dir import atomic_save, cache_key, load_checkpoint


def architecture(model_name):
    """The open_clip architecture name; a model-config .json path is registered with
    open_clip first."""
    import open_clip
    if model_name.endswith(".json"):
        if not os.path.isfile(model_name):
            raise UsageError(f"no open_clip model config at {model_name}")
        open_clip.add_model_config(model_name)
        model_name = os.path.splitext(os.path.basename(model_name))[0]
    if model_name not in open_clip.list_models():
        raise UsageError(f"unknown open_clip model {model_name!r} (see open_clip.list_models())")
    return model_name


def open_clip_config(model_name):
    """The model config (a dict) open_clip builds `model_name` from, after `architecture`."""
    import open_clip
    return open_clip.get_model_config(model_name)


def load_clip(model_name, pretrained, download, device):
    """An open_clip model from a local weights file (or a hub tag with --download). Never
    random weights.

    `model_name` is an open_clip architecture name, or a path to an open_clip model-config
    JSON (for custom or tiny architectures).
    """
    import open_clip
    name = architecture(model_name)
    if not pretrained or pretrained == "none" or (not os.path.isfile(pretrained) and not download):
        raise UsageError("CLIP needs weights: pass --clip-pretrained "
                         f"/path/to/{name}.bin (a local open_clip weights file), or a "
                         "tag such as 'openai' together with --download")
    try:
        model = open_clip.create_model(name, pretrained=pretrained, device=device)
    except Exception as e:
        raise UsageError(f"cannot load CLIP weights {pretrained!r} for {name}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return model.eval()


@torch.no_grad()
def clip_image_features(model, images, device):
    """L2-normalised CLIP embeddings of images in [-1, 1] (N, C, H, W), any size and 1
    or 3 channels."""
    size = model.visual.image_size
    size = size if isinstance(size, (tuple, list)) else (size, size)
    mean = torch.tensor(model.visual.image_mean or (0.48145466, 0.4578275, 0.40821073),
                        device=device).view(1, 3, 1, 1)
    std = torch.tensor(model.visual.image_std or (0.26862954, 0.26130258, 0.27577711),
                       device=device).view(1, 3, 1, 1)
    x = (images.to(device) + 1) / 2
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    x = torch.nn.functional.interpolate(
        x, size=size, mode="bicubic", align_corners=False).clamp(0, 1)
    return torch.nn.functional.normalize(model.encode_image((x - mean) / std).float(), dim=-1)


class TextEncoder:
    """open_clip's text tower, frozen, in eval mode ('none' weights: a seeded random
    tower, for smoke tests)."""

    def __init__(self, model_name, pretrained, download=False, device="cpu"):
        import open_clip
        name = architecture(model_name)
        if pretrained == "none":
            # a random tower must at least be the same random tower every time
            torch.manual_seed(0)
            self.model = open_clip.create_model(name, pretrained=None, device=device).eval()
        else:
            self.model = load_clip(model_name, pretrained, download, device)
        self.model.requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)
        self.device = device
        self.spec = encoder_spec(model_name, pretrained)

    def __call__(self, texts, batch_size=256):
        """(tokens (N, L, W), pooled (N, E)) for a list of strings."""
        parts = [clip_text_embeddings(self.model, self.tokenizer, texts[i:i + batch_size],
                                      self.device) for i in range(0, len(texts), batch_size)]
        return torch.cat([t for t, _ in parts]), torch.cat([p for _, p in parts])


def encoder_spec(clip_model, clip_pretrained):
    """What identifies a text encoder in logs, checkpoints and caches (paths differ
    between machines)."""
    weights = "none (random)" if clip_pretrained == "none" else os.path.basename(clip_pretrained)
    if clip_pretrained != "none" and os.path.isfile(clip_pretrained):
        weights += f" ({os.path.getsize(clip_pretrained)} bytes)"
    return {"clip_model": os.path.basename(clip_model), "clip_pretrained": weights}


def _cached(run_dir, spec, captions):
    """(tokens, pooled) of these captions from any cache in RUN_DIR/text/ made with
    this encoder, else None."""
    folder = os.path.join(run_dir, "text")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:   # a file that is not a readable cache is passed over: encoding again replaces it
            cache = load_checkpoint(os.path.join(folder, name), "caption cache")
            where = {c: i for i, c in enumerate(cache["captions"])}
            whole = len(cache["tokens"]) == len(cache["pooled"]) == len(cache["captions"])
            if whole and cache["encoder"] == spec and all(c in where for c in captions):
                rows = torch.tensor([where[c] for c in captions], dtype=torch.long)
                return cache["tokens"][rows], cache["pooled"][rows]
        except (UsageError, KeyError, TypeError, IndexError):
            continue
    return None


def caption_embeddings(captions, run_dir, *, encoder=None, clip_model="ViT-B-32",
                       clip_pretrained=None, download=False, device="cpu", tower=None):
    """Embeddings of the distinct captions, cached: (tokens (U, L, W), pooled (U, E),
    index (N,) into them, encoder spec).

    `encoder` is the spec an earlier stage recorded: captions it already encoded are
    read from RUN_DIR/text/ without loading any weights. Otherwise
    --clip-model/--clip-pretrained name the encoder (and must match `encoder` when both
    are given), or `tower` is one already built (a release's own: a callable with the
    `spec` it was recorded under)."""
    distinct = sorted(set(captions))
    where = {c: i for i, c in enumerate(distinct)}
    index = torch.tensor([where[c] for c in captions], dtype=torch.long)
    if encoder is not None and (found := _cached(run_dir, encoder, distinct)) is not None:
        return *found, index, encoder
    if not clip_pretrained and tower is not None:
        if tower.spec != encoder:
            raise UsageError(f"the release's text tower is {tower.spec}, but the experts were "
                             f"trained with {encoder}")
        tokens, pooled = tower(distinct)
        return tokens, pooled, index, tower.spec
    if not clip_pretrained:
        raise UsageError("text conditioning needs a text encoder: --clip-pretrained "
                         "/path/to/open_clip_weights.bin (or 'none' for an explicitly "
                         "random one, for smoke tests)")
    spec = encoder_spec(clip_model, clip_pretrained)
    if encoder is not None and spec != encoder:
        raise UsageError(f"--clip-model/--clip-pretrained give {spec}, but the experts "
                         f"were trained with {encoder}")
    if (found := _cached(run_dir, spec, distinct)) is not None:
        return *found, index, spec
    tokens, pooled = TextEncoder(clip_model, clip_pretrained, download, device)(distinct)
    path = os.path.join(run_dir, "text", f"{cache_key([spec, distinct])}.pt")
    atomic_save({"tokens": tokens, "pooled": pooled, "captions": distinct, "encoder": spec}, path)
    print(f"encoded {len(distinct)} distinct captions with {spec}; cached in {path}")
    return tokens, pooled, index, spec


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load_dinov2(weights, image_size, device):
    """A DINOv2 ViT from the official release's state dict (e.g.
    dinov2_vits14_pretrain.pth), built with timm.

    The architecture is read off the tensors: width, depth, patch size, MLP width and
    register tokens; heads = width / 64, as in every DINOv2 model. timm's own converter
    maps the release's names; its position table is resampled to `image_size` (DINOv2
    is used at 224 px)."""
    if not weights:
        raise UsageError("--features dinov2 needs --dinov2-weights FILE: the official "
                         "DINOv2 state dict, e.g. dinov2_vits14_pretrain.pth")
    try:
        from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
    except ImportError:
        raise UsageError("--features dinov2 needs timm (installed with open_clip_torch): "
                         "pip install timm")
    state = load_checkpoint(weights, "DINOv2 weights")
    try:
        if any(".mlp.w12." in k for k in state):
            raise UsageError(f"{weights}: the SwiGLU DINOv2 (ViT-g/14) is not supported; "
                             "use ViT-S/14, B/14 or L/14")
        width, patch = state["cls_token"].shape[-1], state["patch_embed.proj.weight"].shape[-1]
        depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
        mlp_ratio = state["blocks.0.mlp.fc1.weight"].shape[0] / width
        registers = state["register_tokens"].shape[1] if "register_tokens" in state else 0
    except (KeyError, ValueError, AttributeError, TypeError) as e:
        raise UsageError(f"{weights} is not a DINOv2 state dict ({first_line(e)})")
    if image_size % patch:
        raise UsageError(f"--dinov2-size {image_size} is not a multiple of the model's "
                         f"{patch}-pixel patches")
    model = VisionTransformer(img_size=image_size, patch_size=patch, embed_dim=width, depth=depth,
                              num_heads=max(1, width // 64),
                              mlp_ratio=mlp_ratio, init_values=1.0, num_classes=0,
                              reg_tokens=registers, no_embed_class=registers > 0)
    try:
        model.load_state_dict(checkpoint_filter_fn(state, model), strict=True)
    except (RuntimeError, KeyError) as e:
        raise UsageError(f"{weights} does not load as a DINOv2 ViT: {first_line(e)}")
    return model.eval().requires_grad_(False).to(device)


@torch.no_grad()
def dinov2_features(model, images, device):
    """L2-normalised DINOv2 class tokens of images in [-1, 1] (N, C, H, W), any size
    and 1 or 3 channels."""
    size = model.patch_embed.img_size
    x = (images.to(device) + 1) / 2
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    x = torch.nn.functional.interpolate(
        x, size=size, mode="bicubic", align_corners=False).clamp(0, 1)
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1)
                 for v in (IMAGENET_MEAN, IMAGENET_STD))
    return torch.nn.functional.normalize(model((x - mean) / std).float(), dim=-1)
