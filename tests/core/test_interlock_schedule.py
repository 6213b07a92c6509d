"""The pipeline-schedule model (core/interlock/schedule.py) against timelines computed by hand."""

from __future__ import annotations

import pytest

from raylowcomm.core.interlock.routing import message_plan
from raylowcomm.core.interlock.schedule import Link, StageCost, batch_calls, simulate, submission_order


def spans(timeline) -> dict[tuple[int, int, str, int], tuple[float, float]]:
    return {(b, c.stage, c.kind, c.mb): (start, end) for b, c, start, end in timeline.calls}


def test_k3_n2_two_micro_batches_by_hand():
    """K = 3, n = 2 (farthest), 2 micro-batches, 2 batches, every message 0.5 s, own devices.
    Stage costs (forward, backward, step): s0 (1, 2, 1), s1 (2, 1, 1), s2 (1, -, 1).
    Routing: s2's forward emits dL2/dx2, which s1's backward uses; s1's forward emits dL1/dx1,
    which s0's backward uses (nothing crosses two hops). Each actor runs in submission order:
    F(mb0) F(mb1) then B(mb0) B(mb1); a stage steps inside its last call of the batch.

    batch 0:  s0 F0 [0,1]  F1 [1,2]  B0 [4,6] (s1 F0 ends 3.5, +0.5)  B1+step [6,9]
              s1 F0 [1.5,3.5]  F1 [3.5,5.5]  B0 [5.5,6.5] (s2 F0 ends 5)  B1+step [8.5,10.5]
              s2 F0 [4,5]  F1+step [6,8]
    batch 1:  s0 F0 [9,10] (after its own B1)  F1 [10,11]  B0 [13,15]  B1+step [15,18]
              s1 F0 [10.5,12.5]  F1 [12.5,14.5]  B0 [14.5,15.5]  B1+step [17.5,19.5]
              s2 F0 [13,14]  F1+step [15,17]
    Step ends: s0 9, 18; s1 10.5, 19.5; s2 8, 17: a step every 9 s on every stage."""
    costs = [StageCost(1, 2, 1), StageCost(2, 1, 1), StageCost(1, 0, 1)]
    tl = simulate(costs, message_plan(3, 2, "farthest"), micro_batches=2, batches=2, link=Link(latency_s=0.5))
    expected = {
        (0, 0, "forward", 0): (0, 1),
        (0, 0, "forward", 1): (1, 2),
        (0, 0, "backward", 0): (4, 6),
        (0, 0, "backward", 1): (6, 9),
        (0, 1, "forward", 0): (1.5, 3.5),
        (0, 1, "forward", 1): (3.5, 5.5),
        (0, 1, "backward", 0): (5.5, 6.5),
        (0, 1, "backward", 1): (8.5, 10.5),
        (0, 2, "forward", 0): (4, 5),
        (0, 2, "forward", 1): (6, 8),
        (1, 0, "forward", 0): (9, 10),
        (1, 0, "forward", 1): (10, 11),
        (1, 0, "backward", 0): (13, 15),
        (1, 0, "backward", 1): (15, 18),
        (1, 1, "forward", 0): (10.5, 12.5),
        (1, 1, "forward", 1): (12.5, 14.5),
        (1, 1, "backward", 0): (14.5, 15.5),
        (1, 1, "backward", 1): (17.5, 19.5),
        (1, 2, "forward", 0): (13, 14),
        (1, 2, "forward", 1): (15, 17),
    }
    assert spans(tl) == expected
    assert tl.step_ends == [[9, 18], [10.5, 19.5], [8, 17]]
    assert tl.step_time_s == 9
    assert tl.makespan_s == 19.5
    assert tl.busy_s == [2 * (1 + 1 + 2 + 3), 2 * (2 + 2 + 1 + 2), 2 * (1 + 2)]


