"""Run plans: what a training stage will do, resolved once from its command line.

A plan is the parsed command line, frozen, with the few values the stage resolves from it
(an expert's name, its folder). Every cross-flag check happens where it is built
(`from_args`), and nothing below a stage's `main` reads the command line again; a plan
never reads a file. The plan also owns the two things every training stage used to write
for itself: the checkpoint record (`record`) and the check that a checkpoint may be
resumed by this run (`check_resume`)."""
import argparse
import os

from .checkpoint import CHECKPOINT_FORMAT
from .command_line import UsageError
from .latents import same_vae
from .run_dir import expert_dir
from .sources import DataFlags
from .training import decay_start


# what a checkpoint records besides its flags, and a resume must find again
FACTS = {"cluster_fingerprint": "another clustering than the run's clusters.pt",
         "condition": "another condition", "vae": "another latent space (--vae)",
         "teacher_weights": "another teacher (its router or experts retrained since, or not "
                            "recorded by an older version)"}


def flag(name):
    return "--" + name.replace("_", "-")


class Plan(argparse.Namespace):
    """The command line's values as the stage runs them (frozen). DEFINING names those a
    resume must repeat; the others (steps, logging, files) may change between the runs of
    one checkpoint."""
    DEFINING = ()
    STAGE = ""

    def __init__(self, args, **resolved):
        vars(self).update({**vars(args), **resolved})

    def __setattr__(self, name, value):
        raise AttributeError(f"a run plan is frozen: {name} is resolved once, in from_args")

    @property
    def data_flags(self):
        """--data, --image-size, --vae and --download, as the code below a stage takes
        them."""
        return DataFlags(self.data, self.image_size, self.vae, self.download)

    def defining(self, **resolved):
        """The defining flags as recorded, with the values only the run resolves (the
        condition that the data chose, say) given by name."""
        return {name: resolved.get(name, getattr(self, name)) for name in self.DEFINING}

    def record(self, resolved=None, **facts):
        """The checkpoint's `config`: its format, the defining flags and the facts of
        the run."""
        return {"format": CHECKPOINT_FORMAT, "flags": self.defining(**(resolved or {})), **facts}

    def check_resume(self, path, config, resolved=None, **facts):
        """Refuse, in one line, a checkpoint written by other flags or on other facts (the
        clustering, the condition, the latent space) than this run's."""
        if config.get("format") != CHECKPOINT_FORMAT:
            raise UsageError(f"{path} was written by an older version of {self.STAGE} "
                             f"(format {config.get('format', 1)}; this one reads "
                             f"{CHECKPOINT_FORMAT}): retrain it in another --out-dir")
        then, now = config.get("flags") or {}, self.defining(**(resolved or {}))
        missing = [flag(name) for name in now if name not in then]
        if missing:   # no release ever wrote such a checkpoint: no default to assume for it
            raise UsageError(f"{path} was written by an older version of {self.STAGE} "
                             f"(it records no {', '.join(missing)}): retrain it in "
                             "another --out-dir")
        changed = [f"{flag(k)} {then[k]} -> {v}" for k, v in now.items() if then[k] != v]
        same = {"vae": same_vae}
        changed += [FACTS[k] for k, v in facts.items()
                    if not same.get(k, lambda a, b: a == b)(config.get(k), v)]
        if changed:
            raise UsageError(f"{path} was trained with other flags "
                             f"({'; '.join(changed)}); resume with the same flags, or "
                             "use another --out-dir")


class ExpertPlan(Plan):
    """One expert's (or the monolith's, or a contributor's) training run: the flags of
    train_expert.py, and its name (the cluster, 'all' or the partition) and folder."""
    DEFINING = (
        "cluster", "partition", "classes", "objective", "model", "modulation", "condition",
        "init", "time_map", "t_sampling", "beta_schedule", "batch_size", "lr", "lr_schedule",
        "decay_share", "weight_decay", "ema_decay", "grad_clip", "condition_dropout", "hflip",
        "seed")
    STAGE = "train_expert.py"

    @classmethod
    def from_args(cls, args):
        if args.partition and args.cluster is not None:
            raise UsageError("--partition names a contributor's own data; --cluster a "
                             "k-means cluster of the run's: give one")
        if args.classes is not None and not args.partition:
            raise UsageError("--classes selects a contributor's data: use it with "
                             "--partition NAME")
        name = args.partition or args.cluster or "0"
        return cls(args, name=name, cluster=None if args.partition else name,
                   out_dir=args.out_dir or expert_dir(args.run_dir, name))

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, "ckpt.pt")

    def defining(self, **resolved):
        # the checkpoint's "cluster" has always been the expert's name, a contributor's
        # too; --init is recorded by file name, since paths differ between machines
        init = os.path.basename(self.init) if self.init else None
        return super().defining(**{"cluster": self.name, "init": init, **resolved})

    def check_resume(self, path, config, resolved=None, **facts):
        super().check_resume(path, config, resolved, **facts)
        planned = config.get("target_steps", self.steps)
        if self.lr_schedule == "wsd" and planned != self.steps:
            start = decay_start(planned, self.decay_share)
            if config.get("step", 0) > min(start, decay_start(self.steps, self.decay_share)):
                raise UsageError(f"{path} is past the start of its learning-rate decay "
                                 f"(step {config['step']} of {planned}, decay from "
                                 f"{start}); it cannot continue to --steps {self.steps}: "
                                 f"continue from its stable.pt (written at step {start}) "
                                 f"instead, or train to --steps {planned}")


class StudentPlan(Plan):
    """A distillation run: the routed ensemble (the teacher) regressed into one
    network."""
    DEFINING = (
        "experts", "routing", "model", "modulation", "init", "batch_size", "lr", "ema_decay",
        "grad_clip", "condition_dropout", "trajectory_fraction", "trajectory_steps", "seed")
    STAGE = "distill.py"

    @classmethod
    def from_args(cls, args):
        if args.init and args.model:
            raise UsageError("--init fixes the student's architecture; give --init or "
                             "--model, not both")
        return cls(args, out_dir=args.out_dir or expert_dir(args.run_dir, "distilled"))

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, "ckpt.pt")

    @property
    def init_source(self):
        """--init as a path: an expert's name is its folder in this run."""
        return expert_dir(self.run_dir, self.init) if self.init.isdigit() else self.init

    def defining(self, **resolved):
        init = self.init if not self.init or self.init.isdigit() else os.path.basename(self.init)
        return super().defining(**{"init": init, **resolved})


class RouterPlan(Plan):
    """A router's training run (a router is trained afresh each time: nothing to
    resume)."""
    DEFINING = (
        "model", "downsample", "condition", "from_samples", "sample_steps", "steps",
        "batch_size", "lr", "weight_decay", "condition_dropout", "paired_null", "seed")
    STAGE = "train_router.py"

    @classmethod
    def from_args(cls, args):
        if args.experts and not args.from_samples:
            raise UsageError("--experts chooses whose samples train the router "
                             "(--from-samples); from data, the router learns every "
                             "cluster of the cluster file and every contributor whose "
                             "data it can read")
        return cls(args)
