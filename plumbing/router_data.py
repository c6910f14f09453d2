"""What a router trains on: a set of parts, each a data set with its cluster assignments,
a contributor's data, or one expert's samples. From data (`examples_from_data`) the parts
are the cluster file's data set and every contributor's this machine can read; from
samples (`examples_from_samples`, train_router.py --from-samples) they need nobody's data.

With --from-samples each expert draws N images with the project's sampler under its own
label distribution (cached in RUN_DIR/router/samples/ by the expert's weights and the
sampler settings), and labels them as its own; the router then learns p(expert | x_t,
t, y) with every expert's prior set by its recorded share of all training images."""
import hashlib
import json
import os

import numpy as np
import torch
from tqdm import tqdm

from diffusion import sample_flow
from model import (ROUTER_SHARE, DiT, DiT_models, count_flops, forward_flops, model_args_for,
                   registry_name, renamed_args, router_for)
from .checkpoint import split_checkpoint
from .command_line import UsageError
from .condition import condition_for_data, condition_from_spec
from .plans import DEFAULT_EXPERT_MODEL
from .contributors import SINGLE_MODELS, contributor_data, contributors, expert_record
from .ensemble import check_compatible, expert_names, load_experts
from .latents import clustered_data, file_hash
from .run_dir import (atomic_save, cluster_path, expert_dir, load_checkpoint,
                      load_clusters, network_file_set, network_folders, router_dir)


class RoutingExamples:
    """The router's training set as parts, each (images with .batch(idx), target expert of
    each image, condition ids): one data set with its cluster assignments, a contributor's
    data set, or one expert's samples.

    Example g of the whole is image g - offset of its part, so with one part (the
    clusters' data set) the examples are exactly the data set's images."""

    def __init__(self, parts):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(targets) for _, targets, _ in parts])
        self.targets = np.concatenate([targets for _, targets, _ in parts])

    def __len__(self):
        return len(self.targets)

    def _split(self, idx):
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        return [(p, np.flatnonzero(part == p)) for p in np.unique(part)]

    def _gather(self, idx, fetch):
        idx = np.asarray(idx)
        pieces = [(rows, fetch(p, idx[rows] - self.offsets[p])) for p, rows in self._split(idx)]
        if len(pieces) == 1:
            return pieces[0][1]
        out = torch.empty((len(idx), *pieces[0][1].shape[1:]), dtype=pieces[0][1].dtype)
        for rows, values in pieces:
            out[torch.from_numpy(rows)] = values
        return out

    def batch(self, idx, rng=None):
        return self._gather(idx, lambda p, local: self.parts[p][0].batch(local))

    def ids(self, idx):
        return self._gather(idx, lambda p, local: self.parts[p][2](local))


class Samples:
    """One expert's generated images, as a data set for RoutingExamples."""

    def __init__(self, x):
        self.x = x

    def batch(self, idx, rng=None):
        return self.x[torch.as_tensor(idx)].float()


def plan_from_samples(run_dir, which, condition_kind):
    """(experts by name, members, condition): the experts `which` (default all) that
    will each draw --from-samples images, checked first; the router reads
    `condition_kind` of theirs."""
    experts = load_experts(run_dir, which)
    single = [name for name in experts if name in SINGLE_MODELS]
    if single:
        raise UsageError(f"--experts {single[0]} is one model of the whole data set; a "
                         "router routes an ensemble's experts")
    if len(experts) < 2:
        raise UsageError("a router needs at least two experts to choose between; "
                         f"{run_dir}/experts has {', '.join(experts)}")
    # two experts trained on the same data are refused here
    expert_names(experts, None, run_dir)
    check_compatible(experts, None)
    ref = next(iter(experts.values()))
    condition = ref.condition.for_router(condition_kind)
    # refused here, before any sample is drawn, for a condition that labels cannot give
    condition.of_labels([])
    members = []
    for name, expert in experts.items():
        member = expert.config.get("member") or {}
        if not isinstance(member.get("size"), (int, type(None))) or (member.get("size") or 1) < 1:
            raise UsageError(f"expert {name} records a training-set size of {member['size']!r}; "
                             "a share needs a positive count: its checkpoint is damaged")
        if member.get("size") is None:   # an --import'ed model, or an expert from before records
            raise UsageError(f"expert {name} records no training-set size (imported, or "
                             "trained by an older version), so its share is unknown; "
                             "retrain it, or train the router from data")
        members.append({"name": name, "trained_on": member["trained_on"], "size": member["size"],
                        "label_counts": member.get("label_counts")})
    return experts, members, condition


@torch.no_grad()
def intact(cached, n, expert, member):
    """A cache holds n finite images of the expert's shape, with labels it can have drawn."""
    x, labels = cached.get("x"), cached.get("labels")
    shape = (n, expert.config["channels"], expert.config["image_size"], expert.config["image_size"])
    classes = len(member["label_counts"] or [0])
    return (torch.is_tensor(x) and tuple(x.shape) == shape and bool(torch.isfinite(x).all())
            and torch.is_tensor(labels) and labels.shape == (n,)
            and bool(((labels >= 0) & (labels < classes)).all()))


