"""A sweep file: read, checked value by value against the run config before Ray starts."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from raylowcomm.config import ConfigError, RunConfig, apply_overrides, build_dataclass, load_yaml_mapping
from raylowcomm.strategies import STRATEGIES, from_dict
from raylowcomm.tune.metrics import unreported

SPACES = ("grid", "choice", "uniform", "loguniform")
# The driver of a trial waits on its actors most of the time; its bundle holds no CPU so that
# a trial of N one-CPU actors fits on N CPUs.
TRIAL_DRIVER_BUNDLE: dict[str, float] = {}


class SweepError(ValueError):
    """A bad sweep file; the message names the key and what is allowed."""


@dataclass
class AshaConfig:
    metric: str = "train_loss"
    """A progress metric the strategies report while training (ctx.report), e.g. train_loss."""
    mode: Literal["min", "max"] = "min"
    time_attr: str = "training_iteration"
    """What counts as time: Tune's count of reports, or a reported metric such as `step`."""
    grace_period: int = 1
    max_t: int = 100
    reduction_factor: float = 2.0


@dataclass
class SweepConfig:
    base: str
    """The run config the trials start from, relative to the sweep file."""
    space: dict[str, Any]
    metric: str
    mode: Literal["min", "max"]
    set: dict[str, Any] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)
    """More reported metrics shown beside `metric` in the table and summary.json (e.g. both
    strategies' accuracies when a trial runs lofi and ddp)."""
    num_samples: int = 1
    max_concurrent: int | None = None
    asha: AshaConfig | None = None
    storage_path: str = "runs/tune"
    name: str | None = None
    """Experiment folder under storage_path (default: the sweep file's name and a timestamp)."""


@dataclass
class Sweep:
    """A validated sweep: the base config as a raw mapping with the fixed overrides applied."""

    spec: SweepConfig
    raw: dict
    cfg: RunConfig
    samples: dict[str, list]
    """Values per swept key that were checked by building the config (and size the reservation)."""
    path: Path


def with_values(raw: dict, values: dict[str, Any]) -> dict:
    """A copy of `raw` with dotted keys set, e.g. {"optim.lr": 0.01}."""
    raw = copy.deepcopy(raw)
    for dotted, value in values.items():
        node, keys = raw, dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, value, f"'{k}' is not a section")
        node[keys[-1]] = value
    return raw


def _space_samples(key: str, spec: Any) -> tuple[str, list]:
    """The kind of one search space and the values that represent it (all of a grid, both bounds)."""
    where = f"space.{key}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPACES:
        raise SweepError(
            f"{where}: expected a mapping with one of {', '.join(SPACES)}, e.g. {{grid: [1, 2]}}; got {spec!r}"
        )
    kind, values = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}.{kind}: expected a non-empty list of values; got {values!r}")
        return kind, values
    if (
        not isinstance(values, list)
        or len(values) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        or values[0] >= values[1]
    ):
        raise SweepError(f"{where}.{kind}: expected [low, high] with low < high; got {values!r}")
    if kind == "loguniform" and values[0] <= 0:
        raise SweepError(f"{where}.loguniform: bounds must be > 0; got {values!r}")
    return kind, [float(v) for v in values]


def load_sweep(path: str | Path, overrides: list[str] = ()) -> Sweep:
    """Read and check a sweep file; every swept value is tried on the config before Ray starts."""
    path = Path(path)
    spec, raw = _read_sweep(path)
    try:
        raw = apply_overrides(with_values(raw, spec.set), list(overrides))
        cfg = from_dict(raw)
    except ConfigError as err:
        raise SweepError(f"sweep file {path}: base config with 'set' and --set: {err}") from None
    if cfg.nodes.hosts is not None or any(k.split(".")[:2] == ["nodes", "hosts"] for k in spec.space):
        raise SweepError(
            f"sweep file {path}: nodes.hosts: pinning is for a run, not a sweep (concurrent trials would share "
            "each pinned host): leave it unset"
        )
    for section in ("model", "data"):  # user paths stay relative to where the sweep was started
        value = raw.get(section, {}).get("path")
        if value is not None:
            raw[section]["path"] = str(Path(value).resolve())
    samples, configs = _checked_samples(path, spec, raw, cfg)
    prefixes = [f"{s}/" for s in cfg.strategies] if len(cfg.strategies) > 1 else [""]
    named = [("metric", spec.metric)] + [(f"columns[{i}]", c) for i, c in enumerate(spec.columns)]
    named += [("asha.metric", spec.asha.metric)] if spec.asha else []
    for where, metric in named:
        if not any(metric.startswith(p) for p in prefixes):
            raise SweepError(
                f"sweep file {path}: {where} = {metric!r}: with several strategies, name the strategy, "
                f"e.g. {prefixes[0]}{metric}"
            )
    problem = unreported(path, named, [cfg, *configs])  # before Ray starts, not after a whole trial ran
    if problem is not None:
        raise SweepError(problem)
    return Sweep(spec, raw, cfg, samples, path)


def _read_sweep(path: Path) -> tuple[SweepConfig, dict]:
    """The sweep file's own fields, checked, and its base config as a raw mapping."""
    if not path.exists():
        raise SweepError(f"sweep file {path}: no such file")
    try:
        data = load_yaml_mapping(path, "SWEEP")
    except ConfigError as err:  # a folder, unreadable, malformed YAML (with line and column), not a mapping
        raise SweepError(f"sweep file {path}: {err}") from None
    try:
        spec: SweepConfig = build_dataclass(SweepConfig, data, "")
    except (ConfigError, TypeError) as err:
        raise SweepError(f"sweep file {path}: {err}") from None
    if not spec.space:
        raise SweepError(f"sweep file {path}: 'space' is empty; name at least one config field to sweep")
    for k in ("num_samples", "max_concurrent"):
        if getattr(spec, k) is not None and getattr(spec, k) < 1:
            raise SweepError(f"sweep file {path}: {k} = {getattr(spec, k)} must be >= 1")
    base = path.parent / spec.base
    if not base.exists():
        raise SweepError(
            f"sweep file {path}: base = {spec.base!r}: no such file (paths are relative to the sweep file: {base})"
        )
    try:
        return spec, load_yaml_mapping(base, "base")
    except ConfigError as err:
        raise SweepError(f"sweep file {path}: {err}") from None


def _checked_samples(path: Path, spec: SweepConfig, raw: dict, cfg: RunConfig) -> tuple[dict[str, list], list]:
    """The values that represent each swept key, each tried on the config (with the other keys at
    their first value), and the configs so built."""
    samples: dict[str, list] = {}
    configs: list[RunConfig] = []
    first = {k: _space_samples(k, v)[1][0] for k, v in spec.space.items()}
    for key, space in spec.space.items():
        section = key.split(".")[0]
        if section in STRATEGIES and section not in cfg.strategies:
            raise SweepError(
                f"sweep file {path}: space.{key} sweeps options of '{section}', which this sweep does "
                f"not run (strategies: {cfg.strategies}); set strategies in 'set'"
            )
        _, values = _space_samples(key, space)
        for value in values:
            try:
                configs.append(from_dict(with_values(raw, {**first, key: value})))
            except ConfigError as err:
                raise SweepError(f"sweep file {path}: space.{key} value {value!r}: {err}") from None
        samples[key] = values
    return samples, configs
