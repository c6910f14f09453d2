"""A decentralized diffusion ensemble as a diffusers pipeline, shipped inside every
release (export.py), so that three lines sample it with no copy of this project:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("RELEASE_FOLDER", trust_remote_code=True)
    images = pipe(class_labels=[1, 7], num_inference_steps=16).images

Every kind of release loads: class-conditional, unconditional or text-to-image (`prompt=`,
`negative_prompt=`; the CLIP text tower is the `text_encoder` component), pixel or latent
(diffusers' AutoencoderKL is the `vae` component), a routed ensemble or one model (the
monolith, a distilled student: no router). Beside torch, numpy, safetensors, diffusers (and
open_clip for text) it imports only the project files shipped with it: model.py,
diffusion.py, routing.py, reader.py (the checked reader this project's own stages use) and
diffusers_format.py, so it computes what sample.py computes, with the same code.

The scheduler: FlowMatchEulerDiscreteScheduler with shift s steps sample.py's time grid and
equals `sample.py --solver euler --time-shift s`; any flow scheduler swaps in as usual, e.g.
UniPCMultistepScheduler.from_config(pipe.scheduler.config,
prediction_type="flow_prediction", use_flow_sigmas=True); a noise-prediction one is refused."""
import inspect
import os

import numpy as np
import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput

# export.py ships these files beside this one and makes these imports relative
from diffusion import MAX_STEPS
# diffusers copies into its module cache only the files this one imports: hub_components.py
# and reader.py import these
from model import DiT  # noqa: F401
from plumbing.release.diffusers_format import DiffusersFormatError  # noqa: F401
from plumbing.release.hub_components import Condition
from plumbing.release.reader import ReleaseError  # noqa: F401
from routing import Ensemble, drawn, ensemble_velocity, parse_routing, routing_function

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def flow_scheduler(scheduler):
    """Refuse, in one line, a scheduler that does not integrate a flow velocity: the
    networks' mixture is dx/dt = v, and a noise-prediction scheduler would read it as
    epsilon."""
    config = scheduler.config
    if type(scheduler).__name__.startswith("FlowMatch"):
        return
    if getattr(config, "prediction_type", None) != "flow_prediction" or not getattr(
            config, "use_flow_sigmas", False):
        raise ValueError(f"{type(scheduler).__name__} is configured for "
                         f"{getattr(config, 'prediction_type', 'another')} prediction: "
                         "this ensemble predicts a flow velocity; use a FlowMatch "
                         "scheduler or from_config(..., prediction_type='flow_prediction', "
                         "use_flow_sigmas=True)")


def class_ids(class_labels, num_classes):
    """The labels asked for: whole numbers in 0..num_classes - 1, one image each."""
    ids = torch.as_tensor(class_labels if class_labels is not None else [])
    whole = not ids.dtype.is_floating_point and not ids.dtype.is_complex \
        and ids.dtype != torch.bool
    if not whole or ids.dim() != 1 or not len(ids) or not 0 <= ids.min() <= ids.max() < num_classes:
        raise ValueError(f"class_labels: a list of whole numbers in 0..{num_classes - 1} "
                         "(one image each)")
    return ids.long()


