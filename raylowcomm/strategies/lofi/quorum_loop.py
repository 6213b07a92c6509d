"""Quorum rounds' training loop on Ray: `raylowcomm.core.rounds.QuorumPolicy` decides, this carries it out.

Every node trains its segments in calls the driver issues one node at a time (`LofiNode.segment`). A
segment's payload is that call's second return value, owned by the driver: it outlives the node that made
it, and only the nodes that land it fetch it. A node lands the rounds it has not at the start of its next
segment (`NodeRounds.catch_up`), so every node that lands round r holds the same bits (the driver checks
the global hash each node reports with the round it started from). With `keep_training` each round a
node lands moves its model onto the new global model with its unmerged progress on top
(`node_rounds.PendingProgress`). A node that dies is restarted (`nodes.max_restarts`) from its checkpoint
and round file: what it trained since its last round is lost.

The loop owns the object refs, `ray.wait`, the actor calls, the ledger's bookings and the round log in
storage (`ROUNDS`); each call's result becomes an event for the policy."""

from __future__ import annotations

import logging
import time

import ray

from raylowcomm.actors import NodeGroup, ReplicaMismatch
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.rounds import LandedRound, QuorumPolicy
from raylowcomm.core.rounds import events as ev
from raylowcomm.failures import all_left, cause_of
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.messages import SegmentResult
from raylowcomm.strategies.lofi.plan import Plan
from raylowcomm.strategies.lofi.round_file import round_path

logger = logging.getLogger(__name__)

ROUNDS = "lofi/quorum_rounds.json"
"""In storage: every landed round's payloads (node, base round, examples, weight), rewritten as each lands."""


def book_catch_up(ledger, phase: str, k: int, rounds: list[LandedRound]) -> None:
    """What node k is sent to land `rounds` (their numbers, refs and weights) and fetches for them: every
    payload in them but its own."""
    for r in rounds:
        refs = sum(len(a.payload.binary()) for a in r.payloads)
        ledger.record(phase, "round_args", payload_nbytes(r.number) + refs + payload_nbytes(r.weights))
        ledger.record(phase, "outer_gradients", sum(a.nbytes for a in r.payloads if a.node != k))


def land_everywhere(group: NodeGroup, missed: dict[int, list], onto_global: bool) -> None:
    """Every node lands what it has not; one that dies meanwhile is restarted and lands from its round file.
    `onto_global` (keep_training): every payload is merged, so each node's model becomes the global one."""
    calls = {group[k].catch_up.remote(rounds, onto_global): k for k, rounds in missed.items()}
    while calls:
        [ready], _ = ray.wait(list(calls), num_returns=1)
        k = calls.pop(ready)
        try:
            ray.get(ready)
        except ray.exceptions.RayActorError as err:
            group.restart(k, err)
            calls[group[k].catch_up.remote(missed[k], onto_global)] = k


