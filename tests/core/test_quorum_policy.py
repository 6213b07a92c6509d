"""Quorum rounds' policy driven by hand-written events, its decisions pinned exactly: no Ray, no torch, no
clock but the one the events give."""

import math

from raylowcomm.core.rounds import LandedRound, NodeLog, QuorumPolicy, Rules, RunRecord, SegmentReport
from raylowcomm.core.rounds.events import (
    Arrived,
    Assign,
    Begin,
    CatchUp,
    Died,
    Finish,
    Join,
    Joined,
    Land,
    Leave,
    Progress,
    Rejoin,
    Restart,
    Restarted,
    Tick,
    Wait,
)
from raylowcomm.core.rounds.records import Arrival


def policy(nodes=2, budget=16, bounds=(4, 8), **rules) -> QuorumPolicy:
    defaults = dict(quorum=nodes, grace_s=0.0, staleness=0.5, keep_training=False, period_s=None)
    given = {**defaults, **rules}
    weights = {k: 1.0 for k in range(nodes + len(given.get("joins", [])))}
    made = Rules(boundaries=list(bounds), weights=weights, count=nodes, **given)
    return QuorumPolicy(made, budget, {k: NodeLog() for k in range(nodes)}, RunRecord())


def arrive(p, k, flight, step, base, now, train_s=1.0, samples=4, token=None):
    report = SegmentReport(step, base, samples, train_s, 10, token)
    return p.decide(Arrived(k, flight, report, f"p{k}@{step}", now))


def payload(k, step, base, now, samples=4, token=None) -> Arrival:
    return Arrival(k, f"p{k}@{step}", base, 10, 1.0, samples, now, token)


def test_quorum_of_all_nodes_on_time_lands_at_the_lockstep_boundaries():
    p = policy()
    assert p.decide(Begin(0.0, [0, 1])) == [
        Assign(0, 0, 4, None, [], [], False),
        Assign(1, 1, 4, None, [], [], False),
        Wait(None),
    ]
    assert arrive(p, 0, 0, 4, 0, 1.0) == []
    assert p.decide(Tick(1.0)) == [Wait(None)]  # one payload of two: the round waits for the other
    assert arrive(p, 1, 1, 4, 0, 1.0) == []
    r1 = LandedRound(1, [payload(0, 4, 0, 1.0), payload(1, 4, 0, 1.0)], [1.0, 1.0])
    assert p.decide(Tick(1.0)) == [
        Land(r1),
        Assign(0, 2, 8, None, [r1], [], False),
        Assign(1, 3, 8, None, [r1], [], False),
        Progress(4),
        Wait(None),
    ]
    arrive(p, 0, 2, 8, 1, 2.0), arrive(p, 1, 3, 8, 1, 2.0)
    r2 = LandedRound(2, [payload(0, 8, 1, 2.0), payload(1, 8, 1, 2.0)], [1.0, 1.0])
    assert p.decide(Tick(2.0)) == []  # the budget is spent, nobody trains: no wait, the last round is Finish's
    assert p.decide(Finish([0, 1])) == [Land(r2), CatchUp(0, [r2]), CatchUp(1, [r2])]
    assert [[x["node"] for x in r] for r in p.record.landed] == [[0, 1], [0, 1]] and not p.record.late


def three_nodes_after_a_first_round(grace_s):
    """Nodes 0 and 1 at a step a second, node 2 at two: the second segments go out at t=8."""
    p = policy(nodes=3, budget=48, bounds=(4, 8, 12, 16), quorum=2, grace_s=grace_s)
    p.decide(Begin(0.0, [0, 1, 2]))
    arrive(p, 0, 0, 4, 0, 4.0), arrive(p, 1, 1, 4, 0, 4.0)
    assert p.decide(Tick(4.0)) == [Wait(4.0 + grace_s)]  # node 2 has no pace yet: it is waited for
    arrive(p, 2, 2, 4, 0, 8.0)
    decisions = p.decide(Tick(8.0))
    assert [type(d).__name__ for d in decisions] == ["Land", "Assign", "Assign", "Assign", "Progress", "Wait"]
    arrive(p, 0, 3, 8, 1, 12.0), arrive(p, 1, 4, 8, 1, 12.0)
    return p


