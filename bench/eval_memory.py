"""Memory of eval.py on a large batch, against a small one measured in the same run.

    python bench/eval_memory.py                 # 50,000 64x64 RGB images against 1,000
    python bench/eval_memory.py --size 28       # 28x28 grey: Fashion-MNIST and its shipped judge
    python bench/eval_memory.py --n 10000       # a smaller check

Each batch is evaluated by `eval.py` in a process of its own (random uint8 images and labels:
memory, not quality, is measured), and the peak resident memory of that process is read from the
kernel. At 64x64 the real data set is a file in downsampled ImageNet's format of 2,000 random
images, judged by a classifier of 20 steps; at 28x28 it is Fashion-MNIST (apt-get install
dataset-fashion-mnist).

The bound: eval.py reads a batch as uint8 and makes floats a batch of images at a time, so the
large batch may cost more than the small one by its uint8 images plus a fixed amount per image
for what the metrics keep of each sample (its 128 classifier features in float32 and float64,
and the float64 copies torch.cdist makes of one side: PER_IMAGE bytes), never by all its images
as float32 (the line above it says what that would be); the last line says whether it held."""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

# what the metrics keep of each sample, whatever the image size (see the docstring)
PER_IMAGE = 5 * 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss(batch, run_dir, data_flags):
    """Peak resident memory (bytes) of eval.py on `batch`, in a fresh process."""
    script = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; "
              "exec('try:\\n runpy.run_path(sys.argv[0], run_name=\"__main__\")\\n"
              "finally:\\n print(\"PEAK\", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)')")
    done = subprocess.run([sys.executable, "-c", script, os.path.join(ROOT, "eval.py"), batch,
                           *data_flags, "--run-dir", run_dir], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        sys.exit(f"eval.py failed: {done.stderr.strip().splitlines()[-1]}")
    return 1024 * int(done.stdout.split("PEAK")[-1].split()[0])   # ru_maxrss is in KiB on Linux


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--peer", type=int, default=1_000)
    p.add_argument("--size", type=int, choices=(28, 64), default=64)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    channels = 1 if args.size == 28 else 3
    with tempfile.TemporaryDirectory() as folder:
        if args.size == 28:
            data_flags = ["--data", "fashion-mnist"]
        else:
            real = os.path.join(folder, "train_data_batch_1.npz")
            np.savez(real, data=rng.integers(0, 256, (2000, 3 * 64 * 64), dtype=np.uint8),
                     labels=rng.integers(1, 11, 2000))
            data_flags = ["--data", f"imagenet64:{real}", "--classifier-steps", "20"]
        peaks = {}
        for n in (args.peer, args.n):
            batch = os.path.join(folder, f"batch{n}.npz")
            images = rng.integers(0, 256, (n, args.size, args.size, channels), dtype=np.uint8)
            np.savez(batch, arr_0=images, arr_1=rng.integers(0, 10, n))
            peaks[n] = peak_rss(batch, os.path.join(folder, "run"), data_flags)
    pixels = args.size * args.size * channels
    extra, more = peaks[args.n] - peaks[args.peer], args.n - args.peer
    bound = more * (pixels + PER_IMAGE)
    mib = 2 ** 20
    print(f"eval.py peak memory, {args.size}x{args.size}x{channels}: "
          f"{peaks[args.peer] / mib:.0f} MiB at N = {args.peer}, "
          f"{peaks[args.n] / mib:.0f} MiB at N = {args.n}: {extra / mib:.0f} MiB more")
    print(f"the {more} more images as float32 would be {more * pixels * 4 / mib:.0f} MiB; "
          f"the bound (uint8 images + {PER_IMAGE // 1024} KiB each) is {bound / mib:.0f} MiB")
    print("bounded: held" if extra <= bound else "bounded: NOT held")


if __name__ == "__main__":
    main()
