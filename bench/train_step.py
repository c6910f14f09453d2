"""Images/s and peak memory of one training step: our DiT vs diffusers' DiTTransformer2DModel.

    pip install -r bench/requirements.txt
    python bench/train_step.py                      # the CPU config: DiT-S/2, 32x32x3, batch 32
    python bench/train_step.py --config gpu         # DiT-B/2 and DiT-XL/2 on 32x32x4 latents (bf16 autocast)

One step = forward + MSE loss + backward + AdamW. Same width, depth, heads, patch, image size,
batch and classes for every model: ours with adaLN-Zero (vs diffusers' ada_norm_zero) and
ours with AdaLN-Single beside both. Each model is timed in its own process, so peak memory
(max RSS on CPU, max allocated on GPU) belongs to it alone. The printout gives ratios
against diffusers measured in the same run.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {"cpu": [("DiT-S/2", 32, 3, 32)], "gpu": [("DiT-B/2", 32, 4, 256), ("DiT-XL/2", 32, 4, 64)]}


def build(kind, name, size, channels):
    from model import DiT, model_args_for
    args = model_args_for(name, input_size=size, in_channels=channels, num_classes=1000, learn_sigma=False)
    if kind == "diffusers":
        from diffusers import DiTTransformer2DModel
        return DiTTransformer2DModel(num_attention_heads=args["num_heads"], attention_head_dim=args["hidden_size"] // args["num_heads"],
                                     in_channels=channels, out_channels=channels, num_layers=args["depth"], sample_size=size,
                                     patch_size=args["patch_size"], num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
    return DiT(**args, modulation="adaln-zero" if kind == "ours-adaln-zero" else "adaln-single")


def measure(kind, name, size, channels, batch, steps, precision, compile_):
    """Run in a child process: time `steps` training steps after warm-up; print one JSON line."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build(kind, name, size, channels).to(device).train()
    forward = (lambda x, t, y: model(x, timestep=t, class_labels=y).sample) if kind == "diffusers" else model
    if compile_:
        forward = torch.compile(forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, channels, size, size, device=device)
    t = torch.randint(0, 1000, (batch,), device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    target = torch.randn_like(x)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        with autocast:
            loss = ((forward(x, t.float() if kind != "diffusers" else t, y) - target) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"kind": kind, "images_per_s": batch / seconds, "seconds_per_step": seconds, "peak_bytes": peak,
                      "parameters": sum(p.numel() for p in model.parameters())}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="cpu", choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    if args.child:
        kind, name, size, channels, batch = args.child
        return measure(kind, name, int(size), int(channels), int(batch), args.steps, precision, args.compile)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {device}; precision {precision}; compile {args.compile}; torch {torch.__version__}")
    for name, size, channels, batch in CONFIGS[args.config]:
        rows = {}
        for kind in ("diffusers", "ours-adaln-zero", "ours-adaln-single"):
            cmd = [sys.executable, __file__, "--child", kind, name, str(size), str(channels), str(batch), "--steps", str(args.steps),
                   "--precision", precision] + (["--compile"] if args.compile else [])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{kind}: failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
                continue
            rows[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"\n{name}, {size}x{size}x{channels}, batch {batch}")
        print(f"{'model':<20}{'params':>12}{'images/s':>12}{'vs diffusers':>14}{'peak MiB':>11}")
        base = rows.get("diffusers", {}).get("images_per_s")
        for kind, r in rows.items():
            ratio = f"{r['images_per_s'] / base:.2f}x" if base else "-"
            print(f"{kind:<20}{r['parameters']:>12,}{r['images_per_s']:>12.1f}{ratio:>14}{r['peak_bytes'] / 2**20:>11.0f}")
        if base and "ours-adaln-zero" in rows:
            ratio = rows["ours-adaln-zero"]["images_per_s"] / base
            print(f"target: ours (adaLN-Zero) >= 1.3x diffusers at the same config: {'met' if ratio >= 1.3 else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
