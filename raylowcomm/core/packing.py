"""The bytes of a codec's payload (`core.compression`): blockwise absmax quantisation with bf16 scales
rounded up, int4 and int2 codes packed several to a byte, top-k's two index layouts, and a reader
that walks a packed buffer part by part. Plain torch, no state."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

SCALE_DTYPE = torch.bfloat16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class Reader:
    """Reads consecutive typed parts out of one packed buffer (copied, so any alignment is fine)."""

    def __init__(self, buffer: Tensor):
        self.buffer, self.offset = buffer, 0

    def take(self, count: int, dtype: torch.dtype) -> Tensor:
        size = count * torch.empty(0, dtype=dtype).element_size()
        part = self.buffer[self.offset : self.offset + size].clone()
        self.offset += size
        return part.view(dtype)


class IndexLayout(NamedTuple):
    """How top-k stores a kept entry's index: a count of kept entries per chunk of `chunk` entries (the
    last chunk's implied) and the entry's offset inside its chunk, stored as offset − `shift`."""

    chunk: int
    offset_dtype: torch.dtype
    shift: int
    count_dtype: torch.dtype

    def nbytes(self, n: int, k: int) -> int:
        return itemsize(self.count_dtype) * max(ceil_div(n, self.chunk) - 1, 0) + itemsize(self.offset_dtype) * k


INDEX_LAYOUTS = (
    IndexLayout(255, torch.uint8, 0, torch.uint8),  # a count of up to 255 fits a byte
    IndexLayout(1 << 16, torch.int16, 1 << 15, torch.int32),
)


def index_layout(n: int, k: int) -> IndexLayout:
    """The smaller index layout for k kept entries of n (the byte-sized one on a tie)."""
    return min(INDEX_LAYOUTS, key=lambda layout: layout.nbytes(n, k))


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def round_up_to_scale_dtype(value: Tensor) -> Tensor:
    """The smallest bf16 ≥ value (value ≥ 0, float64), so that |x| ≤ qmax·scale and no code clips."""
    scale = value.to(SCALE_DTYPE)
    low = scale.to(torch.float64) < value
    if low.any():
        scale[low] = (scale[low].view(torch.int16) + 1).view(SCALE_DTYPE)  # next positive bf16 up
    if not torch.isfinite(scale).all():
        raise ValueError("a block's absmax is too large for bf16 scales")
    return scale


def in_blocks(x: Tensor, block: int) -> Tensor:
    """Flat x zero-padded to whole blocks, one block a row (a view of x where it fills them)."""
    pad = ceil_div(x.numel(), block) * block - x.numel()
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(-1, block)


def per_entry(scales: Tensor, block: int, n: int) -> Tensor:
    """Each block's scale repeated for its entries, in float64 (exact: bf16 values)."""
    return scales.to(torch.float64).repeat_interleave(block)[:n]


def quantize_blocks(x: Tensor, block: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Blockwise absmax quantization of flat float64 x: (codes int8 of len n, bf16 scale per block)."""
    n = x.numel()
    blocks = in_blocks(x, block)
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()  # = |x|'s max, without |x|
    scales = round_up_to_scale_dtype(absmax / qmax)
    divisor = torch.where(scales > 0, scales.to(torch.float64), 1.0)
    codes = (blocks / divisor[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize_blocks(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """q·scale in float64 (exact: a 7-bit code times an 8-bit bf16 significand). The whole blocks are
    one broadcast product, without repeating each scale for its entries first (a round's decode runs
    over every weight of the model, on every node)."""
    n, whole = codes.numel(), codes.numel() // block
    scales = scales.to(torch.float64)
    out = codes.to(torch.float64)  # exact; multiplying in place is twice as fast as a mixed-dtype product
    head = whole * block
    out[:head].view(whole, block).mul_(scales[:whole, None])
    if head < n:
        out[head:].mul_(scales[whole])
    return out


def pack_int4(codes: Tensor) -> Tensor:
    """Codes in [−7, 7] → ⌈n/2⌉ bytes, q + 8 per nibble, even entries low."""
    nibbles = (codes + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:n]
    return nibbles.to(torch.int16) - 8


_CRUMB_SHIFTS = (0, 2, 4, 6)


def pack_int2(codes: Tensor) -> Tensor:
    """Codes in [−1, 1] → ⌈n/4⌉ bytes, q + 2 per 2-bit field, entry i at bits 2·(i mod 4)."""
    fields = (codes + 2).to(torch.uint8)
    pad = -fields.numel() % 4
    if pad:
        fields = torch.cat([fields, fields.new_full((pad,), 2)])
    quads = fields.view(-1, 4)
    packed = quads[:, 0].clone()
    for i in (1, 2, 3):
        packed |= quads[:, i] << _CRUMB_SHIFTS[i]
    return packed


def unpack_int2(packed: Tensor, n: int) -> Tensor:
    fields = torch.stack([(packed >> shift) & 0x03 for shift in _CRUMB_SHIFTS], dim=1).view(-1)[:n]
    return fields.to(torch.int16) - 2


PACKERS = {8: (lambda codes: as_bytes(codes.to(torch.int8))), 4: pack_int4, 2: pack_int2}
UNPACKERS = {8: (lambda packed, n: packed.view(torch.int8).to(torch.int16)), 4: unpack_int4, 2: unpack_int2}
