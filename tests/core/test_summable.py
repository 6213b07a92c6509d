"""Summable codes (`core.summable`, `lofi.compress_scale: shared`): the nodes' codes and scales are
today's codec's, the codes add exactly, a round decodes as S·Σq with S the mean of the nodes' scales,
error feedback keeps x − q·S, and every replica gets the same bits. Without Ray."""

from __future__ import annotations

import pytest
import torch

from raylowcomm.core.compression import BlockwiseInt, TensorSpec, make_codec
from raylowcomm.core.feedback import ErrorFeedback
from raylowcomm.core.summable import (
    SummableInt,
    average_codes,
    decode_sum,
    make,
    shared_scales,
)
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.payload import DeltaCodec

BLOCK = 16
SPEC = TensorSpec(torch.Size([5, 13]), torch.float32)  # 65 entries: four whole blocks and a tail of one


def _xs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.numel, generator=g, dtype=torch.float64) * (k + 1) for k in range(n)]


def _per_entry(scales: torch.Tensor) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK)[: SPEC.numel]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_are_todays_and_add_exactly_and_the_round_decodes_as_s_times_their_sum(bits):
    codec, today = SummableInt(bits, BLOCK), BlockwiseInt(bits, BLOCK)
    xs = _xs(3)
    packed = [codec.pack(x, SPEC) for x in xs]
    assert all(p.numel() == today.packed_nbytes(SPEC) for p in packed)  # the same bytes on the wire
    codes, magnitudes = zip(*(codec.codes(p, SPEC) for p in packed))
    for x, q in zip(xs, codes):
        assert torch.equal(q, today.unpack_codes(today.pack(x, SPEC), SPEC)[0])  # each node's own grid's codes
    code_sum = codes[0].to(torch.int64) + codes[1] + codes[2]
    assert code_sum.dtype == torch.int64 and code_sum.abs().max() <= 3 * today.qmax
    scales = (magnitudes[0].double() + magnitudes[1].double() + magnitudes[2].double()) / 3
    assert torch.equal(shared_scales(list(magnitudes)), scales)
    expected_sum = _per_entry(scales) * code_sum.double()
    assert torch.equal(decode_sum(scales, code_sum, BLOCK), expected_sum)
    mean, got_scales = average_codes(codec, packed, SPEC, [1.0, 1.0, 1.0])
    assert torch.equal(got_scales, scales) and torch.equal(mean, expected_sum / 3)
    # unequal weights: S·Σ w·q / Σ w, in node order
    weighted, _ = average_codes(codec, packed, SPEC, [1.0, 2.0, 3.0])
    wq = codes[0].double() + codes[1].double() * 2.0 + codes[2].double() * 3.0
    assert torch.equal(weighted, _per_entry(scales) * wq / 6.0)


def test_a_payload_is_the_blockwise_codec_s_own_bytes_scales_and_all():
    """Each node sends its own grid's codes and scales (`BlockwiseInt`'s bytes): only a round decodes them
    otherwise, at the mean of the nodes' scales."""
    codec, today = SummableInt(2, BLOCK), BlockwiseInt(2, BLOCK)
    for x in _xs(3):
        assert torch.equal(codec.pack(x, SPEC), today.pack(x, SPEC))
    # int2, one block of 4: absmax 1 is the scale, codes [0, -1, 1, 0]
    x = torch.tensor([0.3, -1.0, 0.6, 0.1], dtype=torch.float64)
    codes, magnitudes = SummableInt(2, 4).codes(
        SummableInt(2, 4).pack(x, TensorSpec(torch.Size([4]), torch.float32)),
        TensorSpec(torch.Size([4]), torch.float32),
    )
    assert codes.tolist() == [0, -1, 1, 0] and magnitudes.tolist() == [1.0]


def test_error_feedback_keeps_x_minus_q_times_the_shared_scale_once_the_round_is_in():
    codec = SummableInt(2, BLOCK)
    nodes = [ErrorFeedback(codec) for _ in range(3)]
    kept = [torch.zeros(SPEC.numel, dtype=torch.float64)] * 3
    for round_ in range(2):
        deltas = _xs(3, seed=round_ + 1)
        payloads = [fb.encode({"w": d.view(SPEC.shape).float()}) for fb, d in zip(nodes, deltas)]
        assert all(not fb.residual and set(fb.pending) == {"w"} for fb in nodes)  # not before the round is in
        _, scales = average_codes(codec, [p["w"] for p in payloads], SPEC, [1.0, 1.0, 1.0])
        for k, fb in enumerate(nodes):
            x = deltas[k].float().double() + kept[k]
            fb.settle("w", payloads[k]["w"], scales)
            q, _ = codec.codes(payloads[k]["w"], SPEC)
            expected = x - q.double() * _per_entry(scales)
            assert not fb.pending and torch.equal(fb.residual["w"], expected.view(SPEC.shape))
            kept[k] = expected
    assert fb.state_dict()["w"].dtype == torch.float64