def prompt_list(prompt):
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(
            isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError("prompt: a non-empty string or a list of them (one image each)")
    return list(prompts)


def negative_text(negative_prompt):
    """The one caption guidance steers away from (or copies of it), or None."""
    if negative_prompt is None:
        return None
    texts = [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
    if not isinstance(texts, (list, tuple)) or len(set(texts)) != 1 \
            or not isinstance(texts[0], str) or not texts[0].strip():
        raise ValueError("negative_prompt: one non-empty string for every image, or None "
                         "for the null caption")
    return texts[0]


class DecentralizedDiffusionPipeline(DiffusionPipeline):
    """Sampling a routed ensemble of independently trained experts (DDM, Paris, HDDM), or
    one model of the whole data set."""
    _optional_components = ["router", "vae", "text_encoder"]

    def __init__(self, experts, scheduler, router=None, vae=None, text_encoder=None):
        super().__init__()
        self.register_modules(experts=experts, scheduler=scheduler, router=router,
                              vae=vae, text_encoder=text_encoder)

    def requests(self, prompt, negative_prompt, class_labels, num_images):
        """(the condition over this call's prompts, the ids of the images to draw): one
        image per class label, per prompt, or num_images unconditional ones."""
        condition = Condition(self.experts.config.condition)
        given = {"prompt": prompt, "negative_prompt": negative_prompt,
                 "class_labels": class_labels}
        takes = {"class": ["class_labels"], "text": ["prompt", "negative_prompt"]}
        for name, value in given.items():
            if value is not None and name not in takes.get(condition.kind, []):
                raise ValueError(f"{name}: this release's networks read "
                                 f"{condition.kind.replace('none', 'no condition')}")
        if condition.kind == "class":
            ids = class_ids(class_labels, condition.null_id)
            self.fitting(len(ids), "class_labels")
            return condition, ids
        if condition.kind == "none":
            n = 1 if num_images is None else num_images
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"num_images: a positive whole number, not {n!r}")
            return condition, condition.null(self.fitting(n, "num_images"))
        prompts, negative = prompt_list(prompt), negative_text(negative_prompt)
        self.fitting(len(prompts), "prompt")
        if self.text_encoder is None:
            raise ValueError("this text release has no text_encoder component")
        tokens, pooled = self.text_encoder.encode(prompts + [negative] * bool(negative))
        if negative is None:   # the null caption: zeros, read as the DiT's learned null
            tokens = torch.cat([tokens, torch.zeros_like(tokens[:1])])
            pooled = torch.cat([pooled, torch.zeros_like(pooled[:1])])
        table = Condition(self.experts.config.condition, (tokens, pooled))
        return table, torch.arange(len(prompts))

    def ensemble(self, condition, routing, guidance_scale, cfg_routing):
        """routing.Ensemble over the experts, each at its router output; an output whose
        expert the release lacks is renormalised away, as sample.py does. A release of one
        model (the monolith, a distilled student) has no router: all weight on it."""
        rule = parse_routing(routing or self.experts.config.routing)
        if self.router is None:
            expert = self.experts.expert(next(iter(self.experts.nets)))
            return Ensemble({0: expert}, None, ("oracle", 0), condition, 1,
                            guidance_scale, cfg_routing)
        names = self.router.config.experts
        strangers = [n for n in self.experts.nets if n not in names]
        if strangers:
            raise ValueError(f"the router was trained for experts {names}; {strangers} "
                             "joined later: this release needs a router for the grown "
                             "set")
        experts = {names.index(n): self.experts.expert(n) for n in self.experts.nets}
        route = routing_function(self.router, condition)
        return Ensemble(experts, route, rule, condition, len(names), guidance_scale,
                        cfg_routing)

    def flow_times(self, steps, device):
        """The scheduler's time grid as flow times t in [0, 1] (the sigmas), one per
        network evaluation: sample.py's grid (1 to 0 in equal steps, warped by the
        scheduler's shift) wherever the scheduler takes a grid."""
        whole = not isinstance(steps, bool) and isinstance(steps, int)
        if not whole or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"num_inference_steps: a whole number in 1..{MAX_STEPS}, "
                             f"not {steps!r}")
        flow_scheduler(self.scheduler)
        if "sigmas" in inspect.signature(self.scheduler.set_timesteps).parameters:
            grid = np.linspace(1, 0, steps + 1)[:-1]
            self.scheduler.set_timesteps(sigmas=grid, device=device)
        else:
            self.scheduler.set_timesteps(steps, device=device)
        return self.scheduler.sigmas

    def fitting(self, n, argument):
        """n, if n images fit in half this machine's memory (a guided step holds about 16
        copies of the batch; a latent release's decoded images are larger), else a one-line
        refusal naming the argument."""
        args, vae = self.experts.config.model_args[0], self.experts.config.vae
        side = args["input_size"] * (vae["downsample"] if vae else 1)
        per_image = 4 * max(16 * args["in_channels"] * args["input_size"] ** 2, 3 * side ** 2)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if n * per_image > memory // 2:
            raise ValueError(f"{argument}: {n} images need about "
                             f"{n * per_image / 2 ** 30:.1f} GiB, more than half of this "
                             f"machine's {memory / 2 ** 30:.0f} GiB; ask in several calls")
        return n

    def initial_noise(self, n, latents, generator, dtype, device):
        args = self.experts.config.model_args[0]
        shape = (n, args["in_channels"], args["input_size"], args["input_size"])
        latents = torch.randn(shape, generator=generator) if latents is None else \
            torch.as_tensor(latents)
        if tuple(latents.shape) != shape or not latents.is_floating_point() \
                or not torch.isfinite(latents).all():
            raise ValueError(f"latents: finite floating-point noise of shape {shape}, "
                             f"not {tuple(latents.shape)} {latents.dtype}")
        return latents.to(device, dtype)

    def image_space(self, x):
        """Images in [0, 1] (N, C, H, W) from the ODE's end point: latents decoded as
        sample.py decodes them (unscaled, the VAE's shift added back, grey data sets as
        the mean of the decoded RGB)."""
        spec = self.experts.config.vae
        if spec is not None:
            if self.vae is None:
                raise ValueError("this latent release has no vae component")
            x = self.vae.decode(x.to(self.vae.dtype) / spec["scaling_factor"]
                                + spec["shift_factor"]).sample.clamp(-1, 1)
            channels = (self.experts.config.data_shape or [x.shape[1]])[0]
            x = x.mean(1, keepdim=True) if channels == 1 and x.shape[1] != 1 else x
        return (x.float().clamp(-1, 1) + 1) / 2

    @torch.no_grad()
    def __call__(self, prompt=None, negative_prompt=None, class_labels=None,
                 num_images=None, num_inference_steps=16, guidance_scale=1.0, routing=None,
                 cfg_routing="shared", generator=None, latents=None, draws=None,
                 output_type="pil", return_dict=True):
        """Images for `class_labels` (one each; class-conditional releases), `prompt` (one
        each; text releases, guided away from `negative_prompt`), or `num_images`
        unconditional ones. routing: top1 | top2 | topk:N | full | draw | threshold:TAU
        (default: the release's recommendation); guidance_scale 1 is none. latents: the
        initial noise (N, C, H, W), else drawn with `generator`; draws: each image's
        uniform number for the draw rule (N,), else drawn with `generator`. output_type:
        pil, np (floats in [0, 1], N x H x W x C), pt (N x C x H x W) or latent (the
        ODE's end point)."""
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type is one of {', '.join(OUTPUT_TYPES)}, "
                             f"not {output_type!r}")
        condition, ids = self.requests(prompt, negative_prompt, class_labels, num_images)
        ensemble = self.ensemble(condition, routing, guidance_scale, cfg_routing)
        device, dtype = self.experts.device, self.experts.dtype
        x = self.initial_noise(len(ids), latents, generator, dtype, device)
        ids = ids.to(device)
        # a single model's release runs as oracle whatever the routing asked
        if draws is not None and ensemble.rule[0] not in ("draw", "oracle"):
            raise ValueError(f"draws: only the draw rule reads them, not {ensemble.rule[0]}")
        if ensemble.rule[0] == "draw":   # each image's expert, drawn once at the noise
            draws = torch.rand(len(ids), generator=generator, dtype=torch.float64) \
                if draws is None else torch.as_tensor(draws, dtype=torch.float64)
            if draws.shape != (len(ids),) or not ((draws >= 0) & (draws < 1)).all():
                raise ValueError(f"draws: one number in [0, 1) per image ({len(ids)})")
            ensemble = drawn(ensemble, x, ids, draws)
        sigmas = self.flow_times(num_inference_steps, device)
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            v, _ = ensemble_velocity(ensemble, x, sigmas[i], ids)
            x = self.scheduler.step(v, t, x).prev_sample
        if output_type == "latent":
            out = x
        else:
            images = self.image_space(x)
            out = images if output_type == "pt" else \
                images.permute(0, 2, 3, 1).cpu().numpy()
            out = self.numpy_to_pil(out) if output_type == "pil" else out
        return ImagePipelineOutput(images=out) if return_dict else (out,)
