"""The run's typed configuration: the dataclasses every strategy shares (each field's docstring is
its entry in docs/configuration.md) and the one error a bad value raises."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from raylowcomm.core.bad_updates import BadNode


class ConfigError(ValueError):
    """A bad config value; the message names the field, the value and the fix."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        super().__init__(f"config field '{field_name}' = {value!r} is invalid: {allowed}")
        self.field_name, self.value, self.allowed = field_name, value, allowed

    def __reduce__(self):
        """Picklable, so one raised on a node (a label its own file has) reaches the driver as itself."""
        return type(self), (self.field_name, self.value, self.allowed)


@dataclass
class LoraConfig:
    """LoRA adapters (peft): the base stays frozen, only the adapters and a new head train.
    Checked by `validate_lora`."""

    r: int = 8
    """Rank of each adapter: A is r x in_features, B is out_features x r (B starts at zero)."""
    alpha: float = 16
    """The update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on each adapter's input (peft's lora_dropout)."""
    target_modules: list[str] | None = None
    """Module names (or suffixes) to adapt; None: peft's default for the architecture (BERT:
    query, value; Llama: q_proj, v_proj), for timm every Linear and ungrouped Conv2d but the head."""


@dataclass
class ModelConfig:
    name: str = "efficientnet_lite0"
    """A bundled asset (efficientnet_lite0, all-MiniLM-L6-v2, SmolLM2-135M), a timm architecture,
    or a Hugging Face folder / hub id."""
    family: Literal["timm", "hf_classifier", "hf_causal_lm"] = "timm"
    """timm: an image model; hf_classifier: a Hugging Face encoder with a new sequence-classification
    head; hf_causal_lm: a causal LM, for language modelling or for classification by prompt
    (data.template, data.label_words)."""
    path: str | None = None
    """Your own weights: a timm checkpoint file or a Hugging Face folder, a local or mounted path or a
    storage URI (s3://, gs://, file://…: each host copies it once into its cache). Overrides the asset."""
    pretrained: bool = True
    """Start from the pretrained weights; false: a random initialisation of the architecture, drawn from
    the run's seed (e.g. a timm resnet10t, for which no pretrained weights ship offline, or a Hugging
    Face model trained from scratch: its config and tokenizer are still read)."""
    config_overrides: dict[str, Any] | None = None
    """With pretrained: false, Hugging Face config fields to change before the random initialisation
    (e.g. {num_hidden_layers: 8, hidden_size: 256}: a smaller model of the same family, from scratch)."""
    timm_arch: str | None = None
    """timm architecture the weights belong to, when `name` is an asset or a file."""
    lora: LoraConfig | None = None
    """Fine-tune LoRA adapters instead of every weight (None: full fine-tuning)."""
    merge: bool = False
    """With `lora`: save the merged model (adapters folded into the weights), not the adapter."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The weights' own dtype (not optim.precision's autocast). With `lora`: the frozen base in it,
    adapters and head fp32. Without: SPSA only (lo-fi, DDP and interlocking update every weight,
    which needs fp32). See docs/models.md for what each combination keeps exact."""
    memory_format: Literal["auto", "channels_last", "contiguous"] = "auto"
    """How an image model's 4-D weights (and so the activations its convolutions produce) lie in memory where it trains.
    channels_last: pixels with their channels side by side, where oneDNN runs depthwise and grouped convolutions
    (EfficientNet, MobileNet) fastest on a CPU (docs/models.md; docs/benchmarks.md); contiguous: torch's default; auto:
    channels_last for timm models on CPU, contiguous elsewhere (GPUs: not measured here). The same values cross and are
    counted; results differ from contiguous only in float rounding. SPSA's nodes stay contiguous (they perturb each
    weight in memory order, the same order on every replica)."""
    source: Literal["auto", "nodes", "driver"] = "auto"
    """Who loads the pretrained weights. nodes: each node from model.path / the asset / its hub cache, only a recipe of
    a few KB crosses; driver: the driver loads them and sends them through the object store; auto: nodes when every node
    can read the source and no strategy of the run needs the weights on the driver (docs/models.md)."""


@dataclass
class ShiftSource:
    """One distribution-shift set (data.shift.<name>), read like the training data; its labels
    are mapped onto the training classes by name."""

    source: str | None = None
    """As data.source; None: the training data's source (a builder such as csv needs `files`)."""
    files: str | list[str] | dict[str, str | list[str]] | None = None
    """As data.files: this set's path, glob, list, or {split: path}."""
    split: str | None = None
    """The split scored (None: the only split, else "train")."""
    columns: dict[str, str] = field(default_factory=dict)
    """Roles -> this set's column names; roles not named here default as for the training data."""


