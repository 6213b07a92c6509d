"""Quorum rounds (`lofi.quorum`): peer rounds that never wait for every node.

Every node trains its segments (to its next round boundary) at its own pace, in calls the driver
issues one node at a time (`LofiNode.segment`). A segment's payload is that call's second return
value, owned by the driver: it outlives the node that made it, and only the nodes that land it fetch
it. A round lands once a quorum of nodes' payloads is in, and either no live node is still training or
`grace_s` has passed since the quorum was reached (no node is waited for that its last segment's pace
says will come later than that). It holds every payload that arrived since the last
round, in node order, each weighted by its node's weight times (1 + τ)^-staleness, τ the rounds that
landed after the global model its Δ started from: a payload that missed its round is merged late, not
lost. The log of landed rounds is the membership record: a node lands the rounds it has not, in
order, at the start of its next segment (`NodeRounds.catch_up`), so every node that lands round r
lands the same payloads with the same weights in the same order, and holds the same bits (the
driver checks the global hash each node reports with the round it started from).

A node whose payload waits for its round does not train on (its next Δ would count what it sent
again): it starts its next segment from the round that merged it. With `keep_training` it trains on,
its next Δ measured from where it sent (at most two of its payloads wait at once), and each round it
lands moves its model onto the new global model with its unmerged progress on top
(`node_rounds.PendingProgress`). A node that dies leaves the quorum
at once; it is restarted (`nodes.max_restarts`) from its checkpoint and round file, joins again at its
next segment by landing the rounds it missed and starting from the latest global model: what it
trained since its last round is lost. A node whose restarts are spent leaves the run.

The run's length is a budget of node-steps, the run's steps times the nodes: a slow node contributes
the steps it managed, and the fast ones take the rest (their shards' epochs repeat, in their own
order, `batch_at`). With every node on time and `quorum` = all nodes, every round holds every node's
payload at the same boundaries as lockstep rounds: the same model, bit for bit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import ClassVar

import ray

from raylowcomm.actors import NodeGroup, ReplicaMismatch
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.membership import ScheduleError, check_schedule
from raylowcomm.core.round_policy import (
    boundary_after,
    in_phase_s,
    pace_share,
    quorum_of,
    staleness_weight,
    tail_steps,
)
from raylowcomm.failures import all_left, cause_of
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.exchange import FinalModel
from raylowcomm.strategies.lofi.payload import final_is_own
from raylowcomm.strategies.lofi.peers import PeerExchange, check_global
from raylowcomm.strategies.lofi.plan import Plan
from raylowcomm.strategies.lofi.round_file import round_path
from raylowcomm.strategies.lofi.star import curve_needs_driver_weights

logger = logging.getLogger(__name__)

ROUNDS = "lofi/quorum_rounds.json"
"""In storage: every landed round's payloads (node, base round, examples, weight), rewritten as each lands."""


@dataclass
class Arrival:
    """A payload in the driver's hands, waiting for its round."""

    node: int
    ref: ray.ObjectRef
    base: int
    """The round its Δ started from."""
    nbytes: int
    train_s: float
    samples: int
    """Examples its segment trained on: all its Δ holds, as the node started the segment from its global model
    (or, `keep_training`, from where it last sent)."""
    arrived_at: float
    token: str | None = None
    """`keep_training`: the node's name for it, by which the node learns that a round merged it."""


