"""Quorum rounds' decisions, pinned by hand-computed cases without Ray or torch (the policy is plain
Python: importing it pulls in neither, checked in a fresh interpreter)."""

import subprocess
import sys

from raylowcomm.core.rounds.arithmetic import (
    boundary_after,
    in_phase_s,
    pace_share,
    quorum_of,
    staleness_weight,
    tail_steps,
)


def test_the_policy_imports_neither_ray_nor_torch():
    modules = "raylowcomm.core.rounds.arithmetic, raylowcomm.core.rounds, raylowcomm.core.rounds.policy"
    code = f"import sys, {modules}; print(sorted({{'ray', 'torch'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_quorum_counts_and_weights():
    assert [quorum_of(q, 4) for q in (1, 3, 4, 0.5, 0.6, 1.0)] == [1, 3, 4, 2, 3, 4]
    assert quorum_of(3, 2) == 2  # never more than the live nodes
    assert staleness_weight(250.0, 0, 0.5) == 250.0  # a fresh payload keeps its node's weight exactly
    assert staleness_weight(1.0, 3, 0.5) == 0.5 and staleness_weight(2.0, 1, 0.0) == 2.0


def test_a_node_goes_on_past_the_run_with_the_last_gap():
    bounds = [8, 16, 24, 30]  # a 30-step run's rounds
    assert [boundary_after(bounds, s) for s in (0, 7, 8, 29, 30, 36)] == [8, 8, 16, 30, 36, 42]


def test_a_slow_nodes_last_segment_is_cut_to_what_it_trains_while_the_others_spend_the_budget():
    assert tail_steps(8, 1.0, [1.0], 8, 0.0) == 8  # nodes at one pace: never cut
    assert tail_steps(8, 3.0, [], 0, 0.0) == 8  # nobody else to take its steps
    # 3x slower than three others with 6 node-steps left besides it: they take 2 s, its 8 steps 24 s; all four
    # spend the 14 steps in 14 / (3 + 1/3) = 4.2 s, in which it trains 1.4 steps: 2
    assert tail_steps(8, 3.0, [1.0, 1.0, 1.0], 6, 0.0) == 2
    assert tail_steps(8, 3.0, [1.0, 1.0, 1.0], 6, 30.0) == 8  # within grace_s: waited for
    # cut only where it would end more than half its own length (12 s) after the others (work / 3 s)
    assert tail_steps(8, 3.0, [1.0, 1.0, 1.0], 36, 0.0) == 8
    assert tail_steps(8, 3.0, [1.0, 1.0, 1.0], 35, 0.0) == 5  # (35 + 8) / (10 / 3) = 12.9 s: 4.3 of its steps


def test_under_sync_by_time_the_budget_left_is_shared_by_pace():
    assert pace_share(12, 1.0, [1.0, 1.0, 1.0]) == 4  # one pace: equal shares
    assert pace_share(11, 3.0, [3.0, 1.0, 1.0, 1.0]) == 2  # 3x slower: 11 * (1/3) / (10/3) = 1.1 steps
    assert pace_share(11, 1.0, [3.0, 1.0, 1.0, 1.0]) == 4  # 11 / (10/3) = 3.3
    assert pace_share(10, None, [None, 1.0, 1.0, 1.0]) == 3  # a pace not known yet: equal shares
    assert pace_share(5, 1.0, [1.0]) == 5


def test_under_sync_by_time_a_node_starting_mid_period_ends_with_the_others():
    assert in_phase_s(16.0, [], 0.0) == 16.0  # nobody else training: a period
    # restarted while three others train, due in 3, 9 and 12 s: it ends with the median, less its 1 s overhead
    assert in_phase_s(16.0, [12.0, 3.0, 9.0], 1.0) == 8.0
    assert in_phase_s(16.0, [5.0], 1.0) == 20.0  # 4 s is under half a period: the round after
    assert in_phase_s(16.0, [-20.0], 0.0) == 12.0  # long overdue: whole periods on (-20 + 2 x 16)
    assert in_phase_s(16.0, [17.5, 17.5, 17.5], 1.5) == 16.0  # released with them: a period, as they train