def test_end_to_end_backward_is_a_chain_and_bytes_cost_bandwidth():
    """K = 3, n = 3 (end to end), 1 micro-batch, forward 1 s, backward 2 s, no step; a message of
    b bytes takes b / 4 s. Activations weigh 4 bytes (1 s), a gradient 8 bytes (2 s).
    s0 F [0,1]; s1 F [2,3]; s2 F [4,5] (emits dL2/dx2); s1 B [7,9] (emits dL2/dx1); s0 B [11,13].
    Batch 1's s0 F waits for s0's own backward: [13,14], so a step every 13 s."""
    costs = [StageCost(1, 2, 0, activation_bytes=4, gradient_bytes=8)] * 3
    tl = simulate(costs, message_plan(3, 3, "farthest"), micro_batches=1, batches=2, link=Link(bytes_per_s=4))
    s = spans(tl)
    assert [s[(0, k, "forward", 0)] for k in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert s[(0, 1, "backward", 0)] == (7, 9) and s[(0, 0, "backward", 0)] == (11, 13)
    assert s[(1, 0, "forward", 0)] == (13, 14)
    assert tl.step_time_s == 13


def test_shared_cores_slow_concurrent_calls():
    """K = 2, n = 1 (no backward messages), 1 micro-batch, forward 1 s on both stages, 1 core
    shared. s0 F(b0) [0,1] alone; from then on s0 F(b+1) and s1 F(b) run together at half speed:
    [1,3], [3,5], ...: a step every 2 s (the total work over one core), vs 1 s on own devices."""
    plan = message_plan(2, 1, "farthest")
    shared = simulate([StageCost(1)] * 2, plan, micro_batches=1, batches=4, cores=1)
    assert spans(shared)[(0, 0, "forward", 0)] == (0, 1)
    assert spans(shared)[(1, 0, "forward", 0)] == (1, 3) and spans(shared)[(0, 1, "forward", 0)] == (1, 3)
    assert shared.step_ends == [[1, 3, 5, 7], [3, 5, 7, 8]]
    assert shared.step_time_s == 2
    assert simulate([StageCost(1)] * 2, plan, micro_batches=1, batches=4).step_time_s == 1


def test_driver_keeps_at_most_max_ahead_batches_beyond_the_oldest():
    """K = 2, n = 1: stage 1 takes 10 s, stage 0 1 s. With max_ahead 0 batch b is submitted when
    batch b − 1 is complete, so stage 0 cannot run ahead: its steps come 11 s apart, not 1 s."""
    plan = message_plan(2, 1, "farthest")
    costs = [StageCost(1), StageCost(10)]
    assert simulate(costs, plan, 1, batches=3, max_ahead=0).step_ends[0] == [1, 12, 23]
    assert simulate(costs, plan, 1, batches=3, max_ahead=2).step_ends[0] == [1, 2, 3]


@pytest.mark.parametrize("K,n", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_every_backward_waits_for_a_message_of_the_next_stage(K, n):
    """The call list the driver submits: K forwards per micro-batch, and each backward's source is
    a call of stage k + 1 of the same micro-batch (n = 1: no backward at all)."""
    calls = batch_calls(message_plan(K, n, "farthest"), 3)
    assert sum(c.kind == "forward" for c in calls) == 3 * K
    backward = [c for c in calls if c.kind == "backward"]
    assert len(backward) == (0 if n == 1 else 3 * (K - 1))
    assert all(c.source.stage == c.stage + 1 and c.source.mb == c.mb for c in backward)
    # n = 2: the message comes from the next stage's forward; end to end: a chain of backwards
    assert all(c.source.kind == ("forward" if n < K or c.stage == K - 2 else "backward") for c in backward)


def test_a_stage_that_overlaps_batches_runs_the_next_forward_while_its_message_travels_by_hand():
    """K = 2, n = 2 (end to end), 1 micro-batch, 4 batches; s0 (forward 1, backward 1), s1 (forward 1).
    One batch at a time, s0 waits for s1's forward before its backward, and s1 for s0's: a step
    every 3 s. With 2 batches a stage, s0 runs F(b + 1) while s1 runs F(b):
        s0  F0 [0,1]  F1 [1,2]  B0 [2,3]  F2 [3,4]  B1 [4,5]  F3 [5,6]  B2 [6,7]  B3 [7,8]
        s1  F0 [1,2]  F1 [2,3]  F2 [4,5]  F3 [6,7]
    a step every 2 s once it runs."""
    plan, costs = message_plan(2, 2, "farthest"), [StageCost(1, 1), StageCost(1)]
    assert simulate(costs, plan, 1, batches=4).step_ends == [[3, 6, 9, 12], [2, 5, 8, 11]]
    ahead = simulate(costs, plan, 1, batches=4, stage_batches=2)
    assert ahead.step_ends == [[3, 5, 7, 8], [2, 3, 5, 7]]
    assert ahead.step_time_s == 2
    assert [(b, c.kind) for b, c, *_ in sorted(ahead.calls, key=lambda t: t[2]) if c.stage == 0] == [
        (0, "forward"), (1, "forward"), (0, "backward"), (2, "forward"),
        (1, "backward"), (3, "forward"), (2, "backward"), (3, "backward"),
    ]  # fmt: skip


@pytest.mark.parametrize("stage_batches", [1, 2, 3])
@pytest.mark.parametrize("K,n,rule", [(2, 2, "farthest"), (4, 2, "farthest"), (4, 2, "sum"), (4, 4, "farthest")])
def test_the_submission_order_holds_every_call_once_after_its_source(K, n, rule, stage_batches):
    """Every call of every batch once, each after the call its input comes from (the actors, which
    run their calls in this order, cannot deadlock); one batch a stage is batch_calls batch by batch;
    with more, a stage's forwards of batch b + stage_batches − 1 come before its backwards of batch b."""
    plan, batches = message_plan(K, n, rule), 5
    order = submission_order(plan, 2, batches, stage_batches)
    calls = batch_calls(plan, 2)
    assert sorted(order, key=lambda bc: (bc[0], calls.index(bc[1]))) == [(b, c) for b in range(batches) for c in calls]
    position = {bc: i for i, bc in enumerate(order)}
    assert all(position[(b, c.source)] < i for i, (b, c) in enumerate(order) if c.source is not None)
    if stage_batches == 1:
        assert order == [(b, c) for b in range(batches) for c in calls]
    for b, c in order:
        if c.kind == "backward" and b + stage_batches - 1 < batches:
            later = [position[(b + stage_batches - 1, f)] for f in calls if f.kind == "forward" and f.stage == c.stage]
            assert max(later) < position[(b, c)]
