"""Can the input pipeline feed the training step? Images/s of train_expert.py's loader against
the step's.

    python bench/data.py                    # 100k synthetic ImageNet-64 images; 0, 2 and 4
                                            # workers; DiT-B/2 at 64 px
    python bench/data.py --dir /fast/disk   # where the synthetic file is made (kept for the
                                            # next run)

The data set is made once in the real downsampled-ImageNet format (one uncompressed
train_data_batch_1.npz: `data` uint8 N x 12288 channel-planar, `labels` 1..1000), so the loader
reads it exactly as it reads the real one: memory-mapped, a batch gathered per step, horizontal
flips on. The loader is data.TrainingBatches.loader, as train_expert.py uses it.
The step is DiT-B/2 on 64x64x3 (forward, loss, backward, AdamW) at the given batch, in bf16 on
a GPU and fp32 on a CPU. The last column says how many such steps per second the loader could
feed: below 1.0x the GPU waits for data.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import DiT, model_args_for   # noqa: E402
from plumbing.data.datasets import load_dataset, TrainingBatches  # noqa: E402


def synthetic_imagenet64(folder, n):
    """An uncompressed train_data_batch_1.npz of n random 64x64 images, written in chunks; reused if
    it exists."""
    path = os.path.join(folder, "train_data_batch_1.npz")
    if os.path.isfile(path):
        with np.load(path, mmap_mode="r") as z:
            if len(z["labels"]) == n:
                return folder
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    data = np.lib.format.open_memmap(os.path.join(folder, "data.npy"), mode="w+", dtype=np.uint8,
                                     shape=(n, 3 * 64 * 64))
    for start in range(0, n, 10000):
        data[start:start + 10000] = rng.integers(0, 256, (min(10000, n - start),
                                                          3 * 64 * 64), dtype=np.uint8)
    data.flush()
    np.save(os.path.join(folder, "labels.npy"), rng.integers(1, 1001, n).astype(np.int64))
    import zipfile
    with zipfile.ZipFile(path + ".tmp", "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        z.write(os.path.join(folder, "data.npy"), "data.npy")
        z.write(os.path.join(folder, "labels.npy"), "labels.npy")
    os.replace(path + ".tmp", path)
    os.remove(os.path.join(folder, "data.npy"))
    os.remove(os.path.join(folder, "labels.npy"))
    return folder


def loader_rate(dataset, batch, workers, batches, device):
    """Images/s the loader delivers to `device`, after its first batch (worker start-up) is out of
    the way."""
    batches_made = TrainingBatches(dataset, np.arange(len(dataset)), batch, seed=0, hflip=True)
    loader = batches_made.loader(0, batches + 1, workers, pin_memory=device.type == "cuda")
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _, x in it:
        x = x.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return batches * batch / (time.perf_counter() - start)


def step_rate(batch, steps, device):
    """Images/s of DiT-B/2's training step on 64x64x3 (bf16 autocast on a GPU)."""
    torch.manual_seed(0)
    model = DiT(**model_args_for("DiT-B/2", input_size=64, in_channels=3, num_classes=1000,
                                 learn_sigma=False)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, 64, 64, device=device)
    t, y = torch.rand(batch, device=device), torch.randint(0, 1000, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = (model(x, t, y).float() - x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000,
                   help="images in the synthetic file (1.2 GB per 100k)")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ddm-bench-imagenet64"))
    p.add_argument("--batch", type=int, default=None,
                   help="per step (default: 256 on a GPU, as DiT; 8 on a CPU)")
    p.add_argument("--batches", type=int, default=20, help="loader batches timed per worker count")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps timed (default: 20 on a GPU, 2 on a CPU; 0: the loader "
                        "alone, e.g. at a GPU's batch on a CPU machine)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = args.batch or (256 if device.type == "cuda" else 8)
    folder = synthetic_imagenet64(args.dir, args.n)
    dataset = load_dataset(f"imagenet64:{folder}")
    name = (torch.cuda.get_device_name() if device.type == "cuda"
            else f"CPU, {os.cpu_count()} cores")
    print(f"device {name}; {len(dataset):,} ImageNet-64 images (memory-mapped), batch {batch}, "
          "flips on")
    steps = args.steps if args.steps is not None else (20 if device.type == "cuda" else 2)
    step = step_rate(batch, steps, device) if steps else None
    print(f"{'':<28}{'images/s':>12}{'feeds the step':>16}")
    if step:
        print(f"{'DiT-B/2 training step':<28}{step:>12.2f}{'':>16}")
    for workers in args.workers:
        rate = loader_rate(dataset, batch, workers, args.batches, device)
        feeds = f"{rate / step:.1f}x" if step else "-"
        print(f"{f'loader, {workers} workers':<28}{rate:>12.1f}{feeds:>16}")


if __name__ == "__main__":
    main()
