"""Achieved FLOP/s of a training step against the machine's measured dense-matmul FLOP/s, and
where the time goes.

    python bench/flops.py   # DiT-S/2, 32x32x3, batch 32, fp32 (the CPU target: >= 50% of peak)

FLOPs are counted by PyTorch's FlopCounterMode (model.count_flops, CPU attention included);
the practical peak is a large square matmul at the same precision. A profiler table of the
step follows, sorted by self time, so the gap to the peak can be read off.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import DiT, count_flops, model_args_for   # noqa: E402


def matmul_peak(device, dtype, n=2048, repeats=10):
    a, b = torch.randn(n, n, device=device,
                       dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * repeats / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-S/2")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modulation", default="adaln-single", choices=["adaln-single", "adaln-zero"])
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = DiT(**model_args_for(args.model, input_size=args.size, in_channels=args.channels,
                                 num_classes=1000, learn_sigma=False),
                modulation=args.modulation).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.channels, args.size, args.size, device=device)
    t, y = torch.rand(args.batch,
                      device=device) * 999, torch.randint(0, 1000, (args.batch,), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def step():
        with autocast:
            loss = ((model(x, t, y) - x) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    flops = count_flops(step)
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = matmul_peak(device, dtype)
    achieved = flops / seconds
    name = (torch.cuda.get_device_name() if device == "cuda"
            else f"CPU, {torch.get_num_threads()} threads")
    print(f"device: {name}; {dtype}")
    print(f"{args.model} ({args.modulation}), {args.size}x{args.size}x{args.channels}, batch "
          f"{args.batch}: {flops / 1e9:.2f} GFLOPs per step, {seconds * 1e3:.0f} ms per step")
    print(f"achieved {achieved / 1e9:.1f} GFLOP/s; measured matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"{achieved / peak:.0%} of peak (target >= 50%: "
          f"{'met' if achieved >= 0.5 * peak else 'NOT met'})")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            step()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15))


if __name__ == "__main__":
    main()
