"""The cosine screen (`core.screening.screen_unlike`) against hand-computed rounds: each node's cosine to
the coordinate-wise median, the bound, and a round that drops a node pointing away from the others exactly
as if it had not sent. Values are small integers and halves, exact in float64."""

import math

import pytest
import torch

from raylowcomm.core.aggregation import average_decoded
from raylowcomm.core.compression import Payload, layout_of, make_codec
from raylowcomm.core.robust import make_rule, robust_round
from raylowcomm.core.screening import Dropped, cosines_to_median, middle, screen_unlike

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


def test_cosines_run_over_every_tensor_to_the_coordinatewise_median():
    # four nodes of (w0, w1, b0); medians of an even count are the means of the middle two:
    # w0 sorted -4, 1, 1, 3 → 1; w1 sorted 0, 0, 2, 2 → 1; b0 sorted -2, 2, 2, 2 → 2: the median (1, 1, 2)
    rows = [(1, 0, 2), (1, 2, 2), (3, 0, 2), (-4, 2, -2)]
    parts, payloads = _round(rows)
    # every dot product and square is a small integer, exact in float64: the cosines are these divisions
    want = [sum(v * c for v, c in zip(r, (1, 1, 2))) / (math.sqrt(sum(v * v for v in r)) * math.sqrt(6)) for r in rows]
    got = cosines_to_median(parts, payloads)
    assert got == want and got[3] < 0 < min(got[:3])
    zero_parts, zero = _round([(0, 0, 0), (1, 0, 0), (0, 0, 0)])
    assert cosines_to_median(zero_parts, zero) == [0.0, 0.0, 0.0], "a median of norm 0: no direction, cosine 0"


def test_screen_unlike_drops_below_factor_times_the_median_cosine():
    kept, dropped, bound = screen_unlike([0.5, 0.75, 0.8, -0.25], 0.5)
    # the median of 0.5, 0.75, 0.8, -0.25 is (0.5 + 0.75) / 2 = 0.625: the bound 0.3125
    assert bound == 0.3125 and kept == (0, 1, 2) and dropped == (Dropped(3, "unlike the others", -0.25),)
    assert screen_unlike([0.5, 0.75, 0.8, 0.3125], 0.5)[0] == (0, 1, 2, 3), "on the bound: kept"
    assert screen_unlike([-0.5, 0.0, 0.1], 0.5)[0] == (0, 1, 2), "no agreed direction: nobody dropped"
    for factor in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="factor"):
            screen_unlike([1.0], factor)


@pytest.mark.parametrize("rule", ["mean", "clip"])
def test_an_unlike_node_leaves_the_round_exact_over_the_others(rule):
    # node 3 sends −1 × node 0's update: its norm is the others', its direction the opposite
    rows = [(1, 2, 1), (2, 1, 1), (1, 1, 2), (-1, -2, -1)]
    parts, payloads = _round(rows)
    rule_ = make_rule(rule, kappa=10.0)
    result = robust_round(parts, payloads, rule=rule_, screen_factor=10.0, cosine_factor=0.5, diagnose=True)
    assert result.screening.kept == (0, 1, 2)
    assert [n.dropped.reason if n.dropped else None for n in result.nodes] == [None, None, None, "unlike the others"]
    clean = average_decoded(NONE, payloads[:3], parts[0][1], [1.0, 1.0, 1.0], torch.float64)
    assert all(torch.equal(result.delta[k], clean[k]) for k in clean)


def test_two_nodes_are_never_screened_by_cosine():
    parts, payloads = _round([(1, 0, 0), (-1, 0, 0)])
    assert robust_round(parts, payloads, cosine_factor=1.0).screening.kept == (0, 1)


def test_the_cosine_screen_runs_after_the_norm_screen_over_what_it_kept():
    # node 1 is not finite: the cosines are over nodes 0, 2, 3 only, and node 3 points away from them
    rows = [(1, 1, 1), (math.nan, 0, 0), (1, 2, 1), (-9, -9, 9)]
    tensors = [torch.tensor(r, dtype=torch.float32) for r in rows]
    parts = [(NONE, layout_of({"w": tensors[0]}))]
    payloads = [Payload(w=t.view(torch.uint8).clone()) for t in tensors]  # as a faulty node could send them
    result = robust_round(parts, payloads, screen_factor=math.inf, cosine_factor=0.5)
    assert result.screening.kept == (0, 2)
    assert [d[:2] for d in result.screening.dropped] == [(1, "not finite"), (3, "unlike the others")]
