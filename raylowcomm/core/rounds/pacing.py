"""Where a node's next segment ends and when a segment in flight should arrive, from each node's last
pace: on the plan's boundaries within the budget of node-steps (cut at the end of the run where the
slowest node would outlast the others), or under sync by time its share of the budget left and its
training seconds in phase with the others. Part of `QuorumPolicy`, whose state it reads."""

from __future__ import annotations

from collections.abc import Iterator

from raylowcomm.core.rounds.arithmetic import boundary_after, in_phase_s, pace_share, tail_steps
from raylowcomm.core.rounds.events import Assign, Decision
from raylowcomm.core.rounds.records import Arrival, Flight, LandedRound, NodeLog, Rules, RunRecord


class Pacing:
    """`QuorumPolicy`'s segments: what each one assigns, and when each in flight is expected."""

    rules: Rules
    record: RunRecord
    budget: int
    assigned: int
    nodes: dict[int, NodeLog]
    log: list[LandedRound]
    pending: dict[int, list[Arrival]]
    flights: dict[int, Flight]
    members: set[int]
    joining: set[int]
    appearing: set[int]
    _ids: Iterator[int]

    def cap(self) -> int:
        raise NotImplementedError

    def _assign(self, k: int, now: float) -> list[Decision]:
        """Node k's next segment, to its next boundary within the budget, with the rounds it has not landed
        (none where nothing is left for it)."""
        node, seconds = self.nodes[k], None
        if self.rules.period_s is None:
            until = min(boundary_after(self.rules.boundaries, node.step), node.step + self.budget - self.assigned)
            until = node.step + self._tail_cut(k, until - node.step, now)
        else:  # a cap only: the segment ends after `seconds` of training; what it leaves returns to the pool
            flying = {f.node for f in self.flights.values()} - {k}
            free = [
                self.nodes[j].step_s if j in self.nodes else None
                for j in sorted(self.members)
                if j not in flying | self.appearing
            ]
            until = node.step + pace_share(self.budget - self.assigned, node.step_s, free)
            seconds = self._in_phase(k, now)
        until = min(until, self.rules.leaves.get(k, until))
        if until <= node.step:
            return []
        missed = [r for r in self.log if r.number > node.rounds]
        merged = [a.token for r in missed for a in r.payloads if a.node == k and a.token is not None]
        reset, node.reset = node.reset, False
        if node.idle_since is not None:
            node.waiting_s += now - node.idle_since
            node.idle_since = None
        flight = Flight(next(self._ids), k, node.step, until, now, seconds)
        self.flights[flight.id] = flight
        self.assigned += until - node.step
        return [Assign(k, flight.id, until, seconds, missed, merged, reset)]

    def _expected(self, flight: Flight) -> float:
        """When a segment in flight should arrive: its start plus, under sync by time, its training seconds
        and its node's last segment's time outside training, or its node's last wall time per step times
        its steps (at once, for a node with no segment yet: it is waited for)."""
        node = self.nodes[flight.node]
        if node.pace_s is None:
            return flight.sent_at
        if flight.seconds is not None:
            return flight.sent_at + flight.seconds + node.overhead_s
        return flight.sent_at + node.step_s * (flight.until - flight.start)

    def _in_phase(self, k: int, now: float) -> float:
        """Node k's training seconds for its next segment under sync by time (`in_phase_s`), from the other
        nodes' segments in flight and its own last segment's time outside training."""
        others = [self._expected(f) - now for f in self.flights.values() if f.node != k and self.nodes[f.node].pace_s]
        return in_phase_s(self.rules.period_s, others, self.nodes[k].overhead_s)

    def _tail_cut(self, k: int, steps: int, now: float) -> int:
        """Node k's segment of `steps`, cut at the end of the run where it would outlast the others
        (`tail_steps`): the work left besides it is the budget not yet assigned and the steps the others'
        segments in flight are predicted still to train, from each node's last pace."""
        node, gone = self.nodes[k], self.record.departed
        paced = {j: n.step_s for j, n in self.nodes.items() if j != k and j not in gone and n.step_s}
        if node.step_s is None:
            return steps
        running = sum(
            max(0.0, self._expected(f) - now) / paced[f.node] for f in self.flights.values() if f.node in paced
        )
        work = self.budget - self.assigned - steps + running
        return tail_steps(steps, node.step_s, list(paced.values()), work, self.rules.grace_s)

    def _give_back(self, now: float) -> list[Decision]:
        """Budget a lost segment gave back goes to the nodes that stood idle for want of it."""
        held = {k for k, arrivals in self.pending.items() if len(arrivals) >= self.cap()}
        busy = {f.node for f in self.flights.values()} | held | self.joining
        out: list[Decision] = []
        for k in sorted(self.members):
            if k in self.nodes and k not in busy and self.assigned < self.budget:  # not one still appearing
                out += self._assign(k, now)
        return out
