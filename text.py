"""The frozen text encoder of text-to-image experts: open_clip's text tower, and cached caption embeddings.

`TextEncoder(model, pretrained)` gives, for a list of strings, the token embeddings (N, L, W)
after the tower's final LayerNorm (what cross-attention reads, as in Paris) and the pooled,
projected embedding (N, E) (what the router may read). The tokenizer ships with open_clip and
works offline. Weights: a local open_clip file, a hub tag only with --download, or 'none' for a
randomly initialised tower, which is only for smoke tests and is recorded in every log and
checkpoint as `pretrained: none (random)`.

Captions are encoded once and cached in runs/text/KEY.pt (KEY hashes the encoder spec and the
distinct captions): expert training never runs the text tower.
"""
import hashlib
import json
import os

import torch

from data import UsageError, atomic_save, load_checkpoint


class TextEncoder:
    """open_clip's text tower, frozen, in eval mode."""

    def __init__(self, model_name, pretrained, download=False, device="cpu"):
        import open_clip
        from cluster import load_clip
        if pretrained == "none":
            torch.manual_seed(0)   # a random tower must at least be the same random tower every time
            name = model_name
            if name.endswith(".json"):
                if not os.path.isfile(name):
                    raise UsageError(f"no open_clip model config at {name}")
                open_clip.add_model_config(name)
                name = os.path.splitext(os.path.basename(name))[0]
            self.model = open_clip.create_model(name, pretrained=None, device=device).eval()
        else:
            self.model = load_clip(model_name, pretrained, download, device)
            name = os.path.splitext(os.path.basename(model_name))[0] if model_name.endswith(".json") else model_name
        self.model.requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)
        self.device = device
        self.spec = encoder_spec(model_name, pretrained)

    @torch.no_grad()
    def __call__(self, texts, batch_size=256):
        """(tokens (N, L, W), pooled (N, E)) for a list of strings."""
        tokens, pooled = [], []
        captured = {}
        hook = self.model.ln_final.register_forward_hook(lambda module, args, out: captured.__setitem__("tokens", out))
        try:
            for i in range(0, len(texts), batch_size):
                ids = self.tokenizer(texts[i:i + batch_size]).to(self.device)
                pooled.append(self.model.encode_text(ids, normalize=True).float().cpu())
                tokens.append(captured["tokens"].float().cpu())
        finally:
            hook.remove()
        return torch.cat(tokens), torch.cat(pooled)


def encoder_spec(clip_model, clip_pretrained):
    """What identifies a text encoder in logs, checkpoints and caches (paths differ between machines)."""
    weights = "none (random)" if clip_pretrained == "none" else os.path.basename(clip_pretrained)
    if clip_pretrained != "none" and os.path.isfile(clip_pretrained):
        weights += f" ({os.path.getsize(clip_pretrained)} bytes)"
    return {"clip_model": os.path.basename(clip_model), "clip_pretrained": weights}


def caption_embeddings(captions, clip_model, clip_pretrained, run_dir, download=False, device="cpu"):
    """Every caption's embeddings, cached: (tokens (U, L, W), pooled (U, E), index (N,) into the U distinct captions, spec)."""
    if not clip_pretrained:
        raise UsageError("text conditioning needs a text encoder: --clip-pretrained /path/to/open_clip_weights.bin "
                         "(or 'none' for an explicitly random one, for smoke tests)")
    spec = encoder_spec(clip_model, clip_pretrained)
    distinct = sorted(set(captions))
    where = {c: i for i, c in enumerate(distinct)}
    index = torch.tensor([where[c] for c in captions])
    key = hashlib.sha1(json.dumps([spec, distinct]).encode()).hexdigest()[:16]
    path = os.path.join(run_dir, "text", f"{key}.pt")
    if os.path.isfile(path):
        cached = load_checkpoint(path, "caption cache")
        return cached["tokens"], cached["pooled"], index, spec
    tokens, pooled = TextEncoder(clip_model, clip_pretrained, download, device)(distinct)
    atomic_save({"tokens": tokens, "pooled": pooled, "captions": distinct, "encoder": spec}, path)
    print(f"encoded {len(distinct)} distinct captions with {spec}; cached in {path}")
    return tokens, pooled, index, spec
