"""An ensemble from a run folder: its experts and router loaded, and checked to belong
together.

sample.py and distill.py both read the same files, so they share this module rather
than one stage importing the other; what they do with the ensemble (routing.py) needs
no files."""
import os
import shlex

import torch

from model import clip_text_embeddings, count_flops
from routing import parse_routing
from plumbing.checkpoint import CheckpointError, load, read_network_file
from plumbing.command_line import CONTRIBUTION_NAME, SINGLE_MODELS, UsageError
from plumbing.sources import is_contribution, membership
from plumbing.release.reader import INDEX, ReleaseError, check_index, read_text_tower
from plumbing.data.datasets import describe, same_vae
from plumbing.run_dir import expert_dir, network_folders, network_path, router_dir


def ordered(names):
    """The ensemble's canonical order: k-means clusters by id, then contributors'
    experts by name."""
    return sorted(names, key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))


def load_network(path, what, expect):
    """checkpoint.load with one-line errors: a missing, unreadable or wrong kind of
    checkpoint."""
    try:
        return load(read_network_file(path, what), expect=expect)
    except CheckpointError as e:
        raise UsageError(f"{what} {path}: {e}")


def is_member_name(name):
    """A cluster's id or a contributor's contribution name: what an ensemble's expert is
    called."""
    return name.isascii() and name.isdigit() or bool(CONTRIBUTION_NAME.fullmatch(name)) \
        and name not in SINGLE_MODELS


def load_experts(run_dir, which):
    """{name: Network} for --experts ('' = every expert in runs/experts/: the numbered
    clusters' and the contributors' named ones).

    Names are cluster ids ('2'), contributors' contribution names, 'all' (the monolith) or
    'distilled'."""
    listed = None
    if os.path.isfile(os.path.join(run_dir, INDEX)):   # a release: its index must hold together
        try:
            listed = [e["name"] for e in check_index(run_dir)["experts"]]
        except ReleaseError as e:
            raise UsageError(str(e))
    root = os.path.join(run_dir, "experts")
    names = [name.strip() for name in which.split(",") if name.strip()]
    if which and not names:
        raise UsageError(f"--experts {which!r} names no expert: give cluster ids (e.g. "
                         "0,2,3) or contribution names, 'all' or 'distilled', or leave it "
                         "out for every expert")
    if len(set(names)) != len(names):
        raise UsageError(f"--experts {which!r} names an expert twice")
    strange = [n for n in names if not is_member_name(n) and n not in SINGLE_MODELS]
    if strange:
        raise UsageError("--experts takes cluster ids (e.g. 0,2,3), contribution names, "
                         f"'all' (the monolith) or 'distilled', not {strange[0]!r}")
    if listed is not None:
        # a release's released networks are the ones its index lists; an expert trained in
        # the folder since (a contributor joining it) has its own training checkpoint
        joined = [d for d, path in network_folders(root).items()
                  if d not in listed and is_member_name(d) and path.endswith("ckpt.pt")]
        unlisted = [n for n in names if n not in listed + joined]
        if unlisted:
            raise UsageError(f"--experts {unlisted[0]}: release {run_dir}'s {INDEX} "
                             f"lists {', '.join(listed)}")
        names = names or [n for n in listed + joined if is_member_name(n)]
    elif not which:
        names = [d for d in network_folders(root) if is_member_name(d)]
    single = [name for name in names if name in SINGLE_MODELS]
    if single and len(names) > 1:
        raise UsageError(f"--experts {single[0]} is one model of the whole data set; it "
                         "does not mix with other experts")
    experts = {}
    for name in ordered(names):
        path = network_path(expert_dir(run_dir, name))
        if path is None:
            raise UsageError(f"no expert {name} at {expert_dir(run_dir, name)}"
                             + (": run distill.py first" if name == "distilled" else ""))
        expert = load_network(path, f"expert {name}", "dit")
        if not which and not name.isdigit() and not is_contribution(expert):
            # a study's or a user's other model kept beside the experts (e.g.
            # experts/fp32-seed0), not a member
            continue
        trained_as = membership(expert.config)[0]
        if name.isdigit() and is_contribution(expert) or is_member_name(name) and \
                not name.isdigit() and not is_contribution(expert):
            raise UsageError(f"{path} holds expert {trained_as!r}, not {name!r}: an "
                             "expert is used under the name it was trained as (move it "
                             f"back to experts/{trained_as})")
        held = str(expert.config.get("cluster"))
        if name.isdigit() and expert.config.get("cluster") is None:   # no training record
            raise UsageError(f"{path} holds a network with no training record (a diffusers or "
                             f"official DiT folder): place it with import_dit.py --cluster {name}")
        if name.isdigit() and held != name:
            what = {"all": "the monolith",
                    "distilled": "a distilled student"}.get(held, f"the expert of cluster {held}")
            raise UsageError(f"{path} holds {what}, not the expert of cluster {name}: "
                             f"move it to experts/{held}")
        experts[name] = expert
    if not experts:
        raise UsageError(f"no experts in {root}: run train_expert.py first")
    return experts


