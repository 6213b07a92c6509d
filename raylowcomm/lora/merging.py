"""Merging the nodes' LoRA adapters: the exact average of what they learned on their common frozen
base (`average_delta`), FedAvg of the factors to compare (`average_factors`), lo-fi's average under
LoRA (`AdapterAverage`, `NodeAdapters`), a round merged in place on a node (`merge_nodes`), the next
round started on the merged base (`merge_and_reset`), and a PEFT model made to compute a plain one
for a while (`computing`). Keys in both forms: `adapters`' docstring. Plain torch: no Ray."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.aggregation import MEAN, check_weights
from raylowcomm.lora.adapters import AdaptedLayer, State, init_adapters, lora_layers, lora_modules, plain_key


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """One weight > 0 per node state (uniform by default), for `core.aggregation`'s mean."""
    return check_weights([1.0] * n if weights is None else weights, n)


def _mean(states: Sequence[State], w: list[float], key: str) -> torch.Tensor:
    """Weighted mean of one tensor over the nodes (`core.aggregation.MEAN`, float64), rounded once."""
    return MEAN.combine((s[key].double() for s in states), w).to(states[0][key].dtype)


def _merged_weight(base: torch.Tensor, layer: AdaptedLayer, states: Sequence[State], w: list[float]) -> torch.Tensor:
    """base + the nodes' mean of scale·B_k·A_k (`core.aggregation.MEAN`, float64), rounded once to base's
    dtype, on base's device."""
    delta = MEAN.combine((layer.delta(s) for s in states), w)
    return (base.double() + delta.to(base.device)).to(base.dtype)


def _check_same_keys(states: Sequence[State]) -> None:
    for k, s in enumerate(states[1:], 1):
        if s.keys() != states[0].keys():
            odd = sorted(s.keys() ^ states[0].keys())[:5]
            raise ValueError(f"node state {k} differs from node state 0 in keys: {odd}")


def average_factors(node_states: Sequence[State], weights: Sequence[float] | None = None) -> State:
    """FedAvg of the factors: mean A, mean B, mean head. NOT the average of what the nodes learned
    (mean(B)·mean(A) ≠ mean(B·A)); kept to measure that gap. Its merged model is
    `average_delta(base, [average_factors(states)], layers)`."""
    w = _weights(weights, len(node_states))
    _check_same_keys(node_states)
    return {key: _mean(node_states, w, key) for key in node_states[0]}


def average_delta(
    base_state: State,
    node_states: Sequence[State],
    layers: Sequence[AdaptedLayer],
    weights: Sequence[float] | None = None,
) -> State:
    """The exact lo-fi average of the nodes' models, as a plain (merged, adapter-free) state dict:
    W = W0 + Σ_k w_k·scale·B_k·A_k per adapted layer (w_k normalised; uniform by default), the head
    and any other trainable tensor averaged plainly, everything else W0. Exact because every node's
    model is W0 + scale·B_k·A_k on the same frozen W0, so this equals averaging the full weights.

    `base_state`: the nodes' common frozen weights, in PEFT form (the model's state dict) or plain
    form (the previous round's average); only their non-adapter tensors are read. With one node
    state this is that node's merged model."""
    w = _weights(weights, len(node_states))
    _check_same_keys(node_states)
    merged = {pk: v for k, v in base_state.items() if (pk := plain_key(k)) is not None}
    factors = {key for layer in layers for key in (layer.a, layer.b)}
    for key in node_states[0].keys() - factors:
        merged[plain_key(key)] = _mean(node_states, w, key)
    for layer in layers:
        merged[layer.plain] = _merged_weight(merged[layer.plain], layer, node_states, w)
    return merged


@dataclass
class AdapterAverage:
    """lo-fi's average of adapters on top of the nodes' common frozen `base`: `delta`, the exact
    average of what they learned, or `factors`, FedAvg of A and B (for comparison). Returns the
    plain merged state; after an averaging round it becomes the next round's base (lo-fi's
    `NodeAverage` under LoRA)."""

    base: State
    layers: list[AdaptedLayer]
    how: str = "delta"
    what: ClassVar[str] = "node_adapters"

    def __call__(self, node_states: Sequence[State], weights: Sequence[float] | None = None) -> State:
        if self.how == "factors":
            return average_delta(self.base, [average_factors(node_states, weights)], self.layers)
        return average_delta(self.base, node_states, self.layers, weights)

    def gather(self, states: Iterable[tuple[int, State]], weights: Sequence[float]) -> NodeAdapters:
        """Every node's adapters and head, kept (they are small) in node order with their weights."""
        got = dict(states)
        return NodeAdapters([got[k] for k in sorted(got)], [weights[k] for k in sorted(got)], self.how)

    def combine(self, gathered: NodeAdapters) -> State:
        return self(gathered.states, gathered.weights)

    def rebase(self, state: State) -> None:
        self.base = state

    def sent(self, payload: NodeAdapters | State) -> tuple[str, int]:
        """The nodes' adapters cross to be merged where they are scored; a merged model crosses whole."""
        if isinstance(payload, NodeAdapters):
            return "adapters_to_score", sum(payload_nbytes(s) for s in payload.states)
        return "weights_to_score", payload_nbytes(payload)


