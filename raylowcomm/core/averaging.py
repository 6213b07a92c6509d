"""Weight averaging for lo-fi: streaming, weighted, greedy soups, and BatchNorm statistics.

Plain torch: nothing here knows about Ray, so the arithmetic is tested on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from raylowcomm.core.aggregation import MEAN


class StreamingAverage:
    """θ = Σ w_k θ_k / Σ w_k, adding one state dict at a time: `core.aggregation`'s mean, step by step.

    Holds one running sum (float64 for exactness) besides the state dict being added, so the
    driver never keeps more than two extra copies of the model however many nodes there are.
    Integer tensors (e.g. `num_batches_tracked`) are not averaged: the first one is kept.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"averaging weight must be > 0, got {weight}")
        if self._sum is None:
            self._dtypes = {k: v.dtype for k, v in state.items()}
            self._sum = {
                k: MEAN.start(v, weight) if v.is_floating_point() else v.detach().clone() for k, v in state.items()
            }
        else:
            if state.keys() != self._sum.keys():
                missing = set(self._sum) ^ set(state)
                raise ValueError(f"state dicts differ in keys: {sorted(missing)[:5]}")
            for k, v in state.items():
                if v.is_floating_point():
                    MEAN.add(self._sum[k], v, weight)
        self.total_weight += weight
        self.count += 1

    def result(self, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The average; `extra` adds one more state dict (weight 1) without changing the sum."""
        if self._sum is None:
            raise ValueError("nothing to average")
        total = self.total_weight + (1.0 if extra is not None else 0.0)
        out = {}
        for k, s in self._sum.items():
            if s.is_floating_point():
                acc = s.clone()
                if extra is not None:
                    MEAN.add(acc, extra[k], 1.0)
                out[k] = MEAN.finish(acc, total).to(self._dtypes[k])
            else:
                out[k] = s.clone()
        return out


def average_state_dicts(states: Iterable[dict[str, torch.Tensor]], weights: Iterable[float] | None = None):
    avg = StreamingAverage()
    weights = list(weights) if weights is not None else None
    for i, state in enumerate(states):
        avg.add(state, 1.0 if weights is None else weights[i])
    return avg.result()


def greedy_soup(
    ranked: list[Callable[[], dict[str, torch.Tensor]]],
    score: Callable[[dict[str, torch.Tensor]], float],
) -> tuple[dict[str, torch.Tensor], list[int], float]:
    """Greedy soup (Wortsman et al. 2022): walk the models from best to worst held-out score and
    keep one only if the held-out score of the running average does not drop.

    `ranked` are loaders (fetched one at a time); returns the soup, the kept positions and its score.
    """
    soup = StreamingAverage()
    first = ranked[0]()
    soup.add(first)
    best = score(first)
    kept = [0]
    del first
    for i, load in enumerate(ranked[1:], start=1):
        candidate_state = load()
        candidate = soup.result(extra=candidate_state)
        s = score(candidate)
        if s >= best:
            soup.add(candidate_state)
            best, kept = s, kept + [i]
    return soup.result(), kept, best


def batchnorm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    }


@torch.no_grad()
def measure_bn_statistics(model: nn.Module, batches: Iterable, forward: Callable[[nn.Module, object], object]):
    """Recompute every BN layer's running mean/var on `batches` as an equal-weight average over
    batches (momentum=None), leaving the weights alone. Returns (buffers, number of batches).

    Averaging several nodes' results weighted by their batch counts equals one pass over all
    their batches in one process, which is what lets nodes recalibrate an averaged model
    without sending data.
    """
    layers = batchnorm_layers(model)
    saved = {n: m.momentum for n, m in layers.items()}
    was_training = model.training
    for m in layers.values():
        m.reset_running_stats()
        m.momentum = None
    model.train()
    count = 0
    try:
        for batch in batches:
            forward(model, batch)
            count += 1
    finally:
        for n, m in layers.items():
            m.momentum = saved[n]
        model.train(was_training)
    stats = {}
    for n, m in layers.items():
        stats[f"{n}.running_mean"] = m.running_mean.clone()
        stats[f"{n}.running_var"] = m.running_var.clone()
        stats[f"{n}.num_batches_tracked"] = m.num_batches_tracked.clone()
    return stats, count


def combine_bn_statistics(per_node: list[tuple[dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """Batch-count-weighted average of several nodes' `measure_bn_statistics` results."""
    avg = StreamingAverage()
    total = 0
    for stats, batches in per_node:
        if batches > 0:
            avg.add(stats, float(batches))
            total += batches
    out = avg.result()
    for k in out:
        if k.endswith("num_batches_tracked"):
            out[k] = torch.tensor(total, dtype=out[k].dtype)
    return out


class OuterNesterov:
    """DiLoCo's outer step on the averaged update: Δ = θ_global − mean_k θ_k is treated as a
    gradient for SGD with Nesterov momentum. lr = 1, momentum = 0 is plain averaging (lo-fi)."""

    def __init__(self, initial: dict[str, torch.Tensor], param_names: set[str], lr: float, momentum: float):
        self.state = {k: v.detach().clone() for k, v in initial.items()}
        self.param_names = param_names
        self.lr, self.momentum = lr, momentum
        self.buf = {k: torch.zeros_like(self.state[k]) for k in param_names}

    def step(self, average: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for k, v in average.items():
            if k in self.param_names:
                delta = self.state[k] - v
                self.buf[k].mul_(self.momentum).add_(delta)
                self.state[k].sub_(delta + self.momentum * self.buf[k], alpha=self.lr)
            else:
                self.state[k] = v.clone()
        return self.state

    def step_delta(self, mean_delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The same step from the averaged outer gradient Δ̄ = θ_global − mean_k θ_k itself (peer
        rounds: every node has Δ̄, none has the average); tensors outside param_names move by Δ̄."""
        for k, d in mean_delta.items():
            delta = d.to(self.state[k].dtype)
            if k in self.param_names:
                self.buf[k].mul_(self.momentum).add_(delta)
                self.state[k].sub_(delta + self.momentum * self.buf[k], alpha=self.lr)
            else:
                self.state[k] = self.state[k] - delta
        return self.state