@dataclass
class DataConfig:
    name: str = "mnist"
    """A bundled dataset (see raylowcomm/catalog.py): mnist, rotten_tomatoes, hamlet, speeches. With
    `source` set, only the data's name in messages and reports (not given: its file or folder name)."""
    source: str | None = None
    """Your own data, what `datasets.load_dataset` takes: a builder (csv, json, parquet, text,
    imagefolder) with `files`, a local folder (one written by `save_to_disk` too), or a hub id."""
    files: str | list[str] | dict[str, str | list[str]] | None = None
    """data_files: a path, a glob, a list, or {split: path}. For a preset: your copy of its files."""
    path: str | None = None
    """Your own copy of a preset's file: the same as `files`, under a name that says so."""
    split: str | None = None
    """The split training rows come from (None: the only split, else "train")."""
    test_split: str | None = None
    """A split scored as the test set; None: "test" where the source has one, else `test_size`
    rows drawn by `shuffle_seed` from the training split (as for val_size)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Roles -> your column names: text, text_pair, image, label. Unnamed roles default to columns
    called text / image / label (or the one image column)."""
    classes: list[str] | None = None
    """Label names in class order; None: the data's ClassLabel names, else its sorted distinct labels."""
    train_size: int | None = None
    """Training examples (all nodes together); None takes every example left after the splits."""
    test_size: int = 1000
    """Examples scored as the test set (with data.eval_on_nodes: rows each node holds out of its own
    data). test_size + val_size (+ train_size) must fit in the data."""
    val_size: int = 0
    """Held out from training for greedy soups."""
    shift: Literal["auto", "none"] | dict[str, ShiftSource] = "auto"
    """auto: a preset's real shift set (MNIST -> UCI digits, Rotten Tomatoes -> Amazon reviews);
    or your own sets, name -> {source, files, split, columns}, scored as shift/<name>_*."""
    shift_size: int | None = None
    """Examples scored per shift set, a sample fixed by shuffle_seed; None: all of them."""
    node_files: list[str] | str | None = None
    """Training data that never leaves its node: one path/glob per node, or one pattern with
    {node} (node_{node}.csv). Each node loads its own; the driver loads only evaluation data."""
    node_files_on_driver: bool = True
    """The node files are readable from the driver too (one machine, a shared disk): they are
    checked before any actor starts. false: each lives on its node's host only."""
    eval_on_nodes: bool = False
    """Score on each node's own held-out rows (test_size of them) instead of driver-held test sets."""
    template: str | None = None
    """Causal-LM classification: the text after each example ("<text><template>"), whose next token
    is the class's label word. Rotten Tomatoes: " It was"."""
    label_words: list[str] | None = None
    """One single-token word per class, in class order. Rotten Tomatoes: [" terrible", " great"]."""
    image_size: int | None = 32
    """Side images are resized to; None: the model's pretrained input size."""
    max_length: int = 64
    """Tokens per example (classification) or per block (language modelling)."""
    shuffle_seed: int = 1234
    """Fixes which examples are test/val/train, independent of the run seed."""


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    """The optimizer of every node, worker and stage: sgd (with momentum) or adamw; both fused (one
    kernel over every parameter)."""
    lr: float = 0.05
    """Learning rate (also SPSA's, unless spsa.lr is set)."""
    momentum: float = 0.9
    """SGD momentum, in [0, 1); adamw does not use it."""
    weight_decay: float = 0.0
    """Weight decay (adamw: decoupled). SPSA applies it too, not to biases and norms."""
    batch_size: int = 32
    """Per node (lo-fi) and per worker (DDP), so both see the same samples."""
    epochs: int = 1
    """Passes over each node's shard (lo-fi node, DDP worker): both take the same number of steps."""
    max_steps: int | None = None
    """Stop each node after this many steps (None: `epochs` full passes over its shard)."""
    budget_s: float | None = None
    """Seconds of training each strategy gets, on its own training clock: it trains until the step at
    which they are reached, its shard's epochs repeating in new orders (`epochs` then only caps the
    run at 1,000 times its steps; `max_steps` still caps it), and is scored there; the record says
    where it stopped (`details.budget`). For equal-time comparisons (`bench ... --budget-s`). lo-fi
    (not with quorum rounds), DDP, SPSA and interlocking. None: `epochs` or `max_steps` decide."""
    group_by_length: bool = False
    """Text: batch rows of similar length together (data.length_grouped_batch), so a batch cut to
    its longest row carries little padding; lo-fi, DDP and SPSA. Batches stay random in content;
    their lengths come in groups of 8 batches."""
    eval_batch_size: int | None = None
    """Rows per evaluation batch; None: 32 on CPU, where a small batch's activations stay in
    cache and scoring is faster than in large batches (docs/benchmarks.md), 256 on GPUs."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward under torch.autocast(bfloat16); weights, optimizer state and SPSA's updates stay fp32.
    SPSA replicas stay bit-identical either way (every replica applies the same decoded updates); a resumed or restarted
    node is bit-exact only on the same kind of device, as autocast kernels differ between devices."""


