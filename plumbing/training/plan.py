"""A training stage's plan: its command line frozen with the few values it resolves, the
record its checkpoint carries, and the checks that a run may resume a checkpoint."""
import argparse
import os
import shlex

from plumbing.checkpoint import CHECKPOINT_FORMAT
from plumbing.command_line import UsageError
from plumbing.data.datasets import DataFlags, same_vae
from plumbing.run_dir import check_not_released, load_checkpoint


def written_by(config):
    """The stage that trained a checkpoint, from its config: recorded as `stage`; in older
    checkpoints, told by what only that stage records (None: not one of ours)."""
    if config.get("stage"):
        return config["stage"]
    if config.get("network") == "router":
        return "train_router.py"
    flags = config.get("flags") or {}
    return "train_expert.py" if "cluster" in flags else "distill.py" if "experts" in flags else None


def resume_point(ckpt_path, steps, check, stage, required=False):
    """The checkpoint a training run of `steps` by `stage` continues (None: it starts
    afresh; with `required`, --resume, that is refused), refused in one line where another
    stage trained it, it is a released network or an imported one, is past `steps`, or
    `check(path, config)` refuses it (the plan's check_resume: other flags, other facts)."""
    check_not_released(os.path.dirname(ckpt_path))
    if not os.path.isfile(ckpt_path):
        if required:
            raise UsageError(f"--resume: no checkpoint at {ckpt_path}")
        return None
    ckpt = load_checkpoint(ckpt_path, "checkpoint")
    start_from_it = f"--init {shlex.quote(str(ckpt_path))} --out-dir NEW_FOLDER"
    writer = written_by(ckpt.get("config") or {})
    if writer not in (None, stage):   # an --out-dir that names another network's folder
        raise UsageError(f"{ckpt_path} holds a network that {writer} trained, not a run of "
                         f"{stage} to resume: give another --out-dir")
    if (ckpt.get("config") or {}).get("imported"):
        raise UsageError(f"{ckpt_path} holds an imported checkpoint; to fine-tune "
                         f"it, start a new network from it: {start_from_it}")
    missing = [k for k, kind in (("model", dict), ("ema", dict), ("opt", dict), ("step", int))
               if not isinstance(ckpt.get(k), kind)]
    if missing:   # e.g. a fixture or a copy kept small by dropping the optimizer
        raise UsageError(f"{ckpt_path} holds no {missing[0]} state to resume from; start a "
                         f"new network from it instead: {start_from_it}")
    check(ckpt_path, {**ckpt["config"], "step": ckpt["step"]})
    if ckpt["step"] > steps:
        raise UsageError(f"{ckpt_path} is at step {ckpt['step']}, past --steps "
                         f"{steps}: nothing to train; give --steps {ckpt['step']} or more, "
                         "or another --out-dir")
    return ckpt


def flag(name):
    return "--" + name.replace("_", "-")


class Plan(argparse.Namespace):
    """A training stage's command line, frozen, with the few values it resolves (an
    expert's name, its folder): cross-flag checks happen where it is built (the stage's
    `from_args`), and it never reads a file. It writes the checkpoint's `config` and
    checks that this run may resume a checkpoint.

    A checkpoint's config holds two kinds of thing a resume must find again: `flags`,
    the DEFINING flags as the run resolved them (resolved_flags: the values only the run
    knows, the condition the data chose, say), and facts, what the run found (FACTS:
    the clustering, the condition, the latent space, with what a change means). SAME:
    how a fact compares where equality is too strict (a VAE's path differs between
    machines). Steps, logging and file flags may change between runs."""
    DEFINING, STAGE = (), ""
    FACTS = {"cluster_fingerprint": "another clustering than the run's clusters.pt",
             "condition": "another condition", "vae": "another latent space (--vae)",
             "teacher_weights": "another teacher (its router or experts retrained since, "
                                "or not recorded by an older version)"}
    SAME = {"vae": same_vae}
    # a defining flag renamed since: {today's name: the name older checkpoints record}
    RENAMED = {}

    def __init__(self, args, **resolved):
        vars(self).update({**vars(args), **resolved})

    def __setattr__(self, name, value):
        raise AttributeError(f"a run plan is frozen: {name} is resolved once, in from_args")

    @property
    def data_flags(self):
        return DataFlags(self.data, self.image_size, self.vae, self.download)

    def defining(self, **resolved_flags):
        """The defining flags as recorded, with the values only the run resolves (the
        condition that the data chose, say) given by name."""
        return {name: resolved_flags.get(name, getattr(self, name)) for name in self.DEFINING}

    def comparable(self, flags):
        """The defining flags as a resume compares them: a flag that means nothing under
        the others (a decay's share with no decay) is left out."""
        return flags

    def checkpoint_config(self, resolved_flags=None, **facts):
        """The checkpoint's `config`: its format, the stage that wrote it, the defining flags
        and the run's facts."""
        return {"format": CHECKPOINT_FORMAT, "stage": self.STAGE,
                "flags": self.defining(**(resolved_flags or {})), **facts}

    def check_resume(self, path, config, resolved_flags=None, **facts):
        """Refuse, in one line, a checkpoint written by other flags or on other facts (the
        clustering, the condition, the latent space) than this run's."""
        if config.get("format") != CHECKPOINT_FORMAT:
            raise UsageError(f"{path} was written by an older version of {self.STAGE} "
                             f"(format {config.get('format', 1)}; this one reads "
                             f"{CHECKPOINT_FORMAT}): retrain it in another --out-dir")
        then, now = dict(config.get("flags") or {}), self.defining(**(resolved_flags or {}))
        for name, old in self.RENAMED.items():
            if name not in then and old in then:
                then[name] = then.pop(old)
        then, now = self.comparable(then), self.comparable(now)
        missing = [flag(name) for name in now if name not in then]
        if missing:   # no release ever wrote such a checkpoint: no default to assume for it
            raise UsageError(f"{path} was written by an older version of {self.STAGE} "
                             f"(it records no {', '.join(missing)}): retrain it in "
                             "another --out-dir")
        changed = [f"{flag(k)} {then[k]} -> {v}" for k, v in now.items() if then[k] != v]
        changed += [self.FACTS[k] for k, v in facts.items()
                    if not self.SAME.get(k, lambda a, b: a == b)(config.get(k), v)]
        if changed:
            raise UsageError(f"{path} was trained with other flags "
                             f"({'; '.join(changed)}); resume with the same flags, or "
                             "use another --out-dir")
