"""A schedule of nodes leaving and joining a run at step boundaries (SPSA's elastic membership),
checked before anything starts. Plain Python: node ids are slots, the initial nodes
0..count-1 and the i-th joiner count + i."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class LeaveEvent:
    node: int
    """The id of the node that leaves (a joined node's id is nodes.count + i)."""
    step: int
    """The node takes no part in this step or later ones."""
    how: Literal["remove", "kill"] = "remove"
    """remove: the driver drops the node and ends its actor; kill: the actor process exits
    abruptly (a crash) and the driver finds out when its next call fails."""


@dataclass
class JoinEvent:
    step: int
    """A new node (id nodes.count + i for the i-th join) takes part from this step on."""


class ScheduleError(ValueError):
    """A schedule that cannot run: `field` names the entry (e.g. leave[1].node)."""

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"{field} = {value!r}: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def check_schedule(count: int, leave: list[LeaveEvent], join: list[JoinEvent], steps: int | None = None) -> None:
    """Walk the schedule: steps in range, joins in order, every leave names a node running
    then, and one node always remains."""
    for kind, events in (("join", join), ("leave", leave)):
        for i, ev in enumerate(events):
            if ev.step < 1:
                raise ScheduleError(f"{kind}[{i}].step", ev.step, "must be >= 1 (step 0 starts with nodes.count nodes)")
            if steps is not None and ev.step >= steps:
                raise ScheduleError(f"{kind}[{i}].step", ev.step, f"the run has {steps} steps (0..{steps - 1})")
    if any(b.step < a.step for a, b in zip(join, join[1:])):
        raise ScheduleError(
            "join", [e.step for e in join], "list joins in step order (they get node ids in that order)"
        )
    alive, next_id = set(range(count)), count
    for step in sorted({e.step for e in leave} | {e.step for e in join}):
        for i, ev in enumerate(leave):
            if ev.step == step:
                if ev.node not in alive:
                    raise ScheduleError(
                        f"leave[{i}].node",
                        ev.node,
                        f"no such node is running at step {step} (running: {sorted(alive)})",
                    )
                alive.discard(ev.node)
                if not alive:
                    raise ScheduleError(f"leave[{i}]", {"node": ev.node, "step": step}, "would leave no node running")
        joining = sum(ev.step == step for ev in join)
        alive |= set(range(next_id, next_id + joining))
        next_id += joining
