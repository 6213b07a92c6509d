"""The random stream of the perturbations z: drawn from a CPU generator seeded per sample, in fixed
chunks of every parameter in order (Rademacher signs or Gaussian values, optionally masked to a
sparse subset), so every node that draws from the same seed gets the same bits. `perturb` measures
and updates with it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator

import torch

if sys.byteorder != "little":  # Rademacher signs are unpacked from the bytes of int64 words.
    raise ImportError("raylowcomm.core.zo assumes a little-endian machine")

KINDS = ("rademacher", "gaussian")
# Elements drawn per generator call. Part of the random stream's definition (Gaussian draws
# depend on it), so it must be the same on every node; it also caps the temporary memory.
CHUNK = 1 << 18


@functools.cache
def _sign_words() -> torch.Tensor:
    """Entry b holds the 8 signs of byte b as int8 (+1 where bit i is set, −1 elsewhere) packed
    in one int64: unpacking gathers one 8-byte word per byte, a cheaper gather than a row of 8
    floats per byte (`benchmarks/spsa_replay.py` times the draw, z_gen_s)."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (bits * 2 - 1).to(torch.int8).view(torch.int64).view(-1)


class _Scratch:
    """The buffers one pass draws every chunk's z into, allocated once: a fresh buffer per chunk
    would pay its page faults on every draw, a large share of the draw's time. A z therefore lives
    only until the next draw."""

    def __init__(self) -> None:
        self.words = torch.empty(CHUNK // 64, dtype=torch.int64)
        self.index = torch.empty(CHUNK // 8, dtype=torch.int64)
        self.signs = torch.empty(CHUNK // 8, dtype=torch.int64)
        self.mask_words = torch.empty(CHUNK // 8, dtype=torch.int64)  # one random byte per element
        self._z: dict[torch.dtype, torch.Tensor] = {}

    def z(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._z:
            self._z[dtype] = torch.empty(CHUNK, dtype=dtype)
        return self._z[dtype]


def _rademacher(n: int, dtype: torch.dtype, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # One 64-bit draw gives 64 signs (z_k = +1 iff bit k of its word is set); a byte-indexed
    # table unpacks them. With z = ±1, c·z is exact, so θ + c·z rounds the same with or
    # without fused multiply-add: updates agree across CPU instruction sets.
    words = scratch.words[: (n + 63) // 64].random_(-(1 << 63), None, generator=gen)
    index, signs = scratch.index[: 8 * words.numel()], scratch.signs[: 8 * words.numel()]
    index.copy_(words.view(torch.uint8))
    torch.index_select(_sign_words(), 0, index, out=signs)
    return scratch.z(dtype)[:n].copy_(signs.view(torch.int8)[:n])


def _gaussian(n: int, dtype: torch.dtype, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # MeZO's z (the values of torch.randn(n)). Vectorised CPU kernels differ between instruction
    # sets, so Gaussian streams are only guaranteed identical between machines with the same CPU
    # capability and torch.
    return scratch.z(dtype)[:n].normal_(generator=gen)


_DRAW = {"rademacher": _rademacher, "gaussian": _gaussian}


def mask_threshold(density: float) -> int:
    """The byte threshold of a sparse mask: an element is perturbed iff its random byte is below
    round(256·density), so densities are multiples of 1/256 and density 1 draws no mask at all."""
    if not 1 / 256 <= density <= 1:
        raise ValueError(f"density must be in [1/256, 1], got {density}")
    return round(256 * density)


def _masked_(z: torch.Tensor, keep: int, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # Sparse perturbations (Sparse MeZO, with a random mask): one random byte per element from the
    # seed's own generator, right after the chunk's z; z is zeroed where the byte is ≥ keep. Integer
    # draws and compares: the mask is the same on every machine, so every replica perturbs and
    # updates the same elements.
    n = z.numel()
    words = scratch.mask_words[: (n + 7) // 8].random_(-(1 << 63), None, generator=gen)
    return z.masked_fill_(words.view(torch.uint8)[:n] >= keep, 0)


def _slices(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Flat views of at most CHUNK elements of every tensor, in order: the unit z is drawn in."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("SPSA needs contiguous parameters")
        flat = t.detach().view(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield flat[start : start + CHUNK]


def z_chunks(
    tensors: Iterable[torch.Tensor], seed: int, kind: str, scratch: _Scratch | None = None, density: float = 1.0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(flat slice of a tensor, its z) for every CHUNK of every tensor, in order. The z is drawn
    into `scratch` (streams may share one if each z is used before the next is drawn). With
    density < 1 each chunk's z is followed in the stream by its mask (`_masked_`)."""
    if kind not in _DRAW:
        raise ValueError(f"unknown perturbation kind {kind!r}; expected one of {KINDS}")
    keep = mask_threshold(density)
    draw, gen, scratch = _DRAW[kind], torch.Generator().manual_seed(seed), scratch or _Scratch()
    for part in _slices(tensors):
        z = draw(part.numel(), part.dtype, gen, scratch)
        yield part, (z if keep == 256 else _masked_(z, keep, gen, scratch)).to(part.device)
