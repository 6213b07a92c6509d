"""Interlocking's auxiliary heads (one on top of every stage but the last) and the losses a
stage's head is trained with."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def conv_aux_head(in_channels: int, num_classes: int, widths: Sequence[int] = (128, 64)) -> nn.Sequential:
    """The paper code's vision aux net (``conv128_bn_conv64_bn_gbpl_fc``): (3x3 conv, BN, ReLU)
    per width, global average pool, linear."""
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Conv2d(in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        in_channels = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)


def resnet_aux_heads(
    stages: Sequence[nn.Module], num_classes: int, widths: Sequence[int] = (128, 64)
) -> list[nn.Sequential]:
    """One :func:`conv_aux_head` per stage but the last. A ResNet stage's output width is the
    width of its last BatchNorm2d (block bn2/bn3 or downsample BN, or the stem's bn1)."""
    heads = []
    for stage in stages[:-1]:
        bns = [m for m in stage.modules() if isinstance(m, nn.BatchNorm2d)]
        if not bns:
            raise ValueError("cannot infer a stage's output channels: it has no BatchNorm2d")
        heads.append(conv_aux_head(bns[-1].num_features, num_classes, widths))
    return heads


def decoder_aux_heads(model: nn.Module, num_stages: int, init_from_lm_head: bool = True) -> list[nn.Sequential]:
    """One (final-norm copy, vocabulary linear) head per stage but the last; the linear starts
    as a copy of the real lm_head (``init_from_lm_head``) or fresh N(0, initializer_range)."""
    heads = []
    for _ in range(num_stages - 1):
        linear = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        with torch.no_grad():
            if init_from_lm_head:
                linear.weight.copy_(model.lm_head.weight)
            else:
                linear.weight.normal_(0.0, model.config.initializer_range)
        heads.append(nn.Sequential(copy.deepcopy(model.model.norm), linear))
    return heads


class SampledLogits(NamedTuple):
    """A decoder head's logits at a subset of positions (`PositionSubsetHead`)."""

    logits: Tensor
    """(batch, len(positions), vocabulary)."""
    positions: Tensor
    """Positions t in [0, of): the logits at t predict token t + 1."""
    of: int
    """The positions they were drawn from: the sequence length − 1."""


class PositionSubsetHead(nn.Module):
    """A decoder aux head that, while training, reads a seeded random subset of `fraction` of the token
    positions (the same for every row of a micro-batch, drawn afresh at each call): the head (a final
    norm and a vocabulary-wide linear, 3–5× the forward of the layers under it) costs that fraction.
    `causal_lm_loss` weights the subset so that its expectation is the loss over every position. In
    eval mode it reads every position."""

    def __init__(self, head: nn.Module, fraction: float, seed: int):
        super().__init__()
        self.head, self.fraction, self.seed, self.draws = head, fraction, seed, 0

    def positions(self, length: int) -> Tensor:
        """This call's positions among `length`, sorted: the `draws`-th draw of the head's seed."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.draws)
        self.draws += 1
        count = max(1, round(self.fraction * length))
        return torch.randperm(length, generator=generator)[:count].sort().values

    def forward(self, h: Tensor) -> Tensor | SampledLogits:
        if not self.training or self.fraction >= 1:
            return self.head(h)
        at = self.positions(h.shape[1] - 1).to(h.device)
        return SampledLogits(self.head(h[:, at]), at, h.shape[1] - 1)


def causal_lm_loss(logits: Tensor | SampledLogits, labels: Tensor) -> Tensor:
    """Next-token cross-entropy (labels shifted inside, -100 ignored), as HF causal LMs;
    half-precision logits are upcast to float32 first. `SampledLogits`: the sum over the sampled
    positions times of/len(positions), over the count of every position's valid labels, whose
    expectation over the draw is the mean over every position exactly (each position is in the subset
    with probability len(positions)/of)."""
    if isinstance(logits, SampledLogits):
        shifted = labels[:, 1:]
        sampled = logits.logits.flatten(0, 1).to(torch.promote_types(logits.logits.dtype, torch.float32))
        total = F.cross_entropy(sampled, shifted[:, logits.positions].flatten(), ignore_index=-100, reduction="sum")
        return total * (logits.of / len(logits.positions)) / (shifted != -100).sum()
    logits = logits[:, :-1].flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)


def aux_heads(
    model: nn.Module,
    stages: Sequence[nn.Module],
    family: str,
    num_classes: int | None,
    widths: Sequence[int],
    init_from_lm_head: bool,
    positions: float = 1.0,
    seed: int = 0,
) -> list[nn.Module]:
    """An auxiliary head for every stage but the last: conv heads for CNNs, LM heads for decoders (read on
    a `positions` fraction of the tokens while training, head k's draws seeded by `seed` + k)."""
    if family == "timm":
        return resnet_aux_heads(stages, num_classes, widths)
    heads = decoder_aux_heads(model, len(stages), init_from_lm_head)
    return heads if positions >= 1 else [PositionSubsetHead(h, positions, seed + k) for k, h in enumerate(heads)]


LOSSES = {"cross_entropy": F.cross_entropy, "causal_lm": causal_lm_loss}
"""A stage's head loss, by name (what travels to a stage actor)."""
LOSS_OF_FAMILY = {"timm": "cross_entropy", "hf_causal_lm": "causal_lm"}
