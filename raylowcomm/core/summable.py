"""Summable codes (`lofi.compress_scale: shared`): blockwise int8, int4 and int2 codes that every node of a
round decodes on one grid per block, so that the nodes' codes add as plain integers and a round's sum
decodes with one multiply a block. What secure aggregation needs to mask codes (`core.secagg`), and what a
reduce-scatter ring of code sums would need.

Each node picks its codes q on its own grid and sends them with its own bf16 scale per block, exactly as
`BlockwiseInt` does (int8, int4: x rounded to nearest on absmax/qmax; int2: ternary, ±1 above half the
block's absmax, the scale the absmax): the same bytes. What changes is the decoding: a round decodes every
node's codes of a block at the mean of the nodes' scales (their magnitudes, m below). Why the mean of the
scales, not of each node's least-squares fit (Σ|x|·|q| / Σq²): a ternary code decoded at the block's absmax
overshoots a sent entry and makes up for the entries left at 0, and the N nodes' mean then follows the
true mean about as per-node scales do; decoded at the least-squares magnitude, a round's mean moves
about two thirds as far (docs/benchmarks.md has the measurement).

A magnitude is a fixed-point number: 0, or in [2^-33, 2^8) (a bf16 there is a whole multiple of 2^-40, so
m·2^40 is an integer below 2^48, `fixed_magnitudes`). Smaller ones are sent as 0 (the block's codes still
decode at the others' magnitudes, and error feedback keeps what that misses); a larger one means a Δ of
hundreds a weight, a run gone wrong, and is refused. So the nodes' magnitudes add exactly as integers too,
which is what lets secure aggregation mask them (`core.secagg`, `lofi.secure`).

A round's shared scale of block b is S_b = the mean over the round's N nodes of m_k,b: the integer sum of
the fixed-point magnitudes, times 2^-40 in float64, then one division by N (`scales_from_sum`; the
nodes' weights play no part), and every node's code decodes as q·S_b.
The round's sum is S_b·Σ_k q_k: an integer sum of codes, then one multiply. The mean is S_b·Σ_k q_k / N
with equal weights; with weights w_k it is S_b·(Σ_k w_k·q_k) / Σ_k w_k (float64, node order), no longer
an integer sum. Every replica reads the same bytes and does the same IEEE float64 operations in the same
order (separate kernels, no fused multiply-add): the same bits on every node.

Error feedback keeps what the shared grid misses: a node's residual is x − q·S_b, known only once the
round's magnitudes are in (`residual`; `core.feedback.ErrorFeedback.settle`). Unlike the per-node codecs'
q·scale, q·S_b is a float64 product that may round, so Σ sent + kept = Σ Δ holds to float64 rounding
rather than bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from raylowcomm.core.aggregation import MEAN, check_weights
from raylowcomm.core.compression import BlockwiseInt, Codec, TensorSpec, make_codec
from raylowcomm.core.packing import SCALE_DTYPE, dequantize_blocks, quantize_blocks

SUMMABLE = ("int8", "int4", "int2")
"""The codecs whose codes can be summed on a shared grid."""
FRACTION_BITS = 40
"""A magnitude's fixed point: m·2^40 is a whole number."""
MAGNITUDE_BITS = 48
"""Bits of a fixed-point magnitude, m < 2^(48 - 40) = 256."""
SMALLEST = 2.0**-33
"""The smallest nonzero magnitude sent: from here up a bf16 is a whole multiple of 2^-40."""


def encode_blocks(x: Tensor, block: int, qmax: int) -> tuple[Tensor, Tensor]:
    """(codes and bf16 scales as `quantize_blocks` picks them), each scale a fixed-point magnitude: one
    below 2^-33 sent as 0, one of 256 or more refused."""
    codes, magnitudes = quantize_blocks(x, block, qmax)
    largest = 2.0 ** (MAGNITUDE_BITS - FRACTION_BITS)
    if not (magnitudes < largest).all():
        raise ValueError(f"a block's magnitude is {magnitudes.max().item():g}, at least {largest:g}: Δ has diverged")
    return codes, torch.where(magnitudes < SMALLEST, 0.0, magnitudes).to(SCALE_DTYPE)


