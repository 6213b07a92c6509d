"""A model of the interlocking pipeline's schedule, to predict step times the hardware at hand
cannot run (K stages on K devices) from per-stage call times measured one stage at a time.

It replays what the Ray stage actors do (raylowcomm.strategies.interlocking): the driver
submits every call in :func:`submission_order` (it submits from this very list), an actor runs
its calls one at a time in submission order, a call starts once its input message has arrived
(its producer finished + the link's time for the bytes), and a stage's optimizer step runs
inside its last call of the batch. The driver submits batch b's forwards once batch b − 1 −
``max_ahead`` − (``stage_batches`` − 1) is complete, and batch b's backwards with batch
b + ``stage_batches`` − 1's forwards. With ``cores`` set, the running calls share that many cores equally
(processor sharing: the stages of a run on a small machine); without it every stage has its own
device. Plain Python: no Ray, no torch (the routing plan is passed in)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

_EPS = 1e-9


@dataclass(frozen=True)
class Call:
    """One actor call of a batch: a stage's forward of micro-batch ``mb``, or its backward on the
    upstream message that ``source`` emitted (a forward's source is the previous stage's forward)."""

    stage: int
    kind: Literal["forward", "backward"]
    mb: int
    source: Call | None = None


def batch_calls(plan: Sequence[Sequence[frozenset[int]]], micro_batches: int) -> list[Call]:
    """Every call of one batch in the driver's submission order: all forwards (micro-batch by
    micro-batch, stage by stage), then from the last-but-one stage up, one backward per non-empty
    message that stage k + 1 emits (``plan``: routing.message_plan), micro-batch by micro-batch."""
    K = len(plan)
    emitted: list[list[list[Call]]] = [[[] for _ in range(micro_batches)] for _ in range(K)]  # [k][mb]
    calls: list[Call] = []
    for mb in range(micro_batches):
        for k in range(K):
            calls.append(Call(k, "forward", mb, calls[-1] if k else None))
            emitted[k][mb].append(calls[-1])
    for k in reversed(range(K - 1)):
        for i in [i for i, heads in enumerate(plan[k + 1]) if heads]:
            for mb in range(micro_batches):
                calls.append(Call(k, "backward", mb, emitted[k + 1][mb][i]))
                emitted[k][mb].append(calls[-1])
    return calls


def calls_by_kind(plan: Sequence[Sequence[frozenset[int]]], micro_batches: int) -> tuple[list[Call], list[Call]]:
    """A batch's :func:`batch_calls` split into its forwards and its backwards, each in that order."""
    calls = batch_calls(plan, micro_batches)
    return [c for c in calls if c.kind == "forward"], [c for c in calls if c.kind == "backward"]


def submission_order(
    plan: Sequence[Sequence[frozenset[int]]], micro_batches: int, batches: int, stage_batches: int = 1
) -> list[tuple[int, Call]]:
    """Every (batch, call) of ``batches`` batches in the driver's submission order. With
    ``stage_batches`` = A, batch b's forwards go before batch b − A + 1's backwards, so a stage
    runs the forwards of the A − 1 batches after the one whose gradient messages it waits for;
    A = 1 is each batch's :func:`batch_calls` in turn."""
    forwards, backwards = calls_by_kind(plan, micro_batches)
    order: list[tuple[int, Call]] = []
    for it in range(batches + stage_batches - 1):
        order += [(it, c) for c in forwards] if it < batches else []
        order += [(it - stage_batches + 1, c) for c in backwards] if it >= stage_batches - 1 else []
    return order


def _message_heads(plan: Sequence[Sequence[frozenset[int]]], micro_batches: int) -> dict[Call, int]:
    """How many heads' gradients each emitting call's upstream message carries."""
    emitted: dict[tuple[int, int], int] = {}
    heads: dict[Call, int] = {}
    for call in batch_calls(plan, micro_batches):
        i = emitted.get((call.stage, call.mb), 0)
        heads[call] = len(plan[call.stage][i]) if i < len(plan[call.stage]) else 0
        emitted[(call.stage, call.mb)] = i + 1
    return heads


@dataclass(frozen=True)
class StageCost:
    """Seconds of one stage's calls with the device to itself, and what its messages weigh."""

    forward_s: float
    """A forward call: the stage, its own head's loss and the early (local) backward."""
    backward_s: float = 0.0
    """A backward call on one downstream message."""
    step_s: float = 0.0
    """The optimizer step, at the end of the stage's last call of a batch."""
    activation_bytes: int = 0
    """(h, targets) sent to stage k + 1 per micro-batch."""
    gradient_bytes: int = 0
    """One head's gradient dL_j/dx_k sent to stage k − 1 per micro-batch."""


@dataclass(frozen=True)
class Link:
    """Time of one message between two stages: latency + bytes / bandwidth."""

    latency_s: float = 0.0
    bytes_per_s: float = math.inf

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + (nbytes / self.bytes_per_s if nbytes else 0.0)


