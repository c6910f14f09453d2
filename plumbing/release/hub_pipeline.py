"""A decentralized diffusion ensemble as a diffusers pipeline, shipped inside every release
(export.py), so that three lines sample the routed ensemble with no copy of this project:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("RELEASE_FOLDER", trust_remote_code=True)
    images = pipe(class_labels=[1, 7], num_inference_steps=16, routing="top1").images

It imports torch, numpy, safetensors and diffusers, and three standalone files of this
project that export.py ships beside it: model.py (the networks), diffusion.py (the
objectives: a DDPM expert read as a flow velocity by the exact SNR match) and routing.py
(the routing rules and the routed, guided mixture). So the pipeline computes what sample.py
computes, with the same code: the router is evaluated at every network evaluation,
classifier-free guidance routes its unconditional branch on the conditional branch's
experts (cfg_routing="shared"), and diffusers' FlowMatchEulerDiscreteScheduler steps on
the uniform time grid (t from 1 to 0 in equal steps). tests/test_pipeline.py checks that its
images equal sample.py's with `--solver euler --time-shift 1` (sample.py's default is ab2 on a
shifted grid, which no diffusers scheduler steps; swap in another scheduler as usual).

Not here: training, distillation, text releases (the pipeline reads class labels or
nothing), and latent releases without their VAE folder."""
import json
import os

import numpy as np
import torch
from diffusers import ConfigMixin, DiffusionPipeline, ImagePipelineOutput, ModelMixin
from diffusers.configuration_utils import register_to_config
from safetensors.torch import load_file

# export.py ships these three files beside this one and makes these imports relative
from diffusion import objective_from_spec
from model import DiT, Router
from routing import Ensemble, drawn, ensemble_velocity, parse_routing, routing_function

WEIGHTS = "diffusion_pytorch_model.safetensors"


def read_record(folder):
    """(model_args, the network's training record, its weights) of a release's network
    folder: config.json's `_ddm` record beside its safetensors weights."""
    with open(os.path.join(folder, "config.json")) as f:
        ddm = json.load(f).get("_ddm") or {}
    if ddm.get("layout") != "ddm":
        raise ValueError(f"{folder} is not a network in this release's own layout (export "
                         "without --diffusers to sample it with the pipeline)")
    return ddm["model_args"], ddm["config"], load_file(os.path.join(folder, WEIGHTS))


class Labels:
    """What the networks read of each requested image: its class label (the null class,
    for guidance, is num_classes) or nothing."""

    def __init__(self, spec):
        if spec["kind"] not in ("class", "none"):
            raise ValueError(f"this pipeline samples class-conditional and unconditional "
                             f"releases; these networks read {spec['kind']}")
        self.kind = spec["kind"]
        self.null_id = spec.get("num_classes", 0)

    def null(self, n, device="cpu"):
        return torch.full((n,), self.null_id, dtype=torch.long, device=device)

    def expert_input(self, ids):
        return ids if self.kind == "class" else None

    router_input = expert_input


class Expert:
    """One expert as routing.Ensemble calls it: its network's output as a flow velocity."""

    def __init__(self, net, objective):
        self.net, self.objective = net, objective

    def velocity(self, x_t, t, y=None):
        return self.objective.velocity(self.net, x_t, t, y)


class ExpertSet(ModelMixin, ConfigMixin):
    """The release's experts, in its index's order, each with its objective."""

    @register_to_config
    def __init__(self, names, model_args, objectives, condition):
        super().__init__()
        self.nets = torch.nn.ModuleDict({n: DiT(**args) for n, args in zip(names, model_args)})

    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None, **unused):
        """Every expert the release's index lists, from experts/<name>/."""
        with open(os.path.join(os.path.dirname(os.path.abspath(folder)), "model_index.json")) as f:
            names = [e["name"] for e in json.load(f)["_ddm"]["experts"]]
        records = [read_record(os.path.join(folder, name)) for name in names]
        if any(record.get("vae") for _, record, _ in records):
            raise ValueError("these experts were trained in a VAE's latents; this pipeline "
                             "samples pixel releases (sample.py decodes latent ones)")
        experts = cls(names, [r[0] for r in records], [r[1]["objective"] for r in records],
                      records[0][1]["condition"])
        for name, (_, _, state) in zip(names, records):
            experts.nets[name].load_state_dict(state, strict=True)
        return experts.to(torch_dtype).eval() if torch_dtype else experts.eval()

    def expert(self, name):
        """The expert `name` as the ensemble calls it (pixels: x0 estimates clipped to
        [-1, 1], as the project's sampler does)."""
        objective = self.config.objectives[list(self.nets).index(name)]
        return Expert(self.nets[name], objective_from_spec(objective, clip_x0=True))


