"""Robust rounds: rules that keep a wrong node from moving the model, the screening before them and
what each node did to the round (`../shared/TRUST.md`; Sun et al. 2019 for norm bounding, Yin et al.
2018 for the coordinate-wise median and trimmed mean). Plain torch, no Ray.

A round, over the nodes' payloads in node order: `payload_norms` decodes each once for its L2 norm
over every tensor and whether every entry is finite; `screen` drops the non-finite payloads and,
with a factor f, those whose norm passes f × the median norm of the finite ones, and `screen_unlike`,
with its own factor, those pointing away from the others' coordinate-wise median (`core.screening`); a rule with
`prepare` (clip) turns the kept nodes' norms into a factor per node; `combine_round` decodes one
tensor at a time, scales each node's values and combines them (the mean adds them as they come).
`robust_round` does all four; `Diagnostics` records each node's part on the way.

The rules, N nodes of weights w_k > 0 and W = Σ w_k:
- mean: `core.aggregation.MEAN`, Σ w_k·x_k / W.
- clip: each node's whole Δ scaled by min(1, κ·m / ‖Δ_k‖), m the median of the nodes' norms
  (unweighted: a node's weight must not move the bound; an even N takes the mean of the two middle
  norms), then the weighted mean. A round whose median norm is 0 scales every nonzero Δ to 0.
- trimmed_mean (β in [0, ½)): at each coordinate the values sorted, whole nodes dropped from each end
  while the dropped weight stays within β·W, the rest's weighted mean. With equal weights that drops
  ⌊β·N⌋ nodes a side (β·N = 1.5 drops one); weights trim by mass, so a node of weight 2 counts as
  two of weight 1 and is dropped only whole. Less than W/2 a side, so some node always stays.
- median: the nodes whose weight below and above each reach W/2 (with equal weights the middle
  value, or the two middle ones for an even N), their weighted mean: a weighted median whose exact
  ties at W/2 average the two straddling values.
Ties sort stably (by node index). β = 0 is the weighted mean added in sorted order, not MEAN's bits.

Sparse payloads (top-k): a coordinate a node did not send decodes as 0, and the coordinate rules see
that 0 as its value: among 4 nodes a coordinate only one node sent has median 0 and trimmed mean 0
(β ≥ ¼), so the rules mostly zero a top-k round. `sent_only=True` counts only the nodes whose decoded
value is nonzero at the coordinate (weight 0 for the others; 0 where nobody sent): robust among the
senders, but a coordinate one node alone sent takes that node's value whole, so a wrong node is
bounded only where others sent too, and a sent value that quantised to 0 counts as not sent.

Determinism: every sum is float64 in a fixed order by elementwise adds (`fixed_sum`, the node loops),
each a correctly rounded IEEE operation, and sorting only moves values: every replica that combines
the same payloads with the same weights in the same order gets the same bits, on any device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from raylowcomm.core.aggregation import MEAN, Aggregator, check_weights, needs_norms
from raylowcomm.core.compression import Payload, names_in_layout_order
from raylowcomm.core.screening import (
    Dropped,
    Parts,
    Screening,
    cosines_to_median,
    fixed_sum,
    median_of,
    payload_norms,
    screen,
    screen_unlike,
    split_parts,
)

RULES = ("mean", "clip", "trimmed_mean", "median")


class Clip:
    """Each node's whole Δ clipped in L2 to κ × the round's median norm, then the weighted mean."""

    name = "clip"

    def __init__(self, kappa: float = 1.0):
        if not (math.isfinite(kappa) and kappa > 0):
            raise ValueError(f"clip κ must be finite and > 0, got {kappa}")
        self.kappa = kappa

    def prepare(self, norms: Sequence[float], weights: Sequence[float]) -> list[float]:
        """min(1, κ·m / ‖Δ_k‖) per node, m the unweighted median norm (weights unused)."""
        bound = self.kappa * median_of(norms)
        return [1.0 if n <= bound else bound / n for n in norms]

    def combine(self, values: Iterable[Tensor], weights: Sequence[float]) -> Tensor:
        return MEAN.combine(values, weights)


class Coordinatewise:
    """Per coordinate, the trimmed mean (`trim` = β) or, with trim None, the weighted median."""

    def __init__(self, trim: float | None = None, sent_only: bool = False):
        if trim is not None and not 0 <= trim < 0.5:
            raise ValueError(f"trimmed mean β must be in [0, 0.5), got {trim}")
        self.trim, self.sent_only = trim, sent_only
        self.name = "median" if trim is None else "trimmed_mean"

    def combine(self, values: Iterable[Tensor], weights: Sequence[float]) -> Tensor:
        return self.combine_counted(values, weights)[0]

    def combine_counted(self, values: Iterable[Tensor], weights: Sequence[float]) -> tuple[Tensor, Tensor, Tensor]:
        """(the round's value, per node the coordinates it took part in that the rule left out, per node
        the coordinates it took part in: all, or those it sent with `sent_only`)."""
        values = list(values)
        x = torch.stack([v.detach().to(torch.float64).reshape(-1) for v in values])
        w = torch.tensor(check_weights(weights, len(values)), dtype=torch.float64, device=x.device)
        w = w[:, None].expand_as(x) * (x != 0) if self.sent_only else w[:, None].expand_as(x)
        order = torch.sort(x, dim=0, stable=True)
        v, ws = order.values, w.gather(0, order.indices)
        below = [torch.zeros_like(ws[0])]  # the weight sorted below each position, added node by node
        for row in ws[:-1]:
            below.append(below[-1] + row)
        lower = torch.stack(below)
        total = lower[-1] + ws[-1]
        if self.trim is None:
            kept = (lower + ws >= total / 2) & (total - lower >= total / 2)
        else:
            kept = (lower + ws > self.trim * total) & (total - lower > self.trim * total)
        mass = torch.where(kept, ws, 0.0)
        num, den = v[0] * mass[0], mass[0].clone()
        for i in range(1, len(v)):
            num, den = num + v[i] * mass[i], den + mass[i]
        out = torch.where(den > 0, num / den, 0.0)  # den 0: nobody sent the coordinate
        took = w > 0
        kept_by_node = torch.empty_like(kept).scatter_(0, order.indices, kept)
        return out.view(values[0].shape), (took & ~kept_by_node).sum(dim=1), took.sum(dim=1)


def make_rule(name: str, kappa: float = 1.0, trim: float = 0.1, sent_only: bool = False) -> Aggregator:
    """The rule `lofi.aggregate` names: mean | clip | trimmed_mean | median."""
    if name == "mean":
        return MEAN
    if name == "clip":
        return Clip(kappa)
    if name in ("trimmed_mean", "median"):
        return Coordinatewise(trim if name == "trimmed_mean" else None, sent_only)
    raise ValueError(f"unknown aggregate {name!r}; choose one of {RULES}")


@dataclass(frozen=True)
class NodeDiagnostics:
    """One node's part in a round: the norm of its decoded Δ (before clipping), its cosine to the
    round's aggregate (None when dropped or either is zero), its clip factor (1.0: unclipped), the
    fraction of the coordinates it took part in that the rule left out, and why it was dropped."""

    node: int
    norm: float
    cosine: float | None
    scale: float
    trimmed: float
    dropped: Dropped | None

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


class Diagnostics:
    """Accumulates, one tensor at a time, each combined node's dot product with the aggregate and its
    squared norm (float64, `fixed_sum`) and its left-out coordinates; the values are those the rule
    saw (scaled: a cosine does not change under a positive scale)."""

    def __init__(self, count: int):
        self._dots, self._squares = [0.0] * count, [0.0] * count
        self._left, self._took = [0] * count, [0] * count
        self._aggregate = 0.0

    def add(self, values: Sequence[Tensor], aggregate: Tensor, left_out: Tensor, took_part: Tensor) -> None:
        flat = aggregate.reshape(-1)
        for k, x in enumerate(values):
            self._dots[k] += fixed_sum(x.reshape(-1) * flat)
            self._squares[k] += fixed_sum(x * x)
            self._left[k] += int(left_out[k])
            self._took[k] += int(took_part[k])
        self._aggregate += fixed_sum(flat * flat)

    def _cosine(self, k: int) -> float | None:
        scale = math.sqrt(self._squares[k]) * math.sqrt(self._aggregate)
        return self._dots[k] / scale if scale > 0 else None

    def report(
        self, norms: Sequence[float], screening: Screening | None = None, scales: Sequence[float] | None = None
    ) -> tuple[NodeDiagnostics, ...]:
        """A row per node of the round (norms in node order), the combined ones in `screening.kept`."""
        kept = screening.kept if screening else tuple(range(len(norms)))
        why = {d.node: d for d in screening.dropped} if screening else {}
        at = {node: j for j, node in enumerate(kept)}
        rows = []
        for node, norm in enumerate(norms):
            j = at.get(node)
            if j is None:
                rows.append(NodeDiagnostics(node, norm, None, 1.0, 0.0, why.get(node)))
                continue
            trimmed = self._left[j] / self._took[j] if self._took[j] else 0.0
            rows.append(NodeDiagnostics(node, norm, self._cosine(j), scales[j] if scales else 1.0, trimmed, None))
        return tuple(rows)


def _counted(rule: Aggregator, values: list[Tensor], weights: Sequence[float]) -> tuple[Tensor, Tensor, Tensor]:
    """`combine_counted` where the rule has it; else combine, no node left out of any coordinate."""
    if hasattr(rule, "combine_counted"):
        return rule.combine_counted(values, weights)
    out = rule.combine(values, weights)
    return out, torch.zeros(len(values), dtype=torch.int64), torch.full((len(values),), out.numel())


def combine_round(
    parts: Parts,
    payloads: Sequence[Payload],
    weights: Sequence[float],
    rule: Aggregator = MEAN,
    scales: Sequence[float] | None = None,
    diagnostics: Diagnostics | None = None,
) -> dict[str, Tensor]:
    """Each tensor's round value, float64 in its layout's shape, decoded a tensor at a time in node
    order, each node's values multiplied by its scale (none for 1.0). Without diagnostics the values
    reach the rule as a generator (the mean then holds one decoded tensor and one sum: `MEAN` gives
    `average_decoded`'s bits); with them, a tensor's N values are listed for the dot products."""
    weights = check_weights(weights, len(payloads))
    scales = [1.0] * len(payloads) if scales is None else [float(s) for s in scales]
    out = {}
    for codec, layout, sub in split_parts(parts, payloads):
        for name in names_in_layout_order(sub[0], layout):
            spec = layout[name]
            decoded = (codec.unpack(p[name], spec) for p in sub)  # each a fresh float64 tensor
            values = (x if s == 1.0 else x.mul_(s) for x, s in zip(decoded, scales))
            if diagnostics is None:
                combined = rule.combine(values, weights)
            else:
                values = list(values)
                combined, left, took = _counted(rule, values, weights)
                diagnostics.add(values, combined, left, took)
            out[name] = combined.view(spec.shape)
    return out


@dataclass(frozen=True)
class RoundResult:
    """A robust round's Δ̄ (float64), its screening and, when asked, a row per node."""

    delta: dict[str, Tensor]
    screening: Screening
    nodes: tuple[NodeDiagnostics, ...] | None


def _screen_unlike(parts: Parts, payloads: Sequence[Payload], screening: Screening, factor: float) -> Screening:
    """`screening` with the kept payloads unlike the others (`screen_unlike`) dropped too."""
    kept, unlike, _ = screen_unlike(cosines_to_median(parts, screening.select(payloads)), factor)
    unlike = tuple(Dropped(screening.kept[d.node], d.reason, d.value) for d in unlike)
    return Screening(tuple(screening.kept[j] for j in kept), tuple(sorted(screening.dropped + unlike)), screening.bound)


def robust_round(
    parts: Parts,
    payloads: Sequence[Payload],
    weights: Sequence[float] | None = None,
    rule: Aggregator = MEAN,
    screen_factor: float | None = None,
    diagnose: bool = False,
    cosine_factor: float | None = None,
) -> RoundResult:
    """Screening (when `screen_factor` is given: inf drops only non-finite payloads; then, with
    `cosine_factor`, those unlike the others, `screen_unlike`), the rule's `prepare` on the kept nodes'
    norms, then `combine_round` over the kept payloads. The norm pass runs only when one of these needs
    it: a plain mean round is `combine_round` alone."""
    weights = [1.0] * len(payloads) if weights is None else check_weights(weights, len(payloads))
    norms = None
    if screen_factor is not None or needs_norms(rule) or diagnose:
        norms = payload_norms(parts, payloads)
    if screen_factor is not None:
        screening = screen(norms.norms, norms.finite, screen_factor)
    else:
        screening = Screening(tuple(range(len(payloads))), (), math.inf)
    if cosine_factor is not None and len(screening.kept) > 2:
        screening = _screen_unlike(parts, payloads, screening, cosine_factor)
    if not screening.kept:
        raise ValueError(f"screening dropped every payload: {screening.dropped}")
    kept_weights = screening.select(weights)
    scales = rule.prepare(screening.select(norms.norms), kept_weights) if needs_norms(rule) else None
    diagnostics = Diagnostics(len(screening.kept)) if diagnose else None
    delta = combine_round(parts, screening.select(payloads), kept_weights, rule, scales, diagnostics)
    nodes = diagnostics.report(norms.norms, screening, scales) if diagnostics else None
    return RoundResult(delta, screening, nodes)
