"""`lofi.secure` (secure aggregation, `core.secagg`) against the rest of a run's options: before anything
starts, the combinations in which masked codes cannot add, a node's own update would cross in the clear
beside them, or the sum would reveal one node's update, refused in one line naming both fields; on the
loaded model, what still crosses in the clear named in the log."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.averaging import batchnorm_layers
from raylowcomm.core.secagg import MIN_NODES
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.option_groups import OptionGroup
from raylowcomm.strategies.lofi.payload import crossing
from raylowcomm.strategies.lofi.privacy import value_of

if TYPE_CHECKING:
    from raylowcomm.strategies.base import RunContext

logger = logging.getLogger(__name__)

_OFF = "or lofi.secure: false"

_REFUSED = (
    (
        "lofi.compress_scale",
        lambda c, o: o.compress_scale != "shared",
        "masks codes that add, and per-node scales do not add: set lofi.compress_scale: shared (with lofi.compress "
        "int8, int4 or int2)",
    ),
    (
        "lofi.aggregate",
        lambda c, o: o.aggregate != "mean",
        "hides each node's Δ, which a robust rule reads: set lofi.aggregate: mean (lofi.privacy.clip bounds each "
        "node's Δ before it is masked)",
    ),
    (
        "lofi.on_bad_payload",
        lambda c, o: o.on_bad_payload != "fail",
        "hides each node's Δ, which dropping a payload screens: set lofi.on_bad_payload: fail",
    ),
    (
        "lofi.weighting",
        lambda c, o: o.weighting != "uniform",
        "adds masked codes as integers, with one weight for every node: set lofi.weighting: uniform",
    ),
    (
        "lofi.overlap",
        lambda c, o: o.overlap > 0,
        "masks a round again among the others when a node is lost, which a round landing during training "
        "cannot wait for: set lofi.overlap: 0",
    ),
    ("lofi.probe_steps", lambda c, o: o.probe_steps > 0, "the probe averages each node's head in the clear: set 0"),
    ("eval_every", lambda c, o: c.eval_every > 0, "the curve fetches each node's own snapshots: set eval_every: 0"),
    ("model.lora", lambda c, o: c.model.lora is not None, "rounds that merge adapters send each node's: remove it"),
)
"""(field, whether the run has it, why secure rounds cannot run with it and the fix)."""


@dataclass(frozen=True)
class SecureOptions(OptionGroup):
    """`lofi.secure` and what it refuses beside it."""

    secure: bool

    def check(self, cfg: RunConfig, exchange: type[Exchange], groups) -> None:
        """`groups`: the run's `options.LofiOptions`. The topology first, then the node count, then `_REFUSED`."""
        if not self.secure:
            return
        o = SimpleNamespace(
            **{k: v for g in (groups.rounds, groups.codec, groups.probe, groups.robust) for k, v in vars(g).items()}
        )
        chosen_later = groups.dial.dial == "auto" and groups.codec.compress == "none"  # the dial's peer rounds
        if not exchange.nodes_keep_rounds and not chosen_later:
            raise ConfigError(
                "lofi.exchange",
                o.exchange,
                "lofi.secure masks the codes of peer rounds, and the driver's star gathers whole weights: set "
                f"lofi.compress (int8, int4 or int2) with lofi.compress_scale: shared, {_OFF}",
            )
        if exchange.paced:
            raise ConfigError(
                "lofi.secure",
                True,
                "quorum rounds (lofi.quorum, sync: time, join, leave or elastic nodes) merge a late payload into "
                "a later round, whose masks were made for other nodes: use lockstep rounds, " + _OFF,
            )
        if cfg.nodes.count < MIN_NODES:
            raise ConfigError(
                "nodes.count",
                cfg.nodes.count,
                f"lofi.secure needs at least {MIN_NODES} nodes: with 2 the sum and one node's own update reveal "
                f"the other's; set nodes.count to 3 or more, {_OFF}",
            )
        for field, present, why in _REFUSED:
            if present(cfg, o):
                raise ConfigError(field, value_of(cfg, o, field), f"not with lofi.secure, which {why}, {_OFF}")

    def check_loaded(self, ctx: RunContext, o) -> None:
        """Floating-point buffers that cross in rounds uncompressed (BatchNorm statistics with
        `bn_recalibrate: false`) would cross in the clear: refused. Recalibrated at the end, the average's
        statistics on each node's shard cross once, in the clear: said in the log."""
        if not self.secure:
            return
        model = ctx.architecture
        params = {k for k, _ in model.named_parameters()}
        buffers = sorted(k for k in crossing(model.state_dict(), o) if k not in params)
        if buffers:
            field, value, fix = ("lofi.secure", True, _OFF[3:])
            if not o.bn_recalibrate and batchnorm_layers(model):
                field, value, fix = ("lofi.bn_recalibrate", False, "set lofi.bn_recalibrate: true, " + _OFF)
            raise ConfigError(
                field,
                value,
                f"with lofi.secure the model's floating-point buffers ({', '.join(buffers[:2])}, ...) would cross "
                f"every round uncompressed, in the clear beside the masked codes: {fix}",
            )
        if batchnorm_layers(model):
            logger.warning(
                "[lofi] secure: the final BatchNorm recalibration sends the per-layer activation means and variances "
                "of the average over each node's own shard in the clear (docs/privacy.md)"
            )
