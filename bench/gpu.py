"""One prepared check of everything only a GPU can show, in a few minutes: run it first on a
lent GPU machine.

    python bench/gpu.py --out gpu-check          # a CUDA machine: at most --budget s (480)
    python bench/gpu.py --dry-run --out /tmp/x   # tiny sizes on the CPU, compilation off
                                                 # (the tests run it)

It needs only this repository and its requirements (bench/requirements.txt adds diffusers, the
peer of the throughput rows). Each check is one of the project's own commands, run in a child
process with its own time limit, in the order of what matters most; a check that no longer fits
the budget is reported as skipped. It prints one table and writes it, with every check's
result, to OUT/gpu.json.

  pipeline     cluster -> 2 experts -> router -> sample -> eval on digits; --precision auto
               must pick bf16 on a GPU and say so; the experts read batches through the
               DataLoader with workers and pinned memory
  ddp          train_expert.py under torchrun --nproc_per_node=<GPUs> (NCCL on CUDA, gloo on a CPU)
  compile      train_expert.py --compile
  resume       a run killed (SIGKILL) after its first checkpoint, resumed to the end: the same
               weights as a straight run
  quality      reproduce.py --part precision: fp32 (two seeds, the spread) vs bf16 training,
               FD of each
  throughput   bench/train_step.py: DiT-S/2 and DiT-B/2, 32x32x4 latents, batch 256, ours vs
               diffusers, fp32 and bf16
  loader       bench/data.py: the synthetic ImageNet-64 loader's images/s against DiT-B/2's
               step at 64 px
  sampling     bench/sample.py: routed sampling (top-1, full) against one expert
  compiled     bench/train_step.py --compile for DiT-B/2 in bf16, ours vs diffusers
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def checks(work, dry):
    """(name, seconds allowed, function(work) -> (ok, result line)), most important first."""
    gpus = max(1, torch.cuda.device_count()) if not dry else 2
    if dry:
        tiny = ["--model", "DiT-M/2", "--batch-size", "8"]
    else:
        tiny = ["--model", "DiT-S/2", "--batch-size", "256"]
    steps = ["--steps", "4"] if dry else ["--steps", "200"]
    run = os.path.join(work, "run")

    def pipeline(_):
        out = [command("cluster.py", "--k", 2, "--run-dir", run)]
        for k in (0, 1):
            out.append(command("train_expert.py", "--cluster", k, *tiny, *steps, "--workers", 2,
                               "--run-dir", run))
        out.append(command("train_router.py", "--steps", 4 if dry else 100, "--run-dir", run))
        out.append(command("sample.py", "--routing", "top1", "--n", 16 if dry else 256, "--steps",
                           2 if dry else 25, "--run-dir", run))
        out.append(command("eval.py", os.path.join(run, "samples", "top1.npz"), "--run-dir", run,
                           "--classifier-steps", 20 if dry else 1500))
        expert = os.path.join(run, "experts", "0", "ckpt.pt")
        config = torch.load(expert, weights_only=True)["config"]
        with open(os.path.join(run, "samples", "top1.eval.json")) as f:
            fd = json.load(f)["fd_classifier"]
        ok = all(code == 0 for code, _ in out) and (dry or config["precision"] == "bf16")
        reason = config["precision_evidence"]["reason"]
        return ok, f"auto -> {config['precision']} ({reason}); top-1 FD {fd:.2f}"

    def ddp(_):
        code, tail = command("-m", "torch.distributed.run", "--nproc_per_node", gpus,
                             os.path.join(ROOT, "train_expert.py"), "--cluster", 1,
                             *tiny, "--steps", 4 if dry else 50, "--run-dir", run, "--out-dir",
                             os.path.join(work, "ddp"))
        backend = "gloo" if dry or not torch.cuda.is_available() else "nccl"
        return code == 0, f"{gpus} processes, {backend}: {last_line(tail)}"

    def compiled_training(_):
        code, tail = command("train_expert.py", "--cluster", 0, *tiny, "--steps", 3 if dry else 50,
                             "--compile", "--run-dir", run,
                             "--out-dir", os.path.join(work, "compile"))
        return code == 0, last_line(tail)

    def resume(_):
        total = 40 if dry else 400
        flags = ["--cluster", 0, *tiny, "--steps", total, "--ckpt-every", 2 if dry else 100,
                 "--run-dir", run]
        straight = os.path.join(work, "straight")
        command("train_expert.py", *flags, "--out-dir", straight)
        killed = os.path.join(work, "killed")
        killed_at = kill_at_first_checkpoint([PY, os.path.join(ROOT, "train_expert.py"),
                                              *map(str, flags), "--out-dir", killed])
        # a run that ended before it was killed resumes nothing: its weights would match
        # whether resuming works or not
        if killed_at is None or killed_at >= total:
            return False, (f"the run was not killed mid-way (its checkpoint: step {killed_at} "
                           f"of {total}); nothing was resumed")
        code, tail = command("train_expert.py", *flags, "--out-dir", killed)
        a, b = (torch.load(os.path.join(f, "ckpt.pt"), weights_only=True)["model"]
                for f in (straight, killed))
        gap = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        return (code == 0 and gap < 1e-3,
                f"killed (SIGKILL) at step {killed_at} of {total}, resumed: max weight "
                f"difference vs straight {gap:.2e}")

    def quality(_):
        code, tail = command("reproduce.py", "--part", "precision", "--out",
                             os.path.join(work, "repro"),
                             *(["--precision-steps", 2, "--precision-model", "DiT-M/2", "--n", 16,
                                "--classifier-steps", 20]
                               if dry else ["--precision-steps", 300, "--n", 1000]))
        return code == 0, " / ".join(line.strip() for line in tail.splitlines()
                                     if line.startswith("| fp32") or line.startswith("| bf16"))

    def bench(script, *flags):
        def run_bench(_):
            code, tail = command(os.path.join("bench", script), *flags)
            return code == 0, " | ".join(tail.strip().splitlines()[-4:])
        return run_bench

    if dry:
        throughput = ["--config", "dry", "--steps", 1, "--kinds", "diffusers", "ours-adaln-single"]
        loader = ["--n", 200, "--batch", 8, "--steps", 0, "--batches", 2, "--workers", 0, 2]
        sampling = ["--model", "DiT-M/2", "--size", 8, "--channels", 4, "--steps", 1]
    else:
        throughput = ["--config", "gpu-check", "--steps", 10]
        loader = ["--n", 20000, "--batch", 256, "--steps", 20]
        sampling = ["--model", "DiT-S/2", "--size", 32, "--channels", 4]
    return [("pipeline", 240 if dry else 120, pipeline), ("ddp", 120 if dry else 60, ddp),
            ("compile", 240 if dry else 90, compiled_training),
            ("resume", 120 if dry else 60, resume),
            ("quality", 240 if dry else 90, quality),
            ("throughput", 300 if dry else 120, bench("train_step.py", *throughput)),
            ("loader", 120 if dry else 45, bench("data.py", *loader)),
            ("sampling", 300 if dry else 45, bench("sample.py", *sampling)),
            ("compiled", 300 if dry else 120, bench("train_step.py", *throughput, "--compile",
                                                    "--precisions", "bf16",
                                                    "--kinds", "diffusers", "ours-adaln-single",
                                                    "--models", "DiT-M/2" if dry else "DiT-B/2"))]


TIMEOUT = {}   # the running check's limit, read by command()
ENV = {**os.environ, "TQDM_DISABLE": "1"}   # main() adds TORCHDYNAMO_DISABLE for a dry run


def command(script, *argv):
    """Run `python SCRIPT ARGV` from the repository root within the running check's limit: (exit
    code, the tail of its standard output)."""
    cmd = [PY, *([os.path.join(ROOT, script)] if script.endswith(".py") else [script]),
           *map(str, argv)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT["seconds"], env=ENV)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{' '.join(cmd[1:3])}... ran past the check's {TIMEOUT['seconds']:.0f} "
                           "s")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{os.path.basename(cmd[1])} exited {proc.returncode}: "
                           f"{last_line(tail)}")
    # a result is what the script printed; its stderr holds progress bars and library warnings
    return proc.returncode, proc.stdout[-4000:]


def last_line(text):
    """The last 'wrote ...' line of a command's output, else its last line (warnings are not
    results)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    wrote = [line for line in lines if line.startswith("wrote ")]
    return (wrote or lines or [""])[-1][:300]


