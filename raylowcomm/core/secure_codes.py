"""Summable codes masked for secure aggregation (`lofi.secure`): one tensor of a `SummableInt` payload as
what crosses, and the members' masked tensors back to the sums a round decodes. Plain torch and numpy.

A summable payload tensor holds a node's integer codes q (b bits an entry) and its fixed-point block
magnitudes (`core.summable`). Masked, it is [q masked on `CodeSpec(b, N)` | magnitudes masked on
`CodeSpec(48, N, unsigned)`], each packed to exactly its n bits an entry (`core.secagg`), N the run's
nodes: b + ceil(log2 N) bits an entry and 48 + ceil(log2 N) bits a block. The members' tensors add
(`add_tensors`, on every peer or on the driver) to Σq and Σ m·2^40 (`sums_of`), from which
`core.summable.mean_of_sums` decodes the round's mean, the same bits as the round in the clear (the
magnitudes add exactly: that is why they are fixed-point)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from raylowcomm.core.compression import TensorSpec
from raylowcomm.core.packing import ceil_div
from raylowcomm.core.secagg import CodeSpec, SecAggNode, add_masked, signed_sum
from raylowcomm.core.summable import MAGNITUDE_BITS, SummableInt, fixed_magnitudes


def specs(codec: SummableInt, nodes: int) -> tuple[CodeSpec, CodeSpec]:
    """(the codes' spec, the magnitudes' spec) of `codec`'s tensors in sums of at most `nodes` nodes."""
    return CodeSpec(codec.grid.bits, nodes), CodeSpec(MAGNITUDE_BITS, nodes, signed=False)


def masked_nbytes(codec: SummableInt, spec: TensorSpec, nodes: int) -> tuple[int, int]:
    """(bytes of the masked codes, bytes of the masked magnitudes) of one tensor."""
    codes, magnitudes = specs(codec, nodes)
    return codes.nbytes(spec.numel), magnitudes.nbytes(ceil_div(spec.numel, codec.block_size))


def mask_tensor(
    node: SecAggNode,
    codec: SummableInt,
    packed: Tensor,
    spec: TensorSpec,
    slot: str,
    members: Iterable[int],
    nodes: int,
) -> Tensor:
    """One payload tensor (`packed`, as `codec` packs it) masked for `slot` among `members`: a uint8 tensor."""
    members = sorted(members)
    code_spec, magnitude_spec = specs(codec, nodes)
    codes, magnitudes = codec.codes(packed, spec)
    data = node.mask(codes.numpy(), code_spec, f"{slot}|codes", members)
    data += node.mask(fixed_magnitudes(magnitudes).numpy(), magnitude_spec, f"{slot}|magnitudes", members)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _split(codec: SummableInt, data: bytes, spec: TensorSpec, nodes: int) -> tuple[bytes, bytes]:
    code_nbytes, magnitude_nbytes = masked_nbytes(codec, spec, nodes)
    if len(data) != code_nbytes + magnitude_nbytes:
        raise ValueError(f"a masked tensor is not {code_nbytes + magnitude_nbytes} bytes")
    return data[:code_nbytes], data[code_nbytes:]


def add_tensors(codec: SummableInt, masked: Sequence[Tensor], spec: TensorSpec, nodes: int) -> Tensor:
    """Every member's masked tensor of one slot added (`core.secagg.add_masked`): the members' sums of codes
    and of magnitudes, laid out as one masked tensor is, a uint8 tensor."""
    code_spec, magnitude_spec = specs(codec, nodes)
    parts = [_split(codec, t.numpy().tobytes(), spec, nodes) for t in masked]
    blocks = ceil_div(spec.numel, codec.block_size)
    data = add_masked([c for c, _ in parts], code_spec, spec.numel)
    data += add_masked([m for _, m in parts], magnitude_spec, blocks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def sums_of(codec: SummableInt, total: Tensor, spec: TensorSpec, nodes: int, members: int) -> tuple[Tensor, Tensor]:
    """(Σq per entry, Σ m·2^40 per block), int64, from `add_tensors`'s sum of `members` masked tensors."""
    code_spec, magnitude_spec = specs(codec, nodes)
    codes, magnitudes = _split(codec, total.numpy().tobytes(), spec, nodes)
    blocks = ceil_div(spec.numel, codec.block_size)
    code_sum = signed_sum(codes, code_spec, spec.numel, members)
    magnitude_sum = signed_sum(magnitudes, magnitude_spec, blocks, members)
    return torch.from_numpy(np.ascontiguousarray(code_sum)), torch.from_numpy(np.ascontiguousarray(magnitude_sum))
