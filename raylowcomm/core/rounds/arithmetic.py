"""The arithmetic of quorum rounds' policy (`rounds.policy`, `rounds.pacing`): how many payloads a
round needs, what a late payload weighs, where a node's next segment ends on its schedule, by its pace
or in phase with the others under sync by time, and where a slow node's last segment is cut. Plain
Python: tests/core/test_round_policy.py imports neither."""

from __future__ import annotations

import math


def quorum_of(quorum: int | float, live: int) -> int:
    """Payloads a round needs: a count, or a fraction of the live nodes (rounded up), at most `live`."""
    need = quorum if isinstance(quorum, int) else math.ceil(quorum * live)
    return max(1, min(need, live))


def staleness_weight(weight: float, missed: int, exponent: float) -> float:
    """A quorum round's weight for a payload `missed` rounds after the one its Δ started from (FedBuff's
    polynomial discount; exactly `weight` for a fresh one)."""
    return weight if missed == 0 else weight * (1 + missed) ** -exponent


def boundary_after(bounds: list[int], step: int) -> int:
    """The next round boundary after `step` on a node's own schedule: the plan's boundaries (`bounds`),
    then on past the run's steps with their last gap (a fast node taking a slow one's share)."""
    for b in bounds:
        if b > step:
            return b
    gap = bounds[-1] - bounds[-2] if len(bounds) > 1 else bounds[-1]
    return step + gap


def pace_share(left: int, step_s: float | None, free: list[float | None]) -> int:
    """A node's cap on its next segment under `sync: time`: its share of the `left` node-steps among the
    nodes free to take them (`free`: each one's time a step, it among them), in proportion to its pace,
    so that near the end the slow node is not handed the steps the fast ones would finish first; an
    equal share where a pace is not known yet."""
    if step_s is None or None in free:
        return math.ceil(left / max(1, len(free)))
    return math.ceil(left / step_s / sum(1 / s for s in free))


def in_phase_s(period: float, others_left_s: list[float], overhead_s: float) -> float:
    """Under `sync: time`, the training seconds of a node's next segment: it ends when the median of the
    other nodes' segments in flight is expected to arrive (`others_left_s`, seconds from now), less its
    own landing and encoding (`overhead_s`), so a node restarted or joining mid-period meets the others'
    round instead of waiting most of a period for the next one; whole periods more where that leaves
    under half of one, and a period where no other node trains with a known pace."""
    if not others_left_s:
        return period
    left = sorted(others_left_s)[len(others_left_s) // 2] - overhead_s
    return left if left >= period / 2 else left + period * math.ceil((period / 2 - left) / period)


def tail_steps(steps: int, step_s: float, others_step_s: list[float], work: float, grace_s: float) -> int:
    """A segment of `steps` at `step_s` a step, cut where it would end well after the other nodes (at
    `others_step_s` a step each) have trained `work` node-steps, what is left of the budget besides it:
    by more than half of its own length or `grace_s`, whichever is more (nodes at the same pace are
    never cut). Cut, it is what its node trains by the time all of them, it too, are predicted to
    spend the budget: at the end of the run nobody waits for the slowest node's whole segment."""
    if not others_step_s:
        return steps
    others = sum(1 / s for s in others_step_s)
    own = steps * step_s
    if own - work / others <= max(grace_s, own / 2):
        return steps
    return max(1, math.ceil((work + steps) / (others + 1 / step_s) / step_s))
