"""Interlocking's options (the `interlocking:` section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raylowcomm.config.applicability import always, needs


@dataclass
class InterlockingConfig:
    stages: int = 2
    """K: depth-wise stages, one actor each (nodes.cpus / nodes.gpus per stage)."""
    n: int = 1
    """Communication width, 1..stages: a head's loss trains at most n stages (`width` in the code)."""
    rule: Literal["farthest", "sum"] = "farthest"
    """farthest: stage k learns from the loss of the farthest head within n stages (n = stages:
    end-to-end backprop); sum: from the sum of those heads' losses."""
    micro_batches: int = 4
    """Micro-batches per optimizer step, in flight together; optim.batch_size is split evenly."""
    balance: Literal["blocks", "params", "measured"] = "measured"
    """How units (stem + blocks / decoder layers) group into stages; measured: by timed forward +
    backward, aux heads included."""
    split: list[int] | None = None
    """Units per stage, fixed (e.g. to compare n on one split); overrides balance."""
    aux_widths: list[int] = field(default_factory=lambda: [128, 64])
    """ResNet aux heads: (3x3 conv, BN, ReLU) widths before pool + linear."""
    aux_init_from_lm_head: bool = True
    """Decoder aux heads: a copy of the final norm + lm_head (false: random)."""
    aux_positions: float = 1.0
    """Decoder aux heads: the fraction of token positions their loss reads while training, a seeded subset
    drawn afresh for each micro-batch and weighted so that the loss's expectation is the loss over every
    position (`core/interlock/heads.PositionSubsetHead`): the head, a vocabulary-wide linear, costs that
    fraction. 1: every position. Scoring reads every position either way."""
    time_budget_s: float | None = None
    """Stop submitting batches after this many seconds of training (in-flight ones finish)."""
    max_batches_ahead: int = 2
    """Batches in flight beyond the oldest unreported one (bounds memory, not a barrier). With
    `overlap`, also how many batches a stage holds at once."""
    overlap: bool = False
    """A stage runs the forwards of the next max_batches_ahead − 1 batches before the backwards of
    the one whose gradient messages are still on their way, so it computes while they travel. Each
    such forward keeps the weights it ran with until its backward (a copy of the stage's weights
    per batch ahead, PipeDream's weight stashing) and its gradient is applied a step or more later:
    an update from weights up to max_batches_ahead − 1 steps old, on the stages that wait for
    messages. false: each batch's calls in turn, every update from the current weights. With
    max_batches_ahead = 1 both orders are the same."""

    @property
    def width(self) -> int:
        """The communication width: the config's `n` (the paper's name), not a count of nodes."""
        return self.n


OPTION_RULES = {
    "stages": always,
    "n": always,
    "rule": needs(
        lambda cfg, o: o.n > 1, "chooses among the heads within n stages, and n is 1: set interlocking.n > 1"
    ),
    "micro_batches": always,
    "balance": needs(lambda cfg, o: o.split is None, "interlocking.split fixes the stages: remove one of the two"),
    "split": always,
    "aux_widths": needs(
        lambda cfg, o: cfg.model.family == "timm", "sizes a CNN's aux heads; a decoder's copy its final norm and head"
    ),
    "aux_init_from_lm_head": needs(
        lambda cfg, o: cfg.model.family == "hf_causal_lm", "starts a decoder's aux heads; this model is a CNN"
    ),
    "aux_positions": always,  # Interlocking.validate: decoders only
    "time_budget_s": needs(
        lambda cfg, o: cfg.optim.budget_s is None, "optim.budget_s is the run's budget and wins: remove one of the two"
    ),
    "max_batches_ahead": always,
    "overlap": needs(
        lambda cfg, o: o.max_batches_ahead > 1,
        "runs the next batches' forwards early, and max_batches_ahead is 1: raise it, or remove overlap",
    ),
}
"""When each interlocking option can take effect (`config.applicability`)."""
