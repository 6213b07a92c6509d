"""lo-fi's lockstep loop: every node trains to the next round boundary with no communication, then the
exchange's averaging round (the star's, or peer rounds'), until the plan's last boundary or the end of
`optim.budget_s`. Quorum rounds run their own loop (`quorum_loop`); with every node on time and a
quorum of every node they land the same rounds as this one.

Training time as DDP measures it: the nodes' own loop time (the slowest node per call) plus the
averaging rounds; Ray's call overhead is left out of both."""

from __future__ import annotations

import logging
import time

from raylowcomm.actors import NodeGroup
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.timing import TrainClock
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
        began, bounds = time.perf_counter(), self.plan.boundaries
        for i, until in enumerate(bounds[first:], first):
            if self.budget is not None and self.calls and self.train_s >= self.budget:  # the last round took the rest
                self._land_at_stop(i)
                self.plan.stop_at(bounds[i - 1], i)  # the final round comes where that one did
                break
            self.round_s, last = 0.0, i == len(bounds) - 1
            self._train_to(i, until, last)
            if self.budget is not None and not last and self.train_s >= self.budget:  # spent: this segment ends it
                self.plan.stop_at(max(r.step for r in self.calls[-1]), i)
                break
            if not last:
                round_clock = TrainClock()
                self.exchange.round(self.group, self.plan, i + 1, until)
                self.round_s = round_clock.elapsed()
                self.train_s += self.round_s
        reached = max((r.step for r in self.calls[-1]), default=self.plan.steps) if self.calls else self.plan.steps
        if self.budget is not None and reached < self.plan.steps:  # the last segment ended by time
            self.plan.stop_at(reached, len(bounds) - 1)
        slowest = max(self.calls[-1], key=lambda r: r.train_s).last_step_s if self.calls else 0.0
        return Trained(
            nodes=[[r.wire() for r in calls] for calls in zip(*self.calls)],
            train_s=self.train_s,
            snapshots=self.snapshots,
            goodput=goodput(lockstep_accounts(self.group, self.calls), time.perf_counter() - began),
            samples=sum(r.samples for call in self.calls for r in call),
            last_step_s=slowest + self.round_s,  # the last step (and a round after it)
        )

    def _land_at_stop(self, i: int) -> None:
        """`lofi.overlap` with a spent budget: the round in flight lands where the nodes stand, its wait
        booked beside the wait for the round before it."""
        landing = self.exchange.landing(self.plan, i)
        if not landing:
            return
        self.group.ledger.send("train", "control", landing[0][0], copies=len(self.group))
        waits = self.group.call("land_round", landing[0][0], phase="train")
        for report, wait in zip(self.calls[-1], waits):
            report.round_wait_at_stop_s = wait
        self.exchange.landed(self.group, self.plan.boundaries[i - 1], "train")

    def _train_to(self, i: int, until: int, last: bool) -> None:
        """Every node's call up to boundary i (`until`), landing the round in flight in it, if any."""
        plan, ledger = self.plan, self.group.ledger
        landing = self.exchange.landing(plan, i)
        ledger.send(
            "setup" if i == 0 else "train", "control", [until, *landing] if landing else until, copies=len(self.group)
        )
        due = [s for s in plan.snapshots if (plan.boundaries[i - 1] if i else 0) < s <= until]
        sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
        seconds = None if self.budget is None else self.budget - self.train_s  # the rest, on the nodes' clocks
        phase = "final" if last else "train"
        wires = self.group.call(
            "train", until, due, landing[0] if landing else None, seconds, phase=phase, what="train_stats"
        )
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
