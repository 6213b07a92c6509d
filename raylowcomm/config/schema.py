"""Run configuration: typed dataclasses loaded from YAML, `--set key=value` overrides,
and validation that names the field, the value and what is allowed — all before any actor starts.

Each strategy owns the dataclass of its options (`Strategy.Config`); a YAML section named after
the strategy fills it, so a new strategy needs no change here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from raylowcomm import catalog


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
    Checked by `raylowcomm.lora.validate_lora`."""

    r: int = 8
    alpha: float = 16
    """The update is scaled by alpha / r."""
    dropout: float = 0.0
    target_modules: list[str] | None = None
    """Module names (or suffixes) to adapt; None: peft's default for the architecture (BERT:
    query, value; Llama: q_proj, v_proj), for timm every Linear and ungrouped Conv2d but the head."""


@dataclass
class ModelConfig:
    name: str = "efficientnet_lite0"
    """A bundled asset (efficientnet_lite0, all-MiniLM-L6-v2, SmolLM2-135M), a timm architecture,
    or a Hugging Face folder / hub id."""
    family: Literal["timm", "hf_classifier", "hf_causal_lm"] = "timm"
    path: str | None = None
    """Your own weights: a timm checkpoint file or a Hugging Face folder. Overrides the asset."""
    pretrained: bool = True
    timm_arch: str | None = None
    """timm architecture the weights belong to, when `name` is an asset or a file."""
    lora: LoraConfig | None = None
    """Fine-tune LoRA adapters instead of every weight (None: full fine-tuning)."""
    merge: bool = False
    """With `lora`: save the merged model (adapters folded into the weights), not the adapter."""


@dataclass
class ShiftSource:
    """One distribution-shift set (data.shift.<name>), read like the training data; its labels
    are mapped onto the training classes by name."""

    source: str | None = None
    """As data.source; None: the training data's source (a builder such as csv needs `files`)."""
    files: str | list[str] | dict[str, str | list[str]] | None = None
    split: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    """Roles -> this set's column names; roles not named here default as for the training data."""


@dataclass
class DataConfig:
    name: str = "mnist"
    """A bundled dataset (see raylowcomm/catalog.py): mnist, rotten_tomatoes, hamlet, speeches. With
    `source` set, only the data's name in reports."""
    source: str | None = None
    """Your own data, what `datasets.load_dataset` takes: a builder (csv, json, parquet, text,
    imagefolder) with `files`, a local folder (one written by `save_to_disk` too), or a hub id."""
    files: str | list[str] | dict[str, str | list[str]] | None = None
    """data_files: a path, a glob, a list, or {split: path}. For a preset: your copy of its files."""
    path: str | None = None
    """Your own copy of a preset's file (the same as `files`, kept for existing configs)."""
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
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    """Per node (lo-fi) and per worker (DDP), so both see the same samples."""
    epochs: int = 1
    max_steps: int | None = None
    """Stop each node after this many steps (None: `epochs` full passes over its shard)."""
    group_by_length: bool = False
    """Text: batch rows of similar length together (data.length_grouped_batch), so a batch cut to
    its longest row carries little padding; lo-fi, DDP and SPSA. Batches stay random in content;
    their lengths come in groups of 8 batches."""
    eval_batch_size: int | None = None
    """Rows per evaluation batch; None: 32 on CPU, where a small batch's activations stay in
    cache (MiniLM scores 1,000 reviews in 5.3 s at 16-32 rows, 10.5 s at 256), 256 on GPUs."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward under torch.autocast(bfloat16); weights, optimizer state and
    SPSA's updates stay fp32. SPSA replicas stay bit-identical either way (every replica applies
    the same decoded updates); a resumed or restarted node is bit-exact only on the same kind of
    device, as autocast kernels differ between devices."""