class SummableInt(Codec):
    """int8, int4 or int2 codes and scales on each node's own grid: `BlockwiseInt`'s bytes (but a scale
    below 2^-33, sent as 0). Alone, a payload decodes as q·m (`unpack`); a round decodes on the shared
    scales, the mean of the nodes' (`average_codes`)."""

    def __init__(self, bits: int, block_size: int = 64):
        self.grid = BlockwiseInt(bits, block_size)
        self.name, self.block_size = self.grid.name, block_size

    def packed_nbytes(self, spec: TensorSpec) -> int:
        return self.grid.packed_nbytes(spec)

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        return self.grid.pack_codes(*encode_blocks(x, self.block_size, self.grid.qmax))

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        return dequantize_blocks(*self.grid.unpack_codes(packed, spec), self.block_size)

    def codes(self, packed: Tensor, spec: TensorSpec) -> tuple[Tensor, Tensor]:
        """(integer codes, bf16 magnitudes) of one payload tensor, its size checked as `unpack` checks it."""
        self.check_size(packed, spec)
        return self.grid.unpack_codes(packed, spec)


def fixed_magnitudes(magnitudes: Tensor) -> Tensor:
    """bf16 magnitudes (as `encode_blocks` sends them) as whole numbers m·2^40, int64: exact."""
    return magnitudes.to(torch.float64).mul_(2.0**FRACTION_BITS).to(torch.int64)


def scales_from_sum(total: Tensor, count: int) -> Tensor:
    """S per block from the sum of `count` nodes' fixed-point magnitudes: total·2^-40 / count, float64."""
    return MEAN.finish(total.to(torch.float64).mul_(2.0**-FRACTION_BITS), count)


def shared_scales(magnitudes: Sequence[Tensor]) -> Tensor:
    """S per block: the mean of the nodes' magnitudes, summed exactly as fixed-point integers."""
    return scales_from_sum(sum(fixed_magnitudes(m) for m in magnitudes), len(magnitudes))


def mean_of_sums(code_sum: Tensor, magnitude_sum: Tensor, count: int, block: int) -> tuple[Tensor, Tensor]:
    """(S·Σq / N per entry, flat float64; S) from the sums of `count` nodes' codes and fixed-point
    magnitudes: a round of equal weights, whether its sums were taken in the clear or masked."""
    scales = scales_from_sum(magnitude_sum, count)
    return MEAN.finish(decode_sum(scales, code_sum, block), count), scales


def decode_sum(scales: Tensor, code_sum: Tensor, block: int) -> Tensor:
    """S·Σq per entry, float64 (a new tensor): the sum of codes times its block's shared scale, one multiply."""
    return dequantize_blocks(code_sum.to(torch.float64, copy=True), scales, block)


def residual(x: Tensor, codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """x − q·S per entry, float64 (a new tensor): what a node's codes on the round's shared grid miss."""
    return decode_sum(scales, codes, block).neg_().add_(x)


def average_codes(
    codec: SummableInt, packed: Sequence[Tensor], spec: TensorSpec, weights: Sequence[float]
) -> tuple[Tensor, Tensor]:
    """(the round's mean of one tensor, flat float64; its shared scales S) from the nodes' payload tensors in
    node order: S·Σq / N where the weights are equal (an integer sum of codes), S·(Σ w·q) / Σ w otherwise."""
    weights = check_weights(weights, len(packed))
    equal = len(set(weights)) == 1
    magnitude_sum, total = 0, None
    for tensor, weight in zip(packed, weights):
        codes, m = codec.codes(tensor, spec)
        magnitude_sum = magnitude_sum + fixed_magnitudes(m)
        term = codes.to(torch.int64) if equal else codes.to(torch.float64)
        if not equal and weight != 1.0:
            term = term * weight
        total = term if total is None else total.add_(term)
    if equal:
        return mean_of_sums(total, magnitude_sum, len(packed), codec.block_size)
    scales = scales_from_sum(magnitude_sum, len(packed))
    return MEAN.finish(decode_sum(scales, total, codec.block_size), math.fsum(weights)), scales


def make(name: str, block_size: int = 64, topk_fraction: float = 0.01, scale: str = "node") -> Codec:
    """`core.compression.make_codec`, but `SummableInt` for int8/int4/int2 where `scale` is shared."""
    if scale == "shared" and name in SUMMABLE:
        return SummableInt(int(name[3:]), block_size)
    return make_codec(name, block_size, topk_fraction)
