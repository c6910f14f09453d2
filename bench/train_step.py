"""Images/s and peak memory of one training step: our DiT vs diffusers' DiTTransformer2DModel.

    pip install -r bench/requirements.txt
    python bench/train_step.py                # the CPU config: DiT-S/2, 32x32x3, batch 32;
                                              # fp32 and bf16
    python bench/train_step.py --config gpu   # DiT-B/2 and DiT-XL/2 on 32x32x4 latents
    # ./ddm pipeline's expert, as it runs there:
    OMP_NUM_THREADS=1 python bench/train_step.py --config tiny --compile

One step = forward + MSE loss + backward + AdamW. Same width, depth, heads, patch, image size,
batch and classes for every model: ours with adaLN-Zero (vs diffusers' ada_norm_zero) and
ours with AdaLN-Single beside both. Each model and precision is timed in its own process, so
peak memory (max RSS on CPU, max allocated on GPU) belongs to it alone. The printout gives
ratios against diffusers at the same precision, measured in the same run, and then each side
at its default: diffusers' fp32, and ours under --precision auto.
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

# tiny: the default expert of ./ddm pipeline (digits), whose step is small enough for framework
# overhead to show gpu-check: bench/gpu.py's rows (SD-VAE latents of 256 px images, DiT's batch);
# dry: its CPU dry run
CONFIGS = {"cpu": [("DiT-S/2", 32, 3, 32)], "gpu": [("DiT-B/2", 32, 4, 256),
                                                    ("DiT-XL/2", 32, 4, 64)],
           "gpu-check": [("DiT-S/2", 32, 4, 256), ("DiT-B/2", 32, 4, 256)],
           "tiny": [("DiT-T/2", 8, 1, 64)],
           "dry": [("DiT-M/2", 8, 4, 4)]}
KINDS = ("diffusers", "ours-adaln-zero", "ours-adaln-single")


def build(kind, name, size, channels):
    from model import DiT, model_args_for
    args = model_args_for(name, input_size=size, in_channels=channels, num_classes=1000,
                          learn_sigma=False)
    if kind == "diffusers":
        from diffusers import DiTTransformer2DModel
        return DiTTransformer2DModel(num_attention_heads=args["num_heads"],
                                     attention_head_dim=args["hidden_size"] // args["num_heads"],
                                     in_channels=channels, out_channels=channels,
                                     num_layers=args["depth"], sample_size=size,
                                     patch_size=args["patch_size"], num_embeds_ada_norm=1000,
                                     norm_type="ada_norm_zero")
    return DiT(**args, modulation="adaln-zero" if kind == "ours-adaln-zero" else "adaln-single")


def measure(kind, name, size, channels, batch, steps, precision, compile_):
    """Run in a child process: time `steps` training steps after warm-up; print one JSON line."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build(kind, name, size, channels).to(device).train()
    forward = (lambda x, t,
               y: model(x, timestep=t, class_labels=y).sample) if kind == "diffusers" else model
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

    start = time.perf_counter()
    for _ in range(3):   # with --compile, the compilation happens here
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
    print(json.dumps({"kind": kind, "images_per_s": batch / seconds, "seconds_per_step": seconds,
                      "warmup_seconds": warmup, "peak_bytes": peak,
                      "parameters": sum(p.numel() for p in model.parameters())}))


def run_child(kind, name, size, channels, batch, steps, precision, compile_):
    cmd = [sys.executable, __file__, "--child", kind, name, str(size), str(channels), str(batch),
           "--steps", str(steps),
           "--precision", precision] + (["--compile"] if compile_ else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{kind} {precision}: failed: "
              f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="cpu", choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="the implementations to time (default: all three)")
    p.add_argument("--models", nargs="+", default=None,
                   help="only these models of the config (e.g. DiT-B/2)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, name, size, channels, batch = args.child
        return measure(kind, name, int(size), int(channels), int(batch), args.steps,
                       args.precision, args.compile)
    from plumbing.training.precision import SPEED_UP_NEEDED
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU, {torch.get_num_threads()} threads")
    print(f"device: {device}; compile {args.compile}; torch {torch.__version__}")
    failed = []
    for name, size, channels, batch in [c for c in CONFIGS[args.config] if not args.models
                                        or c[0] in args.models]:
        rows = {(kind, precision): run_child(kind, name, size, channels, batch, args.steps,
                                             precision, args.compile)
                for precision in args.precisions for kind in args.kinds}
        failed += [f"{name} {kind} {precision}" for (kind, precision), r in rows.items() if not r]
        rows = {key: r for key, r in rows.items() if r}
        print(f"\n{name}, {size}x{size}x{channels}, batch {batch}")
        print(f"{'model':<20}{'precision':>10}{'params':>12}{'images/s':>10}"
              f"{'vs diffusers, same precision':>30}{'peak MiB':>10}{'3 warm-up steps, s':>20}")
        for (kind, precision), r in rows.items():
            base = rows.get(("diffusers", precision), {}).get("images_per_s")
            ratio = f"{r['images_per_s'] / base:.2f}x" if base else "-"
            print(f"{kind:<20}{precision:>10}{r['parameters']:>12,}{r['images_per_s']:>10.2f}"
                  f"{ratio:>30}{r['peak_bytes'] / 2**20:>10.0f}{r['warmup_seconds']:>20.1f}")
        # defaults: diffusers trains in fp32 unless told otherwise; ours runs --precision auto,
        # which picks bf16 when it is SPEED_UP_NEEDED x faster by its own measurement (on CUDA:
        # always bf16), the rule applied here to these timings
        ours = {prec: rows[("ours-adaln-single", prec)]["images_per_s"] for prec in args.precisions
                if ("ours-adaln-single", prec) in rows}
        theirs = rows.get(("diffusers", "fp32"), {}).get("images_per_s")
        if theirs and "fp32" in ours:
            bf16_wins = "bf16" in ours and (torch.cuda.is_available()
                                            or ours["bf16"] >= SPEED_UP_NEEDED * ours["fp32"])
            pick = "bf16" if bf16_wins else "fp32"
            ratio = ours[pick] / theirs
            print(f"defaults: ours (AdaLN-Single, --precision auto -> {pick}) {ours[pick]:.2f} "
                  f"images/s vs diffusers (fp32) {theirs:.2f}: {ratio:.2f}x; target >= 1.3x: "
                  f"{'met' if ratio >= 1.3 else 'NOT met'}")
    # a row that could not be measured is a failed benchmark, not a shorter table
    if failed:
        sys.exit(f"bench/train_step.py: {len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
