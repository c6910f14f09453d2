"""The measures eval.py reports: Frechet distance, k-NN precision and recall, diversity,
KID and memorisation, each a function of feature arrays (it reads and writes no file), and
the floor, which runs the feature networks on real rows of a data set. The feature networks
are judge.py's classifier and inception.py's Inception-v3."""
from typing import NamedTuple

import numpy as np
import torch

from plumbing.command_line import UsageError
from plumbing.data.datasets import Rows


# --- Frechet distance, precision / recall, diversity ---------------------------------------------

def statistics_problem(features, mu, sigma, n):
    """What is wrong with reference statistics read back from a cache (None: nothing):
    the features of n images, their mean and covariance of the same width, every number
    finite. A cache is keyed by what made it, but a damaged or foreign file can sit there."""
    if features.ndim != 2 or features.shape[0] != n:
        return f"not the features of {n} images (shape {features.shape})"
    width = features.shape[1]
    if mu.shape != (width,) or sigma.shape != (width, width):
        return (f"of mismatched shapes (mean {mu.shape}, covariance {sigma.shape} for "
                f"{width} features)")
    if not all(np.isfinite(a).all() for a in (features, mu, sigma)):
        return "not all finite"
    return None


def frechet_distance(mu1, sigma1, mu2, sigma2):
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), with symmetric
    eigendecompositions in float64."""
    mu1, mu2, sigma1, sigma2 = (np.asarray(a, dtype=np.float64) for a in (mu1, mu2, sigma1, sigma2))
    w, v = np.linalg.eigh(sigma1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    middle = root1 @ sigma2 @ root1
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_root)


# rows of a feature array handled at once: memory stays a few chunks' worth, whatever N is
CHUNK = 4096


def chunks(n, size=CHUNK):
    return (slice(start, min(start + size, n)) for start in range(0, n, size))


def by_chunks(n, size, dtype, row_values):
    """row_values(s) for every chunk s of range(n), written into one tensor made up front.
    Kept in a list and concatenated at the end, the small per-chunk results pinned the freed
    blocks of the large temporaries between them, and glibc's heap grew by about one
    distance matrix per chunk: eval.py's main, run on 50,000 random 28x28 images under a
    wrapper reading /proc/self/status, peaked at 19,582 MiB resident before this and at
    984 MiB after."""
    out = None
    for s in chunks(n, size):
        values = row_values(s)
        if out is None:
            out = torch.empty((n, *values.shape[1:]), dtype=dtype)
        out[s] = values
    return out


def statistics(features):
    """(mean, covariance) of (N, D) features in float64, two passes a chunk at a time (as
    np.cov, with no float64 copy of all N rows)."""
    n = len(features)
    mu = sum(np.asarray(features[s], dtype=np.float64).sum(0) for s in chunks(n)) / n
    sigma = 0
    for s in chunks(n):
        centred = np.asarray(features[s], dtype=np.float64) - mu
        sigma = sigma + centred.T @ centred
    return mu, sigma / (n - 1)


PRECISION_RECALL_K = 3


def precision_recall(real, fake, k=PRECISION_RECALL_K):
    """Kynkaenniemi et al.: a sample is precise if it falls inside some real point's
    k-NN ball, and vice versa."""
    real, fake = torch.as_tensor(real, dtype=torch.float64), torch.as_tensor(fake, dtype=torch.float64)

    def rows(other):   # distances to `other` a chunk of rows at a time: 4M of them, 32 MiB
        return max(1, 2 ** 22 // len(other))

    def radii(x):   # +1: the point itself is at distance 0
        return by_chunks(len(x), rows(x), torch.float64, lambda s: torch.cdist(x[s], x).topk(
            k + 1, dim=1, largest=False).values[:, -1])

    def covered(a, b, radius):   # the share of a's rows inside some row of b's ball
        return by_chunks(len(a), rows(b), torch.bool, lambda s: (torch.cdist(a[s], b) <= radius).any(1))

    precision = covered(fake, real, radii(real)).double().mean().item()
    recall = covered(real, fake, radii(fake)).double().mean().item()
    return precision, recall


def diversity(features, labels):
    """Mean pairwise distance within each label (labels with at least two samples),
    averaged over labels."""
    if labels is None:
        labels = np.zeros(len(features), dtype=np.int64)
    per_label = []
    for c in np.unique(labels):
        f = torch.as_tensor(features[labels == c], dtype=torch.float64)
        if len(f) >= 2:   # over ordered pairs, a chunk of rows at a time: the zero diagonal adds nothing
            total = sum(torch.cdist(f[s], f).sum().item() for s in chunks(len(f), max(1, 2 ** 22 // len(f))))
            per_label.append(total / (len(f) * (len(f) - 1)))
    return float(np.mean(per_label)) if per_label else float("nan")

KID_SUBSET = 1000


def kid(real, fake, subsets=100, subset_size=None, seed=0):
    """Kernel Inception Distance (Binkowski et al. 2018), as torch-fidelity and
    clean-fid define it: the unbiased MMD^2 between feature sets with the cubic
    polynomial kernel k(x, y) = (x.y / d + 1)^3, over `subsets` random subsets of
    `subset_size` of each side (default half the smaller side, a subset of all N having
    no spread, and at most torch-fidelity's 1000, so that a 50,000-image batch costs no
    more memory than a 2,000-image one). Returns (mean, standard deviation over the
    subsets)."""
    m = subset_size or min(max(2, min(len(real), len(fake)) // 2), KID_SUBSET)
    d, rng, values = real.shape[1], np.random.default_rng(seed), []
    for _ in range(subsets):   # only the subsets in float64
        x = np.asarray(fake[rng.choice(len(fake), m, replace=False)], dtype=np.float64)
        y = np.asarray(real[rng.choice(len(real), m, replace=False)], dtype=np.float64)
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
    return by_chunks(len(queries), chunk, torch.float64, lambda s: torch.cdist(
        torch.as_tensor(queries[s], dtype=torch.float64), keys).topk(2, dim=1, largest=False).values).numpy()


def neighbour_sets(spec, dataset, feature_sets, device):
    """{space: (training rows, test rows)} for --memorisation: every training image and
    every test image, in pixels and in the classifier's features."""
    if dataset.test is None:
        raise UsageError(f"--memorisation compares samples with the training images and the "
                         f"held-out test images; {spec} has no test split")
    train = dataset.batch(np.arange(len(dataset)))
    test = dataset.test.batch(np.arange(len(dataset.test)))
    sets = {"pixels": (train.flatten(1).numpy(), test.flatten(1).numpy())}
    if "clf" in feature_sets:
        sets["clf"] = tuple(batched(feature_sets["clf"], images, device=device).numpy()
                            for images in (train, test))
    return sets


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