@dataclass
class LandedRound:
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
        """What a node lands it from: its number, the refs (each in a list, so that nobody resolves it
        on the way) and the weights."""
        return self.number, [[a.ref] for a in self.payloads], self.weights


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
    (under `sync: time`, its training seconds and the rest of that wall time: `_expected`)."""
    step_s: float | None = None
    """That wall time per step it trained: what a segment of its costs (`tail_steps`)."""
    idle_since: float | None = None
    """When its last payload arrived, until its next segment: the time it waits (`waiting_s`)."""
    segments: list[dict] = field(default_factory=list)


def book_catch_up(ledger, phase: str, k: int, rounds: list[LandedRound]) -> None:
    """What node k is sent to land `rounds` (their numbers, refs and weights) and fetches for them: every
    payload in them but its own."""
    for r in rounds:
        refs = sum(len(a.ref.binary()) for a in r.payloads)
        ledger.record(phase, "round_args", payload_nbytes(r.number) + refs + payload_nbytes(r.weights))
        ledger.record(phase, "outer_gradients", sum(a.nbytes for a in r.payloads if a.node != k))


def check_membership(cfg: RunConfig, o: LofiConfig, steps: int | None) -> None:
    """lofi.join and lofi.leave against the first nodes and, once known, the run's steps per node."""
    for i, ev in enumerate(o.leave):
        if ev.how != "remove":
            raise ConfigError(
                f"lofi.leave[{i}].how",
                ev.how,
                "a node leaves quorum rounds by `remove`; a crash is churn.kill (with nodes.max_restarts: 0 it "
                "does not come back): set how: remove",
            )
    if o.join and cfg.data.node_files is not None:
        raise ConfigError(
            "lofi.join",
            [ev.step for ev in o.join],
            "a joiner's shard is cut from one shared training set: not offered with data.node_files; remove lofi.join",
        )
    try:
        check_schedule(cfg.nodes.count, o.leave, o.join, steps)
    except ScheduleError as err:
        raise ConfigError(f"lofi.{err.field}", err.value, err.allowed) from None


