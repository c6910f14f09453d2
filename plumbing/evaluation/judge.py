"""The evaluation classifier, the judge that gives small images their feature space: its
network, its training, and the copy of it shipped with the project (plumbing/evaluation/judges/), so
that every machine scores the same samples alike. A run trains its own only where no judge
is shipped for its data set."""
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing.checkpoint import weights_digest
from plumbing.command_line import UsageError
from plumbing.run_dir import atomic_save, cache_key, load_checkpoint, save_safetensors


def classifier_network(image_size):
    """Which Classifier network images of this size get: 'pooled' up to 16 px, 'flat'
    above."""
    return "pooled" if image_size <= 16 else "flat"


def classifier_identity(image_size, steps):
    """What an .eval.json records of the classifier it was measured with; FDs compare
    only at the same identity."""
    return f"{classifier_network(image_size)}-{steps}"


class Classifier(nn.Module):
    """A small CNN; `features` is its 128-d penultimate layer.

    'pooled' (8 px digits, the network of every digits figure in docs/) averages its last 2x2 map.
    At 28 px that average throws away where on the image things are (a sleeve, a heel): it reached
    84.5 % on Fashion-MNIST's test split at 3000 steps. 'flat' normalises its convolutions and
    flattens the last 7x7 map into the 128-d layer, and reached 92.1 % at 1500 steps (python eval.py
    --prepare --data fashion-mnist --classifier-steps 1500)."""
    def __init__(self, channels, num_classes, image_size):
        super().__init__()
        self.network = classifier_network(image_size)
        if self.network == "pooled":
            self.body = nn.Sequential(
                nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
                nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten())
        else:
            def conv(c_in, c_out, stride):
                return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                        nn.BatchNorm2d(c_out), nn.ReLU()]
            side = -(-image_size // 4)   # two stride-2 convolutions, each rounding up
            self.body = nn.Sequential(*conv(channels, 32, 1), *conv(32, 32, 2), *conv(32, 64, 1),
                                      *conv(64, 64, 2),
                                      nn.Flatten(), nn.Linear(64 * side * side, 128), nn.ReLU())
        self.head = nn.Linear(128, num_classes)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def data_key(dataset):
    return cache_key(dataset.fingerprint, 12)


def train_classifier(dataset, steps, seed=0):
    """Train on the training images and report accuracy on the test split; a set
    without one holds out 10 % of its images."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(dataset), generator=g).numpy()
    if dataset.test is not None:
        held_out, val, train = dataset.test, np.arange(len(dataset.test)), order
    else:
        n_val = max(1, len(dataset) // 10)
        held_out, val, train = dataset, order[:n_val], order[n_val:]
    model = Classifier(dataset.channels, dataset.num_classes, dataset.image_size)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(steps):
        # cosine decay to zero; 'pooled' keeps the constant rate its digits figures used
        if model.network == "flat":
            opt.param_groups[0]["lr"] = 1e-3 * (1 + np.cos(np.pi * step / steps))
        idx = train[torch.randint(len(train), (128,), generator=g).numpy()]
        x = dataset.batch(idx)
        # slight shift jitter
        x = torch.roll(x, shifts=tuple(torch.randint(
            -1, 2, (2,), generator=g).tolist()), dims=(2, 3))
        loss = F.cross_entropy(model(x), torch.from_numpy(dataset.labels[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        chunks = [val[i:i + 512] for i in range(0, len(val), 512)]
        correct = sum(int((model(held_out.batch(c)).argmax(1).numpy() == held_out.labels[c]).sum()) for c in chunks)
    return model, correct / len(val)


# judges shipped with the project: every machine scores the same samples alike
JUDGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "judges")
# their weights' digests and held-out accuracies as published (docs/evaluation.md): a judge
# file that differs is refused, and the accuracy reported is this one, not the file's
PINNED = {"classifier-b76ab5c294cd-flat-1500.safetensors": ("eecfdc969647", 0.9214)}


def classifier_name(dataset, steps):
    network = classifier_network(dataset.image_size)
    # pooled: the name caches had before 'flat'
    if network == "pooled":
        return f"{data_key(dataset)}-{steps}"
    return f"{data_key(dataset)}-{network}-{steps}"


def load_or_train_classifier(dataset, run_dir, steps):
    """(the evaluation classifier, its accuracy, its weights' digest): the judge
    shipped in plumbing/evaluation/judges/ for this data set, network and steps, else the one
    cached in RUN_DIR/eval/ (trained there when missing; an unreadable cache is trained
    again)."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    model = Classifier(dataset.channels, dataset.num_classes, dataset.image_size)
    name = f"classifier-{classifier_name(dataset, steps)}.safetensors"
    shipped = os.path.join(JUDGES, name)
    if os.path.isfile(shipped):
        try:
            with safe_open(shipped, "pt") as f:
                accuracy = float(f.metadata()["accuracy"])
            model.load_state_dict(load_file(shipped))
        except Exception as e:   # SafetensorError, a missing key, other shapes
            raise UsageError(f"the shipped judge {shipped} is damaged ({type(e).__name__}): "
                             "restore it from the project's repository")
        digest = weights_digest(model.state_dict())
        if name in PINNED and digest != PINNED[name][0]:
            raise UsageError(f"the shipped judge {shipped} has weights digest {digest}, not the "
                             f"published {PINNED[name][0]}: restore it from the project's repository")
        return model.eval(), PINNED.get(name, (None, accuracy))[1], digest
    path = os.path.join(run_dir, "eval", f"classifier-{classifier_name(dataset, steps)}.pt")
    if os.path.isfile(path):
        try:
            ckpt = load_checkpoint(path, "classifier")
            model.load_state_dict(ckpt["model"])
            return model.eval(), ckpt["accuracy"], weights_digest(model.state_dict())
        except (UsageError, KeyError, RuntimeError) as e:
            print(f"the cached classifier {path} is unreadable ({e}); training it again")
    print(f"training the evaluation classifier on the real data ({steps} steps, cached in {path})")
    model, accuracy = train_classifier(dataset, steps)
    atomic_save({"model": model.state_dict(), "accuracy": accuracy, "data": dataset.fingerprint,
                 "network": model.network}, path)
    return model, accuracy, weights_digest(model.state_dict())


def ship_classifier(model, accuracy, dataset, steps):
    """Write a trained classifier as the judge of its data set (safetensors, accuracy as
    metadata); returns the file."""
    path = os.path.join(JUDGES, f"classifier-{classifier_name(dataset, steps)}.safetensors")
    save_safetensors(model.state_dict(), path,
                     metadata={"accuracy": repr(accuracy), "data": json.dumps(dataset.fingerprint)})
    return path
