"""Strategy registry: a new strategy is one module plus one line here. Loading a config needs the
table (only it knows which YAML sections belong to strategies; the config package knows none of
them), so the public `load_config` and `from_dict` bind it here."""

from __future__ import annotations

from pathlib import Path

from raylowcomm.config import RunConfig, assemble
from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.interlocking import Interlocking
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.strategies.spsa import Spsa

STRATEGIES = {s.name: s for s in (Lofi, Ddp, Spsa, Interlocking)}


def from_dict(raw: dict) -> RunConfig:
    """A validated RunConfig from a mapping (a YAML file's content): `config.assemble.from_dict`."""
    return assemble.from_dict(raw, STRATEGIES)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """A config file plus `--set key=value` overrides, validated before anything starts."""
    return assemble.load_config(path, overrides, STRATEGIES)


def nodes_may_load(cfg: RunConfig) -> bool:
    """Whether the nodes may load the weights themselves: `config.assemble.nodes_may_load`."""
    return assemble.nodes_may_load(cfg, STRATEGIES)
