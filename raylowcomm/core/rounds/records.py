"""What quorum rounds' policy keeps: the run's rules, each node's log, the segments in flight, the payloads
waiting for a round, the landed rounds and what the record tells of them. Plain data, no Ray: a payload
is an opaque handle the policy hands back, never looks into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rules:
    """What the policy decides by, fixed for a run."""

    quorum: int | float
    """Payloads a round needs: a node count, or a fraction of the live nodes (`quorum_of`)."""
    grace_s: float
    """How long a round whose quorum is in waits for a node expected within it."""
    staleness: float
    """τ's exponent in a late payload's discount (`staleness_weight`)."""
    keep_training: bool
    """A node trains on while its payload waits (two of its payloads may wait at once)."""
    period_s: float | None
    """Sync by time: a segment's seconds of training; None: segments end at the plan's boundaries."""
    boundaries: list[int]
    """The plan's round boundaries, in steps of a node's own schedule."""
    weights: dict[int, float]
    """Each node slot's weight in a round (joiners' too); under sync by time a payload weighs its examples."""
    count: int
    """The nodes the budget is for (a range's max): the run's step is the node-steps over them."""
    leaves: dict[int, int] = field(default_factory=dict)
    """lofi.leave: node -> the step it leaves at."""
    joins: list[tuple[int, int]] = field(default_factory=list)
    """lofi.join: (node slot, the run's step it joins at), in order."""


@dataclass
class NodeLog:
    """The driver's account of one node: what it has done and what it holds."""

    step: int = 0
    rounds: int = 0
    """The rounds it has landed."""
    useful_s: float = 0.0
    """Training whose payload landed in a round."""
    lost_s: float = 0.0
    """Segments lost with the node (a death), as the driver timed them."""
    waiting_s: float = 0.0
    """Time between its payload's arrival and its next segment: the round it waited for."""
    restarts: int = 0
    joined_at: float | None = None
    """When it joined (lofi.join), on the driver's clock; None: a first node."""
    left_at: float | None = None
    """When it left the run (lofi.leave, or its restarts spent)."""
    reset: bool = False
    """Restarted: its next segment starts from its global model (what it trained since is lost)."""
    pace_s: float | None = None
    """Its last segment's wall time, from the call to its arrival: when its next one should arrive
    (under sync by time, its training seconds and the rest of that wall time: `overhead_s`)."""
    step_s: float | None = None
    """That wall time per step it trained: what a segment of its costs (`tail_steps`)."""
    overhead_s: float = 0.0
    """Its last segment's wall time outside training (landing, encoding, the calls): 0 before one."""
    idle_since: float | None = None
    """When its last payload arrived, until its next segment: the time it waits (`waiting_s`)."""
    segments: list[dict] = field(default_factory=list)
    """Each segment's report as the record tells it, with its node and wall time."""


@dataclass(frozen=True)
class Flight:
    """A segment in flight: node `node` trains from step `start` to `until` (or `seconds` of training under
    sync by time), sent at `sent_at` on the driver's clock."""

    id: int
    node: int
    start: int
    until: int
    sent_at: float
    seconds: float | None


@dataclass(frozen=True)
class SegmentReport:
    """What a node's segment reports as its payload arrives."""

    step: int
    """The step it reached (short of the segment's end where sync by time stopped it)."""
    base_round: int
    """The round its Δ started from."""
    samples: int
    """Examples its segment trained on: all its Δ holds, as the node started the segment from its global model
    (or, `keep_training`, from where it last sent)."""
    train_s: float
    nbytes: int
    token: str | None = None
    """`keep_training`: the node's name for its payload, by which it learns that a round merged it."""
    record: dict = field(default_factory=dict)
    """The whole report, as the record keeps it (`NodeLog.segments`)."""


@dataclass(frozen=True)
class Arrival:
    """A payload in the driver's hands, waiting for its round."""

    node: int
    payload: Any
    """The driver's handle on it (an object ref): the policy hands it back in the round, never looks into it."""
    base: int
    """The round its Δ started from."""
    nbytes: int
    train_s: float
    samples: int
    arrived_at: float
    token: str | None = None


@dataclass(frozen=True)
class LandedRound:
    """Round `number`: its payloads in node order, each with its weight."""

    number: int
    payloads: list[Arrival]
    weights: list[float]

    def record(self) -> list[dict]:
        """What the record says of it: each payload's node, base round, examples and weight."""
        return [
            {"node": a.node, "base": a.base, "samples": a.samples, "weight": weight}
            for a, weight in zip(self.payloads, self.weights)
        ]

    def args(self) -> tuple[int, list[list], list[float]]:
        """What a node lands it from: its number, the payload handles (each in a list, so that nobody
        resolves it on the way) and the weights."""
        return self.number, [[a.payload] for a in self.payloads], self.weights


@dataclass
class RunRecord:
    """What the run's record tells of its rounds and its membership."""

    landed: list[list[dict]] = field(default_factory=list)
    """Every landed round as the record tells it (`LandedRound.record`)."""
    late: list[int] = field(default_factory=list)
    """The staleness τ of every payload merged late."""
    departed: list[int] = field(default_factory=list)
    """Nodes out of the run: left (lofi.leave) or died with their restarts spent."""
    died_of: dict[int, dict] = field(default_factory=dict)
    """What each node that died with its restarts spent died of ({type, message}): the first cause."""
    joined: list[dict] = field(default_factory=list)
    left: list[dict] = field(default_factory=list)
