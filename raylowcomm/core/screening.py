"""Screening a round before its rule: which nodes' payloads it leaves out, and the plain float64
helpers every robust round shares (`fixed_sum`, `median_of`, `split_parts`). Plain torch, no Ray.

Two screens, both scale-free (bounds in units of a median over the round's nodes, so no bound needs
the model's scale) and both dropping whole nodes:
- `screen`: a payload with a non-finite entry, or whose L2 norm passes f × the median norm. It
  catches a blown-up update (a diverged node, a scaled attack) but not a wrong direction.
- `screen_unlike`: a payload whose cosine to the round's coordinate-wise median falls below f × the
  median of those cosines. A sign-flipped, noised or wrongly trained update (wrong labels) points
  away from where most nodes agree even when its norm is ordinary; on a clean round the honest
  nodes' cosines are alike and nobody is dropped. It needs more honest nodes than wrong ones (the
  median must be theirs) and 3 or more nodes: with 2, both make the same angle with their midpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from raylowcomm.core.compression import Codec, Layout, Payload, names_in_layout_order

Parts = Sequence[tuple[Codec, Layout]]
"""A round's codecs and the tensors each carries (one pair for a single-codec round)."""


def fixed_sum(x: Tensor) -> float:
    """Σ x in float64 by a fixed pairwise tree of elementwise adds (halves added, a zero padding an odd
    length): torch's own reductions may split the work by threads or device, this never does."""
    x = x.reshape(-1).to(torch.float64)
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        half = x.numel() // 2
        x = x[:half] + x[half:]
    return float(x[0]) if x.numel() else 0.0


def median_of(numbers: Sequence[float]) -> float:
    """The middle of the sorted numbers; of an even count, the mean of the two middle ones."""
    ordered, mid = sorted(numbers), len(numbers) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def split_parts(parts: Parts, payloads: Sequence[Payload]) -> Iterator[tuple[Codec, Layout, list[Payload]]]:
    """Each part's codec, layout and the payloads' tensors of it, for the parts the payloads carry."""
    if not payloads:
        raise ValueError("nothing to combine")
    if any(set(p) != set(payloads[0]) for p in payloads):
        raise ValueError("payloads carry different sets of tensors")
    unknown = set(payloads[0]).difference(*(layout for _, layout in parts))
    if unknown:
        raise ValueError(f"payload has tensors no part's layout has: {sorted(unknown)[:5]}")
    for codec, layout in parts:
        names = [k for k in layout if k in payloads[0]]
        if names:
            yield codec, layout, [Payload({k: p[k] for k in names}) for p in payloads]


@dataclass(frozen=True)
class Norms:
    """Each node's Σ x² over its decoded tensors and whether every entry was finite, in node order."""

    squares: tuple[float, ...]
    finite: tuple[bool, ...]

    @property
    def norms(self) -> list[float]:
        return [math.sqrt(s) for s in self.squares]


def payload_norms(parts: Parts, payloads: Sequence[Payload]) -> Norms:
    """Decodes every payload once, a tensor at a time, for its norm (tensors in layout order)."""
    squares, finite = [0.0] * len(payloads), [True] * len(payloads)
    for codec, layout, sub in split_parts(parts, payloads):
        for name in names_in_layout_order(sub[0], layout):
            for k, payload in enumerate(sub):
                x = codec.unpack(payload[name], layout[name])
                squares[k] += fixed_sum(x * x)
                finite[k] = finite[k] and bool(torch.isfinite(x).all())
    return Norms(tuple(squares), tuple(finite))


class Dropped(NamedTuple):
    """A payload screening left out: its node, why, and the figure it was left out for (its norm, or with
    "unlike the others" its cosine to the round's median)."""

    node: int
    reason: Literal["not finite", "norm past bound", "unlike the others"]
    value: float


@dataclass(frozen=True)
class Screening:
    """Which payloads a round keeps (node indices, in order), which it drops and why, and the bound."""

    kept: tuple[int, ...]
    dropped: tuple[Dropped, ...]
    bound: float

    def select(self, items: Sequence) -> list:
        """The kept nodes' items (payloads, weights, norms), in node order."""
        return [items[k] for k in self.kept]


def screen(norms: Sequence[float], finite: Sequence[bool], factor: float = math.inf) -> Screening:
    """Drops a payload with a non-finite entry or norm, then one whose norm passes factor × the median
    norm of the finite ones (factor ≥ 1, so the median node stays; inf: no bound). A median norm of
    0 drops every nonzero payload. Every node dropped leaves `kept` empty: the caller decides."""
    if not factor >= 1:
        raise ValueError(f"screening factor must be ≥ 1, got {factor}")
    ok = [k for k, (n, f) in enumerate(zip(norms, finite)) if f and math.isfinite(n)]
    bound = factor * median_of([norms[k] for k in ok]) if ok and math.isfinite(factor) else math.inf
    dropped = [Dropped(k, "not finite", n) for k, n in enumerate(norms) if k not in ok]
    dropped += [Dropped(k, "norm past bound", norms[k]) for k in ok if norms[k] > bound]
    kept = tuple(k for k in ok if norms[k] <= bound)
    return Screening(kept, tuple(sorted(dropped)), bound)


def middle(x: Tensor) -> Tensor:
    """Per column of x (nodes × entries), the median: the middle value, or the mean of the two middle
    ones for an even count; sorting only moves values, so it is exact and the same on every replica."""
    v = torch.sort(x, dim=0, stable=True).values
    n = v.shape[0]
    return v[(n - 1) // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def cosines_to_median(parts: Parts, payloads: Sequence[Payload]) -> list[float]:
    """Each payload's cosine to the payloads' coordinate-wise median (equal weights: a node's weight must
    not move the reference), over every tensor, decoded a tensor at a time in layout order; 0 for a
    payload or a median of norm 0."""
    dots, squares, reference = [0.0] * len(payloads), [0.0] * len(payloads), 0.0
    for codec, layout, sub in split_parts(parts, payloads):
        for name in names_in_layout_order(sub[0], layout):
            x = torch.stack([codec.unpack(p[name], layout[name]).reshape(-1) for p in sub])
            centre = middle(x)
            reference += fixed_sum(centre * centre)
            for k in range(len(sub)):
                dots[k] += fixed_sum(x[k] * centre)
                squares[k] += fixed_sum(x[k] * x[k])
    scale = [math.sqrt(q) * math.sqrt(reference) for q in squares]
    return [d / s if s > 0 else 0.0 for d, s in zip(dots, scale)]


def screen_unlike(cosines: Sequence[float], factor: float) -> tuple[tuple[int, ...], tuple[Dropped, ...], float]:
    """(kept, dropped, bound): drops a payload whose cosine falls below factor × the median cosine
    (factor in (0, 1], so the median node stays). Where the median cosine is not above 0 the nodes agree
    on no direction, and nobody is dropped for it."""
    if not 0 < factor <= 1:
        raise ValueError(f"cosine screening factor must be in (0, 1], got {factor}")
    centre = median_of(cosines)
    bound = factor * centre if centre > 0 else -math.inf
    dropped = tuple(Dropped(k, "unlike the others", c) for k, c in enumerate(cosines) if c < bound)
    return tuple(k for k, c in enumerate(cosines) if c >= bound), dropped, bound
