"""A run's config from a raw mapping, given the strategies a build offers: the shared fields, each
strategy's own section typed into its options dataclass, and every check before anything starts.
The strategy table is a parameter, not an import: config sits below the strategies (the registry,
`raylowcomm.strategies`, binds its table into `load_config` / `from_dict`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from raylowcomm.config.applicability import check_applicability
from raylowcomm.config.checks import validate
from raylowcomm.config.loading import build_dataclass, read_yaml
from raylowcomm.config.schema import ConfigError, RunConfig


class StrategyOptions(Protocol):
    """What loading a config asks of a strategy (`raylowcomm.strategies.base.Strategy` has it all)."""

    name: str
    Config: type
    """The dataclass its YAML section fills."""
    fp32_updates: bool
    """Whether its optimizer steps every weight it trains, so full fine-tuning needs fp32 weights."""
    count_field: str
    elastic_nodes: bool
    """Whether it takes a range of nodes (`nodes.count: [min, max]`)."""
    runs_by_default: bool
    """Whether a config that names no strategies runs it."""
    ignores: dict[str, str]
    """Shared fields it cannot honour, with what it does instead (`applicability`)."""
    option_rules: dict
    """When each of its options can take effect (`applicability.Rule` by field name)."""

    @staticmethod
    def validate(cfg: RunConfig) -> None: ...

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None: ...

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]: ...

    @staticmethod
    def external_bundles(cfg: RunConfig) -> list[dict[str, float]]: ...


def from_dict(raw: dict, strategies: Mapping[str, StrategyOptions]) -> RunConfig:
    """A validated RunConfig from a mapping (a YAML file's content): shared fields first, then
    each listed strategy's own checks."""
    raw = dict(raw or {})
    names = ", ".join(strategies)
    strategy_sections = {name: raw.pop(name) for name in list(raw) if name in strategies}
    if "options" in raw:
        raise ConfigError("options", raw["options"], f"write each strategy's options under its own name: {names}")
    cfg = build_dataclass(RunConfig, raw, "")
    if cfg.strategies is None:
        cfg.strategies = [name for name, s in strategies.items() if s.runs_by_default]
    if not cfg.strategies:
        raise ConfigError("strategies", cfg.strategies, f"name at least one strategy to run: {names}")
    for i, name in enumerate(cfg.strategies):
        if name not in strategies:
            raise ConfigError(f"strategies[{i}]", name, f"expected one of {names}")
    if len(set(cfg.strategies)) != len(cfg.strategies):
        raise ConfigError("strategies", cfg.strategies, "each strategy may appear once")
    cfg.options = {name: build_dataclass(s.Config, strategy_sections.get(name), name) for name, s in strategies.items()}
    validate(cfg, fp32_updating=[name for name in cfg.strategies if strategies[name].fp32_updates])
    for name in cfg.strategies:
        if cfg.nodes.elastic and not strategies[name].elastic_nodes:
            raise ConfigError(
                "nodes.count",
                cfg.nodes.count_as_given(),
                f"{name} runs a fixed number of nodes; a range is for lo-fi's quorum rounds: give one number",
            )
        strategies[name].validate(cfg)
        check_hosts(cfg, strategies[name])
    nodes_may_load(cfg, strategies)
    check_applicability(cfg, strategies)
    return cfg


def load_config(path: str | Path | None, overrides: list[str], strategies: Mapping[str, StrategyOptions]) -> RunConfig:
    """A config file plus `--set key=value` overrides, validated before anything starts."""
    return from_dict(read_yaml(path, overrides), strategies)


def nodes_may_load(cfg: RunConfig, strategies: Mapping[str, StrategyOptions]) -> bool:
    """Whether the nodes may load the weights themselves (model.source nodes or auto): not where a
    strategy of the run, or model.merge, needs them on the driver; model.source: nodes there is a
    ConfigError. Whether every host can read them is asked later, once Ray runs (`RunContext`)."""
    reasons = [r for name in cfg.strategies if (r := strategies[name].driver_weights(cfg))]
    if cfg.model.merge:
        reasons.append("model.merge merges the adapters into the base on the driver")
    if cfg.model.source == "nodes" and reasons:
        raise ConfigError("model.source", "nodes", f"{reasons[0]}: set model.source: auto (or driver)")
    return cfg.model.source != "driver" and not reasons


def check_hosts(cfg: RunConfig, strategy: StrategyOptions) -> None:
    """nodes.hosts names one host per actor `strategy` starts (its own bundles and Ray Train's)."""
    hosts = cfg.nodes.hosts
    if hosts is None:
        return
    if not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError("nodes.hosts", hosts, "a list of Ray node addresses or node ids, one per actor")
    count = len(strategy.bundles(cfg) + strategy.external_bundles(cfg))
    if len(hosts) != count:
        raise ConfigError(
            "nodes.hosts",
            hosts,
            f"{strategy.name} starts {count} actors (its {strategy.count_field} "
            f"and any it adds after them): give one host per actor, not {len(hosts)}",
        )
