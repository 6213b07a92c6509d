"""Lockstep rounds' policy (`LockstepPolicy.decide`), plain Python: events in, decisions out. Every node
trains to the next round boundary, then the exchange's averaging round is taken, until the last boundary
or the end of the training budget (`optim.budget_s`). The Ray loop (`strategies/lofi/lockstep.py`) carries
the decisions out and tells the policy what each call and round took. With every node on time and a
quorum of every node, quorum rounds (`QuorumPolicy`) land the same rounds at the same boundaries.

With overlapped rounds (`lofi.overlap`) the round sent at boundary i − 1 lands in the call up to boundary
i, at its landing step. A budget spent in a segment ends the run there: the final round is taken where
the furthest node stands. A budget spent by a round ends it at that round's boundary, the round in
flight (overlapped) landing where the nodes stand."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Started:
    """The run's training begins at boundary `first` (a resumed run's: the rounds before it landed)."""

    first: int


@dataclass(frozen=True)
class SegmentTrained:
    """Every node's call up to the boundary ended: `reached`, the furthest node's step; `train_s`, the run's
    training seconds with it."""

    reached: int
    train_s: float


@dataclass(frozen=True)
class RoundTaken:
    """The averaging round ended: `train_s`, the run's training seconds with it."""

    train_s: float


@dataclass(frozen=True)
class Landing:
    """An overlapped round in flight: round `round`, sent at the boundary before, lands at step `step`."""

    round: int
    step: int


@dataclass(frozen=True)
class TrainTo:
    """Every node trains from step `since` to boundary `index`, step `until` (`last`: the run's last
    boundary), in at most `seconds` of training (None: no budget), landing `landing` on the way."""

    index: int
    since: int
    until: int
    last: bool
    seconds: float | None
    landing: Landing | None


@dataclass(frozen=True)
class ExchangeRound:
    """Averaging round `round`, at step `until` of every node."""

    round: int
    until: int


@dataclass(frozen=True)
class LandAtStop:
    """The budget is spent with round `round` in flight: it lands where the nodes stand, at step `at`."""

    round: int
    at: int


@dataclass(frozen=True)
class StopAt:
    """The budget ended the run at step `step` before boundary `index` came: rounds 1..index landed, and
    the final round is taken at `step` (`Plan.stop_at`)."""

    step: int
    index: int


@dataclass(frozen=True)
class Done:
    """The training is over."""


LockstepEvent = Started | SegmentTrained | RoundTaken
LockstepDecision = TrainTo | ExchangeRound | LandAtStop | StopAt | Done


class LockstepPolicy:
    """Decides, call by call, which boundary every node trains to next, whether a round is taken after it,
    and where the budget stops the run. A decision list ends in `TrainTo` or `ExchangeRound` (whose
    outcome is the next event) or in `Done`."""

    def __init__(self, boundaries: list[int], budget: float | None, steps: int, landings: list[int] | None = None):
        """`boundaries`: the steps rounds are taken at (the last is the run's end, `steps`); `landings`: with
        overlapped rounds, the step the round sent at each boundary but the last lands at."""
        self.boundaries, self.budget, self.steps, self.landings = list(boundaries), budget, steps, landings
        self.index = 0
        """The boundary the nodes train to, or last trained to."""
        self.reached: int | None = None
        """The furthest node's step after the last call (None: no call yet)."""
        self._handlers = {Started: self._started, SegmentTrained: self._segment_trained, RoundTaken: self._round_taken}

    def decide(self, event: LockstepEvent) -> list[LockstepDecision]:
        return self._handlers[type(event)](event)

    def _started(self, ev: Started) -> list[LockstepDecision]:
        self.index = ev.first
        return [self._train_to(0.0)] if ev.first < len(self.boundaries) else self._end()

    def _segment_trained(self, ev: SegmentTrained) -> list[LockstepDecision]:
        """After the last boundary the run ends; before it a budget spent in the segment stops the run
        where the furthest node stands, else the round at the boundary is taken."""
        self.reached = ev.reached
        if self.index == len(self.boundaries) - 1:
            return self._end()
        if self._spent(ev.train_s):
            return [self._stop_at(ev.reached, self.index), *self._end()]
        return [ExchangeRound(self.index + 1, self.boundaries[self.index])]

    def _round_taken(self, ev: RoundTaken) -> list[LockstepDecision]:
        """A budget the round spent stops the run at its boundary (the final round comes where that one
        did), the round in flight landing first; else the nodes train to the next boundary."""
        self.index += 1
        if not self._spent(ev.train_s):
            return [self._train_to(ev.train_s)]
        landing = self._landing(self.index)
        at = self.boundaries[self.index - 1]
        land = [LandAtStop(landing.round, at)] if landing is not None else []
        return [*land, self._stop_at(at, self.index), *self._end()]

    def _end(self) -> list[LockstepDecision]:
        """A last segment the budget ended short of the run's steps stops the run where it ended."""
        if self.budget is not None and self.reached is not None and self.reached < self.steps:
            return [self._stop_at(self.reached, len(self.boundaries) - 1), Done()]
        return [Done()]

    def _train_to(self, train_s: float) -> TrainTo:
        i = self.index
        return TrainTo(
            index=i,
            since=self.boundaries[i - 1] if i else 0,
            until=self.boundaries[i],
            last=i == len(self.boundaries) - 1,
            seconds=None if self.budget is None else self.budget - train_s,  # the rest, on the nodes' clocks
            landing=self._landing(i),
        )

    def _landing(self, i: int) -> Landing | None:
        """The round sent at boundary i − 1 that lands in the call up to boundary i (none before the first)."""
        return Landing(i, self.landings[i - 1]) if self.landings is not None and i > 0 else None

    def _spent(self, train_s: float) -> bool:
        return self.budget is not None and train_s >= self.budget

    def _stop_at(self, step: int, index: int) -> StopAt:
        self.steps = step  # `Plan.stop_at`: the run now ends at `step`
        return StopAt(step, index)
