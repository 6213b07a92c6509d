"""Quorum rounds' policy: events in, decisions out (`QuorumPolicy.decide`), on the driver's clock as the
events give it. It keeps the nodes' logs, the segments in flight, the payloads waiting and the rounds
landed; the driver (`strategies/lofi/quorum_loop.py`) carries its decisions out."""

from __future__ import annotations

import itertools

from raylowcomm.core.rounds.arithmetic import quorum_of, staleness_weight
from raylowcomm.core.rounds.events import (
    Appeared,
    Arrived,
    Begin,
    Book,
    CatchUp,
    Decision,
    Died,
    Dismiss,
    Event,
    Finish,
    Join,
    Joined,
    Land,
    Leave,
    NotStarted,
    Progress,
    Rejoin,
    Restart,
    Restarted,
    RestartsSpent,
    Tick,
    Wait,
)
from raylowcomm.core.rounds.pacing import Pacing
from raylowcomm.core.rounds.records import Arrival, Flight, LandedRound, NodeLog, Rules, RunRecord


class QuorumPolicy(Pacing):
    """Decides, event by event, which node trains which segment, which round lands with what, who joins
    and leaves, and how long the driver waits for the next event."""

    def __init__(self, rules: Rules, budget: int, nodes: dict[int, NodeLog], record: RunRecord):
        self.rules, self.budget, self.assigned, self.nodes, self.record = rules, budget, 0, nodes, record
        self.log: list[LandedRound] = []
        """The landed rounds some node has still to land: the driver keeps their payloads."""
        self.pending: dict[int, list[Arrival]] = {}
        """Each node's payloads waiting for a round (one; two where it keeps training), in the order sent."""
        self.flights: dict[int, Flight] = {}
        self.members: set[int] = set()
        """The nodes with an actor: training, joining, restarting or not started yet."""
        self.joining: set[int] = set()
        """Nodes starting or restarting: out of the quorum until they hold a global model (`Joined`)."""
        self.unjoined: set[int] = set()
        """Joiners that hold no global model yet."""
        self.appearing: set[int] = set()
        """A range's nodes past its min not started yet: each joins once the cluster holds it."""
        self.joins = list(rules.joins)
        self.quorum_at: float | None = None
        """Since when the quorum of the next round has been in."""
        self._ids = itertools.count()
        self._handlers = {
            Begin: self._begin,
            Arrived: self._arrived,
            Died: self._died,
            Restarted: self._restarted,
            RestartsSpent: self._restarts_spent,
            Joined: self._joined,
            Appeared: self._appeared,
            NotStarted: self._not_started,
            Tick: self._tick,
            Finish: self._finish,
        }

    def decide(self, event: Event) -> list[Decision]:
        return self._handlers[type(event)](event)

    def progress(self) -> int:
        """The run's step: the node-steps its nodes trained (those that left too) over the nodes it is for."""
        return sum(n.step for n in self.nodes.values()) // self.rules.count

    def cap(self) -> int:
        """How many of a node's payloads may wait for rounds before it waits too."""
        return 2 if self.rules.keep_training else 1

    def _begin(self, ev: Begin) -> list[Decision]:
        self.members = set(ev.members)
        out = [d for k in sorted(ev.members) for d in self._leave_or_train(k, ev.now)]
        if ev.booked:
            self.members |= set(ev.booked)
            self.appearing = set(ev.booked)
            out.append(Book(list(ev.booked)))
        return out + self._joins_due(ev.now) + self._wait_or_end()

    def _arrived(self, ev: Arrived) -> list[Decision]:
        k, r = ev.node, ev.report
        flight, node = self.flights.pop(ev.flight), self.nodes[ev.node]
        self.assigned -= flight.until - r.step  # a segment stopped by time returns what it did not use
        node.step, node.rounds, node.pace_s = r.step, r.base_round, ev.now - flight.sent_at
        node.step_s = node.pace_s / max(1, r.step - flight.start)
        node.overhead_s = node.pace_s - r.train_s
        self._forget_landed()
        node.segments.append({**r.record, "node": k, "wall_s": node.pace_s})
        arrival = Arrival(k, ev.payload, r.base_round, r.nbytes, r.train_s, r.samples, ev.now, r.token)
        self.pending.setdefault(k, []).append(arrival)
        node.idle_since = ev.now
        leave = self._leave_if_due(k, ev.now)
        if leave or len(self.pending[k]) >= self.cap():
            return leave
        return self._assign(k, ev.now)  # keep_training: it trains on while its payload waits

    def _died(self, ev: Died) -> list[Decision]:
        """A node that died leaves the quorum at once; the steps of the segment it lost return to the budget."""
        self.joining.discard(ev.node)  # died again while starting: it joins again once restarted
        if ev.flight is not None:
            flight = self.flights.pop(ev.flight)
            self.assigned -= flight.until - flight.start
            self.nodes[ev.node].lost_s += ev.now - flight.sent_at
        return [Restart(ev.node)]

    def _restarted(self, ev: Restarted) -> list[Decision]:
        """Restarted, it joins again at its next segment; a joiner that died before it joined joins again:
        the rounds before its global model may be gone."""
        self.nodes[ev.node].restarts += 1
        self.joining.add(ev.node)
        return [Join(ev.node, self._adopt_from())] if ev.node in self.unjoined else [Rejoin(ev.node)]

    def _restarts_spent(self, ev: RestartsSpent) -> list[Decision]:
        self.members.discard(ev.node)
        self.record.departed.append(ev.node)
        self.nodes[ev.node].left_at = ev.now
        return []

    def _joined(self, ev: Joined) -> list[Decision]:
        node = self.nodes[ev.node]
        self.joining.discard(ev.node)
        node.rounds, node.step = ev.rounds, ev.step
        self.unjoined.discard(ev.node)
        node.reset = True
        return self._assign(ev.node, ev.now)

    def _appeared(self, ev: Appeared) -> list[Decision]:
        """A range's node the cluster now holds joins, while budget is left."""
        self.appearing.discard(ev.node)
        if self.assigned >= self.budget:
            self.members.discard(ev.node)
            return [Dismiss(ev.node)]
        return [self._begin_join(ev.node, "cluster", ev.now)]

    def _not_started(self, ev: NotStarted) -> list[Decision]:
        self.appearing.discard(ev.node)
        self.members.discard(ev.node)
        return []

    def _tick(self, ev: Tick) -> list[Decision]:
        out = self._joins_due(ev.now)
        live = len(self.members) - len(self.joining) - len(self.appearing)  # a node starting or restarting is out
        if self._due(live, ev.now):
            self.quorum_at = None
            landed, free = self._land()
            out += [Land(landed), *(d for k in free for d in self._assign(k, ev.now)), Progress(self.progress())]
        return out + self._give_back(ev.now) + self._wait_or_end()

    def _finish(self, ev: Finish) -> list[Decision]:
        """The last payloads land as the final round; every node lands what it has not of the log."""
        out: list[Decision] = [Land(self._land()[0])] if self.pending else []
        out += [CatchUp(k, [r for r in self.log if r.number > self.nodes[k].rounds]) for k in ev.members]
        for k in ev.members:
            self.nodes[k].rounds = len(self.record.landed)
        return out

    def _wait_or_end(self) -> list[Decision]:
        """Wait for the next event while a segment or a join is under way: until the grace of a quorum that
        is in ends; else the training is over, and a range's nodes the cluster never held do not join."""
        if self.flights or self.joining:
            return [Wait(None if self.quorum_at is None else self.quorum_at + self.rules.grace_s)]
        dismissed = [Dismiss(k) for k in sorted(self.appearing)]
        self.members -= self.appearing
        self.appearing = set()
        return dismissed

    def _joins_due(self, now: float) -> list[Decision]:
        """The joiners whose step the run has reached (while budget is left for them)."""
        out: list[Decision] = []
        while self.joins and self.joins[0][1] <= self.progress():
            k, _ = self.joins.pop(0)
            if self.assigned >= self.budget:
                out.append(Dismiss(k))
                continue
            self.members.add(k)
            out.append(self._begin_join(k, "schedule", now))
        return out

    def _begin_join(self, k: int, why: str, now: float) -> Join:
        """Node k (its actor started) becomes a member: it adopts the latest global model a node holds."""
        self.nodes[k] = NodeLog(joined_at=now)  # its rounds (0) keep the log until it joins
        self.unjoined.add(k)
        self.record.joined.append({"node": k, "step": self.progress(), "by": why})
        self.joining.add(k)
        return Join(k, self._adopt_from(), why, self.progress())

    def _adopt_from(self) -> int | None:
        """The member that has landed the most rounds (None before the first round: every node holds the start)."""
        members = [j for j in sorted(self.members) if j in self.nodes and j not in self.unjoined]
        ahead = max(members, key=lambda j: self.nodes[j].rounds)
        return ahead if self.nodes[ahead].rounds else None

    def _leave_or_train(self, k: int, now: float) -> list[Decision]:
        return self._leave_if_due(k, now) or self._assign(k, now)

    def _leave_if_due(self, k: int, now: float) -> list[Decision]:
        """Node k leaves once it has trained to its `lofi.leave` step: its last payload (pending) still merges."""
        at, node = self.rules.leaves.get(k), self.nodes[k]
        if at is None or node.step < at:
            return []
        self.members.discard(k)
        self.record.departed.append(k)
        node.left_at = now
        self.record.left.append({"node": k, "step": node.step})
        return [Leave(k, node.step)]

    def _due(self, live: int, now: float) -> bool:
        """Whether the pending payloads land now (and since when the quorum has been in, `quorum_at`). With no
        node training that has no payload waiting (one that keeps training has one), every payload is in;
        with no node training at all and the budget spent, the last ones are `Finish`'s. Once the quorum is
        in, the round waits `grace_s` only for nodes expected within it (`_expected`): a node far behind is
        not waited for at all."""
        self.quorum_at, quorum_at = None, self.quorum_at
        if not self.pending:
            return False
        awaited = [f for f in self.flights.values() if f.node not in self.pending]  # not a node training on
        if not awaited:
            return bool(self.flights) or self.assigned < self.budget
        if len(self.pending) < quorum_of(self.rules.quorum, live):
            return False
        self.quorum_at = now if quorum_at is None else quorum_at
        deadline = self.quorum_at + self.rules.grace_s
        return now >= deadline or not any(self._expected(f) <= deadline for f in awaited)

    def _land(self) -> tuple[LandedRound, list[int]]:
        """The pending payloads as the next round, in node order, each weighted by its node's weight (under
        sync by time, its examples) times (1 + τ)^-staleness; and the nodes now free to train."""
        number = len(self.record.landed) + 1
        payloads = [a for k in sorted(self.pending) for a in self.pending[k]]
        weights = []
        for a in payloads:
            missed = number - 1 - a.base
            if missed:
                self.record.late.append(missed)
            work = float(a.samples) if self.rules.period_s is not None else self.rules.weights[a.node]  # by work
            weights.append(staleness_weight(work, missed, self.rules.staleness))
            self.nodes[a.node].useful_s += a.train_s
        landed = LandedRound(number, payloads, weights)
        self.log.append(landed)
        self.record.landed.append(landed.record())
        self.pending = {}
        training = {f.node for f in self.flights.values()}
        gone = set(self.record.departed)
        return landed, sorted({a.node for a in payloads if a.node not in gone and a.node not in training})

    def _forget_landed(self) -> None:
        """Drop the rounds every node of the run has landed: nobody will fetch their payloads again, so the
        driver lets them go. A node restarting catches up from its round file, which holds a round it had
        landed, so the rounds after it are kept for it."""
        everyone = min(n.rounds for k, n in self.nodes.items() if k not in self.record.departed)
        self.log = [r for r in self.log if r.number > everyone]
