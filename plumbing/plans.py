"""Run plans: what a training stage will do, resolved once from its command line.

A plan is frozen: every cross-flag check happens in its constructor (`from_args`), and
nothing below a stage's `main` reads the command line again. The plan also owns the two
things every training stage used to write for itself: the checkpoint record (`record`)
and the check that a checkpoint may be resumed by this run (`check_resume`)."""
import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from model import registry_name
from .checkpoint import CHECKPOINT_FORMAT, CheckpointError, split_checkpoint
from .command_line import UsageError, first_line
from .latents import same_vae
from .run_dir import expert_dir, load_checkpoint
from .training import decay_start


# what a checkpoint records besides its flags, and a resume must find again
FACTS = {"cluster_fingerprint": "another clustering than the run's clusters.pt",
         "condition": "another condition", "vae": "another latent space (--vae)",
         "teacher_weights": "another teacher (its router or experts retrained since, or not "
                            "recorded by an older version)"}


def flag(name):
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Plan:
    """The fields a resume must repeat are DEFINING; the others (steps, logging, files)
    may change between the runs of one checkpoint."""
    DEFINING: ClassVar[tuple] = ()
    STAGE: ClassVar[str] = ""

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


def from_args(cls, args, **resolved):
    """cls built from the command line's fields of the same names, `resolved`
    overriding some."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in vars(args).items() if k in names}, **resolved})


@dataclass(frozen=True)
class ExpertPlan(Plan):
    """One expert's (or the monolith's, or a contributor's) training run."""
    DEFINING: ClassVar[tuple] = (
        "cluster", "partition", "classes", "objective", "model", "modulation", "condition",
        "init", "time_map", "t_sampling", "beta_schedule", "batch_size", "lr", "lr_schedule",
        "decay_share", "weight_decay", "ema_decay", "grad_clip", "condition_dropout", "hflip",
        "seed")
    STAGE: ClassVar[str] = "train_expert.py"

    name: str                   # the expert's folder and its name in the ensemble
    cluster: Optional[str]      # the k-means cluster it learns ('all': the monolith), or None
    partition: Optional[str]    # a contributor's name for their own data, or None
    classes: Optional[list]
    objective: str
    model: str
    modulation: str
    condition: Optional[str]    # None: class for labelled data, else none
    init: Optional[str]
    time_map: str
    t_sampling: str
    beta_schedule: str
    batch_size: int
    lr: float
    lr_schedule: str
    decay_share: float
    weight_decay: float
    ema_decay: float
    grad_clip: float
    condition_dropout: float
    hflip: bool
    seed: int
    steps: int
    precision: str
    compile: bool
    data: Optional[str]
    vae: Optional[str]
    image_size: Optional[int]
    download: bool
    workers: Optional[int]
    run_dir: str
    out_dir: str
    resume: bool
    clip_model: str
    clip_pretrained: Optional[str]
    log_every: int
    ckpt_every: int
    sample_every: int

    @classmethod
    def from_args(cls, args):
        if args.partition and args.cluster is not None:
            raise UsageError("--partition names a contributor's own data; --cluster a "
                             "k-means cluster of the run's: give one")
        if args.classes is not None and not args.partition:
            raise UsageError("--classes selects a contributor's data: use it with "
                             "--partition NAME")
        name = args.partition or args.cluster or "0"
        cluster = None if args.partition else name
        model = expert_model(args.init, args.model)
        return from_args(cls, args, name=name, cluster=cluster, model=model,
                         out_dir=args.out_dir or expert_dir(args.run_dir, name))

    @property
    def ckpt_path(self):
        return os.path.join(self.out_dir, "ckpt.pt")

    def defining(self, **resolved):
        # the checkpoint's "cluster" has always been the expert's name, a contributor's
        # too;
        # --init is recorded by file name, since paths differ between machines
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


DEFAULT_EXPERT_MODEL = "DiT-T/2"


def expert_model(init, model):
    """--model as it will run: with --init, the starting checkpoint's size (a different
    --model is refused, so the recorded flags always name the network that trained);
    else the flag, DiT-T/2 by default."""
    if not init:
        return model or DEFAULT_EXPERT_MODEL
    try:
        _, model_args, config = split_checkpoint(load_checkpoint(init, "--init checkpoint"))
        size = registry_name(model_args)
    except (CheckpointError, KeyError, ValueError, TypeError) as e:
        raise UsageError(f"cannot start from --init {init}: {first_line(e)}")
    if config.get("network") == "router":   # refused by what it is before by its size
        raise UsageError(f"cannot start from --init {init}: this is a router checkpoint, not "
                         "an expert")
    if model and model != size:
        raise UsageError(f"--init {init} is a {size}; --model {model} would not be what "
                         "trains: drop --model, or start from a checkpoint of that size")
    return size


