"""Strategy registry: a new strategy is one module plus one line here. The registry also turns
a raw config mapping into a `RunConfig` with every strategy's own options, since only it knows
which sections belong to strategies (the config package knows none of them)."""

from __future__ import annotations

from pathlib import Path

from raylowcomm.config import ConfigError, RunConfig, build_dataclass, read_yaml, validate
from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.interlocking import Interlocking
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.strategies.spsa import Spsa

STRATEGIES = {s.name: s for s in (Lofi, Ddp, Spsa, Interlocking)}


def from_dict(raw: dict) -> RunConfig:
    """A validated RunConfig from a mapping (a YAML file's content): shared fields first, then
    each listed strategy's own checks."""
    raw = dict(raw or {})
    strategy_sections = {name: raw.pop(name) for name in list(raw) if name in STRATEGIES}
    if "options" in raw:
        raise ConfigError(
            "options", raw["options"], f"write each strategy's options under its own name: {', '.join(STRATEGIES)}"
        )
    cfg = build_dataclass(RunConfig, raw, "")
    if not cfg.strategies:
        raise ConfigError("strategies", cfg.strategies, f"name at least one strategy to run: {', '.join(STRATEGIES)}")
    for i, name in enumerate(cfg.strategies):
        if name not in STRATEGIES:
            raise ConfigError(f"strategies[{i}]", name, f"expected one of {', '.join(STRATEGIES)}")
    if len(set(cfg.strategies)) != len(cfg.strategies):
        raise ConfigError("strategies", cfg.strategies, "each strategy may appear once")
    cfg.options = {
        name: build_dataclass(STRATEGIES[name].Config, strategy_sections.get(name), name) for name in STRATEGIES
    }
    validate(cfg)
    for name in cfg.strategies:
        STRATEGIES[name].validate(cfg)
        check_hosts(cfg, name)
    nodes_may_load(cfg)
    return cfg


def nodes_may_load(cfg: RunConfig) -> bool:
    """Whether the nodes may load the weights themselves (model.source nodes or auto): not where a
    strategy of the run, or model.merge, needs them on the driver; model.source: nodes there is a
    ConfigError. Whether every host can read them is asked later, once Ray runs (`RunContext`)."""
    reasons = [r for name in cfg.strategies if (r := STRATEGIES[name].driver_weights(cfg))]
    if cfg.model.merge:
        reasons.append("model.merge merges the adapters into the base on the driver")
    if cfg.model.source == "nodes" and reasons:
        raise ConfigError("model.source", "nodes", f"{reasons[0]}: set model.source: auto (or driver)")
    return cfg.model.source != "driver" and not reasons


def check_hosts(cfg: RunConfig, name: str) -> None:
    """nodes.hosts names one host per actor strategy `name` starts (its own bundles and Ray Train's)."""
    hosts, s = cfg.nodes.hosts, STRATEGIES[name]
    if hosts is None:
        return
    if not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError("nodes.hosts", hosts, "a list of Ray node addresses or node ids, one per actor")
    count = len(s.bundles(cfg) + s.external_bundles(cfg))
    if len(hosts) != count:
        raise ConfigError("nodes.hosts", hosts, f"{name} starts {count} actors (its {s.count_field}, SPSA's "
                          f"joiners after them): give one host per actor, not {len(hosts)}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """A config file plus `--set key=value` overrides, validated before anything starts."""
    return from_dict(read_yaml(path, overrides))
