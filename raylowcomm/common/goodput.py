"""Goodput: the share of the node-seconds a run reserved that went into training whose result reached
the model (Decoupled DiLoCo's measure of what churn costs), from each strategy's own account of its
nodes (`goodput` in results.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class NodeAccount:
    node: int
    useful_s: float
    """Training whose result reached the model."""
    idle_at_barriers_s: float
    """Waiting for other nodes: for the slowest in lockstep, for its round in quorum rounds."""
    lost_s: float | None
    """Training lost with the node (a death), where the strategy can time it."""
    restarts: int = 0
    joins: int = 0
    reserved_s: float | None = None
    """Seconds the node was in the run (from its join to its leave); None: the whole training phase."""


def goodput(accounts: list[NodeAccount], reserved_s: float, **extra) -> dict:
    """Each node was reserved for `reserved_s` (the training phase's wall time), or for its own time in the
    run where it joined or left: its goodput is its useful seconds over that, and the run's is useful
    node-seconds over reserved node-seconds."""
    held = [a.reserved_s if a.reserved_s is not None else reserved_s for a in accounts]
    nodes = [{**asdict(a), "reserved_s": r, "goodput": a.useful_s / r if r else None} for a, r in zip(accounts, held)]
    useful, reserved = sum(a.useful_s for a in accounts), sum(held)
    return {
        "goodput": useful / reserved if reserved else None,
        "useful_node_s": useful,
        "reserved_node_s": reserved,
        "idle_at_barriers_node_s": sum(a.idle_at_barriers_s for a in accounts),
        "restarts": sum(a.restarts for a in accounts),
        "joins": sum(a.joins for a in accounts),
        **extra,
        "nodes": nodes,
    }
