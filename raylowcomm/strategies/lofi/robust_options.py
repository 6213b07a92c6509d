"""lo-fi's robust-round options (`RobustOptions`, a group of `LofiConfig`'s fields): the rule a peer or
quorum round combines the nodes' Δ with (`lofi.aggregate`, `core.robust`) and what a round does with a
payload it cannot combine (`lofi.on_bad_payload`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.robust import RULES
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.option_groups import OptionGroup


@dataclass(frozen=True)
class RobustOptions(OptionGroup):
    """The round's rule, its κ or β, and what a bad payload does (fail, or drop it from its round)."""

    aggregate: Literal["mean", "clip", "trimmed_mean", "median"]
    clip_kappa: float
    trim: float
    on_bad_payload: Literal["fail", "drop"]
    bad_norm_factor: float
    bad_cosine_factor: float | None

    @property
    def robust(self) -> bool:
        """Whether rounds go through `core.robust.robust_round` (else today's mean, bit for bit)."""
        return self.aggregate != "mean" or self.on_bad_payload == "drop"

    def check(self, cfg: RunConfig, exchange: type[Exchange]) -> None:
        if self.aggregate not in RULES:
            raise ConfigError("lofi.aggregate", self.aggregate, f"choose one of {', '.join(RULES)}")
        if self.on_bad_payload not in ("fail", "drop"):
            raise ConfigError("lofi.on_bad_payload", self.on_bad_payload, "choose fail or drop")
        if not (math.isfinite(self.clip_kappa) and self.clip_kappa > 0):
            raise ConfigError("lofi.clip_kappa", self.clip_kappa, "must be a finite number > 0")
        if not 0 <= self.trim < 0.5:
            raise ConfigError("lofi.trim", self.trim, "must be in [0, 0.5): less than half the weight a side")
        if not (math.isfinite(self.bad_norm_factor) and self.bad_norm_factor >= 1):
            raise ConfigError("lofi.bad_norm_factor", self.bad_norm_factor, "must be a finite number >= 1")
        unlike = self.bad_cosine_factor
        if unlike is not None and not 0 < unlike <= 1:
            raise ConfigError("lofi.bad_cosine_factor", unlike, "must be in (0, 1], or null for no cosine screen")
        if not self.robust:
            return
        field, value = ("lofi.aggregate", self.aggregate)
        if self.aggregate == "mean":
            field, value = ("lofi.on_bad_payload", self.on_bad_payload)
        if not exchange.nodes_keep_rounds:
            raise ConfigError(
                field,
                value,
                "the driver's star (lofi.exchange: driver, or auto without a compress) streams a running sum "
                "of the nodes' weights and never holds each node's update: set lofi.exchange: peers (or a "
                "lofi.compress), or aggregate: mean and on_bad_payload: fail",
            )
        if cfg.model.lora is not None:
            raise ConfigError(
                field,
                value,
                "with model.lora a round merges each node's adapters (lofi.lora_average), not a mean of Δ a "
                "rule could replace: not offered yet; remove model.lora, or aggregate: mean and "
                "on_bad_payload: fail",
            )
