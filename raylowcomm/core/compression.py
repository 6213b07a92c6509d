"""What crosses in an averaging round: an outer gradient Δ (name → float tensor) packed small, decoded
identically on every node, with error feedback so that what compression drops is only delayed.

Payload: one uint8 tensor per name, exactly the bytes that cross. Names, shapes and dtypes do not
travel: every node reads them off its own model (`layout_of`). Multi-byte parts (bf16 scales, int16
offsets, int32 counts) are in the machine's byte order, little-endian on every platform torch runs.

| codec | bytes of a tensor of n entries (block b, k kept entries)               | error per entry              |
|-------|--------------------------------------------------------------------------|------------------------------|
| none  | n · itemsize                                                             | 0                            |
| int8  | 2·⌈n/b⌉ scales + n codes                                                 | ≤ scale/2 of its block       |
| int4  | 2·⌈n/b⌉ scales + ⌈n/2⌉ codes                                             | ≤ scale/2 of its block       |
| int2  | 2·⌈n/b⌉ scales + ⌈n/4⌉ codes                                             | ≤ scale/2 of its block       |
| topk  | 2·⌈k/b⌉ scales + index bytes (below) + ⌈k/2⌉ codes                      | kept ≤ scale/2; dropped: all |
| sign  | 2·⌈n/b⌉ scales + ⌈n/8⌉ sign bits                                         | |x − sign(x)·s|, s = mean |x| |

Scales are bf16 (2 bytes like fp16, but fp32's range: a fine-tuning Δ of 1e-6 would underflow fp16
scales), rounded up to the next bf16 ≥ absmax/qmax, so no code clips and the error bound is scale/2
≤ absmax/(2·qmax)·(1 + 2⁻⁷). Codes are symmetric: int8 in [−127, 127], int4 in [−7, 7] stored as q +
8, two per byte (even entry in the low nibble), int2 in [−1, 1] (ternary: an entry below half its
block's absmax sends 0) stored as q + 2, four per byte (entry i at bits 2·(i mod 4)). Top-k keeps
round(fraction·n) entries (at least one) of largest |x|, sorted by index; an index is stored as its
chunk (a count of kept entries per chunk, the last one implied) and its offset inside the chunk. Two
index layouts, the smaller for the tensor's n and k (every node computes which from the layout
alone): chunks of 255 with a 1-byte offset and a 1-byte count, (⌈n/255⌉ − 1) + k bytes, about 1.13
bytes per kept entry at 3% and 1.39 at 1%; or, for sparser tensors (below about 0.4%), chunks of
65,536 with a 2-byte offset and a 4-byte count, 4·(⌈n/65536⌉ − 1) + 2·k. The kept values are int4 in
blocks of b. Sign (scaled sign, as error-feedback signSGD) moves every entry every round by its
block's mean |x| (the scale that minimises the block's squared error), bf16 rounded to nearest; a
bit per entry, entry i in byte i // 8 at bit i % 8, set for x ≥ 0: 1.25 bits a weight at b = 64,
where top-k 3% spends 0.27 on 3% of the entries.

Why decoding is bit-identical everywhere: a decoded entry is q·scale with |q| ≤ 127 (7 bits) and a
bf16 scale (8 significant bits), a 15-bit product that float32 and float64 hold exactly, so there is
nothing to round and every device gets the same number. `core.aggregation.average_decoded` then sums in float64, one
node at a time in the caller's order, as separate multiply and add kernels (no fused multiply-add),
each step correctly rounded IEEE arithmetic: the same bits on every replica, CPU or GPU.

Why error feedback is exact: `core.feedback.ErrorFeedback` keeps the residual r in float64. It encodes x = Δ + r
(float64) and keeps r' = x − d, d the decoded value. If q = 0 then d = 0 and r' = x. Otherwise q =
round(x/s) with |q| ≥ 1 puts x in [d/2, 2d], so x − d is exact in float64 (Sterbenz); the `none` codec's
cast to the tensor's dtype is within a factor 2 as well. So d + r' == x bit for bit, and over rounds
Σ d_t + r_T = Σ Δ_t exactly as long as every x = Δ + r is itself exact in float64 (sign's d is not
within a factor 2 of x, so there x − d is exact while x's bits and the scale's 8 span at most 53
together, as they do while an entry stays within 2²⁹ of its block's mean): r only holds bits
between the lowest bit of the entry's deltas and the highest of its |x|, so this holds while an entry's
nonzero fp32 deltas stay within 2²⁹ of each other in magnitude over the run (bf16: 2⁴⁵); beyond that,
the only loss is float64 rounding, 2⁻⁵³ of the entry. The residual costs 8 bytes per entry on the node.
Codes that every node of a round decodes on one shared grid, so that they add as integers: `core.summable`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from raylowcomm.core.packing import (
    PACKERS,
    SCALE_DTYPE,
    UNPACKERS,
    Reader,
    as_bytes,
    ceil_div,
    dequantize_blocks,
    in_blocks,
    index_layout,
    per_entry,
    quantize_blocks,
)

CODECS = ("none", "int8", "int4", "int2", "topk", "sign")


class TensorSpec(NamedTuple):
    """What every node knows about a tensor without being sent it: its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Layout = dict[str, TensorSpec]