class QuorumExchange(PeerExchange):
    name: ClassVar[str] = "quorum"
    paced: ClassVar[bool] = True
    """The exchange runs the training loop itself (`train`): nodes are not stepped in lockstep."""

    def __init__(self, ctx: RunContext, o: LofiConfig, start: dict | None):
        super().__init__(ctx, o, start)
        self.quorum = o.quorum if o.quorum is not None else 1.0  # sync by time alone: every live node
        self.storage, self.batch_size = ctx.storage, ctx.cfg.optim.batch_size
        self.resumed: dict[int, NodeLog] | None = None
        self.resumed_at = 0
        self.seconds = o.sync_every_s if o.sync == "time" else None
        self.log: list[LandedRound] = []
        """The landed rounds some node has still to land: their payloads stay in the object store."""
        self.landed: list[list[dict]] = []
        """Every landed round as the record tells it (`LandedRound.record`)."""
        self.pending: dict[int, list[Arrival]] = {}
        """Each node's payloads waiting for a round (one; two where it keeps training), in the order sent."""
        self.nodes: dict[int, NodeLog] = {}
        self.late: list[int] = []
        """The staleness τ of every payload merged late."""
        self.departed: list[int] = []
        """Nodes out of the run: left (lofi.leave) or died with their restarts spent."""
        self.died_of: dict[int, dict] = {}
        """What each node that died with its restarts spent died of ({type, message}): the first cause."""
        self.joined: list[dict] = []
        self.left: list[dict] = []

    @staticmethod
    def validate(cfg: RunConfig, o: LofiConfig) -> None:
        PeerExchange.validate(cfg, o)
        q, n = o.quorum, cfg.nodes.most
        whole = isinstance(q, int) and not isinstance(q, bool)
        if q is not None and not ((whole and 1 <= q <= n) or (isinstance(q, float) and 0 < q <= 1)):
            raise ConfigError(
                "lofi.quorum", q, f"a node count in 1..{n} (nodes.count), a fraction in (0, 1], or null for lockstep"
            )
        if cfg.nodes.elastic:
            refused = [("data.node_files", cfg.data.node_files), ("nodes.hosts", cfg.nodes.hosts)]
            for name, value in refused:
                if value is not None:
                    raise ConfigError(
                        "nodes.count",
                        cfg.nodes.count_as_given(),
                        f"a range's nodes start wherever the cluster holds them, with a shard cut from one "
                        f"training set: not offered with {name}; give one number",
                    )
        if o.grace_s < 0:
            raise ConfigError("lofi.grace_s", o.grace_s, "must be >= 0 seconds")
        if o.staleness < 0:
            raise ConfigError("lofi.staleness", o.staleness, "must be >= 0 (0: a late payload counts fully)")
        check_membership(cfg, o, None)
        timed = o.sync == "time"
        if timed and not (o.sync_every_s and o.sync_every_s > 0):
            raise ConfigError(
                "lofi.sync_every_s", o.sync_every_s, "sync: time needs the seconds between payloads (> 0)"
            )
        refused = {
            "lofi.average_every": (
                (o.average_every is None) != timed,
                "sync: time replaces average_every: set one of them"
                if timed
                else "quorum rounds need rounds: set lofi.average_every (or lofi.sync: time)",
            ),
            "lofi.warmup_steps": (timed and o.warmup_steps > 0, "a warm-up counts steps: with sync: time set it to 0"),
            "model.lora": (cfg.model.lora is not None, "not offered with quorum rounds yet: remove lofi.quorum"),
            "lofi.fragments": (o.fragments > 1, "quorum rounds sync the whole model: set lofi.fragments: 1"),
            "lofi.overlap": (o.overlap > 0, "a quorum round lands between segments: set lofi.overlap: 0"),
            "lofi.final_round": (
                final_is_own(o),
                "a quorum round may merge a late payload with the last ones, so every payload is encoded "
                "alike: set lofi.final_round: compressed and lofi.final_residual: true",
            ),
            "eval_every": (cfg.eval_every > 0, "a curve from snapshots needs lockstep nodes: set eval_every: 0"),
            "optim.budget_s": (
                cfg.optim.budget_s is not None,
                "quorum rounds run a budget of node-steps: remove optim.budget_s",
            ),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                value = {"model.lora": "set", "eval_every": cfg.eval_every, "optim.budget_s": cfg.optim.budget_s}.get(
                    name, getattr(o, name[5:], None)
                )
                raise ConfigError(name, value, fix)

    @staticmethod
    def driver_weights(cfg: RunConfig, o: LofiConfig) -> str | None:
        """The final round lands on the nodes, which hold the average: the driver needs the weights for a
        curve at most."""
        return curve_needs_driver_weights(cfg)

    def resume(self, ctx: RunContext, group: NodeGroup, plan: Plan) -> int:
        """After the driver died: the payloads it owned died with it, so every node adopts the global
        model of the node that had landed the most rounds (from that node's round file in storage) and
        drops what it trained since; the budget goes on from what the landed rounds merged
        (`ROUNDS`, written as each round landed)."""
        keys = group.keys()
        held = dict(zip(keys, group.call("round_of", phase="train")))
        ahead = max(keys, key=lambda k: held[k][0])
        latest = held[ahead][0]
        if latest:
            group.call("adopt_round", round_path(ahead), phase="train")
        else:  # every node still holds the start as its global model: it starts from there again
            group.call("catch_up", [], True, phase="train")
        landed = ctx.storage.read_json(ROUNDS) if ctx.storage.exists(ROUNDS) else []
        self.landed = landed[:latest] + [[] for _ in range(latest - len(landed))]
        self.resumed, self.resumed_at = {k: NodeLog(step=held[k][1], rounds=latest) for k in keys}, latest
        logger.info("[lofi] quorum rounds resume from round %d (node %d's global model)", latest, ahead)
        return latest

    def train(self, ctx: RunContext, group: NodeGroup, plan: Plan, launch=None) -> dict:
        """Segments until the budget of node-steps is spent, landing rounds as their quorums come in, nodes
        joining (`launch(k)` starts node k's actor) and leaving on their schedules. The last payloads stay
        pending: `finish` lands them as the final round."""
        self.first = first = len(group)
        extra = ctx.cfg.nodes.most - ctx.cfg.nodes.count  # a range's nodes past its min
        self.count = first + extra  # the nodes the budget is for: a range's max
        self.nodes = self.resumed or {k: NodeLog() for k in group.keys()}
        self.weights = dict(enumerate(plan.weights))  # one per node slot, joiners' too
        merged = sum(p["samples"] for r in self.landed for p in r) // self.batch_size
        self.budget, self.assigned, self.hashes = plan.steps * self.count - merged, 0, {}
        self.flights: dict[ray.ObjectRef, tuple] = {}
        self.joining: dict[ray.ObjectRef, int] = {}
        self.launch, self.unjoined = launch, set()
        self.joins = list(range(first, first + len(self.opts.join)))
        self.leaves = {ev.node: ev.step for ev in self.opts.leave}
        self.appearing: dict[ray.ObjectRef, int] = {}
        """A range's nodes past its min not started yet: each joins once the cluster holds it."""
        began, quorum_at = time.perf_counter(), None
        for k in group.keys():
            if not self._leave_if_due(group, k):
                self._assign(group, plan, k)
        after_joiners = first + len(self.opts.join)  # a range's nodes past its min: their slots come last
        self.bookings = {k: launch(k, placed=False) for k in range(after_joiners, after_joiners + extra)}
        self.appearing = {group[k].__ray_ready__.remote(): k for k in self.bookings}
        self._join_due(group)
        while self.flights or self.joining:
            wait_s = None if quorum_at is None else max(0.0, quorum_at + self.opts.grace_s - time.perf_counter())
            ready, _ = ray.wait([*self.flights, *self.joining, *self.appearing], num_returns=1, timeout=wait_s)
            for ref in ready:
                self._arrived(group, plan, ref)
            self._join_due(group)
            live = len(group) - len(self.joining) - len(self.appearing)  # a node starting or restarting is out
            due, quorum_at = self._due(live, quorum_at)
            if due:
                quorum_at = None
                for k in self._land("train"):
                    self._assign(group, plan, k)
                ctx.report({"step": self._progress(), "steps": plan.steps, "bytes": group.ledger.total_bytes})
            self._give_back(group, plan)
        for k in self.appearing.values():  # the budget is spent before the cluster held them
            group.remove(k)
            logger.info("[lofi] node %d does not join: the run's budget of steps is spent", k)
        train_s = time.perf_counter() - began
        last = {k: sum(a.train_s for a in arrivals) for k, arrivals in self.pending.items()}  # `finish` lands them
        rounds = len(self.landed)
        late = self.late + [rounds - a.base for arrivals in self.pending.values() for a in arrivals if rounds > a.base]
        end = time.perf_counter()
        accounts = [
            NodeAccount(
                k,
                n.useful_s + last.get(k, 0.0),
                n.waiting_s,
                n.lost_s,
                n.restarts,
                joins=int(n.joined_at is not None),
                reserved_s=None
                if n.joined_at is None and n.left_at is None
                else (n.left_at or end) - (n.joined_at or began),
            )
            for k, n in sorted(self.nodes.items())
        ]
        return {
            "nodes": [self.nodes[k].segments for k in group.keys()],  # the nodes still in the run
            "samples": sum(s["samples"] for n in self.nodes.values() for s in n.segments),  # those that left too
            "train_s": train_s,
            "snapshots": [],
            "goodput": goodput(accounts, train_s, late_payloads=len(late), late_staleness=late),
        }

    def _progress(self) -> int:
        """The run's step: the node-steps its nodes trained (those that left too) over nodes.count."""
        return sum(n.step for n in self.nodes.values()) // self.count

    def _join_due(self, group: NodeGroup) -> None:
        """Start the joiners whose step the run has reached (while budget is left for them): each adopts
        the latest global model a node holds, from that node's round file."""
        while self.joins and self.opts.join[self.joins[0] - self.first].step <= self._progress():
            k = self.joins.pop(0)
            if self.assigned >= self.budget:
                logger.info("[lofi] node %d does not join: the run's budget of steps is spent", k)
                continue
            self.launch(k)
            self._begin_join(group, k, "schedule")

    def _begin_join(self, group: NodeGroup, k: int, why: str) -> None:
        """Node k (its actor started) becomes a member: it adopts the latest global model (`_join_call`)."""
        self.nodes[k] = NodeLog(joined_at=time.perf_counter())  # its rounds (0) keep the log until it joins
        self.unjoined.add(k)
        self.joined.append({"node": k, "step": self._progress(), "by": why})
        self.joining[self._join_call(group, k)] = k
        logger.info("[lofi] node %d joins at step %d (%s)", k, self._progress(), why)

    def _appeared(self, group: NodeGroup, ref: ray.ObjectRef) -> None:
        """A range's node the cluster now holds joins, while budget is left; its fetches are booked now."""
        k = self.appearing.pop(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            logger.warning("[lofi] node %d could not start (%s): it does not join", k, err)
            group.remove(k, kill=False)
            return
        if self.assigned >= self.budget:
            group.remove(k)
            logger.info("[lofi] node %d does not join: the run's budget of steps is spent", k)
            return
        self.bookings.pop(k)()
        self._begin_join(group, k, "cluster")

    def _join_call(self, group: NodeGroup, k: int) -> ray.ObjectRef:
        """Node k's call that makes it a member: the latest global model's round file (none before the
        first round: it holds the start), booked as what it reads."""
        members = [j for j in group.keys() if j in self.nodes and j not in self.unjoined]
        ahead = max(members, key=lambda j: self.nodes[j].rounds)
        path = round_path(ahead) if self.nodes[ahead].rounds else None
        if path is not None:
            group.ledger.record("train", "join_round_file", self.storage.size(path))
        return group[k].join.remote(path)

    def _leave_if_due(self, group: NodeGroup, k: int) -> bool:
        """Node k leaves once it has trained to its `lofi.leave` step: its last payload (pending) still
        merges; its actor ends."""
        at = self.leaves.get(k)
        if at is None or self.nodes[k].step < at:
            return False
        group.remove(k)
        self.departed.append(k)
        self.nodes[k].left_at = time.perf_counter()
        self.left.append({"node": k, "step": self.nodes[k].step})
        logger.info("[lofi] node %d leaves at its step %d", k, self.nodes[k].step)
        return True

    def _give_back(self, group: NodeGroup, plan: Plan) -> None:
        """Budget a lost segment gave back goes to the nodes that stood idle for want of it."""
        held = {k for k, arrivals in self.pending.items() if len(arrivals) >= self._pending_cap()}
        busy = {f[0] for f in self.flights.values()} | held | set(self.joining.values())
        for k in group.keys():
            if k in self.nodes and k not in busy and self.assigned < self.budget:  # not one still appearing
                self._assign(group, plan, k)

    def _due(self, live: int, quorum_at: float | None) -> tuple[bool, float | None]:
        """Whether the pending payloads land now, and since when the quorum has been in. With no node
        training that has no payload waiting (one that keeps training has one), every payload is in; with
        no node training at all and the budget spent, the last ones are `finish`'s. Once the quorum is in,
        the round waits `grace_s` only for nodes expected within it (`_expected`): a node far behind is not
        waited for at all."""
        if not self.pending:
            return False, None
        awaited = [f for f in self.flights.values() if f[0] not in self.pending]  # not a node training on
        if not awaited:
            return bool(self.flights) or self.assigned < self.budget, None
        if len(self.pending) < quorum_of(self.quorum, live):
            return False, None
        now = time.perf_counter()
        quorum_at = quorum_at or now
        deadline = quorum_at + self.opts.grace_s
        return now >= deadline or not any(self._expected(f) <= deadline for f in awaited), quorum_at

    def _expected(self, flight: tuple) -> float:
        """When a segment in flight should arrive: its start plus, under `sync: time`, its training seconds
        and its node's last segment's time outside training, or its node's last wall time per step times
        its steps (at once, for a node with no segment yet: it is waited for)."""
        k, _, start, until, sent_at, seconds = flight
        node = self.nodes[k]
        if node.pace_s is None:
            return sent_at
        return sent_at + (seconds + self._overhead(k) if seconds is not None else node.step_s * (until - start))

    def _overhead(self, k: int) -> float:
        """Node k's last segment's wall time outside training (landing, encoding, the calls): 0 before one."""
        last = self.nodes[k].segments[-1] if self.nodes[k].segments else None
        return last["wall_s"] - last["train_s"] if last else 0.0

    def _assign(self, group: NodeGroup, plan: Plan, k: int) -> None:
        """Node k's next segment, to its next boundary within the budget, with the rounds it has not landed."""
        node, seconds = self.nodes[k], None
        if self.seconds is None:
            until = min(boundary_after(plan.boundaries, node.step), node.step + self.budget - self.assigned)
            until = node.step + self._tail_cut(k, until - node.step)
        else:  # a cap only: the segment ends after `seconds` of training; what it leaves returns to the pool
            flying, starting = {f[0] for f in self.flights.values()} - {k}, set(self.appearing.values())
            free = [
                self.nodes[j].step_s if j in self.nodes else None for j in group.keys() if j not in flying | starting
            ]
            until = node.step + pace_share(self.budget - self.assigned, node.step_s, free)
            seconds = self._in_phase(k)
        until = min(until, self.leaves.get(k, until))
        if until <= node.step:
            return
        missed = [r for r in self.log if r.number > node.rounds]
        merged = [a.token for r in missed for a in r.payloads if a.node == k and a.token is not None]
        group.ledger.send("train", "control", [until, merged] if merged else until)
        book_catch_up(group.ledger, "train", k, missed)
        meta, payload = group[k].segment.remote([r.args() for r in missed], until, seconds, node.reset, merged)
        node.reset = False
        if node.idle_since is not None:
            node.waiting_s += time.perf_counter() - node.idle_since
            node.idle_since = None
        self.flights[meta] = (k, payload, node.step, until, time.perf_counter(), seconds)
        self.assigned += until - node.step

    def _in_phase(self, k: int) -> float:
        """Node k's training seconds for its next segment under `sync: time` (`in_phase_s`), from the other
        nodes' segments in flight and its own last segment's time outside training."""
        now = time.perf_counter()
        others = [self._expected(f) - now for f in self.flights.values() if f[0] != k and self.nodes[f[0]].pace_s]
        return in_phase_s(self.seconds, others, self._overhead(k))

    def _tail_cut(self, k: int, steps: int) -> int:
        """Node k's segment of `steps`, cut at the end of the run where it would outlast the others
        (`tail_steps`): the work left besides it is the budget not yet assigned and the steps the others'
        segments in flight are predicted still to train, from each node's last pace."""
        node, now = self.nodes[k], time.perf_counter()
        paced = {j: n.step_s for j, n in self.nodes.items() if j != k and j not in self.departed and n.step_s}
        if node.step_s is None:
            return steps
        running = sum(max(0.0, self._expected(f) - now) / paced[f[0]] for f in self.flights.values() if f[0] in paced)
        work = self.budget - self.assigned - steps + running
        return tail_steps(steps, node.step_s, list(paced.values()), work, self.opts.grace_s)

    def _arrived(self, group: NodeGroup, plan: Plan, ref: ray.ObjectRef) -> None:
        if ref in self.appearing:
            self._appeared(group, ref)
            return
        if ref in self.joining:
            k = self.joining.pop(ref)
            try:
                self.nodes[k].rounds, self.nodes[k].step = ray.get(ref)
            except ray.exceptions.RayActorError as err:  # died again while starting
                self._rejoin(group, k, err)
                return
            self.unjoined.discard(k)
            self.nodes[k].reset = True
            self._assign(group, plan, k)
            return
        k, payload, start, until, sent_at, _ = self.flights.pop(ref)
        node = self.nodes[k]
        try:
            meta = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self.assigned -= until - start
            node.lost_s += time.perf_counter() - sent_at
            self._rejoin(group, k, err)
            return
        group.ledger.send("train", "round_replies", meta)
        self.assigned -= until - meta["step"]  # a segment stopped by time returns what it did not use
        node.step, node.rounds, node.pace_s = meta["step"], meta["base_round"], time.perf_counter() - sent_at
        node.step_s = node.pace_s / max(1, meta["step"] - start)
        self._forget_landed()
        node.segments.append({**meta, "node": k, "wall_s": node.pace_s})
        self._check(k, meta)
        arrival = Arrival(
            k,
            payload,
            meta["base_round"],
            meta["nbytes"],
            meta["train_s"],
            meta["samples"],
            time.perf_counter(),
            meta.get("token"),
        )
        self.pending.setdefault(k, []).append(arrival)
        node.idle_since = arrival.arrived_at
        if not self._leave_if_due(group, k) and len(self.pending[k]) < self._pending_cap():
            self._assign(group, plan, k)  # keep_training: it trains on while its payload waits

    def _pending_cap(self) -> int:
        """How many of a node's payloads may wait for rounds before it waits too."""
        return 2 if self.opts.keep_training else 1

    def _forget_landed(self) -> None:
        """Drop the rounds every node of the run has landed: nobody will fetch their payloads again, so
        the object store frees them. A node restarting catches up from its round file, which holds a
        round it had landed, so the rounds after it are kept for it."""
        everyone = min(self.nodes[k].rounds for k in self.nodes if k not in self.departed)
        self.log = [r for r in self.log if r.number > everyone]

    def _check(self, k: int, meta: dict) -> None:
        """Every node that started from round r holds the same global model."""
        seen = self.hashes.setdefault(meta["base_round"], {})
        seen[k] = meta["base_hash"]
        if len(set(seen.values())) > 1:
            raise ReplicaMismatch(f"lo-fi nodes hold different global models after round {meta['base_round']}: {seen}")

    def _rejoin(self, group: NodeGroup, k: int, err: Exception) -> None:
        """A node that died leaves the quorum at once; restarted, it joins again at its next segment."""
        try:
            group.restart(k, err)
        except Exception as final:
            logger.warning("[lofi] node %d died and its restarts are spent (%s): it leaves the run", k, final)
            group.remove(k, kill=False)
            self.departed.append(k)
            self.nodes[k].left_at = time.perf_counter()
            self.died_of[k] = cause_of(err)
            if not len(group):  # nothing left to train or land: the first death is the run's error
                raise all_left(self._progress(), "lofi node", self.died_of) from final
            return
        self.nodes[k].restarts += 1
        # a joiner that died before it joined joins again: the rounds before its global model may be gone
        self.joining[self._join_call(group, k) if k in self.unjoined else group[k].round_of.remote()] = k

    def _land(self, phase: str) -> list[int]:
        """The pending payloads as the next round, in node order; returns the nodes now free to train."""
        number = len(self.landed) + 1
        payloads = [a for k in sorted(self.pending) for a in self.pending[k]]
        weights = []
        for a in payloads:
            missed = number - 1 - a.base
            if missed:
                self.late.append(missed)
            work = float(a.samples) if self.seconds is not None else self.weights[a.node]  # merge by work
            weights.append(staleness_weight(work, missed, self.opts.staleness))
            self.nodes[a.node].useful_s += a.train_s
        self.log.append(LandedRound(number, payloads, weights))
        self.landed.append(self.log[-1].record())
        self.storage.write_json(ROUNDS, self.landed)  # what a resumed run's budget goes on from
        self.pending = {}
        training = {f[0] for f in self.flights.values()}
        return sorted({a.node for a in payloads if a.node not in self.departed and a.node not in training})

    def finish(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str, node_metrics: list[dict]
    ) -> FinalModel:
        """The last payloads land as the final round; every node lands what it has not of the log, and
        the driver checks that they all hold one global model: the average."""
        if self.pending:
            self._land("final")
        ledger, calls = group.ledger, {}
        for k in group.keys():
            missed = [r for r in self.log if r.number > self.nodes[k].rounds]
            book_catch_up(ledger, "final", k, missed)
            calls[k] = [r.args() for r in missed]
        self._land_everywhere(group, calls, self.opts.keep_training)
        for k in group.keys():
            self.nodes[k].rounds = len(self.landed)
        check_global(group, plan.steps, ledger, "final")
        return FinalModel(group.keys(), on_nodes=True)

    @staticmethod
    def _land_everywhere(group: NodeGroup, missed: dict[int, list], onto_global: bool) -> None:
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

    def details(self) -> dict:
        return {
            "rounds": len(self.landed),
            "round_sizes": [len(r) for r in self.landed],
            "round_log": self.landed,
            "late_payloads": len(self.late),
            "late_staleness": self.late,
            "departed": self.departed,
            "died_of": self.died_of,
            "joined": self.joined,
            "left": self.left,
            **({"resumed_after_round": self.resumed_at} if self.resumed else {}),
            "restarts": {k: n.restarts for k, n in self.nodes.items() if n.restarts},
        }
