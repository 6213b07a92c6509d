import math
import pickle
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load_file, save_file

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.aggregation import average_decoded
from raylowcomm.core.compression import (
    BlockwiseInt,
    Payload,
    TensorSpec,
    TopK,
    layout_of,
    make_codec,
)
from raylowcomm.core.feedback import ErrorFeedback
from raylowcomm.core.packing import index_layout

SIZES = [0, 1, 7, 63, 64, 65, 129, 1000]
WIDE = 1 << 16  # the sparse index layout's chunk
DTYPES = [torch.float32, torch.bfloat16]


def _delta(n, dtype=torch.float32, seed=0, shape=None):
    """An outer-gradient-like tensor: ~1e-3 with entries spread over four orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    spread = 10.0 ** (4 * torch.rand(n, generator=gen, dtype=torch.float64) - 2)
    x = (1e-3 * torch.randn(n, generator=gen, dtype=torch.float64) * spread).to(dtype)
    return x.view(shape) if shape is not None else x


def _model_delta(dtype=torch.float32, seed=0):
    """A small Δ dict with the awkward shapes: a matrix, an odd vector, a scalar, an empty tensor."""
    return {
        "w": _delta(37 * 11, dtype, seed, (37, 11)),
        "b": _delta(129, dtype, seed + 1),
        "scale": _delta(1, dtype, seed + 2, ()),
        "empty": torch.zeros(0, 5, dtype=dtype),
    }


def _block_bound(x, block, qmax):
    """|x − decode| ≤ scale/2 with scale the next bf16 ≥ absmax/qmax, < absmax/qmax·(1 + 2⁻⁷)."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x.double().reshape(-1), (0, -(-n // block) * block - n)).view(-1, block)
    absmax = blocks.abs().amax(dim=1).repeat_interleave(block)[:n]
    return absmax / (2 * qmax) * (1 + 2**-7)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_none_is_exact_and_sends_the_tensors_own_bytes(dtype):
    delta = _model_delta(dtype)
    codec = make_codec("none")
    payload = codec.encode(delta)
    decoded = codec.decode(payload, layout_of(delta))
    for name, tensor in delta.items():
        assert decoded[name].dtype == dtype and decoded[name].shape == tensor.shape
        assert torch.equal(decoded[name], tensor)
    assert payload.nbytes == sum(t.numel() * t.element_size() for t in delta.values())


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_blockwise_round_trip_within_the_block_bound(bits, block, dtype, n):
    x = _delta(n, dtype, seed=n)
    codec = make_codec(f"int{bits}", block_size=block)
    layout = {"x": TensorSpec(x.shape, dtype)}
    payload = codec.encode({"x": x})
    exact = codec.decode(payload, layout, dtype=torch.float64)["x"]
    assert ((exact - x.double()).abs() <= _block_bound(x, block, 2 ** (bits - 1) - 1)).all()
    assert torch.equal(codec.decode(payload, layout, dtype=torch.float32)["x"].double(), exact)  # q·scale is exact
    restored = codec.decode(payload, layout)["x"]
    assert restored.dtype == dtype and restored.shape == x.shape
    if n:  # not a vacuous bound: the codes carry the values
        assert (exact - x.double()).abs().max() < x.double().abs().max() / 2 ** (bits - 2)


def test_blockwise_keeps_a_block_of_tiny_deltas_that_fp16_scales_would_zero():
    x = torch.linspace(1e-7, 3e-7, 64)
    codec = make_codec("int8")
    exact = codec.decode(codec.encode({"x": x}), layout_of({"x": x}), torch.float64)["x"]
    assert (exact > 0).all()
    assert ((exact - x.double()).abs() <= _block_bound(x, 64, 127)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [3 * WIDE + 17])
def test_topk_keeps_the_largest_entries_within_the_4bit_bound_and_zeroes_the_rest(dtype, n):
    x = _delta(n, dtype, seed=n)
    codec = TopK(0.1, block_size=64)
    exact = codec.decode(codec.encode({"x": x}), layout_of({"x": x}), dtype=torch.float64)["x"]
    k = codec.kept(n)
    kept = torch.topk(x.double().abs(), k).indices.sort().values
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[kept] = False
    assert (exact[dropped] == 0).all()
    values = x.double()[kept]
    assert ((exact[kept] - values).abs() <= _block_bound(values, 64, 7)).all()
    assert (exact[kept] != 0).sum() >= k // 2  # the kept entries really arrive


