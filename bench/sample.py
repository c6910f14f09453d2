"""Seconds per sampling step: one expert, top-1 and top-2 over K experts, the full mixture; the
router's share.

    python bench/sample.py                  # DiT-T/2 experts on 32x32x3 with a DiT-M/2 router,
                                            # and the Fashion study's DiT-M/4 experts on 28x28x1
                                            # with a DiT-M/4 router, then with train_router.py's
                                            # default for them
    python bench/sample.py --model DiT-S/2  # bigger experts in the first configuration

Experts and router are randomly initialised (timing does not depend on training), with the
router's head randomised so that routes spread over the experts as a trained one's would. Each
row also gives the matrix FLOPs per image against one expert's (model.count_flops), the target
that binds: top-1 over K experts costs at most 1.1x one expert, router included, because each
expert runs once on the sub-batch routed to it. Wall time is reported beside it, with what K
calls on sub-batches cost against one call on all the rows (the per-call overhead a CPU pays).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from diffusion import RectifiedFlow   # noqa: E402
from model import DiT, Router, count_flops, forward_flops, model_args_for, router_for   # noqa: E402
from routing import Ensemble, parse_routing, sample   # noqa: E402
from plumbing.checkpoint import Network  # noqa: E402
from plumbing.condition import ClassCondition  # noqa: E402

CONDITION = ClassCondition(10)


def experts_and_router(model, k, size, channels, device, router_model="DiT-M/2"):
    torch.manual_seed(0)
    experts = {}
    for j in range(k):
        e = DiT(**model_args_for(model, input_size=size, in_channels=channels, num_classes=10,
                                 learn_sigma=False, t_scale=1000.0))
        experts[j] = Network(e.to(device).eval(), CONDITION, {}, RectifiedFlow())
    router = Router(**model_args_for(router_model, input_size=size, in_channels=channels,
                                     num_experts=k, num_classes=10))
    torch.nn.init.normal_(router.head.weight, std=1.0)
    router = router.to(device).eval()
    return experts, router


def seconds_per_step(experts, router, routing, batch, k, size, channels, steps, device):
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(batch, channels, size, size, generator=g).to(device)
    y = torch.randint(10, (batch,), generator=g).to(device)
    ensemble = Ensemble(experts, router, routing, CONDITION, k)
    sample(ensemble, noise, y, 1)                      # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    sample(ensemble, noise, y, steps)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def router_seconds(router, batch, size, channels, steps, device):
    x = torch.randn(batch, channels, size, size, device=device)
    t = torch.rand(batch, device=device)
    y = torch.zeros(batch, dtype=torch.long, device=device)
    router(x, t, y)
    start = time.perf_counter()
    for _ in range(steps):
        router(x, t, y).softmax(1).cpu()
    return (time.perf_counter() - start) / steps


def flops_per_image(experts, router, routing, k, size, channels):
    """Matrix FLOPs of one image's sampling step, router included."""
    x, y = torch.randn(1, channels, size, size), torch.zeros(1, dtype=torch.long)
    ensemble = Ensemble({j: e.to("cpu") for j, e in experts.items()},
                        None if router is None else router.to("cpu"), routing, CONDITION, k)
    return count_flops(lambda: sample(ensemble, x, y, 1))


@torch.no_grad()
def call_overhead(expert, batch, k, size, channels, steps, device):
    """Seconds of K calls on batch/K rows each over one call on all `batch` rows."""
    x = torch.randn(batch, channels, size, size, device=device)
    t = torch.full((batch,), 0.5, device=device)
    y = torch.zeros(batch, dtype=torch.long, device=device)
    whole = lambda: expert.velocity(x, t, y)   # noqa: E731
    parts = lambda: [expert.velocity(x[i::k], t[i::k], y[i::k]) for i in range(k)]   # noqa: E731
    times = []
    for fn in (whole, parts):
        fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps)
    return times[1] / times[0]


def bench(model, router_model, size, channels, steps, device, shapes):
    print(f"experts {model} on {size}x{size}x{channels}; router {router_model}")
    print(f"{'K':>3}{'batch':>7}{'routing':>10}{'s/step':>10}{'images/s':>10}{'vs one expert':>15}"
          f"{'router share':>14}{'FLOPs vs one':>14}")
    for k, batch in shapes:
        experts, router = experts_and_router(model, k, size, channels, device, router_model)
        one = seconds_per_step({0: experts[0]}, None, ("oracle", 0), batch, 1, size, channels,
                               steps, device)
        one_flops = flops_per_image({0: experts[0]}, None, ("oracle", 0), 1, size, channels)
        experts, router = experts_and_router(model, k, size, channels, device, router_model)
        r = router_seconds(router, batch, size, channels, steps, device)
        print(f"{k:>3}{batch:>7}{'one':>10}{one:>10.4f}{batch / one / 50:>10.1f}{'1.00x':>15}"
              f"{'-':>14}{'1.00x':>14}")
        for spec in ["top1", "top2", "full"]:
            s = seconds_per_step(experts, router, parse_routing(spec), batch, k, size, channels,
                                 steps, device)
            flops = flops_per_image(experts, router, parse_routing(spec), k, size, channels)
            experts, router = experts_and_router(model, k, size, channels, device, router_model)
            print(f"{k:>3}{batch:>7}{spec:>10}{s:>10.4f}{batch / s / 50:>10.1f}{s / one:>14.2f}x"
                  f"{r / s:>13.0%}{flops / one_flops:>13.2f}x")
            if spec == "top1" and k == 4 and batch == shapes[0][1]:
                print(f"    target: top-1 over {k} experts <= 1.1x one expert's FLOPs: "
                      f"{'met' if flops / one_flops <= 1.1 else 'NOT met'} "
                      f"({flops / one_flops:.2f}x; wall time {s / one:.2f}x)")
        overhead = call_overhead(experts[0], batch, k, size, channels, steps, device)
        print(f"    {k} calls on {batch // k} rows each take {overhead:.2f}x one call on {batch}: "
              "what batching the experts' rows into one call would recover")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-T/2")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = (torch.cuda.get_device_name() if device == "cuda"
            else f"CPU, {torch.get_num_threads()} threads")
    print(f"device: {name}")
    bench(args.model, "DiT-M/2", args.size, args.channels, args.steps, device,
          [(4, 256), (4, 64), (2, 256), (8, 256)])
    # the configuration every Fashion finding uses (docs/results.md), with its DiT-M/4 router
    # and with the router train_router.py now picks for those experts (its size rule)
    bench("DiT-M/4", "DiT-M/4", 28, 1, args.steps, device, [(4, 250)])
    expert_flops = forward_flops(DiT, model_args_for("DiT-M/4", input_size=28, in_channels=1,
                                                     **CONDITION.expert_args()))
    default_router = router_for(expert_flops, 28, 1, num_experts=4, **CONDITION.router_args())[0]
    bench("DiT-M/4", default_router, 28, 1, args.steps, device, [(4, 250)])
    print("images/s assume 50 sampling steps per image")


if __name__ == "__main__":
    main()
