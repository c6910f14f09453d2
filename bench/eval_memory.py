"""Memory of eval.py on a large batch, against a small one measured in the same run.

    python bench/eval_memory.py                 # 50,000 Fashion-MNIST-shaped images against 1,000
    python bench/eval_memory.py --n 10000       # a smaller check

Each batch is evaluated by `eval.py` in a process of its own (the shipped Fashion judge; random uint8
images and labels: memory, not quality, is measured), and the peak resident memory of that process is
read from the kernel. eval.py reads a batch as uint8 and turns it into floats a batch of images at a
time, so the large batch may cost more than the small one by its uint8 images and its features, but
not by all its images as float32; the last line says whether it held."""
import argparse
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss(batch, run_dir):
    """Peak resident memory (bytes) of eval.py on `batch`, in a fresh process."""
    script = ("import resource, runpy, sys; sys.argv = sys.argv[1:]; "
              "exec('try:\\n runpy.run_path(sys.argv[0], run_name=\"__main__\")\\n"
              "finally:\\n print(\"PEAK\", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)')")
    done = subprocess.run([sys.executable, "-c", script, os.path.join(ROOT, "eval.py"), batch,
                           "--data", "fashion-mnist", "--run-dir", run_dir], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        sys.exit(f"eval.py failed: {done.stderr.strip().splitlines()[-1]}")
    return 1024 * int(done.stdout.split("PEAK")[-1].split()[0])   # ru_maxrss is in KiB on Linux


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--peer", type=int, default=1_000)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        peaks = {}
        for n in (args.peer, args.n):
            batch = os.path.join(folder, f"batch{n}.npz")
            np.savez(batch, arr_0=rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
                     arr_1=rng.integers(0, 10, n))
            peaks[n] = peak_rss(batch, os.path.join(folder, "run"))
    as_float32 = args.n * 28 * 28 * 4
    extra = peaks[args.n] - peaks[args.peer]
    print(f"eval.py peak memory: {peaks[args.peer] / 2 ** 20:.0f} MiB at N = {args.peer}, "
          f"{peaks[args.n] / 2 ** 20:.0f} MiB at N = {args.n}")
    print(f"the larger batch costs {extra / 2 ** 20:.0f} MiB more; its images as float32 would be "
          f"{as_float32 / 2 ** 20:.0f} MiB (ratio {extra / as_float32:.2f})")
    print("bounded: held" if extra < as_float32 else "bounded: NOT held")


if __name__ == "__main__":
    main()
