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


def goodput(accounts: list[NodeAccount], reserved_s: float, **extra) -> dict:
    """Each node was reserved for `reserved_s` (the training phase's wall time): its goodput is its
    useful seconds over that, and the run's is useful node-seconds over reserved node-seconds."""
    nodes = [
        {**asdict(a), "reserved_s": reserved_s, "goodput": a.useful_s / reserved_s if reserved_s else None}
        for a in accounts
    ]
    useful, reserved = sum(a.useful_s for a in accounts), reserved_s * len(accounts)
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