def release_vae(run_dir):
    """A release's own VAE folder (export.py ships a latent ensemble's VAE as vae/), else
    None: a run folder records where its VAE was on the machine that trained it."""
    folder = os.path.join(run_dir, "vae")
    return folder if os.path.isfile(os.path.join(run_dir, INDEX)) and os.path.isdir(folder) else None


class ReleasedTextTower:
    """A release's own text tower (text_encoder/, the experts' open_clip text tower), as
    the text condition encodes prompts with it: (tokens, pooled) of a list of strings,
    under the encoder spec the experts recorded."""

    def __init__(self, folder):
        try:
            config, self.clip, self.tokenizer = read_text_tower(folder)
        except ReleaseError as e:
            raise UsageError(str(e))
        self.spec = config["encoder"]

    def __call__(self, texts):
        return clip_text_embeddings(self.clip, self.tokenizer, texts)


def release_text_tower(run_dir):
    """A release's own text tower, else None (a run folder's experts name the weights file
    they were trained with, on the machine that trained them)."""
    folder = os.path.join(run_dir, "text_encoder")
    is_release = os.path.isfile(os.path.join(run_dir, INDEX))
    return ReleasedTextTower(folder) if is_release and os.path.isdir(folder) else None


def load_router(run_dir, path):
    """The router Network from `path` (a checkpoint or a router folder; default
    RUN_DIR/router/ckpt.pt)."""
    path = path or router_dir(run_dir)
    if os.path.isdir(path):
        path = network_path(path) or os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise UsageError(f"no router at {path}: run train_router.py first (or use "
                         "--routing oracle:C)")
    return load_network(path, "router", "router")


def retrain_hint(run_dir, experts):
    command = f"python train_router.py --run-dir {shlex.quote(str(run_dir))}"
    if any(is_contribution(e) for e in experts.values()):
        return (f"{command} --from-samples 256, or without --from-samples where this machine "
                "holds every expert's data")
    return command


def expert_names(experts, router, run_dir):
    """The expert behind each of the router's outputs, checked against the experts at
    hand.

    A router records the expert set it was trained for (names and data fingerprints);
    any subset of it may sample (a lost expert: weights renormalised), but an expert it
    never saw, or one retrained on other data since, is refused. Without a router
    (oracle routing) the clusters' experts sit at their ids, contributors' after them."""
    if router is None:
        numbered = [n for n in experts if n.isdigit()]
        k = experts[numbered[0]].config["k"] if numbered else 0
        names = [str(c) for c in range(k)] + [n for n in experts if not n.isdigit()]
    elif "experts" not in router.config:   # no release ever wrote such a router: no shim to keep
        raise UsageError("the router records no expert set (written by an older version "
                         "of this project): retrain it "
                         f"({retrain_hint(run_dir, experts)})")
    else:
        names = [m["name"] for m in router.config["experts"]]
        for m in router.config["experts"]:
            expert = experts.get(m["name"])
            if expert is not None and membership(expert.config)[1] not in (None, m["trained_on"]):
                raise UsageError(f"expert {m['name']} was trained on other data than "
                                 "when the router was trained; retrain the router for "
                                 f"these experts: {retrain_hint(run_dir, experts)}")
    strangers = [n for n in experts if n not in names]
    if strangers:
        rest = [n for n in experts if n in names]
        raise UsageError(f"the router was trained for experts {', '.join(names)}; "
                         f"{', '.join(strangers)} joined later: retrain the router for "
                         f"the grown set ({retrain_hint(run_dir, experts)})"
                         + (f", or leave {'it' if len(strangers) == 1 else 'them'} out "
                            f"with --experts {','.join(rest)}" if rest else ""))
    seen = {}
    for name, expert in experts.items():
        fingerprint = membership(expert.config)[1]
        if fingerprint is not None and fingerprint in seen:
            raise UsageError(f"experts {seen[fingerprint]} and {name} were trained on "
                             f"the same data (fingerprint {fingerprint[:10]}); an "
                             "ensemble's experts each model their own share")
        seen[fingerprint] = name
    return names