def _codec(**opts) -> DeltaCodec:
    o = LofiConfig(compress="int2", compress_scale="shared", compress_block=BLOCK, **opts)
    state = {"w": torch.zeros(SPEC.shape), "b": torch.zeros(7)}
    return DeltaCodec(o, state, {"w", "b"})


def _deltas(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(SPEC.shape, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g)}
        for _ in range(n)
    ]


def test_every_replica_gets_the_same_bits_whichever_payload_is_its_own():
    replicas = [_codec() for _ in range(3)]
    payloads = [r.encode(d) for r, d in zip(replicas, _deltas(3))]
    driver = _codec().average(payloads, [1.0, 1.0, 1.0])  # the driver: nothing of its own to settle
    for k, replica in enumerate(replicas):
        copies = [{name: t.clone() for name, t in p.items()} for p in payloads]  # what another node fetched
        mean = replica.average(copies, [1.0, 1.0, 1.0], own=k)
        assert mean.keys() == driver.keys() and all(torch.equal(mean[n], driver[n]) for n in mean)
        assert set(replica.residual()) == {"w", "b"} and not replica.feedback[0].pending


def test_a_final_round_in_int8_settles_into_the_same_residuals():
    nodes = [_codec(final_round="int8") for _ in range(2)]
    assert isinstance(nodes[0].final_parts[0][0], SummableInt) and nodes[0].final_parts[0][0].name == "int8"
    payloads = [n.encode(d, final=True) for n, d in zip(nodes, _deltas(2, seed=3))]
    assert payloads[0]["w"].numel() == make_codec("int8", BLOCK).packed_nbytes(SPEC)
    nodes[1].average(payloads, [1.0, 1.0], final=True, own=1)
    assert set(nodes[1].residual()) == {"w", "b"} and not nodes[1].feedback[0].pending


def test_node_scales_stay_todays_codec():
    assert type(make("int4", BLOCK)) is BlockwiseInt and type(make("int4", BLOCK, scale="shared")) is SummableInt
    assert type(make("topk", BLOCK, scale="shared")).__name__ == "TopK"
    o = LofiConfig(compress="int2", compress_block=BLOCK)
    assert o.compress_scale == "node"
    codec = DeltaCodec(o, {"w": torch.zeros(SPEC.shape)}, {"w"})
    assert type(codec.parts[0][0]) is BlockwiseInt
    x = _xs(1)[0]
    assert torch.equal(codec.encode({"w": x.view(SPEC.shape)})["w"], make_codec("int2", BLOCK).pack(x, SPEC))


def test_magnitudes_are_fixed_point_so_the_shared_scale_is_the_float64_mean_to_the_bit():
    """Any bf16 in [2^-33, 2^8) is a whole multiple of 2^-40 below 2^48: summed as integers or as float64 (in
    node order: every partial sum is such a number, under 2^53 · 2^-40) the nodes' magnitudes give the same
    bits, which is what lets a masked round decode as the round in the clear does."""
    g = torch.Generator().manual_seed(3)
    exponents = torch.randint(-33, 8, (8, 4096), generator=g).to(torch.float64)
    magnitudes = (torch.rand(8, 4096, generator=g, dtype=torch.float64) + 1).mul(2.0**exponents).to(torch.bfloat16)
    magnitudes = torch.where(magnitudes < 2.0**8, magnitudes, 0.0).to(torch.bfloat16)
    by_float = magnitudes[0].to(torch.float64)
    for m in magnitudes[1:]:
        by_float = by_float + m.to(torch.float64)
    assert torch.equal(shared_scales(list(magnitudes)), by_float / 8)


def test_a_tiny_magnitude_is_sent_as_zero_and_a_diverged_one_is_refused():
    codec = SummableInt(8, BLOCK)
    x = torch.cat([torch.full((BLOCK,), 1e-12), torch.full((BLOCK,), 0.5)]).to(torch.float64)
    spec = TensorSpec(torch.Size([2 * BLOCK]), torch.float32)
    codes, magnitudes = codec.codes(codec.pack(x, spec), spec)
    assert magnitudes[0] == 0 < magnitudes[1] and codes.abs().min() > 0  # the tiny block's codes still go
    with pytest.raises(ValueError, match="at least 256: Δ has diverged"):
        SummableInt(2, BLOCK).pack(torch.full((2 * BLOCK,), 300.0, dtype=torch.float64), spec)  # ternary: m = 300
