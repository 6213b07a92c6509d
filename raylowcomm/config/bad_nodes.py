"""Bad nodes (`bad_nodes:` in a config): nodes that send a wrong outer update, injected to measure
what one such node costs a run (docs/fault-tolerance.md#bad-nodes). The entry and the wrong update
itself are `core.bad_updates`; here: the checks before anything starts, which strategies carry it,
and what the record books."""

from __future__ import annotations

import math

from raylowcomm.config.schema import ConfigError, RunConfig
from raylowcomm.core.bad_updates import UPDATE_KINDS

HONOURED_BY = ("lofi",)
"""The strategies whose rounds carry a node's update, where a bad one takes effect."""


def check_bad_nodes(cfg: RunConfig) -> str | None:
    """Refuse (ConfigError naming the entry's field) a node the run does not have, a scale that is not
    a finite number > 0 or set for a kind without one, a round below 1 or set for a kind that trains
    wrongly, a node named twice, a wrong update where lo-fi's nodes send none (its driver star); return
    why the section cannot take effect where no strategy of the run carries it, else None."""
    slots = cfg.nodes.most + len(getattr(cfg.options.get("lofi"), "join", ()))
    for i, e in enumerate(cfg.bad_nodes):
        if not 0 <= e.node < slots:
            raise ConfigError(f"bad_nodes[{i}].node", e.node, f"name one of the nodes 0..{slots - 1}")
        if not (math.isfinite(e.scale) and e.scale > 0):
            raise ConfigError(f"bad_nodes[{i}].scale", e.scale, "give a finite number > 0 (10: ten times Δ)")
        if e.update in ("nonfinite", "permuted_labels") and e.scale != 10.0:
            raise ConfigError(f"bad_nodes[{i}].scale", e.scale, f"{e.update} has no scale: remove it")
        if e.round is not None and e.update not in UPDATE_KINDS:
            raise ConfigError(f"bad_nodes[{i}].round", e.round, f"{e.update} trains wrongly from the start: remove it")
        if e.round is not None and e.round < 1:
            raise ConfigError(f"bad_nodes[{i}].round", e.round, "rounds count from 1: give one >= 1, or null")
    nodes = [e.node for e in cfg.bad_nodes]
    if len(set(nodes)) != len(nodes):
        raise ConfigError("bad_nodes", nodes, "name each bad node once")
    if not set(HONOURED_BY) & set(cfg.strategies):
        return "only lo-fi's rounds carry a node's update: add lofi to strategies, or remove bad_nodes"
    lofi = cfg.options.get("lofi")
    sent = [e for e in cfg.bad_nodes if e.update in UPDATE_KINDS]
    if (
        sent
        and "lofi" in cfg.strategies
        and not (lofi.exchange == "peers" or lofi.compress != "none" and lofi.exchange == "auto")
    ):
        raise ConfigError(
            "bad_nodes",
            booked(cfg, "lofi"),
            "lo-fi's driver star gathers each node's whole state, and its nodes keep no global model to measure "
            "an update from: set lofi.exchange: peers (or a lofi.compress codec) so that nodes send their Δ",
        )
    return None


def booked(cfg: RunConfig, strategy: str) -> list[dict] | None:
    """The bad nodes as `strategy`'s record books them (`bad_nodes` in its details), where it carries them."""
    if not cfg.bad_nodes or strategy not in HONOURED_BY:
        return None
    return [{"node": e.node, "update": e.update, "scale": e.scale, "round": e.round} for e in cfg.bad_nodes]