def test_a_round_waits_within_grace_for_a_node_expected_in_it():
    p = three_nodes_after_a_first_round(grace_s=5.0)  # node 2 is expected at 8 + 2 x 4 = 16 <= 12 + 5
    assert p.decide(Tick(12.0)) == [Wait(17.0)]


def test_a_round_does_not_wait_for_a_node_far_behind():
    p = three_nodes_after_a_first_round(grace_s=3.0)  # node 2 is expected at 16 > 12 + 3
    landed = p.decide(Tick(12.0))[0]
    assert landed == Land(LandedRound(2, [payload(0, 8, 1, 12.0), payload(1, 8, 1, 12.0)], [1.0, 1.0]))


def test_a_late_payload_is_merged_in_the_next_round_discounted_by_its_staleness():
    p = three_nodes_after_a_first_round(grace_s=3.0)
    p.decide(Tick(12.0))
    arrive(p, 2, 5, 8, 1, 16.0), arrive(p, 0, 6, 12, 2, 16.0), arrive(p, 1, 7, 12, 2, 16.0)
    [landed] = [d for d in p.decide(Tick(16.0)) if isinstance(d, Land)]
    assert [a.node for a in landed.round.payloads] == [0, 1, 2]
    assert landed.round.weights == [1.0, 1.0, 2**-0.5]  # it missed round 2: (1 + 1)^-0.5
    assert p.record.late == [1]


def test_under_sync_by_time_payloads_weigh_their_examples_and_a_restarted_node_ends_in_phase():
    p = policy(budget=200, quorum=2, period_s=10.0)
    assert p.decide(Begin(0.0, [0, 1])) == [
        Assign(0, 0, 100, 10.0, [], [], False),  # no pace known: equal shares of the budget, a period each
        Assign(1, 1, 100, 10.0, [], [], False),
        Wait(None),
    ]
    arrive(p, 0, 0, 10, 0, 10.0, train_s=8.0, samples=40), arrive(p, 1, 1, 10, 0, 10.0, train_s=8.0, samples=20)
    decisions = p.decide(Tick(10.0))
    assert decisions[0].round.weights == [40.0, 20.0]  # merged by work
    assert decisions[1:3] == [
        Assign(0, 2, 100, 10.0, [decisions[0].round], [], False),
        Assign(1, 3, 100, 10.0, [decisions[0].round], [], False),  # node 0 is due at 10 + 10 + 2
    ]
    assert p.decide(Died(1, 3, 14.0)) == [Restart(1)]
    assert p.assigned == 110 and p.nodes[1].lost_s == 4.0  # its segment's 90 steps return to the budget
    assert p.decide(Restarted(1)) == [Rejoin(1)]
    # node 0's segment is due at 22: the restarted node trains 22 - 15 less its 2 s outside training
    assert p.decide(Joined(1, 1, 10, 15.0)) == [Assign(1, 4, 100, 5.0, [], [], True)]


def test_keep_training_trains_on_until_two_payloads_wait():
    p = policy(budget=24, bounds=(4, 8, 12), keep_training=True)
    p.decide(Begin(0.0, [0, 1]))
    assert arrive(p, 0, 0, 4, 0, 4.0, token="a") == [Assign(0, 2, 8, None, [], [], False)]
    assert arrive(p, 0, 2, 8, 0, 8.0, token="b") == []  # two of its payloads wait: it waits too
    assert p.decide(Tick(8.0)) == [Wait(None)]
    assert arrive(p, 1, 1, 4, 0, 9.0) == [Assign(1, 3, 8, None, [], [], False)]
    r1 = LandedRound(
        1, [payload(0, 4, 0, 4.0, token="a"), payload(0, 8, 0, 8.0, token="b"), payload(1, 4, 0, 9.0)], [1.0] * 3
    )
    assert p.decide(Tick(9.0)) == [
        Land(r1),
        Assign(0, 4, 12, None, [r1], ["a", "b"], False),  # it learns that round 1 merged both of its payloads
        Progress(6),
        Wait(None),
    ]


