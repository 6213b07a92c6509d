"""When lo-fi's nodes stop and how their states are averaged: the averaging boundaries, fragments
and landings of a run (`plan_rounds`), and the driver's gathering of the nodes' states."""

from __future__ import annotations

from dataclasses import dataclass

from raylowcomm.actors import DriverFetches, NodeGroup
from raylowcomm.common.batches import steps_per_epoch
from raylowcomm.config import RunConfig
from raylowcomm.strategies.base import eval_points
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.config import LofiConfig, fixed_period, round_boundaries, round_gaps
from raylowcomm.strategies.lofi.merging import NodeAverage
from raylowcomm.training import total_steps


def gather_nodes(
    group: NodeGroup, plan: Plan, phase: str, method: str = "weights", *args, fetch: DriverFetches | None = None
):
    """The nodes' `method(*args)` states, fetched at once (`NodeGroup.stream`) and gathered by the run's
    average as each lands: full weights into one running sum (one state deserialised at a time, while
    the driver's object store holds the others), adapters kept (with their weights, for the driver to
    combine on its base or a node to merge on its own)."""
    stream = group.stream(method, *args, phase=phase, what=plan.average.what, fetch=fetch)
    return plan.average.gather(stream, plan.weights)


def average_nodes(
    group: NodeGroup, plan: Plan, phase: str, method: str = "weights", *args, fetch: DriverFetches | None = None
) -> dict:
    """The average of the nodes' `method(*args)` states, as plain weights."""
    return plan.average.combine(gather_nodes(group, plan, phase, method, *args, fetch=fetch))


@dataclass
class Plan:
    """When the nodes stop: averaging boundaries, curve snapshots, and each node's weight."""

    steps: int
    boundaries: list[int]
    averaging: bool
    weights: list[float]
    snapshots: list[int]
    average: NodeAverage
    """How the nodes' states are gathered and combined (full weights, or adapters on their base)."""
    fragments: list[int | None]
    """The fragment each boundary's round syncs (ALL at the last; None throughout with one fragment)."""
    landings: list[int] | None = None
    """With lofi.overlap: the step at which the round sent at each boundary (but the last) lands."""

    def stop_at(self, step: int, i: int) -> None:
        """A run on a budget (`optim.budget_s`) ended at `step` (its furthest node's) before boundary i
        came: rounds 1..i are the ones that landed, and the final round, i + 1, is taken at `step`."""
        self.steps = step
        self.boundaries = self.boundaries[:i] + [step]
        self.fragments = self.fragments[: i + 1]
        self.snapshots = [s for s in self.snapshots if s <= step]


def plan_rounds(cfg: RunConfig, opts: LofiConfig, shard_sizes: list[int], average: NodeAverage) -> Plan:
    steps = total_steps(cfg.optim, min(shard_sizes))
    gaps = round_gaps(opts, steps_per_epoch(min(shard_sizes), cfg.optim.batch_size))
    if gaps is None:
        boundaries, fragments = [steps], None
    elif fixed_period(opts) and opts.fragments > 1:  # Streaming DiLoCo: fragments at staggered steps
        boundaries, fragments = streaming.schedule(gaps[0], opts.fragments, steps)
    else:  # the whole model at the gaps' running sums
        boundaries, fragments = round_boundaries(gaps, steps), None
    weights = [float(s) if opts.weighting == "examples" else 1.0 for s in shard_sizes]
    averaging = gaps is not None or opts.outer_optimizer != "none"
    return Plan(
        steps,
        boundaries,
        averaging,
        weights,
        eval_points(cfg, steps),
        average,
        fragments or [None] * len(boundaries),
        streaming.landings(boundaries, opts.overlap) if opts.overlap else None,
    )