@dataclass
class NodeAdapters:
    """Every node's adapters and head with their weights: what crosses for the lo-fi average to be
    merged where it is scored, on the frozen base that node already holds (the same on every node),
    instead of a merged model of the full size."""

    states: list[State]
    weights: list[float]
    how: str = "delta"

    def merged_on(self, model: nn.Module) -> State:
        base = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return AdapterAverage(base, lora_layers(model), self.how)(self.states, self.weights)


def merge_and_reset(model: nn.Module, merged_state: State, seed: int) -> None:
    """Start the next round from the exact average: the frozen base (and head) load `merged_state`
    (`average_delta`'s output) and the adapters restart from `init_adapters(seed)`, B = 0, so the
    PEFT model computes exactly the merged model. Every node must pass the same seed, so the replicas
    stay identical; a new seed each round (e.g. derived from run seed and round) starts every round
    in a fresh random subspace, as ReLoRA does, instead of re-learning in the same one. The
    optimizer's state for the adapters no longer fits them: the caller resets it."""
    wanted = {k: pk for k in model.state_dict() if (pk := plain_key(k)) is not None}
    if set(wanted.values()) != merged_state.keys():
        odd = sorted(set(wanted.values()) ^ merged_state.keys())[:5]
        raise ValueError(f"merged state does not match the model's plain weights, e.g. {odd}")
    model.load_state_dict({k: merged_state[pk] for k, pk in wanted.items()}, strict=False)
    init_adapters(model, seed)


@contextlib.contextmanager
def computing(model: nn.Module, plain: State) -> Iterator[nn.Module]:
    """The PEFT model made to compute the plain model `plain` (e.g. the nodes' average merged on this
    node's base) while the block runs, then put back as it was: every tensor of `plain` that is not the
    model's own (the merged layers, the head) swapped in, and the adapters' scaling 0. A node scores
    the average on the base it holds without a second copy of the model (an 8B base is 16 GB)."""
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}  # tied weights: one tensor, several names
    for key, tensor in model.state_dict(keep_vars=True).items():
        if (pk := plain_key(key)) is not None:
            tensors.setdefault(id(tensor), (tensor, []))[1].append(pk)
    pairs = [
        (tensor, next((plain[pk] for pk in names if pk in plain), None), names) for tensor, names in tensors.values()
    ]
    missing = [names for _, new, names in pairs if new is None]
    if missing:  # before anything is swapped
        raise KeyError(f"the plain state to compute has none of {missing[0]}")
    swapped = []
    for tensor, new, _ in pairs:
        if new.data_ptr() != tensor.data_ptr():
            swapped.append((tensor, tensor.data))
            tensor.data = new.to(tensor.device, tensor.dtype)
    scales = [(m, m.scaling) for _, m in lora_modules(model)]
    for m, scaling in scales:
        m.scaling = {name: 0.0 for name in scaling}
    try:
        yield model
    finally:
        for tensor, data in swapped:
            tensor.data = data
        for m, scaling in scales:
            m.scaling = scaling


def merge_nodes(
    model: nn.Module, node_states: Sequence[State], weights: Sequence[float], how: str = "delta", seed: int = 0
) -> list[str]:
    """A peer round landing on a node: the nodes' adapters and head (`node_states`, all or one fragment's
    tensors) averaged as `average_delta` does, in place: each adapted layer's frozen weight += Σ_k
    w_k·scale·B_k·A_k (float64, rounded once to its dtype), the head and other trainables their mean;
    then those layers' adapters restart from `seed`. `how` factors: the factors' mean merged instead.
    Every node that merges the same states in the same order gets the same bits. Returns the factor
    names restarted (their optimizer state and error-feedback residual no longer fit)."""
    if how == "factors":
        node_states, weights = [average_factors(node_states, weights)], None
    w = _weights(weights, len(node_states))
    layers = [layer for layer in lora_layers(model) if layer.a in node_states[0]]
    factors = {key for layer in layers for key in (layer.a, layer.b)}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in sorted(node_states[0].keys() - factors):
            params[key].copy_(_mean(node_states, w, key))
        for layer in layers:
            params[layer.base].copy_(_merged_weight(params[layer.base], layer, node_states, w))
    init_adapters(model, seed, only={layer.a.rsplit(".lora_A.", 1)[0] for layer in layers})
    return sorted(factors)