def test_a_node_leaves_at_its_step_and_a_joiner_starts_at_the_runs_step():
    p = policy(leaves={1: 4}, joins=[(2, 2)])
    assert p.decide(Begin(0.0, [0, 1])) == [
        Assign(0, 0, 4, None, [], [], False),
        Assign(1, 1, 4, None, [], [], False),
        Wait(None),
    ]
    arrive(p, 0, 0, 4, 0, 4.0)
    assert arrive(p, 1, 1, 4, 0, 4.0) == [Leave(1, 4)]
    r1 = LandedRound(1, [payload(0, 4, 0, 4.0), payload(1, 4, 0, 4.0)], [1.0, 1.0])  # its last payload merges
    assert p.decide(Tick(4.0)) == [
        Join(2, None, "schedule", 4),  # nobody has landed a round yet: it starts from the start
        Land(r1),
        Assign(0, 2, 8, None, [r1], [], False),
        Progress(4),
        Wait(None),
    ]
    assert p.decide(Joined(2, 1, 0, 5.0)) == [Assign(2, 3, 4, None, [], [], True)]
    assert p.record.left == [{"node": 1, "step": 4}] and p.record.departed == [1]
    assert p.record.joined == [{"node": 2, "step": 4, "by": "schedule"}] and p.nodes[2].joined_at == 4.0


def test_a_node_that_dies_leaves_the_quorum_at_once_and_rejoins_catching_up():
    p = policy(nodes=3, budget=24, quorum=3)
    p.decide(Begin(0.0, [0, 1, 2]))
    assert p.decide(Died(2, 2, 1.0)) == [Restart(2)]
    assert p.decide(Restarted(2)) == [Rejoin(2)]
    arrive(p, 0, 0, 4, 0, 4.0), arrive(p, 1, 1, 4, 0, 4.0)
    r1 = LandedRound(1, [payload(0, 4, 0, 4.0), payload(1, 4, 0, 4.0)], [1.0, 1.0])
    assert p.decide(Tick(4.0)) == [  # a quorum of 3 with node 2 restarting: the round lands without it
        Land(r1),
        Assign(0, 3, 8, None, [r1], [], False),
        Assign(1, 4, 8, None, [r1], [], False),
        Progress(2),
        Wait(None),
    ]
    assert p.decide(Joined(2, 0, 0, 5.0)) == [Assign(2, 5, 4, None, [r1], [], True)]
    assert p.nodes[2].restarts == 1 and p.nodes[2].lost_s == 1.0


def test_the_slow_nodes_last_segment_is_cut_at_the_end_of_the_budget():
    p = policy(budget=28, bounds=(4, 12, 20), quorum=1)
    p.decide(Begin(0.0, [0, 1]))
    arrive(p, 1, 1, 4, 0, 4.0)
    p.decide(Tick(4.0))
    arrive(p, 1, 2, 12, 1, 12.0)
    p.decide(Tick(12.0))
    arrive(p, 0, 0, 4, 0, 16.0)  # 4 s a step, where node 1 takes 1
    decisions = p.decide(Tick(16.0))
    # its next boundary within the budget is step 8 (16 s); node 1 spends the 4 node-steps left in 4 s:
    # together they spend those and its own in 8 / 1.25 = 6.4 s, 1.6 of its steps
    [assign] = [d for d in decisions if isinstance(d, Assign)]
    assert (assign.node, assign.flight, assign.until, [r.number for r in assign.catch_up]) == (0, 4, 6, [1, 2, 3])
    assert math.isclose(p.nodes[0].step_s, 4.0)
