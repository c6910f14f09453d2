"""Where a trained network starts: resumed from its own checkpoint, from scratch, or from
another network (--init): another network's weights, fine-tuned as they are where the
objective is the same, or a DDPM network (ours, or an official facebookresearch/DiT state
dict) converted into a rectified-flow expert, as HDDM converts its pretrained DiTs.
`network_to_train` is the one builder of train_expert.py's experts and distill.py's
students."""
import os
from typing import NamedTuple

import torch

from diffusion import RectifiedFlow, objective_from_spec
from model import DiT, DiT_models, model_args_for, registry_name
from plumbing.checkpoint import CheckpointError, fit_state, read_network_file, split_checkpoint
from plumbing.command_line import UsageError


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
    objective is fine-tuned as it is (its schedule and its modulation kept)."""
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
    own = model_args.get("modulation", "adaln-single")
    if own != modulation:   # only a DDPM checkpoint converted to flow is re-parameterised
        raise CheckpointError(f"it keeps its own modulation, {own} (only a DDPM checkpoint "
                              f"converted to a flow model takes --modulation): pass "
                              f"--modulation {own}")
    kept = objective_from_spec(config["objective"], clip_x0=objective.clip_x0)
    return state, model_args, kept, "weights"


class Start(NamedTuple):
    """Where a network starts from --init: the module, its constructor args, the objective
    it trains under, the record of its weights' origin, and its registry size."""
    network: torch.nn.Module
    model_args: dict
    objective: object
    how: str
    size: str


def start_from(flag, path, objective, *, modulation, condition_args, image_size, channels,
               model=None):
    """The network --init FLAG (read from `path`) starts: train_expert.py's expert and
    distill.py's student, read once. Refused in one line: a router, another objective
    than a DDPM one converting to flow, another modulation, a --model of another size,
    other images or another condition than this run's."""
    try:
        state, model_args, objective, how = init_from_checkpoint(
            read_network_file(path, "--init checkpoint"), objective, modulation=modulation,
            condition_args=condition_args)
    except (CheckpointError, KeyError) as e:
        raise UsageError(f"cannot start from --init {flag}: {e}")
    size = registry_name(model_args)
    if model and model != size:
        raise UsageError(f"--init {flag} is a {size}; --model {model} would not be what "
                         "trains: drop --model, or start from a checkpoint of that size")
    want = {"input_size": image_size, "in_channels": channels, **condition_args}
    differ = [f"{k} {model_args.get(k, 0)} vs data {v}" for k, v in want.items()
              if model_args.get(k, 0) != v]
    if differ:
        raise UsageError(f"--init {flag} does not fit this data set: " + "; ".join(differ))
    network = DiT(**model_args)
    fit_state(network, state, f"--init {flag}'s weights")
    return Start(network, model_args, objective, f"{how}:{os.path.basename(flag)}", size)


def network_to_train(resume, start, objective, size, modulation, condition, image_size,
                     channels):
    """(network, constructor args, objective, its weights' origin): a resumed network's
    (its weights are the checkpoint's once the Training's load_state has run), --init's
    Start, or a new `size` training under `objective` on images of this size and channels."""
    if resume is not None:
        spec = resume["config"]["objective"]
        objective = objective_from_spec(spec, clip_x0=objective.clip_x0)
        return DiT(**resume["model_args"]), resume["model_args"], objective, resume["config"]["init"]
    if start is not None:
        return start.network, start.model_args, start.objective, start.how
    patch = DiT_models[size][3]
    if image_size % patch:
        raise UsageError(f"--model {size} cuts images into {patch}x{patch} patches; "
                         f"{image_size}-pixel images do not divide")
    model_args = model_args_for(size, input_size=image_size, in_channels=channels,
                                learn_sigma=False, modulation=modulation,
                                t_scale=objective.network_time_scale, **condition.expert_args())
    return DiT(**model_args), model_args, objective, "scratch"


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
