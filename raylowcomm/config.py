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


class ConfigError(ValueError):
    """A bad config value; the message names the field, the value and the fix."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        super().__init__(f"config field '{field_name}' = {value!r} is invalid: {allowed}")
        self.field_name = field_name


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


@dataclass
class DataConfig:
    name: Literal["mnist", "rotten_tomatoes", "hamlet", "speeches"] = "mnist"
    path: str | None = None
    """Your own copy of the dataset's files instead of the bundled asset."""
    train_size: int | None = None
    """Training examples (all nodes together); None takes every example left after the splits."""
    test_size: int = 1000
    val_size: int = 0
    """Held out from training for greedy soups."""
    shift: Literal["auto", "none"] = "auto"
    """auto: score on the dataset's real shift set where one exists (MNIST -> UCI digits)."""
    image_size: int = 32
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
    eval_batch_size: int = 256


@dataclass
class NodesConfig:
    count: int = 2
    cpus: float = 1.0
    """CPUs per node actor (also torch threads in the actor)."""
    gpus: float = 0.0
    max_restarts: int = 2
    """How often a node actor that dies is restarted from its last checkpoint."""
    placement: Literal["PACK", "SPREAD"] = "PACK"
    """SPREAD: put the actors on different Ray nodes where possible; PACK: Ray's default, which
    fills the driver's node first. In a sweep it is the strategy of each trial's reservation."""
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
    log_every: int = 10
    checkpoint_every: int = 50
    """Steps between node checkpoints (what a restarted node resumes from)."""
    eval_every: int = 0
    """Steps (per node; batches for interlocking) between the evaluations that make each
    strategy's learning curve (`curve` in results.json); 0: the final evaluation only."""
    options: dict[str, Any] = field(default_factory=dict)
    """Per-strategy option dataclasses, keyed by strategy name (YAML: a section per strategy)."""

    def strategy_options(self, name: str):
        return self.options[name]

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


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(text, text, "an override must look like key.sub=value, e.g. --set optim.lr=0.01")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(keys), value, f"'{k}' is not a section")
        node[keys[-1]] = value
    return raw


def from_dict(raw: dict) -> RunConfig:
    from raylowcomm.strategies import STRATEGIES

    raw = dict(raw or {})
    strategy_sections = {name: raw.pop(name) for name in list(raw) if name in STRATEGIES}
    if "options" in raw:
        raise ConfigError("options", raw["options"], f"write each strategy's options under its own name: {', '.join(STRATEGIES)}")
    cfg = build_dataclass(RunConfig, raw, "")
    for i, name in enumerate(cfg.strategies):
        if name not in STRATEGIES:
            raise ConfigError(f"strategies[{i}]", name, f"expected one of {', '.join(STRATEGIES)}")
    if len(set(cfg.strategies)) != len(cfg.strategies):
        raise ConfigError("strategies", cfg.strategies, "each strategy may appear once")
    cfg.options = {name: build_dataclass(STRATEGIES[name].Config, strategy_sections.get(name), name) for name in STRATEGIES}
    validate(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError("CONFIG", str(path), "no such file")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError("CONFIG", str(path), "the file must hold a YAML mapping")
    return from_dict(apply_overrides(raw, list(overrides)))


# --- validation --------------------------------------------------------------------------------

def _positive(name, value, allow_zero=False):
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(name, value, "must be >= 0" if allow_zero else "must be > 0")


def validate(cfg: RunConfig) -> None:
    from raylowcomm.strategies import STRATEGIES

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
    _positive("data.image_size", cfg.data.image_size)
    _positive("data.max_length", cfg.data.max_length)
    _positive("log_every", cfg.log_every)
    _positive("checkpoint_every", cfg.checkpoint_every)
    if cfg.eval_every < 0:
        raise ConfigError("eval_every", cfg.eval_every, "an integer >= 0 (0: evaluate at the end only)")
    if cfg.nodes.gpus > 0:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("nodes.gpus", cfg.nodes.gpus, "this machine has no CUDA GPU; set nodes.gpus=0")
    text_data = cfg.data.name in ("rotten_tomatoes", "hamlet", "speeches")
    lm_data = cfg.data.name in ("hamlet", "speeches")
    if cfg.model.family == "timm" and text_data:
        raise ConfigError("model.family", cfg.model.family, f"data '{cfg.data.name}' is text: use hf_classifier or hf_causal_lm")
    if cfg.model.family != "timm" and not text_data:
        raise ConfigError("model.family", cfg.model.family, f"data '{cfg.data.name}' is images: use timm")
    if cfg.model.family == "hf_causal_lm" and not lm_data and cfg.data.name != "rotten_tomatoes":
        raise ConfigError("data.name", cfg.data.name, "a causal LM needs text: hamlet, speeches or rotten_tomatoes")
    if cfg.model.family == "hf_classifier" and lm_data:
        raise ConfigError("data.name", cfg.data.name, "a classifier needs labelled data: rotten_tomatoes")
    if cfg.model.path is not None and not Path(cfg.model.path).exists():
        raise ConfigError("model.path", cfg.model.path, "no such file or folder; point it at your local weights or remove it")
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", cfg.data.path, "no such file; point it at your local data or remove it")
    for name in cfg.strategies:
        STRATEGIES[name].validate(cfg)
