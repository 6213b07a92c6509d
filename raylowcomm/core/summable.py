"""Summable codes (`lofi.compress_scale: shared`): blockwise int8, int4 and int2 codes that every node of a
round decodes on one grid per block, so that the nodes' codes add as plain integers and a round's sum
decodes with one multiply a block. What secure aggregation needs to mask codes (`core.secagg`), and what a
reduce-scatter ring of code sums would need.

Each node picks its codes q on its own grid, exactly as `BlockwiseInt` does (int8, int4: x rounded to
nearest on absmax/qmax; int2: ternary, ±1 above half the block's absmax). What changes is the number it
sends in each block's bf16 scale field: the magnitude m that decodes its own codes best in least squares,
m = Σ|x|·|q| / Σq² over the block (0 where every code is 0), rounded to the nearest bf16. The bytes are
`BlockwiseInt`'s, at the same size.

A round's shared scale of block b is S_b = the mean over the round's N nodes of m_k,b (float64, added in
node order, then one division; the nodes' weights play no part), and every node's code decodes as q·S_b.
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

from raylowcomm.core.aggregation import check_weights
from raylowcomm.core.compression import BlockwiseInt, Codec, TensorSpec, make_codec
from raylowcomm.core.packing import SCALE_DTYPE, dequantize_blocks, in_blocks, quantize_blocks

SUMMABLE = ("int8", "int4", "int2")
"""The codecs whose codes can be summed on a shared grid."""


def least_squares_magnitudes(x: Tensor, codes: Tensor, block: int) -> Tensor:
    """Per block of flat float64 x and its integer codes: m = Σ|x|·|q| / Σq², float64 (0 where every
    code is 0), the magnitude whose q·m is nearest x in squared error."""
    q = in_blocks(codes.to(torch.float64), block)
    num = (in_blocks(x, block).abs() * q.abs()).sum(dim=1)
    den = (q * q).sum(dim=1)  # an integer, exact in float64
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def encode_blocks(x: Tensor, block: int, qmax: int) -> tuple[Tensor, Tensor]:
    """(codes as `quantize_blocks` picks them, each block's least-squares magnitude rounded to the nearest bf16)."""
    codes, _ = quantize_blocks(x, block, qmax)
    magnitudes = least_squares_magnitudes(x, codes, block).to(SCALE_DTYPE)
    if not torch.isfinite(magnitudes).all():
        raise ValueError("a block's magnitude is too large for bf16 scales")
    return codes, magnitudes


class SummableInt(Codec):
    """int8, int4 or int2 codes on each node's own grid, each block's bf16 field holding the magnitude that
    decodes them best (`least_squares_magnitudes`): `BlockwiseInt`'s bytes. Alone, a payload decodes as
    q·m (`unpack`); a round decodes on the shared scales (`average_codes`)."""

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


def shared_scales(magnitudes: Sequence[Tensor]) -> Tensor:
    """S per block: the mean of the nodes' magnitudes, float64, added in the given (node) order, then one
    division by their count."""
    total = magnitudes[0].to(torch.float64, copy=True)
    for m in magnitudes[1:]:
        total.add_(m.to(torch.float64))
    return total.div_(len(magnitudes))


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
    magnitudes, total = [], None
    for tensor, weight in zip(packed, weights):
        codes, m = codec.codes(tensor, spec)
        magnitudes.append(m)
        term = codes.to(torch.int32) if equal else codes.to(torch.float64)
        if not equal and weight != 1.0:
            term = term * weight
        total = term if total is None else total.add_(term)
    scales = shared_scales(magnitudes)
    mean = decode_sum(scales, total, codec.block_size)
    return mean.div_(len(packed) if equal else math.fsum(weights)), scales


def make(name: str, block_size: int = 64, topk_fraction: float = 0.01, scale: str = "node") -> Codec:
    """`core.compression.make_codec`, but `SummableInt` for int8/int4/int2 where `scale` is shared."""
    if scale == "shared" and name in SUMMABLE:
        return SummableInt(int(name[3:]), block_size)
    return make_codec(name, block_size, topk_fraction)
