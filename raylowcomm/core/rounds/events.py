"""What happens to quorum rounds (events, each with the driver's clock `now` where time matters) and what
the policy decides of it (decisions, for the driver to carry out in the order given)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raylowcomm.core.rounds.records import LandedRound, SegmentReport


@dataclass(frozen=True)
class Begin:
    """The run's segments start on `members`; `booked` (a range's nodes past its min) start once the
    cluster holds them."""

    now: float
    members: list[int]
    booked: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Arrived:
    """Segment `flight` of node `node` ended: its report, and the handle on its payload."""

    node: int
    flight: int
    report: SegmentReport
    payload: object
    now: float


@dataclass(frozen=True)
class Died:
    """Node `node` died: with segment `flight` in flight (lost), or None while it joined or restarted."""

    node: int
    flight: int | None
    now: float


@dataclass(frozen=True)
class Restarted:
    """Node `node`'s actor started again after it died."""

    node: int


@dataclass(frozen=True)
class RestartsSpent:
    """Node `node` died with its restarts spent: it is out of the run."""

    node: int
    now: float


@dataclass(frozen=True)
class Joined:
    """Node `node` holds a global model again (joined, or restarted): `rounds` landed, at `step`."""

    node: int
    rounds: int
    step: int
    now: float


@dataclass(frozen=True)
class Appeared:
    """A range's node `node` started: the cluster holds it."""

    node: int
    now: float


@dataclass(frozen=True)
class NotStarted:
    """A range's node `node` failed to start: it is out."""

    node: int


@dataclass(frozen=True)
class Tick:
    """Time passed (a wait ended, with or without events): joins due, a round due, idle nodes."""

    now: float


@dataclass(frozen=True)
class Finish:
    """The training is over: the payloads still waiting land as the final round on `members`."""

    members: list[int]


@dataclass(frozen=True)
class Assign:
    """Node `node` trains segment `flight` to step `until` (under sync by time at most `seconds` of
    training), after landing `catch_up`; `merged`: its payloads' tokens those rounds merged; `reset`: it
    starts from its global model."""

    node: int
    flight: int
    until: int
    seconds: float | None
    catch_up: list[LandedRound]
    merged: list[str]
    reset: bool


@dataclass(frozen=True)
class Land:
    """Round `round` lands: its payloads (node order) and weights go into the log."""

    round: LandedRound


@dataclass(frozen=True)
class Progress:
    """The run reached step `step` (a round landed): the driver tells its progress."""

    step: int


@dataclass(frozen=True)
class Join:
    """Node `node` becomes a member: it adopts node `adopt_from`'s global model (its round file; None: the
    start). `why` (schedule: start its actor; cluster: it started) and `step` name a new member; None: a
    joiner that died before it joined joins again."""

    node: int
    adopt_from: int | None
    why: str | None = None
    step: int = 0


@dataclass(frozen=True)
class Rejoin:
    """Node `node`, restarted, says which round and step its checkpoint and round file hold."""

    node: int


@dataclass(frozen=True)
class Restart:
    """Node `node` died: start it again (`Restarted`), or it leaves the run (`RestartsSpent`)."""

    node: int


@dataclass(frozen=True)
class Leave:
    """Node `node` leaves (lofi.leave) at its step `step`: its actor ends; its payload waiting still merges."""

    node: int
    step: int


@dataclass(frozen=True)
class Dismiss:
    """Node `node` does not join: the run's budget of steps is spent (its actor, if any, ends)."""

    node: int


@dataclass(frozen=True)
class Book:
    """Start a range's nodes `nodes`, unplaced: each joins once the cluster holds it (`Appeared`)."""

    nodes: list[int]


@dataclass(frozen=True)
class CatchUp:
    """At the end, node `node` lands `rounds`, the rounds it has not."""

    node: int
    rounds: list[LandedRound]


@dataclass(frozen=True)
class Wait:
    """Wait for the next event until `until` on the driver's clock (None: until one comes)."""

    until: float | None


Event = Begin | Arrived | Died | Restarted | RestartsSpent | Joined | Appeared | NotStarted | Tick | Finish
Decision = Assign | Land | Progress | Join | Rejoin | Restart | Leave | Dismiss | Book | CatchUp | Wait