class RouterNetwork(ModelMixin, ConfigMixin):
    """The router: p(expert | x_t, t[, y]) over the experts it records, in its outputs'
    order."""

    @register_to_config
    def __init__(self, model_args, experts, condition):
        super().__init__()
        self.net = Router(**model_args)
        self.condition = Labels(condition)

    @classmethod
    def from_pretrained(cls, folder, torch_dtype=None, **unused):
        model_args, record, state = read_record(folder)
        router = cls(model_args, [m["name"] for m in record["experts"]], record["condition"])
        router.net.load_state_dict(state, strict=True)
        return router.to(torch_dtype).eval() if torch_dtype else router.eval()


class DecentralizedDiffusionPipeline(DiffusionPipeline):
    """Sampling a routed ensemble of independently trained experts (DDM, Paris, HDDM)."""

    def __init__(self, experts, router, scheduler):
        super().__init__()
        self.register_modules(experts=experts, router=router, scheduler=scheduler)

    def ensemble(self, routing, guidance_scale, cfg_routing):
        """routing.Ensemble over the experts, each at its router output; an output whose
        expert the release lacks is renormalised away, as sample.py does. A release of one
        model (the monolith) has no router: all weight on it."""
        condition = Labels(self.experts.config.condition)
        if self.router is None:
            expert = self.experts.expert(next(iter(self.experts.nets)))
            return Ensemble({0: expert}, None, ("oracle", 0), condition, 1, guidance_scale,
                            cfg_routing)
        names = self.router.config.experts
        strangers = [n for n in self.experts.nets if n not in names]
        if strangers:
            raise ValueError(f"the router was trained for experts {names}; {strangers} "
                             "joined later: this release needs a router for the grown set")
        experts = {names.index(n): self.experts.expert(n) for n in self.experts.nets}
        return Ensemble(experts, routing_function(self.router, condition), parse_routing(routing),
                        condition, len(names), guidance_scale, cfg_routing)

    @torch.no_grad()
    def __call__(self, class_labels=None, num_images=None, num_inference_steps=16,
                 guidance_scale=1.0, routing="top1", cfg_routing="shared", generator=None,
                 latents=None, output_type="pil", return_dict=True, draws=None):
        """Images for `class_labels` (one each; class-conditional releases) or
        `num_images` unconditional ones. routing: top1 | top2 | topk:N | full | draw |
        threshold:TAU; guidance_scale 1 is none. latents: the initial noise (N, C, H, W),
        else drawn with `generator`; draws: each image's uniform number for the draw rule
        (N,), else drawn with `generator`. output_type: pil, np (floats in [0, 1]) or pt."""
        ensemble = self.ensemble(routing, guidance_scale, cfg_routing)
        device = self.experts.device
        if ensemble.condition.kind == "class":
            if class_labels is None:
                raise ValueError("a class-conditional release samples class_labels=[...]")
            ids = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1)
            if ids.min() < 0 or ids.max() >= ensemble.condition.null_id:
                raise ValueError(f"class labels run 0..{ensemble.condition.null_id - 1}")
        else:
            ids = ensemble.condition.null(num_images or len(class_labels or [0]))
        args = self.experts.config.model_args[0]
        shape = (len(ids), args["in_channels"], args["input_size"], args["input_size"])
        x = latents if latents is not None else torch.randn(shape, generator=generator)
        x = x.to(device, self.experts.dtype)
        ids = ids.to(device)
        if ensemble.rule[0] == "draw":   # each image's expert, drawn once at the noise
            if draws is None:
                draws = torch.rand(len(ids), generator=generator, dtype=torch.float64)
            ensemble = drawn(ensemble, x, ids, torch.as_tensor(draws, dtype=torch.float64))
        # sample.py's time grid: t = 1 (noise) to 0 in equal steps; the scheduler adds t = 0
        grid = np.linspace(1, 0, num_inference_steps + 1)[:-1]
        self.scheduler.set_timesteps(sigmas=grid, device=device)
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            v, _ = ensemble_velocity(ensemble, x, self.scheduler.sigmas[i], ids)
            x = self.scheduler.step(v, t, x).prev_sample
        images = (x.float().clamp(-1, 1) + 1) / 2
        if output_type == "pt":
            out = images
        else:
            out = images.permute(0, 2, 3, 1).cpu().numpy()
            out = self.numpy_to_pil(out) if output_type == "pil" else out
        return ImagePipelineOutput(images=out) if return_dict else (out,)