@dataclass
class NodesConfig:
    count: int | list[int] = 2
    """Node actors (lo-fi, SPSA) or Ray Train workers (DDP); the training set is split into this many disjoint shards.
    Interlocking runs interlocking.stages actors instead. Or a range [min, max] (lo-fi's quorum rounds): the run starts
    once min nodes fit, takes more as the cluster holds them, up to max, and the training set is split into max shards
    (docs/fault-tolerance.md#elastic-node-count). Read as a number, `count` is the min; `most` is the max."""
    cpus: float = 1.0
    """CPUs per node actor (also torch threads in the actor)."""
    gpus: float = 0.0
    """GPUs per node actor, DDP worker or interlocking stage; the driver itself needs no CUDA."""
    max_restarts: int | None = None
    """How often a node actor that dies is restarted from its last checkpoint, in the strategies
    that restart nodes (lo-fi) and the group (DDP); None: 2. SPSA and interlocking do not restart: set
    for them alone it is refused, beside a strategy that restarts one warning line."""
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """The strategy of the one placement group a strategy's actors start in, together or not at
    all: PACK fills as few Ray nodes as it can (one, where they fit); SPREAD puts them on different
    Ray nodes where possible; STRICT_SPREAD on different nodes or not at all. DDP: Ray Train's
    placement_strategy. In a sweep it is the strategy of each trial's reservation."""
    hosts: list[str] | None = None
    """The host of each actor, in order (node k, SPSA's joiners after the first nodes, stage k):
    a Ray node's address (e.g. 10.0.0.2) or its node id; actor k's bundle is pinned there, and a
    restarted actor comes back to it. One entry per actor each strategy of the run starts; None:
    Ray chooses. See docs/clusters.md (pinning node k to the host that holds its data)."""
    start_timeout_s: float | None = None
    """Seconds to wait for a strategy's placement group before giving up with an error; None: 120
    on the local Ray (it cannot grow), no limit on a joined cluster (it says what it waits for)."""
    wait_for_resources: bool = False
    """On a joined cluster, wait for resources no node has yet (an autoscaler that adds GPU nodes
    on demand) instead of stopping with an error."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per actor, e.g. {"trainer": 1} to run actors only on nodes started
    with `ray start --resources='{"trainer": 4}'`."""

    def __post_init__(self) -> None:
        self._most = None
        if isinstance(self.count, list):
            low_high = self.count
            whole = all(isinstance(c, int) and not isinstance(c, bool) for c in low_high)
            if len(low_high) != 2 or not whole or not 1 <= low_high[0] <= low_high[1]:
                raise ConfigError("nodes.count", low_high, "a node count, or a range [min, max] with 1 <= min <= max")
            self.count, self._most = low_high

    @property
    def most(self) -> int:
        """The most node actors the run may hold: the range's max, or `count`."""
        return self._most if self._most is not None else self.count

    @property
    def elastic(self) -> bool:
        """Whether nodes may join as the cluster holds them (`count: [min, max]` with min < max)."""
        return self.most > self.count

    def count_as_given(self) -> int | list[int]:
        return [self.count, self.most] if self.elastic else self.count


@dataclass
class SlowNode:
    node: int
    """The node (lo-fi node, DDP rank, SPSA node) that runs slow."""
    factor: float = 3.0
    """Each of its steps takes this many times its own time: after a step it sleeps (factor - 1) times
    what that step took, as slower hardware would."""