def _formula(name, n, block, itemsize, codec):
    blocks = lambda m: -(-m // block)  # noqa: E731
    if name == "none":
        return n * itemsize
    if name == "int8":
        return n + 2 * blocks(n)
    if name == "int4":
        return -(-n // 2) + 2 * blocks(n)
    if name == "int2":
        return -(-n // 4) + 2 * blocks(n)
    if name == "sign":
        return -(-n // 8) + 2 * blocks(n)
    k = codec.kept(n)
    narrow = max(-(-n // 255) - 1, 0) + k  # a byte per chunk of 255, a byte per offset
    wide = 4 * max(-(-n // WIDE) - 1, 0) + 2 * k
    return min(narrow, wide) + -(-k // 2) + 2 * blocks(k)


@pytest.mark.parametrize("name", ["none", "int8", "int4", "int2", "topk", "sign"])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("n", SIZES + [255, 256, 511, WIDE, WIDE + 1, 2 * WIDE + 3])
@pytest.mark.parametrize("fraction", [0.03, 0.001])
def test_payload_nbytes_is_the_packed_bytes_and_the_formula(name, block, n, fraction):
    codec = make_codec(name, block_size=block, topk_fraction=fraction)
    x = _delta(n, torch.bfloat16, seed=1)
    payload = codec.encode({"x": x})
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in payload.values())
    assert payload.nbytes == payload["x"].numel() == _formula(name, n, block, 2, codec)
    assert payload.nbytes == codec.payload_nbytes(layout_of({"x": x}))
    assert payload_nbytes(payload) == payload.nbytes  # what the ledger records
    assert len(pickle.dumps(payload, protocol=5)) < payload.nbytes + 600  # only pickle framing besides


def test_topk_indices_cost_a_byte_and_a_bit_per_kept_entry_and_two_bytes_when_sparse():
    spec = TensorSpec(torch.Size([1_000_000]), torch.float32)
    values = lambda k: k // 2 + 2 * math.ceil(k / 64)  # noqa: E731  int4 codes and bf16 scales
    dense, sparse = TopK(0.03), TopK(0.001)
    assert dense.kept(1_000_000) == 30_000 and sparse.kept(1_000_000) == 1_000
    assert dense.packed_nbytes(spec) == 3921 + 30_000 + values(30_000)  # 3,922 chunks of 255, the last implied
    assert sparse.packed_nbytes(spec) == 4 * 15 + 2 * 1_000 + values(1_000)  # 16 chunks of 65,536
    assert (dense.packed_nbytes(spec) - values(30_000)) / 30_000 < 1.14


@pytest.mark.parametrize(
    "n, fraction, chunk", [(1000, 1.0, 255), (255 * 4, 0.9, 255), (70_000, 0.004, 255), (70_000, 0.003, WIDE)]
)
def test_topk_round_trips_full_chunks_and_both_index_layouts(n, fraction, chunk):
    """Every entry of a chunk kept (a count of 255 fills its byte), and the fractions either side of where
    the index layout switches: the kept entries decode where they were, within the 4-bit bound."""
    x = _delta(n, seed=3).double()
    codec = TopK(fraction)
    assert index_layout(n, codec.kept(n)).chunk == chunk
    exact = codec.decode(codec.encode({"x": x}), layout_of({"x": x}), dtype=torch.float64)["x"]
    kept = torch.topk(x.abs(), codec.kept(n)).indices.sort().values
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[kept] = False
    assert (exact[dropped] == 0).all()
    assert ((exact[kept] - x[kept]).abs() <= _block_bound(x[kept], 64, 7)).all()


def test_a_topk_offset_outside_its_chunk_is_refused():
    """A byte offset of 255 would read as the next chunk's first entry: a malformed payload, not decoded."""
    x, codec = _delta(1000, seed=4), TopK(0.03)
    payload = codec.encode({"x": x})
    scales, counts = 2 * math.ceil(30 / 64), 3  # k = 30 values in one block; chunks of 255: 4, the last implied
    payload["x"][scales + counts] = 255  # the first kept entry's offset
    with pytest.raises(ValueError, match="out of range"):
        codec.decode(payload, layout_of({"x": x}))


@pytest.mark.parametrize("name", ["none", "int8", "int4", "int2", "topk", "sign"])
@pytest.mark.parametrize("n", SIZES)
def test_pack_decoded_returns_the_bytes_and_what_they_decode_to(name, n):
    codec, x = make_codec(name, topk_fraction=0.1), _delta(n, torch.float64, seed=n)
    spec = TensorSpec(x.shape, torch.float32)
    packed, decoded = codec.pack_decoded(x, spec)
    assert torch.equal(packed, codec.pack(x, spec))
    assert decoded.dtype == torch.float64 and torch.equal(decoded, codec.unpack(packed, spec))
    if name == "int8":  # against the layout read by hand: [bf16 scales | int8 codes], code · its block's scale
        blocks = -(-n // 64)
        scales = packed[: 2 * blocks].view(torch.bfloat16).double().repeat_interleave(64)[:n]
        assert torch.equal(decoded, packed[2 * blocks :].view(torch.int8).double() * scales)


def _exact_sum(tensors):
    """Per entry, the exact rational sum of the tensors' values."""
    columns = zip(*(t.double().reshape(-1).tolist() for t in tensors))
    return [sum(map(Fraction, column), Fraction(0)) for column in columns]


@pytest.mark.parametrize("name", ["none", "int8", "int4", "int2", "topk", "sign"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_error_feedback_sent_plus_kept_equals_the_true_deltas_exactly(name, dtype):
    codec = make_codec(name, block_size=64, topk_fraction=0.05)
    feedback = ErrorFeedback(codec)
    deltas, decoded = [], []
    for round_ in range(5):
        delta = _model_delta(dtype, seed=10 * round_)
        before = {k: r.clone() for k, r in feedback.residual.items()}
        payload = feedback.encode(delta)
        sent = codec.decode(payload, layout_of(delta), dtype=torch.float64)
        for k in delta:  # per round, bit for bit: decoded + new residual == Δ + old residual
            x = delta[k].double() + before.get(k, torch.zeros_like(delta[k], dtype=torch.float64))
            assert torch.equal(sent[k] + feedback.residual[k], x)
        deltas.append(delta)
        decoded.append(sent)
    for k in deltas[0]:
        sent_plus_kept = _exact_sum([d[k] for d in decoded] + [feedback.residual[k]])
        assert sent_plus_kept == _exact_sum([d[k] for d in deltas])
    carried = any(bool((r != 0).any()) for r in feedback.residual.values())
    assert carried == (name != "none")  # compression dropped something to carry; `none` sends Δ as it is


def test_error_feedback_checkpoints_through_safetensors_and_resumes_identically(tmp_path):
    codec = make_codec("int4")
    uninterrupted, resumed = ErrorFeedback(codec), ErrorFeedback(make_codec("int4"))
    for round_ in range(2):
        uninterrupted.encode(_model_delta(seed=round_))
    save_file(uninterrupted.state_dict(), str(tmp_path / "residual.safetensors"))
    resumed.load_state_dict(load_file(str(tmp_path / "residual.safetensors")))
    for round_ in range(2, 4):
        a, b = uninterrupted.encode(_model_delta(seed=round_)), resumed.encode(_model_delta(seed=round_))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_error_feedback_leaves_other_fragments_residuals_alone():
    feedback = ErrorFeedback(make_codec("int4"))
    feedback.encode(_model_delta())
    kept_b = feedback.residual["b"].clone()
    feedback.encode({"w": _model_delta(seed=5)["w"]})
    assert torch.equal(feedback.residual["b"], kept_b)
    with pytest.raises(ValueError, match="float64"):
        feedback.load_state_dict({"w": torch.zeros(37, 11)})


def _bits(tensors):
    return {k: v.reshape(-1).view(torch.uint8).clone() for k, v in tensors.items()}


@pytest.mark.parametrize("name", ["none", "int8", "int4", "int2", "topk", "sign"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_independent_decoders_average_to_the_same_bits(name, dtype):
    """A peer decodes on its own thread count: here on 2 threads, there on 1. ATen splits an elementwise loop
    over threads once it holds more than 32768 elements (at::internal::GRAIN_SIZE): "big" is split in two
    here, not there; the decoders' operations are elementwise, each entry's result the same however split."""
    nodes = [{**_model_delta(dtype, seed=100 + k), "big": _delta(2 * 32768 + 5, dtype, seed=110 + k)} for k in range(3)]
    payloads = [ErrorFeedback(make_codec(name, topk_fraction=0.1)).encode(d) for d in nodes]
    layout = layout_of(nodes[0])
    weights = [3.0, 1.0, 2.5]
    received = [pickle.loads(pickle.dumps(p, protocol=5)) for p in payloads]  # as a peer gets them
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        here = average_decoded(make_codec(name, topk_fraction=0.1), payloads, layout, weights)
        torch.set_num_threads(1)
        there = average_decoded(make_codec(name, topk_fraction=0.1), received, layout, weights)
    finally:
        torch.set_num_threads(threads)
    assert _bits(here).keys() == _bits(there).keys()
    assert all(torch.equal(a, b) for a, b in zip(_bits(here).values(), _bits(there).values()))
    decoded = [make_codec(name, topk_fraction=0.1).decode(p, layout, torch.float64) for p in payloads]
    for k, spec in layout.items():
        reference = sum(w * d[k] for w, d in zip(weights, decoded)) / 6.5
        assert here[k].dtype == torch.float32 and here[k].shape == spec.shape
        # average_decoded's arithmetic: the weighted float64 terms added in node order, one division, one
        # rounding (Python's sum starts at 0, and 0 + x is x): the same bits
        assert torch.equal(here[k], reference.float()), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "topk", "sign"])
def test_gpu_and_cpu_decoders_agree_bit_for_bit(name):
    nodes = [_model_delta(seed=200 + k) for k in range(3)]
    codec = make_codec(name, topk_fraction=0.1)
    payloads = [codec.encode(d) for d in nodes]
    on_gpu = [Payload({k: t.cuda() for k, t in p.items()}) for p in payloads]
    cpu = average_decoded(codec, payloads, layout_of(nodes[0]), [1.0, 2.0, 0.7])
    gpu = average_decoded(codec, on_gpu, layout_of(nodes[0]), [1.0, 2.0, 0.7])
    assert all(torch.equal(_bits(cpu)[k], _bits({k: v.cpu() for k, v in gpu.items()})[k]) for k in cpu)


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sign_moves_every_entry_by_its_blocks_mean_magnitude(block, dtype, n):
    x = _delta(n, dtype, seed=3)
    x[::5] = 0  # zeros count in their block's mean and go up by it
    codec = make_codec("sign", block_size=block)
    decoded = codec.decode(codec.encode({"x": x}), layout_of({"x": x}), torch.float64)["x"]
    for start in range(0, n, block):
        part, got = x[start : start + block].double(), decoded[start : start + block]
        scale = got.abs()[0]
        assert torch.equal(got, torch.where(part >= 0, scale, -scale))  # one magnitude, the entry's sign
        assert scale.to(torch.bfloat16).double() == scale
        mean = float(sum(map(Fraction, part.abs().tolist()), Fraction(0)) / part.numel())
        # nearest bf16 of a float64 mean: half a bf16 step (2^-8 of the mean's binade) plus the float64 sum's
        # rounding, at most 128 additions and a division of 2^-53 each
        assert (
            abs(scale - mean) <= 2.0 ** (math.floor(math.log2(mean)) - 8) + 130 * 2.0**-53 * mean
            if mean
            else scale == 0
        )


def test_bad_inputs_are_refused_with_clear_errors():
    codec = make_codec("int8")
    with pytest.raises(ValueError, match="unknown compression"):
        make_codec("int3")
    with pytest.raises(ValueError, match="float tensors"):
        codec.encode({"steps": torch.tensor([3])})
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode({"x": torch.tensor([1.0, float("nan")])})
    layout = {"x": TensorSpec(torch.Size([100]), torch.float32)}
    with pytest.raises(ValueError, match="expected 104 uint8 bytes"):
        codec.decode(Payload(x=torch.zeros(50, dtype=torch.uint8)), layout)
    with pytest.raises(ValueError, match="layout does not"):
        codec.decode(Payload(y=torch.zeros(104, dtype=torch.uint8)), layout)
    a = codec.encode({"x": torch.ones(100)})
    with pytest.raises(ValueError, match="different sets"):
        average_decoded(codec, [a, Payload(x=a["x"], z=a["x"])], {**layout, "z": layout["x"]})
    with pytest.raises(ValueError, match="positive weight"):
        average_decoded(codec, [a, a], layout, [1.0, 0.0])
    with pytest.raises(ValueError, match="bits"):
        BlockwiseInt(3)


def test_int2_is_ternary_on_half_the_block_absmax_and_packs_four_codes_a_byte():
    x = torch.tensor([1.0, 0.4, -0.6, 0.0, -0.25])  # one block: scale 1.0, codes 1, 0, −1, 0, 0
    codec = make_codec("int2")
    payload = codec.encode({"x": x})
    scale, codes = payload["x"][:2].view(torch.bfloat16), payload["x"][2:]
    assert scale.item() == 1.0
    # q + 2, entry i at bits 2·(i mod 4); the last byte's three unused fields padded as q = 0
    assert codes.tolist() == [(1 + 2) | (0 + 2) << 2 | (-1 + 2) << 4 | (0 + 2) << 6, 2 | 2 << 2 | 2 << 4 | 2 << 6]
    decoded = codec.decode(payload, layout_of({"x": x}), torch.float64)["x"]
    assert decoded.tolist() == [1.0, 0.0, -1.0, 0.0, 0.0]
