"""Sharded data at scale, simulated: does an island's pipeline stay flat in memory and linear
in time as the data set grows?

    python bench/shards.py                          # 50,000 and 200,000 images, 64 px, 1000 a shard
    python bench/shards.py --sizes 4000 16000       # a quick look
    python bench/shards.py --dir /fast/disk --keep  # where the shards go, kept for a second look

For each size it writes a synthetic WebDataset shard set (64x64 JPEGs in eight patterns with noise,
a `.cls` label each, `islands.write_shards`), then runs the stages as a user would, each in its own
process:
  write     the synthetic shards;
  cluster   cluster.py --data wds:... --fine-k 256 --export-shards ISLANDS: index the shards, hash
            every sample, stream pixel features into a memory-mapped cache, fit two-stage k-means on
            a sample (--fit-sample, 100,000 by default), assign every image, export each cluster's
            shard set;
  island    train_expert.py --cluster K --data wds:ISLANDS/K/*.tar for the largest cluster K,
            with only clusters.pt beside it: index its shards and check them against the cluster
            file (every byte hashed once), then --steps training steps.
It prints each stage's wall time, its time per 1000 images and its peak resident memory (the
process's own, from the kernel's rusage), beside the shard set's size on disk; then the larger size
against the smaller: time should grow like N, memory not at all (what grows is the index, about 50
bytes per image, and the cluster file's keys and digests).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing.data.islands import write_shards  # noqa: E402


def synthetic_samples(n, seed=0):
    """n 64x64 JPEG samples: eight stripe patterns (colour, angle, frequency) under per-image noise
    and shift, each labelled with its pattern."""
    import io
    from PIL import Image
    yy, xx = np.mgrid[0:64, 0:64] / 63.0
    patterns = []
    for c in range(8):
        angle = c * np.pi / 8
        stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi * (1 + c % 3))
        colour = np.array([(c * 37) % 256, (c * 91) % 256, (c * 53) % 256]) / 255
        patterns.append((stripes[..., None] * 0.5 + 0.5) * colour * 200 + 28)
    patterns = np.array(patterns, dtype=np.float32)
    rng = np.random.default_rng(seed)
    for start in range(0, n, 1000):
        count = min(1000, n - start)
        labels = rng.integers(0, 8, count)
        noise = rng.integers(-16, 17, (count, 64, 64, 3), dtype=np.int16)
        shifts = rng.integers(0, 64, count)
        for i in range(count):
            pixels = np.roll(patterns[labels[i]], shifts[i], axis=1) + noise[i]
            out = io.BytesIO()
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG",
                                                                       quality=90)
            yield {"__key__": f"{start + i:09d}", "jpg": out.getvalue(),
                   "cls": str(labels[i]).encode()}


def measured(argv, log):
    """(wall seconds, peak resident MB) of one command in its own process; its output goes to
    `log`, shown if it fails."""
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "TQDM_DISABLE": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        with open(log) as f:
            sys.exit(f"{' '.join(argv)} failed:\n{f.read()[-3000:]}")
    return time.time() - start, usage.ru_maxrss / 1024   # Linux reports kilobytes


def disk_mb(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
               for f in files) / 2**20


def one_size(n, root, per_shard, fine_k, steps, keep):
    """Write n images as shards, cluster and export them, train one island's expert:
    {stage: (seconds, MB)}."""
    folder = os.path.join(root, f"n{n}")
    shards, run, islands, island = (os.path.join(folder, p) for p in ("shards", "run", "islands",
                                                                      "island"))
    python = sys.executable
    rows = {"write": measured([python, __file__, "--write", shards, "--sizes", str(n),
                               "--per-shard", str(per_shard)], os.path.join(root, "write.log"))}
    rows["cluster"] = measured([python, "cluster.py", "--data", f"wds:{shards}/*.tar",
                                "--run-dir", run, "--k", "4", "--fine-k", str(fine_k),
                                "--export-shards", islands, "--device", "cpu"],
                               os.path.join(root, "cluster.log"))
    os.makedirs(island)
    shutil.copy(os.path.join(run, "clusters.pt"), island)
    sizes = []
    for k in range(4):
        with open(os.path.join(islands, str(k), "manifest.json")) as f:
            sizes.append(json.load(f)["size"])
    largest = int(np.argmax(sizes))   # the island with the most data: the one that must scale
    rows["island"] = measured([python, "train_expert.py", "--cluster", str(largest), "--data",
                               f"wds:{islands}/{largest}/*.tar", "--run-dir", island, "--model",
                               "DiT-N/8", "--steps", str(steps), "--batch-size", "32",
                               "--precision", "fp32", "--workers", "0"],
                              os.path.join(root, "island.log"))
    size = disk_mb(shards)
    island_size = sizes[largest]
    if not keep:
        shutil.rmtree(folder)
    return rows, size, island_size


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000],
                   help="data set sizes, smallest first")
    p.add_argument("--per-shard", type=int, default=1000, help="images per shard")
    p.add_argument("--fine-k", type=int, default=256,
                   help="cluster.py's fine centroids (DDM: 1024; fewer keep the bench short)")
    p.add_argument("--steps", type=int, default=20, help="the island's training steps")
    p.add_argument("--dir", default=None, help="where the shards go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the shards and runs")
    p.add_argument("--write", default=None, help=argparse.SUPPRESS)   # the write stage's process
    args = p.parse_args()
    if args.write:
        write_shards(args.write, synthetic_samples(args.sizes[0]), args.per_shard)
        return
    root = args.dir or tempfile.mkdtemp(prefix="ddm-shards-bench-")
    os.makedirs(root, exist_ok=True)
    print(f"{'images':>9} {'on disk':>9} {'stage':>8} {'its images':>10} {'wall s':>8} "
          f"{'s / 1k img':>10} {'peak MB':>8}")
    results = {}
    for n in args.sizes:
        rows, size, island_size = one_size(n, root, args.per_shard, args.fine_k, args.steps,
                                           args.keep)
        results[n] = rows
        for stage, (seconds, peak) in rows.items():
            seen = island_size if stage == "island" else n   # the island reads its cluster only
            print(f"{n:>9,} {size:>7.0f}MB {stage:>8} {seen:>10,} {seconds:>8.1f} "
                  f"{1000 * seconds / seen:>10.3f} {peak:>8.0f}", flush=True)
    small, large = args.sizes[0], args.sizes[-1]
    if large != small:
        print(f"\n{large:,} against {small:,} images ({large / small:.1f}x the data):")
        for stage in results[small]:
            (t0, m0), (t1, m1) = results[small][stage], results[large][stage]
            print(f"  {stage:>8}: time {t1 / t0:.2f}x, peak memory {m1 / m0:.2f}x "
                  f"({m1 - m0:+.0f} MB)")
    if not args.dir and not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
