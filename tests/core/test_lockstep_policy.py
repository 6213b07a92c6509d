"""Lockstep rounds' policy driven by hand-written events, its decisions pinned exactly: no Ray, no torch (the
policy is plain Python: importing it pulls in neither, checked in a fresh interpreter)."""

import subprocess
import sys

from raylowcomm.core.rounds import LockstepPolicy
from raylowcomm.core.rounds.lockstep import (
    Done,
    ExchangeRound,
    LandAtStop,
    Landing,
    RoundTaken,
    SegmentTrained,
    Started,
    StopAt,
    TrainTo,
)


def test_the_lockstep_policy_imports_neither_ray_nor_torch():
    code = "import sys, raylowcomm.core.rounds.lockstep; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plain_rounds_train_to_every_boundary_with_a_round_between():
    p = LockstepPolicy([4, 8, 12], budget=None, steps=12)
    assert p.decide(Started(0)) == [TrainTo(0, 0, 4, False, None, None)]
    assert p.decide(SegmentTrained(4, 1.0)) == [ExchangeRound(1, 4)]
    assert p.decide(RoundTaken(1.5)) == [TrainTo(1, 4, 8, False, None, None)]
    assert p.decide(SegmentTrained(8, 2.5)) == [ExchangeRound(2, 8)]
    assert p.decide(RoundTaken(3.0)) == [TrainTo(2, 8, 12, True, None, None)]
    assert p.decide(SegmentTrained(12, 4.0)) == [Done()]  # the last boundary: the final round is the run's end
    assert p.steps == 12


def test_no_rounds_is_one_segment_to_the_end():
    p = LockstepPolicy([20], budget=None, steps=20)
    assert p.decide(Started(0)) == [TrainTo(0, 0, 20, True, None, None)]
    assert p.decide(SegmentTrained(20, 3.0)) == [Done()]


def test_a_resumed_run_trains_from_its_first_boundary_and_one_with_every_round_behind_it_is_done():
    p = LockstepPolicy([4, 8, 12], budget=None, steps=12, landings=[6, 10])
    assert p.decide(Started(2)) == [TrainTo(2, 8, 12, True, None, Landing(2, 10))]
    assert LockstepPolicy([4, 8, 12], budget=None, steps=12).decide(Started(3)) == [Done()]


def test_a_budget_spent_in_a_segment_stops_the_run_where_the_furthest_node_stands():
    p = LockstepPolicy([4, 8, 12], budget=10.0, steps=12)
    assert p.decide(Started(0)) == [TrainTo(0, 0, 4, False, 10.0, None)]
    assert p.decide(SegmentTrained(4, 3.0)) == [ExchangeRound(1, 4)]
    assert p.decide(RoundTaken(4.0)) == [TrainTo(1, 4, 8, False, 6.0, None)]  # the rest, on the nodes' clocks
    assert p.decide(SegmentTrained(6, 10.5)) == [StopAt(6, 1), Done()]  # rounds 1..1 landed; the final one at 6
    assert p.steps == 6


def test_a_last_segment_the_budget_ends_short_stops_the_run_at_its_step():
    p = LockstepPolicy([4, 8], budget=5.0, steps=8)
    p.decide(Started(0)), p.decide(SegmentTrained(4, 2.0))
    assert p.decide(RoundTaken(2.5)) == [TrainTo(1, 4, 8, True, 2.5, None)]
    assert p.decide(SegmentTrained(6, 5.1)) == [StopAt(6, 1), Done()]
    on_time = LockstepPolicy([4, 8], budget=5.0, steps=8)
    on_time.decide(Started(0)), on_time.decide(SegmentTrained(4, 2.0)), on_time.decide(RoundTaken(2.5))
    assert on_time.decide(SegmentTrained(8, 5.1)) == [Done()]  # it reached the end: nothing moves


def test_a_budget_spent_exactly_by_a_round_stops_the_run_at_its_boundary():
    p = LockstepPolicy([4, 8, 12], budget=5.0, steps=12)
    p.decide(Started(0))
    assert p.decide(SegmentTrained(4, 4.0)) == [ExchangeRound(1, 4)]
    assert p.decide(RoundTaken(5.0)) == [StopAt(4, 1), Done()]  # the final round comes where round 1 did


def test_overlapped_rounds_land_in_the_call_to_the_next_boundary():
    p = LockstepPolicy([4, 8, 12], budget=None, steps=12, landings=[6, 10])
    assert p.decide(Started(0)) == [TrainTo(0, 0, 4, False, None, None)]  # nothing in flight before boundary 0
    assert p.decide(SegmentTrained(4, 1.0)) == [ExchangeRound(1, 4)]
    assert p.decide(RoundTaken(1.0)) == [TrainTo(1, 4, 8, False, None, Landing(1, 6))]
    assert p.decide(SegmentTrained(8, 2.0)) == [ExchangeRound(2, 8)]
    assert p.decide(RoundTaken(2.0)) == [TrainTo(2, 8, 12, True, None, Landing(2, 10))]
    assert p.decide(SegmentTrained(12, 3.0)) == [Done()]


def test_an_overlapped_round_in_flight_when_a_round_spends_the_budget_lands_at_the_stop():
    p = LockstepPolicy([4, 8, 12], budget=5.0, steps=12, landings=[6, 10])
    p.decide(Started(0)), p.decide(SegmentTrained(4, 4.0))
    assert p.decide(RoundTaken(5.0)) == [LandAtStop(1, 4), StopAt(4, 1), Done()]


def test_the_lockstep_policy_shown_lands_the_round_in_flight_where_the_budget_ends():
    """docs/python-api.md's lockstep block: a 5 s budget, the first round spends it; the round in flight
    (overlapped) lands at step 4, where the run then stops."""
    from tests.test_docs import shown_python

    started, trained, spent = shown_python("docs/python-api.md", "def a_budget_the_first_round_spends")[
        "a_budget_the_first_round_spends"
    ]()
    assert started == [TrainTo(0, 0, 4, False, 5.0, None)]
    assert trained == [ExchangeRound(1, 4)]
    assert spent == [LandAtStop(1, 4), StopAt(4, 1), Done()]