def expert_samples(name, expert, member, plan, device):
    """`--from-samples` images of one expert, drawn with the project's sampler under
    its own label distribution, cached in RUN_DIR/router/samples/ by the expert's
    checkpoint hash and the sampler settings; returns (x, labels, FLOPs to draw)."""
    files = network_file_set(expert_dir(plan.run_dir, name))
    settings = {"expert": file_hash(files), "n": plan.from_samples, "steps": plan.sample_steps,
                "seed": plan.seed}
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(router_dir(plan.run_dir), "samples", f"{name}-{key}.pt")
    if os.path.isfile(path):
        cached = load_checkpoint(path, "cached samples")
        if cached.get("settings") == settings and intact(cached, plan.from_samples, expert, member):
            return cached["x"], cached["labels"], cached["flops"]
        print(f"{path} is not the samples its name promises; drawing them again")
    # the same draws whatever the other experts are: an expert that joins later leaves the
    # others' caches valid
    g = torch.Generator().manual_seed(int(hashlib.sha1(f"{name}:{plan.seed}".encode()).hexdigest()[:8], 16))
    # an unlabelled data set: every sample gets label 0, which no condition reads
    counts = member["label_counts"]
    labels = torch.zeros(plan.from_samples, dtype=torch.long) if counts is None else \
        torch.multinomial(torch.tensor(counts, dtype=torch.float), plan.from_samples,
                          replacement=True, generator=g)
    ids = expert.condition.of_labels(labels)
    expert.to(device)
    shape = (expert.config["channels"], expert.config["image_size"], expert.config["image_size"])
    x, flops = draw_samples(lambda x, t,
                            ids: expert.velocity(x, t, expert.condition.expert_input(ids)), ids, shape,
                            plan.sample_steps, g, plan.sample_batch_size, device,
                            clamp=expert.config.get("vae") is None)
    atomic_save({"x": x, "labels": labels, "flops": flops, "settings": settings,
                 "name": name}, path)
    return x, labels, flops


@torch.no_grad()
def draw_samples(velocity, ids, shape, steps, generator, batch_size, device, clamp=True):
    """(images (N, *shape), FLOPs): integrate velocity(x, t, ids) from noise with `steps`
    Euler steps, one image per id.

    clamp: pixels are bounded to [-1, 1] as the data were; latents are not."""
    out, per_row = [], None
    for start in tqdm(range(0, len(ids), batch_size), desc="expert samples"):
        batch_ids = ids[start:start + batch_size].to(device)
        noise = torch.randn(len(batch_ids), *shape, generator=generator).to(device)
        # counted once, on the first batch: a forward's FLOPs grow with its rows
        if per_row is None:
            per_row = count_flops(lambda: velocity(noise, 0.5, batch_ids)) / len(batch_ids)
        x = sample_flow(lambda x, t: velocity(x, t, batch_ids), noise, steps)
        out.append((x.clamp(-1, 1) if clamp else x).float().cpu())
    return torch.cat(out), round(per_row * len(ids) * steps)


def examples_from_samples(plan, experts, members, condition, device):
    """RoutingExamples of every expert's samples (labelled by the expert that drew
    them), and what the router saw."""
    parts, flops = [], 0
    for output, (name, expert) in enumerate(experts.items()):
        x, labels, cost = expert_samples(name, expert, members[output], plan, device)
        ids = condition.of_labels(labels)
        parts.append((Samples(x), np.full(len(x), output), lambda local,
                      ids=ids: ids[torch.as_tensor(local)]))
        flops += cost
    ref = next(iter(experts.values()))
    clustering = next((e.config.get("cluster_fingerprint") for n, e in experts.items()
                       if n.isdigit()), None)
    seen = {"cluster_fingerprint": clustering, "data": None, "vae": ref.config.get("vae"),
            "source": {"samples_per_expert": plan.from_samples, "sample_steps": plan.sample_steps,
                       "sample_flops": flops}}
    return RoutingExamples(parts), seen


def experts_condition(run_dir):
    """The condition spec the run's experts were trained with (they agree, or sample.py
    will say so), or None."""
    for path in network_folders(os.path.join(run_dir, "experts")).values():
        spec = split_checkpoint(load_checkpoint(path, "expert"))[2]["condition"]
        # the information control's monolith is told the cluster; its router, the class
        return {"kind": "class"} if spec.get("kind") == "class+cluster" else spec
    return None


def cluster_members(clusters, dataset):
    """The k-means experts of the cluster file, in ensemble order: name, data
    fingerprint, size, label counts."""
    assign = clusters["assignments"].numpy()
    return [expert_record(str(j), dataset, np.flatnonzero(assign == j))
            for j in range(clusters["k"])]


