"""The driver's side of the stage pipeline: a batch's calls submitted in the schedule model's order,
batches kept in flight up to a bound, and every head scored through the chain. Only refs change hands."""

from __future__ import annotations

import logging

from raylowcomm.actors import DriverFetches
from raylowcomm.common.batches import Split, num_examples
from raylowcomm.common.timing import TrainClock
from raylowcomm.core.interlock.routing import message_plan
from raylowcomm.core.interlock.schedule import Call, calls_by_kind
from raylowcomm.failures import NodeFailed, first_of
from raylowcomm.tasks import CausalLM, ImageClassification, add_sums, metric_names

logger = logging.getLogger(__name__)


class CallSubmitter:
    """Submits stage calls in the schedule model's order (`submission_order` replays the same
    sequence): a batch's forwards, and later its backwards, each call handed the ref its input
    comes from. Only refs change hands."""

    def __init__(self, actors: list, plan: list[list[frozenset[int]]], micro_batches: int):
        self.actors = actors
        self.forwards, self.backwards = calls_by_kind(plan, micro_batches)
        # (batch, call) -> (ref of h for the next stage or None, ref of its upstream message)
        self.refs: dict[tuple[int, Call], tuple] = {}

    def forward(self, step: int) -> None:
        for call in self.forwards:
            source = self.refs[(step, call.source)][0] if call.source else None
            self.refs[(step, call)] = self.actors[call.stage].forward.remote(step, call.mb, source)

    def backward(self, step: int) -> list:
        """Batch ``step``'s backwards; returns the stages' report refs (the batch's refs are dropped)."""
        for call in self.backwards:
            self.refs[(step, call)] = (
                None,
                self.actors[call.stage].backward.remote(step, call.mb, self.refs[(step, call.source)][1]),
            )
        self.refs = {key: refs for key, refs in self.refs.items() if key[0] != step}
        return [actor.report.remote() for actor in self.actors]


def train_interlocked(
    actors: list,
    num_stages: int,
    width: int,
    rule: str,
    micro_batches: int,
    steps: int,
    fetch: DriverFetches,
    time_budget_s: float | None = None,
    max_ahead: int = 2,
    on_reports=None,
    eval_at: frozenset[int] = frozenset(),
    evaluate=None,
    stage_batches: int = 1,
) -> dict:
    """Up to ``steps`` batches (or ``time_budget_s`` of training: no batch is begun once the clock has
    reached it, and the ones in flight finish); ``on_reports`` sees each batch's stage reports; after batch
    b in ``eval_at`` is complete the driver waits for its reports and ``evaluate(b, train_s)`` runs off the
    clock. ``stage_batches`` = A: batch b's backwards are submitted after batch b + A − 1's forwards (the
    stages overlap batches, `submission_order`). With a budget, ``stopped_at_s`` is when the clock was
    found past it and ``last_step_s`` the time since the check before."""
    submit = CallSubmitter(actors, message_plan(num_stages, width, rule), micro_batches)
    clock, pending, reports, batches = TrainClock(), [], [], 0
    checked, stopped, ahead = 0.0, {}, stage_batches - 1

    def drain(keep: int) -> None:
        while len(pending) > keep:
            reports.append(fetch.get(pending.pop(0), "train", "stage_reports"))
            raise_first_failure(reports[-1])
            if on_reports is not None:
                on_reports(reports[-1])

    def finish(batch: int) -> None:
        pending.append(submit.backward(batch))
        if evaluate is not None and batch + 1 in eval_at:
            drain(0)
            with clock.paused():
                evaluate(batch + 1, clock.elapsed())

    for step in range(steps):
        now = clock.elapsed()
        if time_budget_s is not None and now >= time_budget_s:
            stopped = {"stopped_at_s": now, "last_step_s": now - checked}
            break
        checked = now
        drain(max_ahead)
        submit.forward(step)
        batches += 1
        if step >= ahead:
            finish(step - ahead)
    for batch in range(max(batches - ahead, 0), batches):
        finish(batch)
    drain(0)
    return {"reports": reports, "batches": batches, "train_s": clock.elapsed(), **stopped}


def raise_first_failure(batch_reports: list[dict]) -> None:
    """A batch's reports say whether a stage failed: the calls that depend on a failed call never run
    and the driver reads none of their replies, so a stage's own exception reaches the driver only
    here. It is raised as the run's error (`NodeFailed`, the first stage's to fail), before the
    driver reads the batch's losses, which a failed batch does not have."""
    failure = first_of([r.get("failure") for r in batch_reports])
    if failure is not None:
        raise NodeFailed(failure)


def evaluate_chained(
    actors: list, eval_sets: dict[str, Split], batch_size: int, fetch: DriverFetches, loss: str
) -> tuple[dict[str, list[dict]], int]:
    """Every head's metrics on every eval set, chunks pipelined through the stages, each head's
    per-chunk sums added up and summarised by the task (as `Task.evaluate` does for a whole
    model); returns ({set: [metrics of head k]}, bytes sent between stages)."""
    summarize = CausalLM.summarize if loss == "causal_lm" else ImageClassification.summarize
    refs = {name: [[] for _ in actors] for name in eval_sets}
    for name, split in eval_sets.items():
        for chunk in range(-(-num_examples(split) // batch_size)):
            x = None
            for k, actor in enumerate(actors):
                x, metrics = actor.evaluate.remote(name, chunk, x)
                refs[name][k].append(metrics)
    parts = {name: [fetch.get(chunks, "final", "eval_metrics") for chunks in stages] for name, stages in refs.items()}
    sent = sum(p.pop("sent_bytes") for stages in parts.values() for chunks in stages for p in chunks)
    return {name: [summarize(add_sums(chunks)) for chunks in stages] for name, stages in parts.items()}, sent


def final_head_metrics(per_set: dict[str, list[dict]]) -> dict[str, float]:
    """The last stage's head on the test (id_*) and shift sets: the model's metrics."""
    return metric_names({name: heads[-1] for name, heads in per_set.items() if name != "val"})