@dataclass
class NodesConfig:
    count: int = 2
    cpus: float = 1.0
    """CPUs per node actor (also torch threads in the actor)."""
    gpus: float = 0.0
    max_restarts: int | None = None
    """How often a node actor that dies is restarted from its last checkpoint, in the strategies
    that restart nodes (lo-fi); None: 2. Others refuse to pretend: they warn when it is set."""
    placement: Literal["PACK", "SPREAD"] = "PACK"
    """SPREAD: put the actors on different Ray nodes where possible; PACK: Ray's default, which
    fills the driver's node first. In a sweep it is the strategy of each trial's reservation."""
    wait_for_resources: bool = False
    """On a joined cluster, wait for resources no node has yet (an autoscaler that adds GPU nodes
    on demand) instead of stopping with an error."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per actor, e.g. {"trainer": 1} to run actors only on nodes started
    with `ray start --resources='{"trainer": 4}'`."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    strategies: list[str] = field(default_factory=lambda: ["lofi", "ddp"])
    seed: int = 0
    out_dir: str = "runs/default"
    storage: str | None = None
    """Where everything a run must not lose lives: node checkpoints, curve snapshots, the SPSA
    replay log, final weights and results. A path every Ray node can reach (NFS) or an object
    store URI (s3://bucket/run, gs://...); None: OUT/state, enough on one machine."""
    log_every: int = 10
    checkpoint_every: int | None = None
    """Steps between node checkpoints (what a restarted lo-fi node resumes from, what a joining
    SPSA node starts from); None: 50. Strategies that do not checkpoint warn when it is set."""
    eval_every: int = 0
    """Steps (per node; batches for interlocking) between the evaluations that make each
    strategy's learning curve (`curve` in results.json); 0: the final evaluation only."""
    options: dict[str, Any] = field(default_factory=dict)
    """Per-strategy option dataclasses, keyed by strategy name (YAML: a section per strategy)."""

    def strategy_options(self, name: str):
        return self.options[name]

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
        out.pop("options")
        out.update({k: dataclasses.asdict(v) for k, v in self.options.items()})
        return out


# --- loading -----------------------------------------------------------------------------------

def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_describe(typing.get_args(tp)[0])} to {_describe(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _coerce(tp, value, name: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None  # `lora: null` is no LoRA, not a LoraConfig of defaults
        for option in typing.get_args(tp):
            try:
                return _coerce(option, value, name)
            except ConfigError:
                continue
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(name, value, f"expected {_describe(tp)}")
        return [_coerce(typing.get_args(tp)[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(name, value, f"expected {_describe(tp)}")
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(key_tp, k, f"{name}.{k}"): _coerce(value_tp, v, f"{name}.{k}") for k, v in value.items()}
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(name, value, "expected null")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML11_FLOAT.match(value):  # YAML 1.1 reads 3e-5 as a string
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, name)
    elif tp is typing.Any:
        return value
    raise ConfigError(name, value, f"expected {_describe(tp)}")


def build_dataclass(cls, data, prefix: str):
    """Build `cls` from a mapping, rejecting unknown keys and values of the wrong type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, data, f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}" if prefix else key, data[key], f"unknown field; known fields of '{prefix or 'the config'}': {', '.join(sorted(known))}")
    kwargs = {k: _coerce(hints[k], v, f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def yaml_problem(err: yaml.YAMLError) -> str:
    """Where and what, from a YAML parse error: 'malformed YAML at line L, column C: problem'."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"malformed YAML{where}: {problem or err}"


def load_yaml_mapping(path: str | Path, field_name: str = "CONFIG") -> dict:
    """A YAML file that must hold a mapping (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(field_name, str(path), "no such file; check the path")
    if path.is_dir():
        raise ConfigError(field_name, str(path), "is a folder; give a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(field_name, str(path), f"{yaml_problem(err)}; fix the file's YAML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(field_name, str(path), "is not a text (UTF-8) file; give a YAML file") from None
    except OSError as err:
        raise ConfigError(field_name, str(path), f"cannot be read ({err.strerror})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(field_name, str(path), f"the file must hold a YAML mapping (`key: value` lines), not a {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    usage = "an override must look like key.sub=value, e.g. --set optim.lr=0.01"
    if "=" not in text:
        raise ConfigError("--set", text, usage)
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError("--set", text, usage)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(key.strip(), raw, f"{yaml_problem(err)} in --set {text}; quote the value or fix its syntax") from None
    return [k.strip() for k in keys], value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:  # absent, or an empty section (`optim:` in YAML)
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(".".join(keys), value, f"'{'.'.join(keys[:i + 1])}' is not a section; "
                                                         f"set a field of a section, e.g. optim.lr=0.01")
        node[keys[-1]] = value
    return raw


def read_yaml(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The raw mapping of a config file with `--set` overrides applied (not yet typed)."""
    raw = load_yaml_mapping(path) if path is not None else {}
    return apply_overrides(raw, list(overrides))


# --- validation --------------------------------------------------------------------------------

def _positive(name, value, allow_zero=False):
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(name, value, "must be >= 0" if allow_zero else "must be > 0")


def validate(cfg: RunConfig) -> None:
    """Fields every strategy shares; each strategy's `validate` checks its own options after."""
    if cfg.model.lora is not None or cfg.model.merge:
        from raylowcomm.lora import validate_lora  # peft only for LoRA runs

        validate_lora(cfg)
    _positive("nodes.count", cfg.nodes.count)
    if cfg.nodes.count != int(cfg.nodes.count):
        raise ConfigError("nodes.count", cfg.nodes.count, "must be a whole number")
    _positive("nodes.cpus", cfg.nodes.cpus)
    _positive("nodes.gpus", cfg.nodes.gpus, allow_zero=True)
    _positive("nodes.max_restarts", cfg.nodes.max_restarts, allow_zero=True)
    for key, amount in cfg.nodes.resources.items():
        if key.upper() in ("CPU", "GPU", "MEMORY"):
            raise ConfigError(f"nodes.resources.{key}", amount, "set CPUs and GPUs with nodes.cpus / nodes.gpus")
        _positive(f"nodes.resources.{key}", amount)
    _positive("optim.lr", cfg.optim.lr)
    _positive("optim.batch_size", cfg.optim.batch_size)
    _positive("optim.epochs", cfg.optim.epochs)
    _positive("optim.max_steps", cfg.optim.max_steps)
    _positive("optim.eval_batch_size", cfg.optim.eval_batch_size)
    _positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    if not 0 <= cfg.optim.momentum < 1:
        raise ConfigError("optim.momentum", cfg.optim.momentum, "must be in [0, 1)")
    _positive("data.test_size", cfg.data.test_size)
    _positive("data.val_size", cfg.data.val_size, allow_zero=True)
    _positive("data.train_size", cfg.data.train_size)
    _positive("data.shift_size", cfg.data.shift_size)
    _positive("data.image_size", cfg.data.image_size)
    _positive("data.max_length", cfg.data.max_length)
    _positive("log_every", cfg.log_every)
    _positive("checkpoint_every", cfg.checkpoint_every)
    if cfg.eval_every < 0:
        raise ConfigError("eval_every", cfg.eval_every, "an integer >= 0 (0: evaluate at the end only)")
    if cfg.data.source is None and cfg.data.name not in catalog.DATASETS:
        raise ConfigError("data.name", cfg.data.name, f"expected one of {', '.join(map(repr, catalog.DATASETS))}, or set data.source to your own data")
    kind = catalog.declared_kind(cfg.data.name, cfg.data.source, cfg.data.columns)
    if kind is not None and catalog.task_of(cfg.model.family, kind) is None:
        raise ConfigError("model.family", cfg.model.family,
                          f"data '{cfg.data.name}' is {kind.replace('_', ' ')}: use {' or '.join(catalog.FAMILIES_FOR_KIND[kind])}")
    if cfg.optim.group_by_length and cfg.model.family == "timm":
        raise ConfigError("optim.group_by_length", True, "groups text rows by length; images are all one size: remove it")
    if cfg.model.path is not None and not Path(cfg.model.path).exists():
        raise ConfigError("model.path", cfg.model.path, "no such file or folder; point it at your local weights or remove it")
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", cfg.data.path, "no such file; point it at your local data or remove it")
    if cfg.data.path is not None and (cfg.data.files is not None or cfg.data.source is not None):
        raise ConfigError("data.path", cfg.data.path, "give your files as data.files only")
    shifts = cfg.data.shift if isinstance(cfg.data.shift, dict) else {}
    for prefix, columns in [("data", cfg.data.columns), *((f"data.shift.{n}", s.columns) for n, s in shifts.items())]:
        for role, column in columns.items():
            if role not in catalog.ROLES:
                raise ConfigError(f"{prefix}.columns.{role}", column, f"roles are {', '.join(catalog.ROLES)}")
    if isinstance(cfg.data.node_files, list) and len(cfg.data.node_files) < cfg.nodes.count:
        raise ConfigError("data.node_files", cfg.data.node_files, f"one entry per node: {cfg.nodes.count} nodes, {len(cfg.data.node_files)} entries")
    if isinstance(cfg.data.node_files, str) and "{node}" not in cfg.data.node_files:
        raise ConfigError("data.node_files", cfg.data.node_files, "a single pattern must contain {node}, e.g. shards/node_{node}.csv")
    if cfg.data.node_files is not None and cfg.data.train_size is not None:
        raise ConfigError("data.train_size", cfg.data.train_size, "with data.node_files each node trains on all its own rows: remove it")
