"""lo-fi's lockstep loop: every node trains to the next round boundary with no communication, then the
exchange's averaging round (the star's, or peer rounds'), until the plan's last boundary or the end of
`optim.budget_s`, as the lockstep policy (`core.rounds.lockstep`) decides: this loop carries its decisions
out on Ray. Quorum rounds run their own loop (`quorum_loop`); with every node on time and a
quorum of every node they land the same rounds as this one.

Training time as DDP measures it: the nodes' own loop time (the slowest node per call) plus the
averaging rounds; Ray's call overhead is left out of both."""

from __future__ import annotations

import logging
import time

from raylowcomm.actors import NodeGroup
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.timing import TrainClock
from raylowcomm.core.rounds.lockstep import (
    ExchangeRound,
    LandAtStop,
    LockstepDecision,
    LockstepEvent,
    LockstepPolicy,
    RoundTaken,
    SegmentTrained,
    Started,
    StopAt,
    TrainTo,
)
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.exchange import Exchange, Trained
from raylowcomm.strategies.lofi.messages import TrainReport
from raylowcomm.strategies.lofi.plan import Plan

logger = logging.getLogger(__name__)


def lockstep_accounts(group: NodeGroup, calls: list[list[TrainReport]]) -> list[NodeAccount]:
    """Each node's goodput account in lockstep rounds: its training is useful (every round merges it), and
    in each call it waits for the slowest node; what a node lost before a restart is not timed."""
    return [
        NodeAccount(
            key,
            useful_s=sum(call[k].train_s for call in calls),
            idle_at_barriers_s=sum(max(r.train_s for r in call) - call[k].train_s for call in calls),
            lost_s=None,
            restarts=group.restarted.get(key, 0),
        )
        for k, key in enumerate(group.keys())
    ]


class LockstepRounds:
    """One run's lockstep training on `group`, from averaging round `first` (a resumed run's)."""

    def __init__(self, ctx: RunContext, group: NodeGroup, plan: Plan, exchange: Exchange, initial):
        self.ctx, self.group, self.plan, self.exchange, self.initial = ctx, group, plan, exchange, initial
        self.budget = ctx.cfg.optim.budget_s
        self.calls: list[list[TrainReport]] = []
        """Every node's report of every call, call by call."""
        self.snapshots: list[tuple[int, float, int]] = []
        """(step, training seconds at the step, bytes sent by then) of each snapshot (`eval_every`)."""
        self.train_s = self.round_s = 0.0

    def run(self, first: int = 0) -> Trained:
        """Asks the policy (`core.rounds.lockstep`) what comes next and carries it out, until it is done."""
        began = time.perf_counter()
        policy = LockstepPolicy(self.plan.boundaries, self.budget, self.plan.steps, self.plan.landings)
        event: LockstepEvent | None = Started(first)
        while event is not None:
            event = self._carry_out(policy.decide(event))
        slowest = max(self.calls[-1], key=lambda r: r.train_s).last_step_s if self.calls else 0.0
        return Trained(
            nodes=[[r.wire() for r in calls] for calls in zip(*self.calls)],
            train_s=self.train_s,
            snapshots=self.snapshots,
            goodput=goodput(lockstep_accounts(self.group, self.calls), time.perf_counter() - began),
            samples=sum(r.samples for call in self.calls for r in call),
            last_step_s=slowest + self.round_s,  # the last step (and a round after it)
        )

    def _carry_out(self, decisions: list[LockstepDecision]) -> LockstepEvent | None:
        """The decisions in order; what the last one (a call, a round) tells the policy, or None: done."""
        event = None
        for decision in decisions:
            if isinstance(decision, TrainTo):
                event = self._train_to(decision)
            elif isinstance(decision, ExchangeRound):
                event = self._round(decision)
            elif isinstance(decision, LandAtStop):
                self._land_at_stop(decision)
            elif isinstance(decision, StopAt):
                self.plan.stop_at(decision.step, decision.index)
        return event

    def _round(self, decision: ExchangeRound) -> RoundTaken:
        """The exchange's averaging round, its seconds counted as training time."""
        round_clock = TrainClock()
        self.exchange.round(self.group, self.plan, decision.round, decision.until)
        self.round_s = round_clock.elapsed()
        self.train_s += self.round_s
        return RoundTaken(self.train_s)

    def _land_at_stop(self, decision: LandAtStop) -> None:
        """`lofi.overlap` with a spent budget: the round in flight lands where the nodes stand, its wait
        booked beside the wait for the round before it."""
        self.group.ledger.send("train", "control", decision.round, copies=len(self.group))
        waits = self.group.call("land_round", decision.round, phase="train")
        for report, wait in zip(self.calls[-1], waits):
            report.round_wait_at_stop_s = wait
        self.exchange.landed(self.group, decision.at, "train")

    def _train_to(self, decision: TrainTo) -> SegmentTrained:
        """Every node's call up to the decision's boundary, landing the round in flight in it, if any."""
        plan, ledger, until = self.plan, self.group.ledger, decision.until
        landing = [decision.landing.round, decision.landing.step] if decision.landing is not None else None
        self.round_s = 0.0
        ledger.send(
            "setup" if decision.index == 0 else "train",
            "control",
            [until, landing] if landing else until,
            copies=len(self.group),
        )
        due = [s for s in plan.snapshots if decision.since < s <= until]
        sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
        phase = "final" if decision.last else "train"
        wires = self.group.call("train", until, due, landing, decision.seconds, phase=phase, what="train_stats")
        reports = [TrainReport.from_wire(w) for w in wires]
        self.calls.append(reports)
        if landing:
            self.exchange.landed(self.group, until, phase)
        for s in due:  # a node restarted from a later checkpoint than s has no time for it: the others tell
            times = [r.snapshot_s[s] for r in reports if s in r.snapshot_s]
            if times:
                self.snapshots.append((s, self.train_s + max(times), sent))
        self.train_s += max(r.train_s for r in reports)
        self._report(until, reports)
        return SegmentTrained(max(r.step for r in reports), self.train_s)

    def _report(self, until: int, reports: list[TrainReport]) -> None:
        """The call's progress to the driver's view; a restarted node's refetches booked."""
        losses = [r.mean_loss for r in reports if r.mean_loss is not None]
        progress = {"step": until, "steps": self.plan.steps, "bytes": self.group.ledger.total_bytes}
        self.ctx.report({**progress, **({"train_loss": sum(losses) / len(losses)} if losses else {})})
        for r in reports:
            if r.restored_from is not None:
                logger.info("[lofi] node %d died and resumed from its checkpoint at step %d", r.node, r.restored_from)
                self.group.ledger.send("train", "recovery_refetch", self.initial)
                self.group.ledger.send("train", "recovery_refetch", self.ctx.data.train)
