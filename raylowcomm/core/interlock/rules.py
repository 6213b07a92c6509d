"""Interlocking's routing rules as sets of heads (see `routing`'s docstring): which heads' losses
update each stage, which gradients a stage sends upstream, and the messages each stage emits per
micro-batch. Plain Python over stage indices: the stages, the pipeline schedule and the planner
all derive what crosses from them."""

from __future__ import annotations

from typing import Literal

Rule = Literal["farthest", "sum"]
RULES: tuple[str, ...] = ("farthest", "sum")


def check_routing(num_stages: int, width: int, rule: str) -> None:
    """A ValueError unless `rule` is one of RULES and 1 <= width <= num_stages."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not 1 <= width <= num_stages:
        raise ValueError(f"width must be in 1..{num_stages} (number of stages), got {width}")


def update_heads(k: int, num_stages: int, width: int, rule: Rule) -> frozenset[int]:
    """U(k): the heads whose losses update stage k's parameters (see `routing`'s docstring)."""
    check_routing(num_stages, width, rule)
    last = min(k + width - 1, num_stages - 1)
    return frozenset({last}) if rule == "farthest" else frozenset(range(k, last + 1))


def upstream_heads(k: int, num_stages: int, width: int, rule: Rule) -> frozenset[int]:
    """Heads j whose dL_j/dx_k stage k must send to stage k - 1 (some earlier stage uses them)."""
    needed: set[int] = set()
    for i in range(k):
        needed |= {j for j in update_heads(i, num_stages, width, rule) if j >= k}
    return frozenset(needed)


def message_plan(num_stages: int, width: int, rule: str) -> list[list[frozenset[int]]]:
    """For each stage k, the heads carried by each upstream message it emits per micro-batch,
    in emission order: first its forward's early message, then one per backward call (one
    backward call per message stage k + 1 emits). Empty sets are messages never sent."""
    plan: list[list[frozenset[int]]] = [[] for _ in range(num_stages)]
    for k in reversed(range(num_stages)):
        up = upstream_heads(k, num_stages, width, rule)
        incoming = [h for h in plan[k + 1] if h] if k + 1 < num_stages else []
        plan[k] = [frozenset({k}) & up] + [h & up for h in incoming]
    return plan
