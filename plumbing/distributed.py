"""The process layout: one process, or torchrun's (RANK, WORLD_SIZE, LOCAL_RANK set), for
the stages that split their work over processes (training an expert, sampling a batch);
the scheduler job a stage runs in, which its record names; and a scheduler's request to
stop, which a training loop answers by saving its checkpoint."""
import os
import signal
import socket

import torch
import torch.distributed as dist

from plumbing.command_line import UsageError

# what torchrun sets for every process it starts
TORCHRUN = ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# the exit status of a run that stopped on request with its checkpoint saved, to be
# resumed (sysexits' EX_TEMPFAIL); `./ddm slurm`'s expert jobs requeue themselves on it
STOPPED_TO_RESUME = 75


def setup_distributed():
    """(rank, world size, device): torchrun sets RANK/WORLD_SIZE; a plain run is rank 0
    of 1. TF32 matmuls on a GPU that has them, as DiT trains."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    missing = [name for name in TORCHRUN if not os.environ.get(name)]
    if missing:   # a RANK left in the environment, not a launcher's process group
        raise UsageError(f"RANK is set but not {', '.join(missing)}: run it under torchrun, "
                         "or unset RANK for one process")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return rank, world, torch.device("cuda")
    return rank, world, torch.device("cpu")


def scheduler_job():
    """The SLURM job this process runs in (its id, the array job and task, the node, how
    often it was requeued), or None outside a scheduler: every stage records it, so a run
    folder says which job made what."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return None
    return {"scheduler": "slurm", "job_id": env["SLURM_JOB_ID"],
            "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
            "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
            "restarts": int(env.get("SLURM_RESTART_COUNT", 0))}


class StopRequest:
    """SIGUSR1 (a scheduler's warning before the time limit: sbatch --signal) and SIGTERM
    (a requeue, a preemption, `kill`) ask a training loop to stop at its next step, after
    saving its checkpoint; the loop asks `requested()` once a step, and every torchrun
    rank gets the same answer, so all of them save and stop at the same step."""

    def __init__(self):
        self.signal = None
        for number in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(number, self.receive)

    def receive(self, number, frame):
        self.signal = signal.Signals(number).name

    def requested(self, device):
        if not dist.is_initialized():
            return self.signal is not None
        flag = torch.tensor(float(self.signal is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