@dataclass
class Timeline:
    """Every call's (batch, call, start, end) and each stage's optimizer-step times."""

    calls: list[tuple[int, Call, float, float]]
    step_ends: list[list[float]]  # [stage][batch]
    busy_s: list[float] = field(default_factory=list)

    @property
    def makespan_s(self) -> float:
        return max(end for *_, end in self.calls)

    @property
    def step_time_s(self) -> float:
        """Steady step time as the strategy's record measures it (details.steady_step_time_s): the
        slowest stage's median interval between optimizer steps."""
        return max(statistics.median(b - a for a, b in zip(ends, ends[1:])) for ends in self.step_ends)

    @property
    def busy_fraction(self) -> list[float]:
        return [b / self.makespan_s for b in self.busy_s]


def simulate(
    costs: Sequence[StageCost],
    plan: Sequence[Sequence[frozenset[int]]],
    micro_batches: int,
    batches: int = 8,
    link: Link = Link(),
    max_ahead: int = 2,
    cores: float | None = None,
    stage_batches: int = 1,
) -> Timeline:
    """The schedule of ``batches`` batches (see the module docstring); ``plan`` is
    ``routing.message_plan(K, width, rule)`` and ``costs`` one :class:`StageCost` per stage."""
    K, order = len(costs), batch_calls(plan, micro_batches)
    heads = _message_heads(plan, micro_batches)
    last = {k: max(i for i, c in enumerate(order) if c.stage == k) for k in range(K)}
    index = {c: i for i, c in enumerate(order)}
    submitted = submission_order(plan, micro_batches, batches, stage_batches)
    queues = [[(b, index[c]) for b, c in submitted if c.stage == k] for k in range(K)]
    done: dict[tuple[int, int], float] = {}
    ahead = stage_batches - 1

    def work(b: int, i: int) -> float:
        c, cost = order[i], costs[order[i].stage]
        return (cost.forward_s if c.kind == "forward" else cost.backward_s) + (cost.step_s if i == last[c.stage] else 0)

    def arrival(b: int, i: int) -> float | None:
        """When call i of batch b may start, or None while that is not yet known."""
        times = []
        # the driver's loop iteration that submits the call, which first waits for batch it - 1 - ahead - max_ahead;
        # the backwards left after the last iteration go without waiting
        it = b if order[i].kind == "forward" else b + ahead
        if it < batches and it - 1 - ahead - max_ahead >= 0:
            ends = [done.get((it - 1 - ahead - max_ahead, last[k])) for k in range(K)]
            times.append(None if None in ends else max(ends))
        src = order[i].source
        if src is not None:
            end = done.get((b, index[src]))
            nbytes = (
                costs[src.stage].activation_bytes
                if order[i].kind == "forward"
                else heads[src] * costs[src.stage].gradient_bytes
            )
            times.append(None if end is None else end + link.seconds(nbytes))
        return None if None in times else max(times, default=0.0)

    timeline = _play(queues, order, arrival, work, cores, done)
    step_ends = [[done[(b, last[k])] for b in range(batches)] for k in range(K)]
    busy = [sum(end - start for _, c, start, end in timeline if c.stage == k) for k in range(K)]
    return Timeline(timeline, step_ends, busy)


def _play(
    queues: list[list[tuple[int, int]]],
    order: Sequence[Call],
    arrival: Callable[[int, int], float | None],
    work: Callable[[int, int], float],
    cores: float | None,
    done: dict[tuple[int, int], float],
) -> list:
    """Run every stage's queue of (batch, call index) in order, a call starting once its `arrival` is
    known and past, taking `work` seconds (stretched where more stages run than `cores`); each call's
    end goes into `done` as it happens (`arrival` reads it) and the (batch, call, start, end) timeline
    is returned."""
    K = len(queues)
    t, pos, running, timeline = 0.0, [0] * K, {}, []
    while any(p < len(q) for p, q in zip(pos, queues)) or running:
        for k in range(K):
            if k not in running and pos[k] < len(queues[k]):
                at = arrival(*queues[k][pos[k]])
                if at is not None and at <= t + _EPS:
                    running[k] = (queues[k][pos[k]], t, work(*queues[k][pos[k]]))
                    pos[k] += 1
        waiting = [
            at
            for k in range(K)
            if k not in running and pos[k] < len(queues[k])
            if (at := arrival(*queues[k][pos[k]])) is not None
        ]
        if not running:
            if not waiting:
                raise RuntimeError("the schedule deadlocks: no call can start")
            t = min(waiting)
            continue
        rate = 1.0 if cores is None else min(1.0, cores / len(running))
        dt = min(min(left for *_, left in running.values()) / rate, min(waiting, default=math.inf) - t)
        t += dt
        for k, (key, start, left) in list(running.items()):
            running[k] = (key, start, left - dt * rate)
            if left - dt * rate <= _EPS:
                done[key] = t
                timeline.append((key[0], order[key[1]], start, t))
                del running[k]
    return timeline