def check_compatible(experts, router):
    """Every expert (and the router) must describe the same images, condition and
    space; the clusters' experts one clustering of one data set (contributors' experts
    bring their own data). Say what differs."""
    (ref_name, ref), *others = experts.items()
    for name, expert in others:
        keys = ["image_size", "channels", "condition"]
        if name.isdigit() and ref_name.isdigit():
            keys += ["data", "cluster_fingerprint"]
        for key in keys:
            a, b = expert.config.get(key), ref.config.get(key)
            if a != b:
                show = describe if key == "data" else (lambda v: v)
                raise UsageError(f"expert {name} does not match expert {ref_name}: {key} "
                                 f"{show(a)} vs {show(b)}")
        if not same_vae(expert.config.get("vae"), ref.config.get("vae")):
            raise UsageError(f"expert {name} and expert {ref_name} were trained in "
                             f"different spaces ({space(expert)} vs {space(ref)}); an "
                             "ensemble's experts share one VAE")
    if router is None:
        return
    if not same_vae(router.config.get("vae"), ref.config.get("vae")):
        raise UsageError(f"the router reads {space(router)}, the experts were trained in "
                         f"{space(ref)}")
    # an imported expert records no data fingerprint, only its clustering
    for name, expert in experts.items():
        if membership(expert.config)[1] is None and \
                expert.config.get("cluster_fingerprint") != router.config.get("cluster_fingerprint"):
            raise UsageError("the router was trained on another clustering than expert "
                             f"{name} (cluster file fingerprints differ)")
    theirs, ours = router.condition.spec(), ref.condition.spec()
    reads_condition = theirs["kind"] != "none"
    if reads_condition and (theirs["kind"] != ours["kind"]
                            or theirs.get("encoder") != ours.get("encoder")):
        raise UsageError(f"a router conditioned on {theirs} cannot route experts "
                         f"conditioned on {ours}")


def routing_rule(routing_flag):
    """--routing's (rule, parameter), or its one-line refusal."""
    try:
        return parse_routing(routing_flag)
    except ValueError as e:
        raise UsageError(str(e))


def assemble(run_dir, which, router_path, routing_flag):
    """(experts by router output {index: Network}, router Network or None, the rule
    (rule, parameter), expert names by router output) of the ensemble to sample or distil,
    under the --routing flag `routing_flag`: refused in one line where the rule cannot
    run on the experts present (oracle of a missing one, top-k of more than there are)."""
    routing = routing_rule(routing_flag)
    experts = load_experts(run_dir, which)
    router = load_router(run_dir, router_path) if routing[0] != "oracle" else None
    names = expert_names(experts, router, run_dir)
    check_compatible(experts, router)
    experts = {names.index(name): expert for name, expert in experts.items()}
    if routing[0] == "oracle" and routing[1] not in experts:
        have = [f"{i} ({names[i]})" if names[i] != str(i) else str(i) for i in sorted(experts)]
        raise UsageError(f"oracle:{routing[1]} names an expert that is not available "
                         f"(have {', '.join(have)})")
    if routing[0] == "topk" and routing[1] > len(experts):
        raise UsageError(f"top-{routing[1]} routing needs {routing[1]} experts; only "
                         f"{len(experts)} are available")
    return experts, router, routing, names


def space(network):
    vae = network.config.get("vae")
    return f"the latents of VAE {vae['path']} ({vae['fingerprint'][:10]})" if vae else "pixels"


def row_flops(experts, route, condition, ref, device):
    """({router output: FLOPs of one row through that expert}, FLOPs of one row through
    the router, 0 without one): what sampling and distillation count per row run
    (counted on two rows at t = 0.5, with the null condition)."""
    x = torch.zeros(2, ref.config["channels"], ref.config["image_size"], ref.config["image_size"],
                    device=device)
    ids, t = condition.null(2, device), torch.full((2,), 0.5, device=device)
    with torch.no_grad():
        expert_flops = {k: count_flops(lambda: e.velocity(x, t, condition.expert_input(ids))) // 2
                        for k, e in experts.items()}
        return expert_flops, (count_flops(lambda: route(x, t, ids)) // 2 if route else 0)
