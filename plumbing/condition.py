"""What a network is conditioned on: nothing, a class label, or a caption. One class per
kind.

A batch of conditions is always a LongTensor of ids (N,), and each kind has exactly one
meaning of "no condition", its `null_id`:
  none   every id is 0 (= the null); the networks read nothing.
  class  ids are labels 0..C-1; C is the null class (DiT's extra row of `y_embedder`).
  text   ids index a table of captions (the data set's distinct captions when training, the
         prompts when sampling); id = len(table) is the null caption. The expert reads it as
         an all-zero token tensor, which the DiT replaces by PixArt's learned null caption
         (`y_embedder.y_embedding`); the router reads an all-zero pooled embedding.
So guidance dropout, the unconditional branch of classifier-free guidance and a hidden label
for the router are all `null_id`, whatever the kind.

The verbs the stages use: `ids(data_indices)` (bound to a data set), `drop(ids, p,
generator)`, `null(n)`, `expert_input(ids)`, `router_input(ids)`,
`with_prompts(prompts)` and `requests(n, generator, fixed)` (what to sample),
`labels(ids)` (ADM's arr_1), and `spec()` / `condition_from_spec` for checkpoints;
`expert_args()` / `router_args()` give the networks' constructor arguments."""
import numpy as np
import torch

from plumbing.command_line import UsageError
from plumbing.data.datasets import caption_labels
from plumbing.data.encoders import caption_embeddings


class Condition:
    """The shared verbs; a kind sets `kind`, `null_id` and what each network reads."""
    kind = None
    null_id = 0

    def ids(self, data_indices):
        return torch.zeros(len(data_indices), dtype=torch.long)

    def null(self, n, device="cpu"):
        return torch.full((n,), self.null_id, dtype=torch.long, device=device)

    def drop(self, ids, p, generator):
        """Each id replaced by the null with probability p: guidance dropout, label
        hiding for the router."""
        hide = torch.rand(len(ids), generator=generator).to(ids.device) < p
        return torch.where(hide, self.null(len(ids), ids.device), ids)

    def expert_input(self, ids):
        return None

    def router_input(self, ids):
        return None

    def of_labels(self, labels, num_classes=None):
        """The ids of images known only by their class labels (a contributor's data
        set, an expert's samples); the null for a condition that reads no label.
        `num_classes`: how many classes those labels come from."""
        return self.null(len(labels))

    def for_router(self, kind):
        """The condition a router of experts conditioned on this reads: theirs (kind
        None), or none (Paris's blind router)."""
        if kind in (None, self.kind):
            return self
        if kind == NoCondition.kind:
            return NoCondition()
        raise UsageError(f"--condition {kind}: the experts are conditioned on {self.kind}")

    def requests(self, n, generator, fixed=None):
        """The ids to sample n images for."""
        if fixed is not None:
            raise UsageError("--class: these experts are not class-conditional (their "
                             f"condition is {self.kind})")
        return self.null(n)

    def labels(self, ids):
        """Class labels of the requested images, for ADM's arr_1 and conditional
        accuracy; None if unknown."""
        return None

    def with_prompts(self, prompts, negative_prompt=None, **encoder_options):
        """The condition to sample with, given the user's prompts and the negative prompt
        guidance steers away from (only a text condition takes any)."""
        if prompts or negative_prompt is not None:
            raise UsageError("--prompt/--prompts/--negative-prompt need text-conditional "
                             f"experts; these are conditioned on {self.kind}")
        return self

    def spec(self):
        return {"kind": self.kind}

    def expert_args(self):
        return {"num_classes": 0, "text_dim": 0}

    def router_args(self):
        return {"num_classes": 0, "text_dim": 0}


class NoCondition(Condition):
    """An unconditional model: p(x), and the router's p(k | x_t, t)."""
    kind = "none"


class ClassCondition(Condition):
    """A class label, as DiT; `labels` (one per data-set image) binds it to a data set."""
    kind = "class"

    def __init__(self, num_classes, labels=None):
        self.num_classes, self.null_id = num_classes, num_classes
        self.data_labels = labels

    def ids(self, data_indices):
        return torch.from_numpy(np.asarray(self.data_labels[data_indices], dtype=np.int64))

    def expert_input(self, ids):
        return ids

    router_input = expert_input

    def of_labels(self, labels, num_classes=None):
        if num_classes is not None and num_classes != self.num_classes:
            raise UsageError(f"images of {num_classes} classes cannot join experts of "
                             f"{self.num_classes} classes")
        return torch.as_tensor(np.asarray(labels), dtype=torch.long)

    def requests(self, n, generator, fixed=None):
        if fixed is None:
            return torch.randint(self.num_classes, (n,), generator=generator)
        if not 0 <= fixed < self.num_classes:
            raise UsageError(f"--class {fixed} is not a class of these experts "
                             f"(0..{self.num_classes - 1})")
        return torch.full((n,), fixed, dtype=torch.long)

    def labels(self, ids):
        return ids

    def spec(self):
        return {"kind": self.kind, "num_classes": self.num_classes}

    def expert_args(self):
        return {"num_classes": self.num_classes, "text_dim": 0}

    router_args = expert_args


