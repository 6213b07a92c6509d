"""Quorum rounds (`lofi.quorum`): peer rounds that never wait for every node. The policy, plain Python,
decides (`raylowcomm.core.rounds`: which round lands with which payloads and weights, who trains which
segment, who joins and leaves); `quorum_loop.QuorumLoop` runs it on Ray. Here: the options, a resumed
run's start, the final round and what the record tells of the rounds.

A driver that died takes the payloads it owned with it: every node adopts the global model of the node
that had landed the most rounds and the budget goes on from what the landed rounds merged (`ROUNDS`).
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

from raylowcomm.actors import NodeGroup
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.config import RunConfig
from raylowcomm.core.rounds import NodeLog, QuorumPolicy, Rules, RunRecord
from raylowcomm.core.rounds.events import Finish, Land
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.exchange import FinalModel, Trained
from raylowcomm.strategies.lofi.peers import PeerExchange, check_global
from raylowcomm.strategies.lofi.plan import Plan
from raylowcomm.strategies.lofi.quorum_loop import ROUNDS, QuorumLoop, book_catch_up, land_everywhere
from raylowcomm.strategies.lofi.robust_average import robust_details
from raylowcomm.strategies.lofi.round_file import round_path
from raylowcomm.strategies.lofi.star import curve_needs_driver_weights

logger = logging.getLogger(__name__)

__all__ = ["ROUNDS", "QuorumExchange"]


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
        self.record = RunRecord()
        self.policy: QuorumPolicy | None = None

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
        ahead = max(keys, key=lambda k: held[k].rounds)
        latest = held[ahead].rounds
        if latest:
            group.call("adopt_round", round_path(ahead), phase="train")
        else:  # every node still holds the start as its global model: it starts from there again
            group.call("catch_up", [], True, phase="train")
        landed = ctx.storage.read_json(ROUNDS) if ctx.storage.exists(ROUNDS) else []
        self.record.landed = landed[:latest] + [[] for _ in range(latest - len(landed))]
        self.resumed, self.resumed_at = {k: NodeLog(step=held[k].step, rounds=latest) for k in keys}, latest
        logger.info("[lofi] quorum rounds resume from round %d (node %d's global model)", latest, ahead)
        return latest

    def train(self, ctx: RunContext, group: NodeGroup, plan: Plan, launch=None) -> Trained:
        """Segments until the budget of node-steps is spent, landing rounds as their quorums come in, nodes
        joining (`launch(k)` starts node k's actor) and leaving on their schedules. The last payloads stay
        pending: `finish` lands them as the final round."""
        first = len(group)
        count = first + ctx.cfg.nodes.most - ctx.cfg.nodes.count  # the nodes the budget is for: a range's max
        merged = sum(p["samples"] for r in self.record.landed for p in r) // self.batch_size
        rules = Rules(
            quorum=self.quorum,
            grace_s=self.opts.grace_s,
            staleness=self.opts.staleness,
            keep_training=self.opts.keep_training,
            period_s=self.opts.sync_every_s if self.opts.sync == "time" else None,
            boundaries=plan.boundaries,
            weights=dict(enumerate(plan.weights)),  # one per node slot, joiners' too
            count=count,
            leaves={e.node: e.step for e in self.opts.leave},
            joins=[(first + i, e.step) for i, e in enumerate(self.opts.join)],
        )
        nodes = self.resumed or {k: NodeLog() for k in group.keys()}
        self.policy = QuorumPolicy(rules, plan.steps * count - merged, nodes, self.record)
        began = time.perf_counter()
        QuorumLoop(ctx, group, plan, self.policy, launch).run()
        return self._summary(group, began, time.perf_counter())

    def _summary(self, group: NodeGroup, began: float, end: float) -> Trained:
        """The training's record: each node's segments and its goodput account (the payloads still pending
        count as useful: `finish` lands them)."""
        nodes, pending, rounds = self.policy.nodes, self.policy.pending, len(self.record.landed)
        train_s = end - began
        last = {k: sum(a.train_s for a in arrivals) for k, arrivals in pending.items()}
        late = self.record.late + [
            rounds - a.base for arrivals in pending.values() for a in arrivals if rounds > a.base
        ]
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
            for k, n in sorted(nodes.items())
        ]
        return Trained(
            nodes=[nodes[k].segments for k in group.keys()],  # the nodes still in the run
            train_s=train_s,
            snapshots=[],
            goodput=goodput(accounts, train_s, late_payloads=len(late), late_staleness=late),
            samples=sum(s["samples"] for n in nodes.values() for s in n.segments),  # those that left too
        )

    def finish(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str, node_metrics: list[dict]
    ) -> FinalModel:
        """The last payloads land as the final round; every node lands what it has not of the log, and
        the driver checks that they all hold one global model: the average."""
        ledger, calls = group.ledger, {}
        for d in self.policy.decide(Finish(group.keys())):
            if isinstance(d, Land):
                self.storage.write_json(ROUNDS, self.record.landed)
            else:
                book_catch_up(ledger, "final", d.node, d.rounds)
                calls[d.node] = [r.args() for r in d.rounds]
        land_everywhere(group, calls, self.opts.keep_training)
        check_global(group, plan.steps, ledger, "final")
        return FinalModel(group.keys(), on_nodes=True)

    def details(self) -> dict:
        r = self.record
        return {
            "rounds": len(r.landed),
            "round_sizes": [len(x) for x in r.landed],
            "round_log": r.landed,
            "late_payloads": len(r.late),
            "late_staleness": r.late,
            "departed": r.departed,
            "died_of": r.died_of,
            "joined": r.joined,
            "left": r.left,
            **({"resumed_after_round": self.resumed_at} if self.resumed else {}),
            "restarts": {k: n.restarts for k, n in (self.policy.nodes if self.policy else {}).items() if n.restarts},
            **robust_details(self.storage, self.opts, [[a["node"] for a in x] for x in r.landed]),
        }