class QuorumLoop:
    """One run's segments on `group` until the policy's budget is spent; `launch(k)` starts node k's actor."""

    def __init__(self, ctx: RunContext, group: NodeGroup, plan: Plan, policy: QuorumPolicy, launch):
        self.ctx, self.group, self.plan, self.policy, self.launch = ctx, group, plan, policy, launch
        self.flights: dict[ray.ObjectRef, tuple[int, int, ray.ObjectRef]] = {}
        """A segment's report -> its flight, node and payload."""
        self.joining: dict[ray.ObjectRef, int] = {}
        self.appearing: dict[ray.ObjectRef, int] = {}
        """A range's nodes past its min not started yet: each joins once the cluster holds it."""
        self.bookings: dict[int, object] = {}
        self.hashes: dict[int, dict[int, str]] = {}

    def run(self) -> None:
        extra = self.ctx.cfg.nodes.most - self.ctx.cfg.nodes.count
        after_joiners = len(self.group) + len(self.policy.rules.joins)  # a range's nodes past its min come last
        booked = list(range(after_joiners, after_joiners + extra))
        wait = self.carry_out(self.policy.decide(ev.Begin(time.perf_counter(), self.group.keys(), booked)))
        while wait is not None:
            timeout = None if wait.until is None else max(0.0, wait.until - time.perf_counter())
            ready, _ = ray.wait([*self.flights, *self.joining, *self.appearing], num_returns=1, timeout=timeout)
            for ref in ready:
                self.carry_out(self._event(ref))
            wait = self.carry_out(self.policy.decide(ev.Tick(time.perf_counter())))

    def _event(self, ref: ray.ObjectRef) -> list[ev.Decision]:
        """A call's result as the policy's event, and its decisions."""
        if ref in self.appearing:
            k = self.appearing.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                logger.warning("[lofi] node %d could not start (%s): it does not join", k, err)
                self.group.remove(k, kill=False)
                return self.policy.decide(ev.NotStarted(k))
            return self.policy.decide(ev.Appeared(k, time.perf_counter()))
        if ref in self.joining:
            k = self.joining.pop(ref)
            try:
                point = ray.get(ref)
            except ray.exceptions.RayActorError as err:  # died again while starting
                return self._died(k, None, err)
            return self.policy.decide(ev.Joined(k, point.rounds, point.step, time.perf_counter()))
        flight, k, payload = self.flights.pop(ref)
        try:
            meta = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            return self._died(k, flight, err)
        self.group.ledger.send("train", "round_replies", meta)
        segment = SegmentResult.from_wire(meta)
        self._check(k, segment)
        return self.policy.decide(ev.Arrived(k, flight, segment.for_policy(meta), payload, time.perf_counter()))

    def _died(self, k: int, flight: int | None, err: Exception) -> list[ev.Decision]:
        """A node that died leaves the quorum at once; restarted, it joins again at its next segment."""
        (restart,) = self.policy.decide(ev.Died(k, flight, time.perf_counter()))
        k = restart.node
        try:
            self.group.restart(k, err)
        except Exception as final:
            logger.warning("[lofi] node %d died and its restarts are spent (%s): it leaves the run", k, final)
            self.group.remove(k, kill=False)
            self.policy.decide(ev.RestartsSpent(k, time.perf_counter()))
            self.policy.record.died_of[k] = cause_of(err)
            if not len(self.group):  # nothing left to train or land: the first death is the run's error
                raise all_left(self.policy.progress(), "lofi node", self.policy.record.died_of) from final
            return []
        return self.policy.decide(ev.Restarted(k))

    def _check(self, k: int, segment: SegmentResult) -> None:
        """Every node that started from round r holds the same global model."""
        seen = self.hashes.setdefault(segment.base_round, {})
        seen[k] = segment.base_hash
        if len(set(seen.values())) > 1:
            raise ReplicaMismatch(f"lo-fi nodes hold different global models after round {segment.base_round}: {seen}")

    def carry_out(self, decisions: list[ev.Decision]) -> ev.Wait | None:
        """Each decision in order; returns the wait the policy asks for (None: the training is over)."""
        handlers = {
            ev.Assign: self._assign,
            ev.Land: self._land,
            ev.Progress: self._progress,
            ev.Join: self._join,
            ev.Rejoin: self._rejoin,
            ev.Leave: self._leave,
            ev.Dismiss: self._dismiss,
            ev.Book: self._book,
        }
        wait = None
        for d in decisions:
            if isinstance(d, ev.Wait):
                wait = d
            elif type(d) in handlers:
                handlers[type(d)](d)
            else:
                raise TypeError(f"the quorum loop carries out no {type(d).__name__} decision here")
        return wait

    def _assign(self, d: ev.Assign) -> None:
        ledger = self.group.ledger
        ledger.send("train", "control", [d.until, d.merged] if d.merged else d.until)
        book_catch_up(ledger, "train", d.node, d.catch_up)
        meta, payload = self.group[d.node].segment.remote(
            [r.args() for r in d.catch_up], d.until, d.seconds, d.reset, d.merged
        )
        self.flights[meta] = (d.flight, d.node, payload)

    def _land(self, d: ev.Land) -> None:
        self.ctx.storage.write_json(ROUNDS, self.policy.record.landed)  # what a resumed run's budget goes on from

    def _progress(self, d: ev.Progress) -> None:
        self.ctx.report({"step": d.step, "steps": self.plan.steps, "bytes": self.group.ledger.total_bytes})

    def _join(self, d: ev.Join) -> None:
        """Node d.node's call that makes it a member: the latest global model's round file (none before the
        first round: it holds the start), booked as what it reads."""
        if d.why == "schedule":
            self.launch(d.node)
        elif d.why == "cluster":
            self.bookings.pop(d.node)()  # its fetches, booked once it started
        path = None if d.adopt_from is None else round_path(d.adopt_from)
        if path is not None:
            self.group.ledger.record("train", "join_round_file", self.ctx.storage.size(path))
        self.joining[self.group[d.node].join.remote(path)] = d.node
        if d.why is not None:
            logger.info("[lofi] node %d joins at step %d (%s)", d.node, d.step, d.why)

    def _rejoin(self, d: ev.Rejoin) -> None:
        self.joining[self.group[d.node].round_of.remote()] = d.node

    def _leave(self, d: ev.Leave) -> None:
        self.group.remove(d.node)
        logger.info("[lofi] node %d leaves at its step %d", d.node, d.step)

    def _dismiss(self, d: ev.Dismiss) -> None:
        if d.node in self.group.keys():
            self.group.remove(d.node)
        logger.info("[lofi] node %d does not join: the run's budget of steps is spent", d.node)

    def _book(self, d: ev.Book) -> None:
        self.bookings = {k: self.launch(k, placed=False) for k in d.nodes}
        self.appearing = {self.group[k].__ray_ready__.remote(): k for k in self.bookings}