class ClusterCondition(ClassCondition):
    """The information control's condition (docs/x16-protocol.md): a class label and the
    image's k-means cluster, for one monolith told what an expert would know. An id
    holds both, class + (C + 1) * cluster, so every verb works on one LongTensor and
    dropping an id drops both: the null is (C, K). It samples through its K cluster
    views, routed as experts are (`ClusterView`)."""
    kind = "class+cluster"

    def __init__(self, num_classes, k, labels=None, clusters=None):
        super().__init__(num_classes, labels)
        self.k, self.clusters = k, clusters
        self.null_id = self.encode(num_classes, k)

    def encode(self, labels, clusters):
        return labels + (self.num_classes + 1) * clusters

    def ids(self, data_indices):
        clusters = np.asarray(self.clusters[data_indices], dtype=np.int64)
        return self.encode(super().ids(data_indices), torch.from_numpy(clusters))

    def expert_input(self, ids):
        return torch.stack([ids % (self.num_classes + 1), ids // (self.num_classes + 1)], 1)

    def router_input(self, ids):   # a router reads the class alone
        return ids % (self.num_classes + 1)

    def labels(self, ids):
        return ids % (self.num_classes + 1)

    def spec(self):
        return {"kind": self.kind, "num_classes": self.num_classes, "k": self.k}

    def expert_args(self):
        return {"num_classes": self.num_classes, "text_dim": 0, "cluster_classes": self.k}

    def router_args(self):
        return {"num_classes": self.num_classes, "text_dim": 0}


class ClusterView:
    """A cluster-conditioned monolith seen as the expert of one cluster: class requests
    in, its cluster added (the null class keeps the null cluster, so guidance's
    unconditional branch is the fully unconditional one it was trained with)."""

    def __init__(self, network, cluster):
        self.network, self.cluster = network, cluster
        self.net, self.config = network.net, network.config
        spec = network.condition.spec()
        self.condition = ClassCondition(spec["num_classes"])
        self.objective = network.objective

    def velocity(self, x_t, t, y=None):
        null = y == self.condition.null_id
        k = self.network.condition.k
        clusters = torch.where(null, torch.full_like(y, k), torch.full_like(y, self.cluster))
        return self.network.velocity(x_t, t, torch.stack([y, clusters], 1))

    def to(self, device):
        self.network.to(device)
        return self


class TextCondition(Condition):
    """A caption, embedded by a frozen CLIP text tower: tokens for the expert
    (cross-attention), pooled for the router."""
    kind = "text"

    def __init__(self, encoder, length, width, pooled_width, table=None, caption_index=None,
                 table_labels=None):
        self.encoder, self.length, self.width, self.pooled_width = encoder, length, width, pooled_width
        self.caption_index, self.table_labels = caption_index, table_labels
        self.tokens = self.pooled = None
        if table is not None:
            # table: (tokens, pooled, null); a row appended at null_id: the null caption
            # of both networks (all zeros, which the DiT reads as its learned null
            # caption), or null's (a negative prompt's)
            tokens, pooled, null = table
            null_tokens, null_pooled = null if null is not None else (
                torch.zeros(tokens.shape[1:]), torch.zeros(pooled.shape[1]))
            self.tokens = torch.cat([tokens, null_tokens[None]])
            self.pooled = torch.cat([pooled, null_pooled[None]])
            self.null_id = len(tokens)

    def with_table(self, tokens, pooled, table_labels=None, null=None):
        """The same condition over another table of captions (the prompts to sample);
        null: (tokens, pooled) of the caption guidance's unconditional branch reads (a
        negative prompt), else the null caption."""
        return TextCondition(self.encoder, self.length, self.width, self.pooled_width,
                             (tokens, pooled, null), None, table_labels)

    def ids(self, data_indices):
        return self.caption_index[torch.as_tensor(data_indices)]

    def expert_input(self, ids):
        return self.tokens.to(ids.device)[ids]

    def router_input(self, ids):
        return self.pooled.to(ids.device)[ids]

    def of_labels(self, labels, num_classes=None):
        raise UsageError("a text router reads each image's caption, and a contributor's "
                         "data set or an expert's samples carry none here: route text "
                         "experts from the clustered data set, or pass --condition none")

    def requests(self, n, generator, fixed=None):
        if fixed is not None:
            raise UsageError("--class: these experts are text-conditional; give --prompt")
        return torch.arange(n) % self.null_id   # images cycle through the prompts

    def labels(self, ids):
        return None if self.table_labels is None else self.table_labels[ids]

    def with_prompts(self, prompts, negative_prompt=None, *, data_spec, run_dir,
                     clip_model="ViT-B-32", clip_pretrained=None, download=False, tower=None):
        """This condition over a table of the prompts (their labels kept where the data
        set makes captions from labels); guidance's unconditional branch reads the
        negative prompt where one is given."""
        if not prompts:
            raise UsageError("these experts are text-conditional: give --prompt TEXT "
                             "(repeatable) or --prompts FILE")
        if negative_prompt is not None and not negative_prompt.strip():
            raise UsageError("empty --negative-prompt (leave it out for the null caption)")
        negative = [negative_prompt] if negative_prompt is not None else []
        tokens, pooled, index, _ = caption_embeddings(
            prompts + negative, run_dir, encoder=self.encoder, clip_model=clip_model,
            clip_pretrained=clip_pretrained, download=download, tower=tower)
        tokens, pooled = tokens[index], pooled[index]
        null = (tokens[-1], pooled[-1]) if negative else None
        labels = caption_labels(data_spec, prompts)
        return self.with_table(tokens[:len(prompts)], pooled[:len(prompts)],
                               None if labels is None else torch.as_tensor(labels), null)

    def spec(self):
        return {"kind": self.kind, "encoder": self.encoder, "length": self.length,
                "width": self.width,
                "pooled_width": self.pooled_width}

    def expert_args(self):
        return {"num_classes": 0, "text_dim": self.width, "text_len": self.length}

    def router_args(self):
        return {"num_classes": 0, "text_dim": self.pooled_width}


def condition_from_spec(spec):
    """Rebuild a checkpoint's condition (unbound: no data, no caption table)."""
    kind = spec.get("kind")
    if kind == "none":
        return NoCondition()
    if kind == "class":
        return ClassCondition(spec["num_classes"])
    if kind == ClusterCondition.kind:
        return ClusterCondition(spec["num_classes"], spec["k"])
    if kind == "text":
        return TextCondition(spec["encoder"], spec["length"], spec["width"], spec["pooled_width"])
    raise ValueError(f"unknown condition {kind!r}")


def condition_for_data(kind, dataset, run_dir, *, encoder=None, clip_model="ViT-B-32",
                       clip_pretrained=None, download=False, clusters=None):
    """The condition of this kind, bound to the data set (labels, its cluster file's
    assignments, or the cached embeddings of its captions); kind None: class for labelled
    data, else none.

    `encoder`: the text encoder an earlier stage recorded, so its cached captions are
    reused."""
    kind = kind or ("class" if dataset.labels is not None else "none")
    if kind == "none":
        return NoCondition()
    if kind == "class":
        if dataset.labels is None:
            raise UsageError("condition 'class' needs a labelled data set; "
                             f"{dataset.name} has no labels (use --condition none)")
        return ClassCondition(dataset.num_classes, dataset.labels)
    if kind == ClusterCondition.kind:
        if dataset.labels is None or clusters is None:
            raise UsageError("--condition class+cluster is the information control: the "
                             "monolith (--cluster all) of a labelled, clustered data set")
        return ClusterCondition(dataset.num_classes, clusters["k"], dataset.labels,
                                clusters["assignments"].numpy())
    if kind == "text":
        if dataset.captions is None:
            raise UsageError("condition 'text' needs captions: use --data "
                             "digits-captions, or folder:PATH with NAME.txt / "
                             "captions.jsonl")
        tokens, pooled, index, spec = caption_embeddings(
            dataset.captions, run_dir, encoder=encoder, clip_model=clip_model,
            clip_pretrained=clip_pretrained, download=download)
        return TextCondition(spec, tokens.shape[1], tokens.shape[2], pooled.shape[1],
                             (tokens, pooled, None), index)
    raise UsageError(f"unknown condition {kind!r} (class, class+cluster, text or none)")