@torch.no_grad()
def batched(fn, images, batch_size=500, device="cpu"):
    """fn's float32 output for every row of `images`, a batch at a time on `device`: floats
    (N, C, H, W) in [-1, 1], or an ADM batch's uint8 (N, H, W, C), turned into floats one
    batch at a time, so that N images never sit in memory as floats."""
    def features(s):
        x = images[s]
        if isinstance(x, np.ndarray) and x.dtype == np.uint8:
            x = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1
        return fn(x.to(device)).float().cpu()
    return by_chunks(len(images), batch_size, torch.float32, features)


class Outside(NamedTuple):
    """Real images outside the reference set, from which the floor draws."""
    source: object          # a data set
    indices: np.ndarray
    description: str


FLOOR_DRAWS = 5
FD_KEYS = {"clf": ("fd_classifier", "kid_classifier"), "fid": ("fid", "kid"),
           "clip": ("clip_fd", "clip_kid")}


def real_floor(n, feature_sets, references, pool, seed, device, draws=FLOOR_DRAWS):
    """What a perfect sampler scores at batch size n: FD and KID of n real images that the
    reference does not hold, measured against the reference as a batch is, mean and s.d.
    over `draws` draws. FD is biased by both set sizes, so the floor keeps them (n against
    the reference), not two halves of the reference. Where fewer than n real images lie
    outside the reference (a set with no test split, whose reference is all of it), each
    draw takes n of the reference's own images against the rest of it: a reference n
    images smaller than the batches'. None where not even that is possible."""
    floor = None
    for name, fn in feature_sets.items():
        reference, (fd_key, kid_key) = references[name], FD_KEYS[name]
        outside = pool is not None and len(pool.indices) >= n
        if not outside and len(reference["features"]) < n + PRECISION_RECALL_K + 1:
            break
        floor = floor or {"n": n, "draws": draws, "images": (
            f"{pool.description} outside the reference" if outside else
            f"of the reference's images against its other {len(reference['features']) - n}")}
        fds, kids = [], []
        for draw in range(draws):
            rng = np.random.default_rng([seed, n, draw])
            if outside:
                rows = np.sort(rng.choice(pool.indices, n, replace=False))
                feats = batched(fn, Rows(pool.source, rows), device=device).numpy()
                rest = reference
            else:
                taken = np.zeros(len(reference["features"]), dtype=bool)
                taken[rng.choice(len(taken), n, replace=False)] = True
                feats = reference["features"][taken]
                mu, sigma = statistics(reference["features"][~taken])
                rest = {"features": reference["features"][~taken], "mu": mu, "sigma": sigma}
            fds.append(frechet_distance(*statistics(feats), rest["mu"], rest["sigma"]))
            kids.append(kid(rest["features"], feats, seed=seed)[0])
        floor.update({fd_key: float(np.mean(fds)), fd_key + "_sd": float(np.std(fds, ddof=1)),
                      kid_key: float(np.mean(kids)), kid_key + "_sd": float(np.std(kids, ddof=1))})
    return floor
