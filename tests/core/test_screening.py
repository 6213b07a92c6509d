"""The distance screen (`core.screening.screen_far`) against hand-computed rounds: each node's distance
to the coordinate-wise median, the bound, and a round that drops a far node exactly as if it had not
sent. Values are small integers and halves, exact in float64."""

import math

import pytest
import torch

from raylowcomm.core.aggregation import average_decoded
from raylowcomm.core.compression import Payload, layout_of, make_codec
from raylowcomm.core.robust import make_rule, robust_round
from raylowcomm.core.screening import Dropped, distances_to_median, middle, screen_far

NONE = make_codec("none")


def _round(rows):
    deltas = [
        {"w": torch.tensor(r[:2], dtype=torch.float64), "b": torch.tensor(r[2:], dtype=torch.float64)} for r in rows
    ]
    return [(NONE, layout_of(deltas[0]))], [NONE.encode(d) for d in deltas]


def test_middle_is_the_middle_value_or_the_mean_of_the_two_middle_ones():
    x = torch.tensor([[5.0, 1.0], [2.0, 2.0], [-1.0, 0.0]], dtype=torch.float64)
    assert torch.equal(middle(x), torch.tensor([2.0, 1.0], dtype=torch.float64))
    x4 = torch.tensor([[5.0], [2.0], [-1.0], [3.0]], dtype=torch.float64)
    assert torch.equal(middle(x4), torch.tensor([2.5], dtype=torch.float64))


def test_distances_run_over_every_tensor_to_the_coordinatewise_median():
    # four nodes of (w0, w1, b0): the median per coordinate of an even count is the mean of the middle two
    rows = [(1, 0, 2), (1, 2, 2), (3, 0, 2), (-29, 20, -38)]
    parts, payloads = _round(rows)
    # medians: w0 (1, 1) → 1, w1 (0, 0) and 2 ... sorted 0, 0, 2, 20 → 1, b0 sorted -38, 2, 2, 2 → 2
    centre = (1.0, 1.0, 2.0)
    want = [math.sqrt(sum((v - c) ** 2 for v, c in zip(r, centre))) for r in rows]
    assert distances_to_median(parts, payloads) == want == [1.0, 1.0, math.sqrt(5.0), math.sqrt(900 + 361 + 1600)]


def test_screen_far_drops_past_factor_times_the_median_distance():
    kept, dropped, bound = screen_far([1.0, 2.0, 3.0, 50.0], 3.0)
    assert bound == 7.5 and kept == (0, 1, 2) and dropped == (Dropped(3, "far from the others", 50.0),)
    assert screen_far([1.0, 2.0, 3.0, 7.5], 3.0)[0] == (0, 1, 2, 3), "on the bound: kept"
    assert screen_far([0.0, 0.0, 4.0], 1.0)[0] == (0, 1), "a median distance of 0 drops whoever differs"
    with pytest.raises(ValueError, match="factor"):
        screen_far([1.0], 0.5)


@pytest.mark.parametrize("rule", ["mean", "clip"])
def test_a_far_node_leaves_the_round_exact_over_the_others(rule):
    # node 3 sends −10 × node 0's update: within the norm screen's bound (20 × the median norm), far by distance
    rows = [(1, 2, 1), (2, 1, 1), (1, 1, 2), (-10, -20, -10)]
    parts, payloads = _round(rows)
    result = robust_round(
        parts, payloads, rule=make_rule(rule, kappa=10.0), screen_factor=20.0, far_factor=2.0, diagnose=True
    )
    assert result.screening.kept == (0, 1, 2)
    assert [n.dropped.reason if n.dropped else None for n in result.nodes] == [None, None, None, "far from the others"]
    clean = average_decoded(NONE, payloads[:3], parts[0][1], [1.0, 1.0, 1.0], torch.float64)
    assert all(torch.equal(result.delta[k], clean[k]) for k in clean)


def test_two_nodes_are_never_screened_by_distance():
    parts, payloads = _round([(1, 0, 0), (100, 0, 0)])
    assert robust_round(parts, payloads, far_factor=1.0).screening.kept == (0, 1)


def test_the_far_screen_runs_after_the_norm_screen_over_what_it_kept():
    # node 1 is not finite: the distances are over nodes 0, 2, 3 only, and node 3 is far from them
    rows = [(1, 1, 1), (math.nan, 0, 0), (1, 2, 1), (9, -9, 9)]
    tensors = [torch.tensor(r, dtype=torch.float32) for r in rows]
    parts = [(NONE, layout_of({"w": tensors[0]}))]
    payloads = [Payload(w=t.view(torch.uint8).clone()) for t in tensors]  # as a faulty node could send them
    result = robust_round(parts, payloads, screen_factor=math.inf, far_factor=2.0)
    assert result.screening.kept == (0, 2)
    assert [d[:2] for d in result.screening.dropped] == [(1, "not finite"), (3, "far from the others")]