def kill_at_first_checkpoint(cmd):
    """Start a training run and SIGKILL it where its first checkpoint appears, as a preempted
    job dies: the checkpoint's step, or None if the run ended (or the limit came) first.

    It is stopped (SIGSTOP) the moment the file exists, so the step read is the step killed
    at, even where the run would have finished between two polls."""
    checkpoint = os.path.join(cmd[cmd.index("--out-dir") + 1], "ckpt.pt")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + TIMEOUT["seconds"]
    while proc.poll() is None and not os.path.isfile(checkpoint) and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        return None
    os.killpg(proc.pid, signal.SIGSTOP)
    # checkpoints are renamed into place whole: a file that exists can be read
    step = (torch.load(checkpoint, weights_only=True)["step"] if os.path.isfile(checkpoint)
            else None)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu.json and every check's files")
    p.add_argument("--budget", type=float, default=480,
                   help="seconds for all checks together; what no longer fits is skipped")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on the CPU: checks the script itself, measures nothing")
    p.add_argument("--only", nargs="+", default=None, help="run only these checks (by name)")
    args = p.parse_args()
    # compiling on a CPU takes minutes; the dry run checks that --compile's path runs, not the
    # compiler
    if args.dry_run:
        ENV["TORCHDYNAMO_DISABLE"] = "1"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device here; run it on the GPU machine, or pass --dry-run "
                 "to check the script on this CPU")
    os.makedirs(args.out, exist_ok=True)
    device = ("CPU (dry run: nothing measured)" if args.dry_run
              else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    report = {"device": device, "torch": torch.__version__, "budget_s": args.budget, "checks": []}
    start = time.time()
    for name, seconds, check in checks(args.out, args.dry_run):
        if args.only and name not in args.only:
            continue
        left = args.budget - (time.time() - start)
        row = {"check": name, "limit_s": seconds}
        if left < seconds:
            row.update(ok=None, seconds=0.0,
                       result=f"skipped: {left:.0f} s of the budget left, the check needs up to "
                              f"{seconds}")
        else:
            TIMEOUT["seconds"] = seconds
            began = time.time()
            try:
                ok, result = check(args.out)
                row.update(ok=bool(ok), result=result)
            # a failed check is a row of the table, not the end of the others
            except Exception as e:
                row.update(ok=False, result=f"{type(e).__name__}: {e}"[:500])
            row["seconds"] = round(time.time() - began, 1)
        report["checks"].append(row)
        status = "skipped" if row["ok"] is None else "ok" if row["ok"] else "FAILED"
        print(f"{name:<11} {status:<8} {row['seconds']:>7.1f} s  {row['result']}", flush=True)
    with open(os.path.join(args.out, "gpu.json.tmp"), "w") as f:
        json.dump(report, f, indent=1)
    os.replace(os.path.join(args.out, "gpu.json.tmp"), os.path.join(args.out, "gpu.json"))
    print(f"device: {device}; {time.time() - start:.0f} s; table in "
          f"{os.path.join(args.out, 'gpu.json')}")
    sys.exit(0 if all(r["ok"] is not False for r in report["checks"]) else 1)


if __name__ == "__main__":
    main()
