"""A bad node (`bad_nodes:` in a config): a node that sends a wrong outer update, or trains wrongly, to
measure what one such node costs a run (and what a robust rule buys back). Plain torch: a dict of
tensors in, a new dict out; the caller's Δ or shard is left as it is.

What it sends instead of its own Δ (`corrupt`, every round or the one `round` names):

- sign_flip: −scale·Δ, every entry exact (the multiplication by a float is the only rounding);
- noise: Gaussian noise instead of Δ, each entry of standard deviation scale·‖Δ‖/√n (‖Δ‖ the L2 norm
  over every tensor of the update, n its entries), so its norm is about scale·‖Δ‖; drawn from `seed`
  (the caller derives it from the run's seed, the node and the round: a rerun sends the same noise);
- nonfinite: Δ with its first entry NaN, the rest as it is.

How it trains, from its first step (its Δ is then what that training gives, sent as it is):
- learning_rate: at scale × optim.lr (`learning_rate_of`), as a host whose config was mistyped;
- permuted_labels: on its shard with every label y read as (y + 1) mod C, C the task's classes
  (`relabelled`), as a shard whose labels a bug in its pipeline shifted: every label wrong."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

UPDATE_KINDS = ("sign_flip", "noise", "nonfinite")
"""The kinds of wrong update a node can send in place of its Δ."""
TRAINING_KINDS = ("learning_rate", "permuted_labels")
"""The kinds of wrong training a node can do: its Δ is then its own, from that training."""
KINDS = UPDATE_KINDS + TRAINING_KINDS


@dataclass
class BadNode:
    node: int
    """The node (lo-fi node k, 0..nodes.count − 1) whose outer update is wrong."""
    update: Literal["sign_flip", "noise", "nonfinite", "learning_rate", "permuted_labels"]
    """sign_flip: it sends −scale·Δ; noise: Gaussian noise of norm about scale·‖Δ‖ instead of Δ (drawn from
    the run's seed, the node and the round: a rerun sends the same); nonfinite: Δ with a NaN entry;
    learning_rate: it trains at scale × optim.lr; permuted_labels: it trains with every label y read as
    (y + 1) mod the task's classes."""
    scale: float = 10.0
    """sign_flip's factor, noise's norm in units of ‖Δ‖, learning_rate's factor on optim.lr (a finite
    number > 0); not for nonfinite or permuted_labels."""
    round: int | None = None
    """The one averaging round (1, 2, ...; lo-fi without rounds has one, its final average) in which it
    sends the wrong update; None: every round. Not for learning_rate or permuted_labels, which train
    wrongly from the first step."""


def update_seed(run_seed: int, node: int, round_: int) -> int:
    """The noise's seed: the run's seed, the node and the round, so every rerun draws the same."""
    return (run_seed * 1_000_003 + node) * 100_003 + round_


def corrupt(delta: dict[str, Tensor], kind: str, scale: float, seed: int) -> dict[str, Tensor]:
    """The wrong update of `kind` (see the module) in place of `delta`, each tensor in its own dtype."""
    if kind == "sign_flip":
        return {k: d * -scale for k, d in delta.items()}
    if kind == "nonfinite":
        out = {k: d.clone() for k, d in delta.items()}
        first = next((d for d in out.values() if d.is_floating_point() and d.numel()), None)
        if first is not None:
            first[(0,) * first.dim()] = math.nan
        return out
    if kind == "noise":
        return _noise(delta, scale, seed)
    raise ValueError(f"unknown kind of bad update {kind!r}: one of {', '.join(KINDS)}")


def _noise(delta: dict[str, Tensor], scale: float, seed: int) -> dict[str, Tensor]:
    """Gaussian noise of per-entry std scale·‖Δ‖/√n, drawn in float64 on the CPU in the dict's order."""
    n = sum(d.numel() for d in delta.values())
    norm = math.sqrt(sum(float(d.to(torch.float64).square().sum()) for d in delta.values()))
    std = scale * norm / math.sqrt(n) if n else 0.0
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(d.shape, generator=gen, dtype=torch.float64) * std).to(d.dtype).to(d.device)
        for k, d in delta.items()
    }


def bad_update(
    entries: list[BadNode], node: int, round_: int, run_seed: int, delta: dict[str, Tensor]
) -> dict[str, Tensor]:
    """What node `node` sends for round `round_` in place of its `delta`: the wrong update its entry of
    `entries` asks for, where the entry names this round (round None: every round); else `delta` itself."""
    for e in entries:
        if e.node == node and e.update in UPDATE_KINDS and (e.round is None or e.round == round_):
            return corrupt(delta, e.update, e.scale, update_seed(run_seed, node, round_))
    return delta


def _entry(entries: list[BadNode], node: int, kind: str) -> BadNode | None:
    return next((e for e in entries if e.node == node and e.update == kind), None)


def learning_rate_of(entries: list[BadNode], node: int, lr: float) -> float:
    """The learning rate node `node` trains at: scale × `lr` where an entry makes it learning_rate, else `lr`."""
    entry = _entry(entries, node, "learning_rate")
    return lr if entry is None else lr * entry.scale


def relabelled(entries: list[BadNode], node: int, split: dict[str, Tensor], classes: int | None) -> dict[str, Tensor]:
    """Node `node`'s training rows: with every label y as (y + 1) mod `classes` where an entry makes it
    permuted_labels (a new dict; the caller's is kept), else `split` itself."""
    if _entry(entries, node, "permuted_labels") is None:
        return split
    if not classes or classes < 2 or "labels" not in split:
        raise ValueError(f"bad_nodes: node {node}'s permuted_labels needs a classification task of 2 or more classes")
    return {**split, "labels": (split["labels"] + 1) % classes}
