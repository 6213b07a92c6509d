"""core.robust against hand-computed rounds: each rule's definition (ties, even N, β·N not an integer,
weights, sparse coordinates), screening, clipping, diagnostics, and the mean's bits through the new
protocol step. Values are small integers and halves, exact in float64, so every expectation is exact."""

import math
import pickle

import pytest
import torch

from raylowcomm.core.aggregation import MEAN, average_decoded, needs_norms
from raylowcomm.core.compression import Payload, layout_of, make_codec
from raylowcomm.core.feedback import ErrorFeedback
from raylowcomm.core.robust import Clip, Coordinatewise, combine_round, make_rule, robust_round
from raylowcomm.core.screening import Dropped, fixed_sum, median_of, screen

NONE = make_codec("none")


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def _round(rows, codec=NONE, dtype=torch.float64):
    """Each node's one-tensor Δ {"w": rows[k]} encoded: (parts, payloads)."""
    deltas = [{"w": torch.tensor(r, dtype=dtype)} for r in rows]
    return [(codec, layout_of(deltas[0]))], [codec.encode(d) for d in deltas]


def _combine(rule, columns, weights=None):
    """The rule over nodes whose values are the columns' entries: node k holds column[k] of each."""
    values = [torch.tensor(node, dtype=torch.float64) for node in zip(*columns)]
    return rule.combine(values, weights or [1.0] * len(values))