@dataclass(frozen=True)
class StudentPlan(Plan):
    """A distillation run: the routed ensemble (the teacher) regressed into one
    network."""
    DEFINING: ClassVar[tuple] = (
        "experts", "routing", "model", "modulation", "init", "batch_size", "lr", "ema_decay",
        "grad_clip", "condition_dropout", "trajectory_fraction", "trajectory_steps", "seed")
    STAGE: ClassVar[str] = "distill.py"

    experts: str
    router: Optional[str]
    routing: str
    model: Optional[str]
    modulation: str
    init: Optional[str]         # an expert's name in this run, or a checkpoint path
    trajectory_fraction: float
    trajectory_steps: int
    steps: int
    batch_size: int
    lr: float
    ema_decay: float
    grad_clip: float
    condition_dropout: float
    precision: str
    seed: int
    clip_model: str
    clip_pretrained: Optional[str]
    vae: Optional[str]
    download: bool
    run_dir: str
    out_dir: str
    log_every: int
    ckpt_every: int
    device: str

    @classmethod
    def from_args(cls, args):
        if args.init and args.model:
            raise UsageError("--init fixes the student's architecture; give --init or "
                             "--model, not both")
        return from_args(cls, args, out_dir=args.out_dir or expert_dir(args.run_dir, "distilled"))

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


@dataclass(frozen=True)
class RouterPlan(Plan):
    """A router's training run (a router is trained afresh each time: nothing to
    resume)."""
    DEFINING: ClassVar[tuple] = (
        "model", "downsample", "condition", "from_samples", "sample_steps", "steps",
        "batch_size", "lr", "weight_decay", "condition_dropout", "paired_null", "seed")
    STAGE: ClassVar[str] = "train_router.py"

    model: Optional[str]        # None: sized by the rule (train_router.router_size)
    expert_model: Optional[str]
    downsample: int
    condition: Optional[str]
    from_samples: int
    experts: Optional[str]
    sample_steps: int
    sample_batch_size: int
    init: Optional[str]
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    condition_dropout: float
    paired_null: bool
    val_fraction: float
    seed: int
    data: Optional[str]
    vae: Optional[str]
    image_size: Optional[int]
    clip_model: str
    clip_pretrained: Optional[str]
    download: bool
    run_dir: str
    log_every: int
    device: str

    @classmethod
    def from_args(cls, args):
        if args.experts and not args.from_samples:
            raise UsageError("--experts chooses whose samples train the router "
                             "(--from-samples); from data, the router learns every "
                             "cluster of the cluster file and every contributor whose "
                             "data it can read")
        return from_args(cls, args)


@dataclass(frozen=True)
class ClusterPlan(Plan):
    """A clustering of the data set: its features, the k-means (or random) split, and
    where the islands' shards go."""
    STAGE: ClassVar[str] = "cluster.py"

    data: str
    image_size: Optional[int]
    download: bool
    k: int
    features: str
    pca_dim: int
    clustering: str
    clip_model: str
    clip_pretrained: Optional[str]
    dinov2_weights: Optional[str]
    dinov2_size: str
    vae: Optional[str]
    fine_k: Optional[int]
    fit_sample: int
    export_shards: Optional[str]
    to_shards: Optional[str]
    shard_size: int
    min_size: int
    seed: int
    batch_size: int
    device: str
    run_dir: str
    recluster: bool

    @classmethod
    def from_args(cls, args):
        return from_args(cls, args)


@dataclass(frozen=True)
class EvalPlan(Plan):
    """What eval.py measures, against which real images, in which feature spaces."""
    STAGE: ClassVar[str] = "eval.py"

    files: list
    prepare: bool
    data: Optional[str]
    image_size: Optional[int]
    download: bool
    inception_weights: Optional[str]
    convert_inception: Optional[list]
    clip_model: Optional[str]
    clip_pretrained: Optional[str]
    classifier_steps: int
    max_real: Optional[int]
    cluster: Optional[str]
    memorisation: bool
    seed: int
    run_dir: str

    @classmethod
    def from_args(cls, args):
        return from_args(cls, args)