def examples_from_data(plan, device):
    """(RoutingExamples, members, condition, what the router saw): the cluster file's
    data set with its assignments (if the run has one), and every contributor's data
    set that this machine can read."""
    has_clusters = os.path.isfile(cluster_path(plan.run_dir))
    others = contributors(plan.run_dir)
    if not has_clusters and not others:
        raise UsageError(f"no cluster file at {cluster_path(plan.run_dir)} and no "
                         "contributors' experts: run cluster.py first, or train experts "
                         "with --partition NAME")
    parts, members = [], []
    if has_clusters:
        # it would replace the router of pixel experts with one they cannot use
        if plan.vae and load_clusters(plan.run_dir).get("vae") is None:
            raise UsageError(f"--vae {plan.vae}: {cluster_path(plan.run_dir)} and its "
                             "experts are in pixels; a router in a VAE's latents could "
                             "not route them (for a latent run: cluster.py --vae, in "
                             "another --run-dir)")
        # the router reads x_t where the experts do: in the latents (posterior means)
        clusters, dataset = clustered_data(
            plan.run_dir, plan.data, plan.image_size, plan.vae, download=plan.download,
            device=device)
        experts = experts_condition(plan.run_dir)
        kind = plan.condition or (experts or {}).get("kind")
        condition = condition_for_data(kind, dataset, plan.run_dir,
                                       encoder=(experts or {}).get("encoder"),
                                       clip_model=plan.clip_model,
                                       clip_pretrained=plan.clip_pretrained, download=plan.download)
        members = cluster_members(clusters, dataset)
        parts = [(dataset, clusters["assignments"].numpy(), condition.ids)]
        shape = clusters["data"]["shape"]
        seen = {"cluster_fingerprint": clusters["fingerprint"], "data": dataset.fingerprint,
                "vae": getattr(dataset, "vae", None),
                "source": "data"}
    else:   # contributors only: the first one's images and condition set what the others must match
        first = next(iter(others.values()))
        condition = condition_from_spec(first["condition"]).for_router(plan.condition)
        shape = first["data"]["shape"]
        seen = {"cluster_fingerprint": None, "data": None, "vae": None, "source": "data"}
    for name, config in others.items():
        theirs, owned = contributor_data(name, config, shape, plan.download)
        labels = theirs.labels[owned] if theirs.labels is not None else np.zeros(len(owned), dtype=np.int64)
        ids = condition.of_labels(labels, theirs.num_classes)
        parts.append((Subset(theirs, owned), np.full(len(owned), len(members)), lambda local,
                      ids=ids: ids[torch.as_tensor(local)]))
        members.append({"name": name, "trained_on": config["member"]["trained_on"],
                        "size": len(owned),
                        "label_counts": config["member"].get("label_counts")})
    if len(members) < 2:
        raise UsageError("a router needs at least two experts to choose between; this "
                         f"run has {', '.join(m['name'] for m in members)}")
    return RoutingExamples(parts), members, condition, seen


class Subset:
    def __init__(self, dataset, owned):
        self.dataset, self.owned = dataset, owned

    def batch(self, idx, rng=None):
        return self.dataset.batch(self.owned[idx])


def router_size(plan, side, channels, condition, router_args, init):
    """{model, chosen_by, expert_model, expert_forward_flops}: --init's size, --model, or
    by the rule model.router_for (the largest router within ROUTER_SHARE of one expert's
    forward) for the run's smallest trained expert, else for --expert-model."""
    trained = expert_sizes(plan.run_dir)
    if plan.expert_model and trained and plan.expert_model not in trained:
        raise UsageError(f"--expert-model {plan.expert_model}, but the run's experts are "
                         f"{', '.join(sorted(trained))}: drop the flag, the router is sized "
                         "for the experts it finds")
    if trained:
        expert_flops, expert = min((flops, name) for name, flops in trained.items())
    elif plan.model and not plan.expert_model:   # nothing to size by, nothing to compare with
        expert_flops = expert = None
    else:
        expert = plan.expert_model or DEFAULT_EXPERT_MODEL
        if side % DiT_models[expert][3]:
            raise UsageError(f"the router is sized for {expert} experts, whose patch does not "
                             f"tile {side}-px images: give --expert-model, or --model")
        expert_flops = forward_flops(DiT, model_args_for(
            expert, input_size=side, in_channels=channels, **condition.expert_args()))
    if init is not None:
        model, chosen_by = registry_name(renamed_args(init[0]["model_args"])), "--init"
    elif plan.model:
        model, chosen_by = plan.model, "--model"
    else:
        model, flops = router_for(expert_flops, side // plan.downsample, channels, **router_args)
        source = "trained" if trained else "--expert-model" if plan.expert_model else \
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
        model_args = split_checkpoint(load_checkpoint(path, f"expert {name}"))[1]
        found[registry_name(model_args)] = forward_flops(DiT, model_args)
    return found


def router_init(path, members):
    """--init ROUTER: its weights, with its head's row for each expert it knew moved to
    that expert's new output; the rows of experts that joined since start at zero (the
    prior alone). None without --init."""
    if not path:
        return None
    old = load_checkpoint(path, "--init router")
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
