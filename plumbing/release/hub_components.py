"""The components of a release's diffusers pipeline (hub_pipeline.py): the experts, the
router and the text tower, each a diffusers ModelMixin that reads its folder of the release
with the project's checked reader (reader.py), and the condition the networks read.

diffusers imports a component's class from a module in the component's own folder, so
export.py ships this file (with the files it imports) in experts/, router/ and
text_encoder/; the pipeline itself ships once, at the release's root."""
import os

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

# export.py ships these files beside this one and makes these imports relative
from diffusion import objective_from_spec
from model import DiT, Router, clip_text_embeddings
# diffusers copies into its module cache only the files this one imports, and reader.py
# imports this one
from plumbing.release.diffusers_format import DiffusersFormatError  # noqa: F401
from plumbing.release.reader import (ReleaseError, build_clip, check_index, read_network,
                                     read_text_tower)


class Condition:
    """What the networks read of each requested image (routing.Ensemble's condition): a
    class label (the null class, for guidance, is num_classes), nothing, or a caption's
    CLIP embeddings, looked up in a table of the prompts whose last row is the null
    caption (all zeros, the DiT's learned null) or the negative prompt."""

    def __init__(self, spec, table=None):
        self.kind = spec.get("kind")
        if self.kind not in ("class", "none", "text"):
            raise ReleaseError(f"these networks read a {self.kind} condition; the "
                               "pipeline samples class-conditional, unconditional and "
                               "text releases")
        self.null_id = spec.get("num_classes", 0)
        self.tokens = self.pooled = None
        if table is not None:
            self.tokens, self.pooled = table
            self.null_id = len(self.tokens) - 1

    def null(self, n, device="cpu"):
        return torch.full((n,), self.null_id, dtype=torch.long, device=device)

    def expert_input(self, ids):
        if self.kind == "text":
            return self.tokens.to(ids.device)[ids]
        return ids if self.kind == "class" else None

    def router_input(self, ids):
        if self.kind == "text":
            return self.pooled.to(ids.device)[ids]
        return ids if self.kind == "class" else None


class Expert:
    """One expert as routing.Ensemble calls it: its network's output as a flow
    velocity."""

    def __init__(self, net, objective):
        self.net, self.objective = net, objective

    def velocity(self, x_t, t, y=None):
        return self.objective.velocity(self.net, x_t, t, y)


class ExpertSet(ModelMixin, ConfigMixin):
    """The release's experts, in its index's order, each with its objective; the
    condition, latent space and recommended routing they share."""

    @register_to_config
    def __init__(self, names, model_args, objectives, condition, vae=None,
                 data_shape=None, routing="top1"):
        super().__init__()
        self.nets = torch.nn.ModuleDict({name: DiT(**args)
                                         for name, args in zip(names, model_args)})

    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None, **unused):
        """Every expert the release's index lists, read and checked by reader.py."""
        root = os.path.dirname(os.path.abspath(folder))
        index = check_index(root)
        names = [e["name"] for e in index["experts"]]
        records = [read_network(os.path.join(root, e["folder"]), f"expert {e['name']}",
                                "dit") for e in index["experts"]]
        configs = [r["config"] for r in records]
        for key in ("condition", "vae"):
            if any(c.get(key) != configs[0].get(key) for c in configs):
                raise ReleaseError(f"release {root}: its experts record different "
                                   f"{key}s; an ensemble's experts share one")
        experts = cls(names, [r["model_args"] for r in records],
                      [c["objective"] for c in configs], configs[0]["condition"],
                      configs[0].get("vae"), (configs[0].get("data") or {}).get("shape"),
                      index.get("routing") or "top1")
        for name, record in zip(names, records):
            experts.nets[name].load_state_dict(record["ema"], strict=True)
        return experts.to(torch_dtype).eval() if torch_dtype else experts.eval()

    def expert(self, name):
        """The expert `name` as the ensemble calls it (pixels: x0 estimates clipped to
        [-1, 1], as the project's sampler does; latents are not bounded)."""
        objective = self.config.objectives[list(self.nets).index(name)]
        pixels = self.config.vae is None
        return Expert(self.nets[name], objective_from_spec(objective, clip_x0=pixels))


class RouterNetwork(ModelMixin, ConfigMixin):
    """The router: p(expert | x_t, t[, y]) over the experts it records, in its outputs'
    order."""

    @register_to_config
    def __init__(self, model_args, experts, condition):
        super().__init__()
        self.net = Router(**model_args)
        self.condition = Condition(condition)

    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None, **unused):
        root = os.path.dirname(os.path.abspath(folder))
        check_index(root)
        record = read_network(os.path.join(root, "router"), "the router", "router")
        config = record["config"]
        router = cls(record["model_args"], [m["name"] for m in config["experts"]],
                     config["condition"])
        router.net.load_state_dict(record["ema"], strict=True)
        return router.to(torch_dtype).eval() if torch_dtype else router.eval()


class TextTower(ModelMixin, ConfigMixin):
    """The experts' frozen open_clip text tower and its tokenizer (open_clip's own, not a
    transformers tokenizer): prompts become the token embeddings the experts read and the
    pooled embedding the router reads, by model.clip_text_embeddings, as sample.py encodes
    them. Only the text tower's weights ship; the image tower is built and never used."""
    ignore_for_config = ["loaded"]   # the built tower, not configuration

    @register_to_config
    def __init__(self, architecture, open_clip_config, encoder, loaded=None):
        super().__init__()
        self.clip, self.tokenizer = loaded or build_clip(architecture, open_clip_config)

    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None, **unused):
        config, clip, tokenizer = read_text_tower(folder)
        tower = cls(config["architecture"], config["open_clip_config"], config["encoder"],
                    (clip, tokenizer))
        return tower.to(torch_dtype).eval() if torch_dtype else tower.eval()

    def encode(self, texts):
        return clip_text_embeddings(self.clip, self.tokenizer, texts, self.device)
