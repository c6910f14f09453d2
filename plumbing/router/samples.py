"""A router that needs nobody's data (train_router.py --from-samples N): each expert draws
N images with the project's sampler under its own label distribution (cached in
RUN_DIR/router/samples/ by the expert's weights and the sampler settings) and labels them
as its own; the router then learns p(expert | x_t, t, y) with every expert's prior set by
its recorded share of all training images."""
import hashlib
import os
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from diffusion import sample_flow
from model import count_flops
from plumbing.command_line import SINGLE_MODELS, UsageError
from plumbing.ensemble import check_compatible, expert_names, load_experts
from plumbing.sources import member_of
from plumbing.data.latents import file_hash
from plumbing.router.data import RoutingExamples
from plumbing.run_dir import (atomic_save, cache_key, expert_dir, load_checkpoint,
                              network_file_set, router_dir)


class SampleDraw(NamedTuple):
    """What --from-samples asks of each expert: n images, drawn with `steps` Euler steps in
    batches of `batch_size`, from random streams seeded by `seed` and the expert's name."""
    n: int
    steps: int
    seed: int
    batch_size: int


class Samples:
    """One expert's generated images, as a data set for RoutingExamples."""

    def __init__(self, x):
        self.x = x

    def batch(self, idx, rng=None):
        return self.x[torch.as_tensor(idx)].float()


def experts_to_sample(run_dir, which, condition_kind):
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
        member = member_of(expert.config)
        if not isinstance(member.get("size"), (int, type(None))) or (member.get("size") or 1) < 1:
            raise UsageError(f"expert {name} records a training-set size of {member['size']!r}; "
                             "a share needs a positive count: its checkpoint is damaged")
        if member.get("size") is None:   # an --import'ed model, or an expert from before records
            raise UsageError(f"expert {name} records no training-set size (imported, or "
                             "trained by an older version), so its share is unknown; "
                             "retrain it, or train the router from data")
        counts = member.get("label_counts")
        if counts is not None and not valid_counts(counts):
            raise UsageError(f"expert {name} records label counts {counts!r}; its labels are "
                             "drawn from them, which needs whole numbers, not negative, not all "
                             "zero: its checkpoint is damaged")
        members.append({"name": name, "trained_on": member["trained_on"], "size": member["size"],
                        "label_counts": counts})
    return experts, members, condition


def valid_counts(counts):
    """Label counts an expert's labels can be drawn from: a non-empty list of whole numbers,
    none negative, not all zero."""
    return (isinstance(counts, list) and counts
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            and sum(counts) > 0)


@torch.no_grad()
def intact(cached, n, expert, member):
    """A cache holds n finite images of the expert's shape, with labels it can have drawn."""
    x, labels = cached.get("x"), cached.get("labels")
    shape = (n, expert.config["channels"], expert.config["image_size"], expert.config["image_size"])
    classes = len(member["label_counts"] or [0])
    return (torch.is_tensor(x) and tuple(x.shape) == shape and bool(torch.isfinite(x).all())
            and torch.is_tensor(labels) and labels.shape == (n,)
            and bool(((labels >= 0) & (labels < classes)).all()))


def expert_samples(name, expert, member, run_dir, draw, device):
    """`--from-samples` images of one expert, drawn with the project's sampler under
    its own label distribution, cached in RUN_DIR/router/samples/ by the expert's
    checkpoint hash and the sampler settings; returns (x, labels, FLOPs to draw)."""
    files = network_file_set(expert_dir(run_dir, name))
    settings = {"expert": file_hash(files), "n": draw.n, "steps": draw.steps,
                "seed": draw.seed}
    path = os.path.join(router_dir(run_dir), "samples", f"{name}-{cache_key(settings)}.pt")
    if os.path.isfile(path):
        try:   # a cache: one that cannot be read is drawn again, as one that is not intact
            cached = load_checkpoint(path, "cached samples")
        except UsageError:
            cached = {}
        if cached.get("settings") == settings and intact(cached, draw.n, expert, member):
            return cached["x"], cached["labels"], cached["flops"]
        print(f"{path} is not the samples its name promises; drawing them again")
    # the same draws whatever the other experts are: an expert that joins later leaves the
    # others' caches valid
    g = torch.Generator().manual_seed(int(hashlib.sha1(f"{name}:{draw.seed}".encode()).hexdigest()[:8], 16))
    # an unlabelled data set: every sample gets label 0, which no condition reads
    counts = member["label_counts"]
    labels = torch.zeros(draw.n, dtype=torch.long) if counts is None else \
        torch.multinomial(torch.tensor(counts, dtype=torch.float), draw.n,
                          replacement=True, generator=g)
    ids = expert.condition.of_labels(labels)
    expert.to(device)
    shape = (expert.config["channels"], expert.config["image_size"], expert.config["image_size"])
    x, flops = draw_samples(lambda x, t,
                            ids: expert.velocity(x, t, expert.condition.expert_input(ids)), ids, shape,
                            draw.steps, g, draw.batch_size, device,
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


def examples_from_samples(run_dir, draw, experts, members, condition, device):
    """RoutingExamples of every expert's samples (labelled by the expert that drew
    them), and what the router learns from."""
    parts, flops = [], 0
    for output, (name, expert) in enumerate(experts.items()):
        x, labels, cost = expert_samples(name, expert, members[output], run_dir, draw, device)
        ids = condition.of_labels(labels)
        parts.append((Samples(x), np.full(len(x), output), lambda local,
                      ids=ids: ids[torch.as_tensor(local)]))
        flops += cost
    ref = next(iter(experts.values()))
    clustering = next((e.config.get("cluster_fingerprint") for n, e in experts.items()
                       if n.isdigit()), None)
    seen = {"cluster_fingerprint": clustering, "data": None, "vae": ref.config.get("vae"),
            "source": {"samples_per_expert": draw.n, "sample_steps": draw.steps,
                       "sample_flops": flops}}
    return RoutingExamples(parts), seen