def test_median_odd_even_and_ties():
    got = _combine(Coordinatewise(), [(5, 1, 3), (2, 2, 9), (4, 4, 4)])
    assert torch.equal(got, _t(3.0, 2.0, 4.0))
    # even N: the mean of the two middle values; a tie among them is that value
    got = _combine(Coordinatewise(), [(5, 1, 3, 8), (2, 2, 2, 9), (-1, 0, 0.5, 7)])
    assert torch.equal(got, _t(4.0, 2.0, 0.25))
    assert median_of([3.0, 1.0, 2.0]) == 2.0 and median_of([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_weighted_median_takes_the_middle_of_the_weight():
    # weights 1, 1, 3 at values 1, 2, 9: 9 holds more than half the weight
    assert torch.equal(_combine(Coordinatewise(), [(1, 2, 9)], [1.0, 1.0, 3.0]), _t(9.0))
    # weights 1, 1, 2 at 1, 5, 3: sorted 1 (1), 3 (2), 5 (1), W = 4; 3's weight spans the half: 3
    assert torch.equal(_combine(Coordinatewise(), [(1, 5, 3)], [1.0, 1.0, 2.0]), _t(3.0))
    # weights 2, 1, 1 at 1, 3, 5: the weight below 3 is exactly W/2: 1 and 3 straddle it, weighted (1·2 + 3)/3
    assert torch.equal(_combine(Coordinatewise(), [(1, 3, 5)], [2.0, 1.0, 1.0]), _t(5.0) / 3)


def test_trimmed_mean_rounds_beta_n_down():
    column = (10, -4, 1, 3, 100)  # sorted -4, 1, 3, 10, 100
    # β·N = 1.5: one node off each side, the mean of 1, 3, 10
    assert torch.equal(_combine(Coordinatewise(0.3), [column]), _t(14.0) / 3)
    # β·N = 0.75 of three nodes: nobody trimmed, the mean of all
    assert torch.equal(_combine(Coordinatewise(0.25), [(1, 3, 5)]), _t(3.0))
    # β·N = 1 of four, with a tie at the top: one 7 goes, one stays
    assert torch.equal(_combine(Coordinatewise(0.25), [(7, 1, 7, 3)]), _t(5.0))
    # β = 0: the plain mean
    assert torch.equal(_combine(Coordinatewise(0.0), [column]), _t(22.0))


def test_trimmed_mean_trims_by_weight_mass():
    # W = 4, β·W = 1: the weight-2 node at the bottom cannot go whole, the weight-1 node at the top does
    assert torch.equal(_combine(Coordinatewise(0.25), [(1, 3, 5)], [2.0, 1.0, 1.0]), _t(5.0) / 3)
    # the weight-2 node in the middle stays alone once both ends (weight 1 each) go
    assert torch.equal(_combine(Coordinatewise(0.25), [(1, 5, 3)], [1.0, 1.0, 2.0]), _t(3.0))


def test_refused_parameters():
    for beta in (0.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="β"):
            Coordinatewise(beta)
    for kappa in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="κ"):
            Clip(kappa)
    with pytest.raises(ValueError, match="factor"):
        screen([1.0], [True], 0.5)
    with pytest.raises(ValueError, match="unknown aggregate"):
        make_rule("krum")


def test_make_rule_names_the_rules():
    assert make_rule("mean") is MEAN and not needs_norms(MEAN)
    assert isinstance(make_rule("clip", kappa=2.0), Clip) and needs_norms(make_rule("clip"))
    trimmed, median = make_rule("trimmed_mean", trim=0.2), make_rule("median", sent_only=True)
    assert (trimmed.name, trimmed.trim, median.name, median.trim, median.sent_only) == (
        "trimmed_mean",
        0.2,
        "median",
        None,
        True,
    )


def _topk_round():
    """Four nodes' top-1 of four entries, int4 values exact (multiples of 7 are q = ±7 times a bf16 scale):
    coordinate 0 sent by nodes 0 and 2 (7, 21), 1 by node 1 (14), 2 by node 3 (−7), 3 by nobody."""
    rows = [(7, 1, 0, 0), (0, 14, 1, 0), (21, 0, 0, 1), (0, 0, -7, 1)]
    return _round(rows, make_codec("topk", topk_fraction=0.25), torch.float32)


def test_sparse_payloads_read_unsent_coordinates_as_zero_unless_sent_only():
    parts, payloads = _topk_round()
    decoded = [parts[0][0].decode(p, parts[0][1], torch.float64)["w"] for p in payloads]
    assert torch.equal(
        torch.stack(decoded),
        torch.tensor([[7.0, 0, 0, 0], [0, 14, 0, 0], [21, 0, 0, 0], [0, 0, -7, 0]], dtype=torch.float64),
    )
    cases = {
        Coordinatewise(): [3.5, 0, 0, 0],  # a coordinate one node sent has median 0 among four
        Coordinatewise(0.25): [3.5, 0, 0, 0],
        Coordinatewise(sent_only=True): [14, 14, -7, 0],  # among the senders; nobody: 0
        Coordinatewise(0.25, sent_only=True): [14, 14, -7, 0],  # two senders: β·2 = 0.5 trims none
        MEAN: [7, 3.5, -1.75, 0],
    }
    for rule, expected in cases.items():
        got = robust_round(parts, payloads, rule=rule).delta["w"]
        assert torch.equal(got, torch.tensor(expected, dtype=torch.float64)), rule.name


def test_sparse_diagnostics_count_only_the_coordinates_a_node_sent():
    parts, payloads = _topk_round()
    sent_only = robust_round(parts, payloads, rule=Coordinatewise(sent_only=True), diagnose=True).nodes
    assert [n.trimmed for n in sent_only] == [0.0] * 4  # every sender is in its coordinates' median
    dense = robust_round(parts, payloads, rule=Coordinatewise(), diagnose=True).nodes
    # dense median of four: the two middle of each coordinate sorted stably (equal zeros in node order):
    # coordinate 0 keeps nodes 3 and 0, 1 keeps 2 and 3, 2 keeps 0 and 1, 3 (all zero) keeps 1 and 2
    assert [n.trimmed for n in dense] == [0.5] * 4


def test_a_clip_that_clips_exactly_one_node():
    parts, payloads = _round([(3, 4), (0, 2), (6, 8)])  # norms 5, 2, 10: median 5
    result = robust_round(parts, payloads, rule=Clip(1.5), diagnose=True)
    # bound 7.5: the third node scaled by 0.75 to (4.5, 6); the mean of (3, 4), (0, 2), (4.5, 6)
    assert torch.equal(result.delta["w"], _t(2.5, 4.0))
    nodes = result.nodes
    assert [(n.norm, n.scale, n.clipped, n.dropped) for n in nodes] == [
        (5.0, 1.0, False, None),
        (2.0, 1.0, False, None),
        (10.0, 0.75, True, None),
    ]
    # cosines to the aggregate (2.5, 4), |aggregate|² = 22.25
    assert nodes[0].cosine == 23.5 / (5.0 * math.sqrt(22.25))
    assert nodes[1].cosine == 8.0 / (2.0 * math.sqrt(22.25))
    assert nodes[2].cosine == 35.25 / (7.5 * math.sqrt(22.25))


def test_clip_median_of_an_even_round_and_weights():
    # norms 1, 3, 5, 100: median 4, κ = 1 clips the two largest to norm 4
    assert Clip(1.0).prepare([1.0, 3.0, 5.0, 100.0], [1.0] * 4) == [1.0, 1.0, 0.8, 0.04]
    parts, payloads = _round([(0, 1), (3, 0), (0, 5), (100, 0)])
    got = robust_round(parts, payloads, [1.0, 2.0, 1.0, 1.0], Clip(1.0)).delta["w"]
    # (0, 1)·1 + (3, 0)·2 + (0, 4) + (4, 0), over 5
    assert torch.equal(got, _t(10.0, 5.0) / 5)


def _screened_round():
    """Five nodes: node 1 sends NaN, node 3 an enormous Δ (bytes as a faulty node could send them)."""
    rows = [(1.0, 2.0), (math.nan, 0.0), (3.0, 0.0), (1e30, 1.0), (0.0, 4.0)]
    tensors = [torch.tensor(r, dtype=torch.float32) for r in rows]
    payloads = [Payload(w=t.view(torch.uint8).clone()) for t in tensors]
    return [(NONE, layout_of({"w": tensors[0]}))], payloads


def test_screening_drops_a_nan_and_an_enormous_payload():
    parts, payloads = _screened_round()
    norms = [math.sqrt(5.0), math.nan, 3.0, 1e30, 4.0]
    s = screen(norms, [True, False, True, True, True], 10.0)
    # the finite norms' median: sorted √5, 3, 4, 1e30 → 3.5
    assert s.kept == (0, 2, 4) and s.bound == 35.0
    assert s.dropped[0][:2] == (1, "not finite") and math.isnan(s.dropped[0].value)
    assert s.dropped[1] == Dropped(3, "norm past bound", 1e30)
    assert screen(norms, [True, False, True, True, True]).kept == (0, 2, 3, 4)  # no factor: finiteness only
    result = robust_round(parts, payloads, [1.0, 5.0, 2.0, 5.0, 1.0], screen_factor=10.0, diagnose=True)
    assert result.screening.kept == (0, 2, 4)
    # exactly the mean over the others: ((1, 2) + 2·(3, 0) + (0, 4)) / 4
    clean = [payloads[k] for k in (0, 2, 4)]
    assert torch.equal(
        result.delta["w"], average_decoded(NONE, clean, parts[0][1], [1.0, 2.0, 1.0], torch.float64)["w"]
    )
    assert torch.equal(result.delta["w"], _t(7.0, 6.0) / 4)
    assert [n.dropped.reason if n.dropped else None for n in result.nodes] == [
        None,
        "not finite",
        None,
        "norm past bound",
        None,
    ]
    assert result.nodes[1].cosine is None and result.nodes[3].norm == float(torch.tensor(1e30))  # float32's
    with pytest.raises(ValueError, match="dropped every payload"):
        robust_round(parts, [payloads[1]], screen_factor=10.0)


def _model_round(codec_name, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nodes = [
        {"a": torch.randn(40, 37, generator=gen), "big": torch.randn(2 * 32768 + 5, generator=gen) * 0.01}
        for _ in range(4)
    ]
    codec = make_codec(codec_name, topk_fraction=0.1)
    payloads = [ErrorFeedback(codec).encode(d) for d in nodes]
    return codec, layout_of(nodes[0]), payloads


@pytest.mark.parametrize("codec_name", ["none", "int8", "topk"])
def test_the_mean_through_the_new_step_is_average_decoded_bit_for_bit(codec_name):
    codec, layout, payloads = _model_round(codec_name)
    weights = [3.0, 1.0, 2.5, 0.7]
    reference = average_decoded(codec, payloads, layout, weights, torch.float64)
    for diagnose in (False, True):
        got = robust_round([(codec, layout)], payloads, weights, MEAN, diagnose=diagnose).delta
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    scaled = combine_round([(codec, layout)], payloads, weights, MEAN, scales=[1.0] * 4)
    assert all(torch.equal(scaled[k], reference[k]) for k in reference)


@pytest.mark.parametrize(
    "rule", [MEAN, Clip(1.0), Coordinatewise(0.25), Coordinatewise(), Coordinatewise(sent_only=True)]
)
def test_replicas_get_the_same_bits(rule):
    """Here on 2 threads, there on 1 with pickled payloads (as a peer receives them): the same round."""
    codec, layout, payloads = _model_round("topk", seed=1)
    received = [pickle.loads(pickle.dumps(p, protocol=5)) for p in payloads]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        here = robust_round([(codec, layout)], payloads, [1.0, 2.0, 1.5, 1.0], rule, 10.0, diagnose=True)
        torch.set_num_threads(1)
        there = robust_round([(codec, layout)], received, [1.0, 2.0, 1.5, 1.0], rule, 10.0, diagnose=True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(here.delta[k], there.delta[k]) for k in layout)
    assert here.nodes == there.nodes and here.screening == there.screening


def test_fixed_sum_is_a_fixed_tree():
    assert fixed_sum(_t(1.0, 2.0, 3.0, 4.0, 5.0)) == 15.0 and fixed_sum(torch.zeros(0)) == 0.0
    # the tree adds (1e16 + −1e16) + (1 + 1) = 2; left to right, 1e16 + 1 rounds back to 1e16 and ends at 1
    assert fixed_sum(torch.tensor([1e16, 1.0, -1e16, 1.0], dtype=torch.float64)) == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rule", [Clip(1.0), Coordinatewise(0.25), Coordinatewise(sent_only=True)])
def test_gpu_and_cpu_rounds_agree_bit_for_bit(rule):
    codec, layout, payloads = _model_round("topk", seed=2)
    on_gpu = [Payload({k: t.cuda() for k, t in p.items()}) for p in payloads]
    cpu = robust_round([(codec, layout)], payloads, [1.0, 2.0, 1.5, 1.0], rule, 10.0, diagnose=True)
    gpu = robust_round([(codec, layout)], on_gpu, [1.0, 2.0, 1.5, 1.0], rule, 10.0, diagnose=True)
    assert all(torch.equal(cpu.delta[k], gpu.delta[k].cpu()) for k in layout)
    assert cpu.nodes == gpu.nodes