def layout_of(delta: dict[str, Tensor]) -> Layout:
    """Names, shapes and dtypes of Δ, in its order; every node builds the same one from its model."""
    layout = {}
    for name, tensor in delta.items():
        if not tensor.is_floating_point():
            raise ValueError(f"compression takes float tensors; {name!r} is {tensor.dtype}")
        layout[name] = TensorSpec(tensor.shape, tensor.dtype)
    return layout


class Payload(dict):
    """name → one uint8 tensor: a node's encoded Δ, exactly the bytes that cross (and the ledger counts)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values())


class Codec:
    """Packs one flat float64 tensor into a uint8 buffer and back; encodes and decodes whole Δ dicts.

    `unpack` returns the exact decoded values in float64, the same bits on every node."""

    name = "codec"

    def packed_nbytes(self, spec: TensorSpec) -> int:
        raise NotImplementedError

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        raise NotImplementedError

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        raise NotImplementedError

    def pack_decoded(self, x: Tensor, spec: TensorSpec) -> tuple[Tensor, Tensor]:
        """(`pack`, what `unpack` decodes it to): error feedback needs both; a codec that knows the
        decoded values while packing skips decoding its own bytes. The decoded tensor is new and the
        caller's: error feedback overwrites it with the residual."""
        packed = self.pack(x, spec)
        return packed, self._unpack(packed, spec)

    def unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        """Checks the buffer's size against the formula, then decodes it to flat float64: a new tensor,
        the caller's (`average_decoded` sums into it in place)."""
        self.check_size(packed, spec)
        return self._unpack(packed, spec)

    def check_size(self, packed: Tensor, spec: TensorSpec) -> None:
        """A ValueError unless `packed` is the formula's number of uint8 bytes for `spec`."""
        expected = self.packed_nbytes(spec)
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
            raise ValueError(
                f"{self.name} payload of {tuple(packed.shape)} {packed.dtype}: expected "
                f"{expected} uint8 bytes for {tuple(spec.shape)} {spec.dtype}"
            )

    def payload_nbytes(self, layout: Layout) -> int:
        """What a payload for `layout` weighs, from the formula alone (for planning and checks)."""
        return sum(self.packed_nbytes(spec) for spec in layout.values())

    def encode(self, delta: dict[str, Tensor]) -> Payload:
        """Δ (any float dtype) → Payload, without error feedback (see `ErrorFeedback.encode`)."""
        payload = Payload()
        for name, spec in layout_of(delta).items():
            payload[name] = self.pack(flat_float64(delta[name], name), spec)
        return payload

    def decode(self, payload: Payload, layout: Layout, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Payload → float tensors in the layout's shapes and order; dtype None restores each tensor's own
        dtype (bf16 then rounds q·scale), torch.float32 or float64 keeps the decoded values exact."""
        out = {}
        for name in names_in_layout_order(payload, layout):
            spec = layout[name]
            out[name] = self.unpack(payload[name], spec).to(dtype or spec.dtype).view(spec.shape)
        return out


def flat_float64(tensor: Tensor, name: str) -> Tensor:
    x = tensor.detach().reshape(-1).to(torch.float64)
    # A sum is finite when every entry is; the entry-wise check (a pass and a bool tensor more) only
    # confirms a non-finite sum, since finite entries can overflow it.
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise ValueError(f"outer gradient {name!r} has non-finite entries")
    return x


def names_in_layout_order(payload: Payload, layout: Layout) -> list[str]:
    unknown = set(payload) - set(layout)
    if unknown:
        raise ValueError(f"payload has tensors the layout does not: {sorted(unknown)[:5]}")
    return [name for name in layout if name in payload]


class NoCompression(Codec):
    """The tensor's own bytes, in its own dtype (a float64 input is cast to it first)."""

    name = "none"

    def packed_nbytes(self, spec: TensorSpec) -> int:
        return spec.numel * torch.empty(0, dtype=spec.dtype).element_size()

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        sent = x.to(spec.dtype)
        if not torch.isfinite(sent).all():
            raise ValueError(f"outer gradient overflows {spec.dtype}")
        return as_bytes(sent).clone()

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        return Reader(packed).take(spec.numel, spec.dtype).to(torch.float64)


class BlockwiseInt(Codec):
    """Blockwise absmax-scaled int8, int4 or int2 (bits 8, 4, 2): [bf16 scales | codes]."""

    def __init__(self, bits: int, block_size: int = 64):
        if bits not in PACKERS:
            raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.bits, self.block_size = bits, block_size
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def _code_nbytes(self, n: int) -> int:
        return ceil_div(n * self.bits, 8)

    def packed_nbytes(self, spec: TensorSpec) -> int:
        n = spec.numel
        return 2 * ceil_div(n, self.block_size) + self._code_nbytes(n)

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        return self.pack_codes(*quantize_blocks(x, self.block_size, self.qmax))

    def pack_codes(self, codes: Tensor, scales: Tensor) -> Tensor:
        """[bf16 scales | codes packed `bits` to an entry]: the bytes of given codes and scales."""
        return torch.cat([as_bytes(scales), PACKERS[self.bits](codes)])

    def pack_decoded(self, x: Tensor, spec: TensorSpec) -> tuple[Tensor, Tensor]:
        """The codes and scales are the decoded values' factors: q·scale from them, the bytes unread."""
        codes, scales = quantize_blocks(x, self.block_size, self.qmax)
        return self.pack_codes(codes, scales), dequantize_blocks(codes, scales, self.block_size)

    def unpack_codes(self, packed: Tensor, spec: TensorSpec) -> tuple[Tensor, Tensor]:
        """(integer codes of the n entries, bf16 scale per block) as `pack_codes` packed them."""
        n, reader = spec.numel, Reader(packed)
        scales = reader.take(ceil_div(n, self.block_size), SCALE_DTYPE)
        return UNPACKERS[self.bits](reader.take(self._code_nbytes(n), torch.uint8), n), scales

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        return dequantize_blocks(*self.unpack_codes(packed, spec), self.block_size)


class TopK(Codec):
    """The `fraction` largest-|x| entries per tensor, int4 values:
    [bf16 scales | counts per chunk but the last | offsets in chunk | int4 codes], chunks as `index_layout`."""

    name = "topk"

    def __init__(self, fraction: float, block_size: int = 64):
        if not 0 < fraction <= 1:
            raise ValueError(f"topk fraction must be in (0, 1], got {fraction}")
        self.fraction, self.values = fraction, BlockwiseInt(4, block_size)

    def kept(self, n: int) -> int:
        """Entries kept of a tensor of n: round(fraction·n), at least one of a non-empty tensor."""
        return min(n, max(1, round(self.fraction * n))) if n else 0

    def packed_nbytes(self, spec: TensorSpec) -> int:
        n, k = spec.numel, self.kept(spec.numel)
        return index_layout(n, k).nbytes(n, k) + self.values.packed_nbytes(TensorSpec(torch.Size([k]), spec.dtype))

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        n, k = x.numel(), self.kept(x.numel())
        at = index_layout(n, k)
        index = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        chunk, offset = index // at.chunk, index % at.chunk
        counts = torch.bincount(chunk, minlength=ceil_div(n, at.chunk))[:-1].to(at.count_dtype)
        values = self.values.pack(x[index], TensorSpec(torch.Size([k]), spec.dtype))
        scale_bytes = 2 * ceil_div(k, self.values.block_size)
        offsets = (offset - at.shift).to(at.offset_dtype)
        return torch.cat([values[:scale_bytes], as_bytes(counts), as_bytes(offsets), values[scale_bytes:]])

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        n, k = spec.numel, self.kept(spec.numel)
        at = index_layout(n, k)
        scale_bytes = 2 * ceil_div(k, self.values.block_size)
        reader = Reader(packed[scale_bytes:])
        counts = reader.take(max(ceil_div(n, at.chunk) - 1, 0), at.count_dtype).to(torch.int64)
        offsets = reader.take(k, at.offset_dtype).to(torch.int64) + at.shift
        last = k - int(counts.sum())
        if (counts < 0).any() or last < 0:
            raise ValueError("top-k payload has inconsistent chunk counts")
        chunks = torch.arange(counts.numel() + 1, device=packed.device)
        index = torch.repeat_interleave(chunks, torch.cat([counts, counts.new_full((1,), last)])) * at.chunk + offsets
        if k and (int(index.max()) >= n or int(offsets.max()) >= at.chunk or (index[1:] <= index[:-1]).any()):
            raise ValueError("top-k payload has indices out of range or out of order")
        values_packed = torch.cat([packed[:scale_bytes], packed[packed.numel() - ceil_div(k, 2) :]])
        out = torch.zeros(n, dtype=torch.float64, device=packed.device)
        out[index] = self.values.unpack(values_packed, TensorSpec(torch.Size([k]), spec.dtype))
        return out


class ScaledSign(Codec):
    """Every entry as ± its block's mean |x|: [bf16 scales | sign bits]."""

    name = "sign"

    def __init__(self, block_size: int = 64):
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.block_size = block_size

    def packed_nbytes(self, spec: TensorSpec) -> int:
        n = spec.numel
        return 2 * ceil_div(n, self.block_size) + ceil_div(n, 8)

    def pack(self, x: Tensor, spec: TensorSpec) -> Tensor:
        n, block = x.numel(), self.block_size
        blocks = in_blocks(x.abs(), block)
        sizes = torch.full((blocks.shape[0],), float(block), dtype=torch.float64, device=x.device)
        if n % block:
            sizes[-1] = n % block
        scales = (blocks.sum(dim=1) / sizes).to(SCALE_DTYPE)
        if not torch.isfinite(scales).all():
            raise ValueError("a block's mean |x| is too large for bf16 scales")
        bits = in_blocks((x >= 0).to(torch.uint8), 8)
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=x.device)
        return torch.cat([as_bytes(scales), (bits * weights).sum(dim=1, dtype=torch.uint8)])

    def _unpack(self, packed: Tensor, spec: TensorSpec) -> Tensor:
        n, reader = spec.numel, Reader(packed)
        scales = reader.take(ceil_div(n, self.block_size), SCALE_DTYPE)
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        bits = ((reader.take(ceil_div(n, 8), torch.uint8)[:, None] >> shifts) & 1).view(-1)[:n]
        magnitude = per_entry(scales, self.block_size, n)
        return torch.where(bits.bool(), magnitude, -magnitude)


def make_codec(name: str, block_size: int = 64, topk_fraction: float = 0.01) -> Codec:
    """The codec `lofi.compress` names: none | int8 | int4 | int2 | topk | sign."""
    if name == "none":
        return NoCompression()
    if name in ("int8", "int4", "int2"):
        return BlockwiseInt(int(name[3:]), block_size)
    if name == "topk":
        return TopK(topk_fraction, block_size)
    if name == "sign":
        return ScaledSign(block_size)
    raise ValueError(f"unknown compression {name!r}; choose one of {CODECS}")