@dataclass
class KillAt:
    node: int
    """The node whose process is killed (SIGKILL's effect: it exits at once, nothing saved)."""
    at_step: int
    """Right after it finishes this step (before that step's checkpoint, as a preemption would)."""


@dataclass
class ChurnConfig:
    """Slow and preempted nodes, injected for benchmarks and tests (lo-fi, DDP, SPSA), every event
    booked in the record (`churn` in results.json). Empty: no churn."""

    slow: list[SlowNode] = field(default_factory=list)
    """Nodes that run slow, [{node, factor}]."""
    kill: list[KillAt] = field(default_factory=list)
    """Preemptions at a node's step, [{node, at_step}]."""
    kill_every_s: float | None = None
    """A preemption every this many seconds of the strategy's run: the i-th at i × kill_every_s, its
    victim drawn from `seed` (the same victims and times on every replay)."""
    seed: int | None = None
    """Seed of the victims of kill_every_s; None: the run's seed."""
    cpu_quota: bool = False
    """Hold each node process (lo-fi and SPSA nodes, DDP workers, interlocking stages) to nodes.cpus of CPU
    time (a Linux cgroup v1 CPU quota; root), as if each node ran on its own machine: without it,
    fractional-CPU nodes on one machine share its cores, and a node that waits speeds the others up. For
    benchmarks on one machine, with or without churn."""

    @property
    def active(self) -> bool:
        """Slow nodes or preemptions to inject and book (a CPU quota alone injects nothing)."""
        return bool(self.slow or self.kill or self.kill_every_s)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The pretrained model to fine-tune."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data: a bundled dataset or your own files, the test, validation and shift sets."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Hyper-parameters every strategy shares, so they run on identical settings."""
    nodes: NodesConfig = field(default_factory=NodesConfig)
    """The actors: how many, and the CPUs, GPUs and custom resources of each."""
    churn: ChurnConfig = field(default_factory=ChurnConfig)
    """Slow and preempted nodes, injected to measure what churn costs each strategy."""
    bad_nodes: list[BadNode] = field(default_factory=list)
    """Nodes that send a wrong outer update, [{node, update, scale, round}], injected to measure what one costs."""
    strategies: list[str] | None = None
    """The strategies to run, one after another, on identical model, data and hyper-parameters:
    lofi, ddp, spsa, interlocking. null: those the registry runs by default, lofi and ddp (the
    question raylowcomm answers first: lo-fi against its data-parallel baseline)."""
    seed: int = 0
    """The run's seed: a new head's and the adapters' initialisation, each node's batch order and
    SPSA's perturbations derive from it (which rows are test/val/train: data.shuffle_seed)."""
    out_dir: str = "runs/default"
    """Where a run writes results.json, timings.json, config.yaml, TensorBoard events and (without
    `storage`) its state; `raylowcomm run --out` overrides it."""
    storage: str | None = None
    """Where everything a run must not lose lives: node checkpoints, curve snapshots, the SPSA
    replay log, final weights and results. A path every Ray node can reach (NFS) or an object
    store URI (s3://bucket/run, gs://...); None: OUT/state, enough on one machine."""
    log_every: int = 10
    """Steps between a node's log lines (its mean training loss over them)."""
    checkpoint_every: int | None = None
    """Steps between node checkpoints (what a restarted lo-fi node resumes from, what a joining
    SPSA node starts from, and DDP's group); None: 50. Interlocking keeps none: set for it alone it is refused,
    beside a strategy that checkpoints one warning line."""
    eval_every: int = 0
    """Steps (per node; batches for interlocking) between the evaluations that make each
    strategy's learning curve (`curve` in results.json); 0: the final evaluation only."""
    options: dict[str, Any] = field(default_factory=dict)
    """Per-strategy option dataclasses, keyed by strategy name (YAML: a section per strategy)."""

    @property
    def restarts(self) -> int:
        return 2 if self.nodes.max_restarts is None else self.nodes.max_restarts

    @property
    def eval_rows(self) -> int:
        """optim.eval_batch_size, or its default for the nodes' device."""
        if self.optim.eval_batch_size is not None:
            return self.optim.eval_batch_size
        return 256 if self.nodes.gpus > 0 else 32

    @property
    def checkpoint_steps(self) -> int:
        return 50 if self.checkpoint_every is None else self.checkpoint_every

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["nodes"]["count"] = self.nodes.count_as_given()
        out.pop("options")
        out.update({k: dataclasses.asdict(v) for k, v in self.options.items()})
        return out
