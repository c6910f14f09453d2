"""How large a router is, and where it starts: the size rule (the largest router whose
forward costs at most ROUTER_SHARE of one expert's, model.router_for), --model, or
--init's router with its head's rows moved to the experts they belong to."""
import os
from typing import NamedTuple

import torch

from model import (DEFAULT_EXPERT_MODEL, ROUTER_SHARE, DiT, DiT_models, Router, forward_flops,
                   model_args_for, registry_name, renamed_args, router_for)
from plumbing.checkpoint import fit_state, read_network_file, split_checkpoint
from plumbing.command_line import UsageError
from plumbing.run_dir import network_folders


class RouterFlags(NamedTuple):
    """What train_router.py's flags ask of the router's size: --model (None: the size
    rule), --expert-model (what to size it for before any expert is trained) and
    --downsample (the input's pooling factor)."""
    model: str
    expert_model: str
    downsample: int


def build_router(run_dir, asked, example, members, condition, init, device, seed):
    """(router, constructor args, its size record): a fresh router for images like
    `example` (--model, or the size rule), or --init's weights with its head's rows moved
    to these members' outputs (a member it did not know starts from zero: the prior)."""
    torch.manual_seed(seed)
    side, channels = example.shape[-1], example.shape[1]
    if init is None and (asked.downsample > side or side % asked.downsample):
        raise UsageError(f"--downsample {asked.downsample} does not divide the router's "
                         f"{side}-px input: give a factor of {side}")
    router_args = dict(num_experts=len(members), **condition.router_args())
    size = router_size(run_dir, asked, side, channels, condition, router_args, init)
    patch = DiT_models[size["model"]][3]
    if init is None and side % (asked.downsample * patch):
        pooled = f" pooled {asked.downsample}x ({side // asked.downsample} px)" \
            if asked.downsample > 1 else ""
        named = f"--model {size['model']}" if asked.model else f"the size rule's {size['model']}"
        raise UsageError(f"{named}'s patch {patch} does not tile the router's {side}-px "
                         f"input{pooled}: pick a --model whose patch divides it")
    model_args = model_args_for(size["model"], input_size=side, in_channels=channels,
                                downsample=asked.downsample, **router_args)
    if init is not None:
        model_args = {**renamed_args(init[0]["model_args"]), "num_experts": len(members)}
    size["router_forward_flops"] = forward_flops(Router, model_args)
    size["share_of_expert"] = size["router_forward_flops"] / size["expert_forward_flops"] \
        if size["expert_forward_flops"] else None
    router = Router(**model_args).to(device)
    if init is not None:
        # a training checkpoint's raw weights, or a released router's (its EMA), checked
        # against the router they were trained as before its head's rows move
        known = init[1]
        trained_as = Router(**{**model_args, "num_experts": len(known)})
        fit_state(trained_as, init[0].get("model", init[0].get("ema")), "--init's weights")
        state = trained_as.state_dict()
        head_w, head_b = router.head.weight.detach().clone(), router.head.bias.detach().clone()
        for output, m in enumerate(members):
            if m["name"] in known:
                row = known[m["name"]]
                head_w[output], head_b[output] = state["head.weight"][row], state["head.bias"][row]
        router.load_state_dict({**state, "head.weight": head_w, "head.bias": head_b}, strict=True)
    return router, model_args, size


def router_size(run_dir, asked, side, channels, condition, router_args, init):
    """{model, chosen_by, expert_model, expert_forward_flops}: --init's size, --model, or
    by the rule model.router_for (the largest router within ROUTER_SHARE of one expert's
    forward) for the run's smallest trained expert, else for --expert-model."""
    trained = expert_sizes(run_dir)
    if asked.expert_model and trained and asked.expert_model not in trained:
        raise UsageError(f"--expert-model {asked.expert_model}, but the run's experts are "
                         f"{', '.join(sorted(trained))}: drop the flag, the router is sized "
                         "for the experts it finds")
    if trained:
        expert_flops, expert = min((flops, name) for name, flops in trained.items())
    elif asked.model and not asked.expert_model:   # nothing to size by, nothing to compare with
        expert_flops = expert = None
    else:
        expert = asked.expert_model or DEFAULT_EXPERT_MODEL
        if side % DiT_models[expert][3]:
            raise UsageError(f"the router is sized for {expert} experts, whose patch does not "
                             f"tile {side}-px images: give --expert-model, or --model")
        expert_flops = forward_flops(DiT, model_args_for(
            expert, input_size=side, in_channels=channels, **condition.expert_args()))
    if init is not None:
        model, chosen_by = registry_name(renamed_args(init[0]["model_args"])), "--init"
    elif asked.model:
        model, chosen_by = asked.model, "--model"
    else:
        try:
            model, flops = router_for(expert_flops, side // asked.downsample, channels,
                                      **router_args)
        except ValueError as e:   # no patch leaves the pooled input enough tokens
            raise UsageError(f"--downsample {asked.downsample}: {e}; pool less, or give --model")
        source = "trained" if trained else "--expert-model" if asked.expert_model else \
            "train_expert.py's default; no expert trained yet"
        chosen_by = (f"the largest router within {ROUTER_SHARE:.0%} of one {expert} expert's "
                     f"forward ({source})" if flops <= ROUTER_SHARE * expert_flops else
                     f"the cheapest router, none being within {ROUTER_SHARE:.0%} of one {expert} "
                     f"expert's forward ({source})")
    return {"model": model, "chosen_by": chosen_by, "expert_model": expert,
            "expert_forward_flops": expert_flops}


def expert_sizes(run_dir):
    """{registry name: forward FLOPs} of the run's trained experts (the monolith and a
    student are not routed)."""
    found = {}
    for name, path in network_folders(os.path.join(run_dir, "experts")).items():
        if name in ("all", "distilled"):
            continue
        model_args = split_checkpoint(read_network_file(path, f"expert {name}"))[1]
        found[registry_name(model_args)] = forward_flops(DiT, model_args)
    return found


def router_init(path, members):
    """--init ROUTER: its weights, with its head's row for each expert it knew moved to
    that expert's new output; the rows of experts that joined since start at zero (the
    prior alone). None without --init."""
    if not path:
        return None
    old = read_network_file(path, "--init router")
    config = old.get("config") or {}
    if config.get("network") != "router" or "experts" not in config:
        raise UsageError(f"--init {path}: not a router checkpoint that records its experts")
    known = {m["name"]: i for i, m in enumerate(config["experts"])}
    changed = [m["name"] for m in config["experts"]
               if any(n["name"] == m["name"] and n["trained_on"] != m["trained_on"]
                      for n in members)]
    if changed:
        raise UsageError(f"--init {path}: expert {', '.join(changed)} was retrained on "
                         "other data since; train the router afresh")
    if not any(m["name"] in known for m in members):
        raise UsageError(f"--init {path} knows none of these experts "
                         f"({', '.join(m['name'] for m in members)})")
    return old, known
