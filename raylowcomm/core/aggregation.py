"""How the nodes' values of one tensor become the round's: the one place lo-fi takes its mean from
(the star's running sum of states, peer and quorum rounds' decoded outer gradients, the LoRA merge,
the probe's heads, greedy soups, and the integer sums of summable and masked codes, `core.summable`,
which end in `WeightedMean.finish`), behind a protocol another rule can take its place in.

A rule sees one tensor at a time, in node order, each node's value in float64 with its weight.
`values` may be a generator: the mean adds each as it comes (a round holds one decoded tensor and one
sum, never N copies), a rule that needs them all (a median) lists them. Every replica that combines
the same values with the same weights in the same order gets the same bits: nothing here depends on
threads or devices beyond IEEE float64 arithmetic, done as separate multiplies and adds.

A rule that needs the whole round before any tensor (clipping each node's whole Δ to a bound from
the round's norms) is a `RoundAggregator`: its `prepare` takes every node's L2 norm and returns a
factor per node that each decoded value is multiplied by before `combine` (`core.robust` runs that
pass and holds the robust rules). A rule without `prepare`, the mean among them, is fed straight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from raylowcomm.core.compression import Codec, Layout, Payload, names_in_layout_order


class Aggregator(Protocol):
    """Combines the nodes' values of one tensor into the round's."""

    name: str

    def combine(self, values: Iterable[Tensor], weights: Sequence[float]) -> Tensor:
        """The round's value of one tensor, float64, from the nodes' values (float64, one shape, in node
        order), node k weighing weights[k] > 0."""


class RoundAggregator(Aggregator, Protocol):
    """An `Aggregator` with a whole-round step, run before any tensor is combined."""

    def prepare(self, norms: Sequence[float], weights: Sequence[float]) -> list[float] | None:
        """A factor per node (None: none) from each node's L2 norm of its whole Δ (every tensor of
        the round), in node order."""


def needs_norms(aggregator: Aggregator) -> bool:
    """Whether the rule asks for the round's norms first (has `prepare`); the mean does not."""
    return callable(getattr(aggregator, "prepare", None))


def check_weights(weights: Sequence[float], count: int) -> list[float]:
    """One finite weight > 0 per value (at least one), as floats; a ValueError naming them otherwise."""
    out = [float(w) for w in weights]
    if not count or len(out) != count or not all(math.isfinite(w) and w > 0 for w in out):
        raise ValueError(f"need one positive weight per value, got {list(weights)} for {count}")
    return out


class WeightedMean:
    """Σ_k w_k·x_k / Σ_k w_k in float64: the products and the additions as separate kernels (a weight of
    1 multiplies nothing), one division at the end. `start`, `add` and `finish` are its steps for a
    caller that receives values one at a time over a run (the star's states as they land)."""

    name = "mean"

    @staticmethod
    def start(value: Tensor, weight: float) -> Tensor:
        """A running sum from the first value: a new float64 tensor, never the caller's."""
        total = value.detach().to(torch.float64)
        if weight != 1.0:
            return total * weight
        return total if value.dtype != torch.float64 else total.clone()  # .to() copied all but float64

    @staticmethod
    def add(total: Tensor, value: Tensor, weight: float) -> None:
        """total += w·x, in place."""
        value = value.detach().to(torch.float64)
        total.add_(value if weight == 1.0 else value * weight)

    @staticmethod
    def finish(total: Tensor, weight_sum: float) -> Tensor:
        """The mean from the running sum (divided in place)."""
        return total.div_(weight_sum)

    def combine(self, values: Iterable[Tensor], weights: Sequence[float]) -> Tensor:
        it = iter(values)
        total = self.start(next(it), float(weights[0]))
        for value, weight in zip(it, weights[1:]):
            self.add(total, value, float(weight))
        return self.finish(total, math.fsum(float(w) for w in weights))


MEAN = WeightedMean()
"""Every lo-fi round's rule today."""


def average_decoded(
    codec: Codec,
    payloads: Sequence[Payload],
    layout: Layout,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
    aggregator: Aggregator = MEAN,
) -> dict[str, Tensor]:
    """Δ̄ = Σ_k w_k·d_k / Σ_k w_k over the nodes' payloads, in the given order (pass them by node index).

    The mean of `core.aggregation` (float64, one node at a time, multiply and add as separate kernels,
    one division): every replica that decodes the same payloads in the same order gets the same bits.
    Holds one tensor's sum and one decoded tensor at a time, never N decoded models. Another
    `aggregator` takes each tensor's decoded values in node order instead."""
    if not payloads:
        raise ValueError("nothing to average")
    weights = [1.0] * len(payloads) if weights is None else check_weights(weights, len(payloads))
    names = names_in_layout_order(payloads[0], layout)
    if any(set(p) != set(names) for p in payloads):
        raise ValueError("payloads carry different sets of tensors")
    out = {}
    for name in names:
        spec = layout[name]
        decoded = (codec.unpack(payload[name], spec) for payload in payloads)  # each a fresh float64 tensor
        combined = aggregator.combine(decoded, weights)
        out[name] = combined.to(dtype).view(spec.shape)
    return out
