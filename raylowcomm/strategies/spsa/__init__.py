"""SPSA with shared randomness (MeZO + Just One Byte) on Ray: after the initial broadcast a node
sends one byte per perturbation per step; no weights or gradients ever move. Each step every node
measures g = (L(θ+εz) − L(θ−εz)) / 2ε (or, `estimator: one_sided_batch`, (L(θ+εz) − L(θ)) / ε with
one L(θ) shared) on its own batch for `samples` seeds of (run seed, step, node, sample) and returns
g as a byte inline in its reply (an ObjectRef would cost ~250 B); the
driver relays every node the others' codes inline in `apply`, and each node replays all updates
in (node, sample) order with the DECODED values (`Replica`; `step: normalised` divides them by
their spread, computed from the same decoded values): replicas stay bit-identical,
checked every `verify_every` steps. Nodes leave, die and join at step boundaries (core/membership)
from the latest checkpoint plus the replay log; one shard per slot, `nodes.count + len(join)`.
Bytes: `train/projected_grads` (N·samples·codec B a step), `train/projected_grads_relay` (to the
N−1 others), `train/train_loss` (4 B), `train/control` (publisher lists); `details`: wire bytes and
the forward passes run (`forwards`, also on every curve point).
"""

from __future__ import annotations

import logging
import math
import re
from typing import ClassVar

from raylowcomm.actors import NodeGroup
from raylowcomm.common.ledger import Ledger
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.checks import check_kills
from raylowcomm.core.zo.estimators import check_step_rule
from raylowcomm.core.zo.perturb import mask_threshold, trainable_parameters
from raylowcomm.execution import node_bundle
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
)
from raylowcomm.strategies.spsa.config import NAME, OPTION_RULES, SpsaConfig, check_membership
from raylowcomm.strategies.spsa.driver import SpsaRun
from raylowcomm.strategies.spsa.inprocess import node_batch, planned_steps, step_as_nodes
from raylowcomm.strategies.spsa.node import SpsaNode

__all__ = ["Spsa", "SpsaRun", "node_batch", "planned_steps", "step_as_nodes"]

logger = logging.getLogger(__name__)


class Spsa(Strategy[SpsaConfig]):
    name: ClassVar[str] = NAME
    Config: ClassVar[type] = SpsaConfig
    option_rules: ClassVar[dict] = OPTION_RULES
    ignores: ClassVar[dict[str, str]] = {
        "nodes.max_restarts": "a node that dies leaves the run; new ones join with spsa.join",
        "optim.name": "it steps plain SGD on its zeroth-order estimate",
        "optim.momentum": "it steps plain SGD on its zeroth-order estimate",
        "model.memory_format": "its nodes perturb each weight in memory order, contiguous on every replica",
        "bad_nodes": "every node applies the same seeded update; no round carries one node's outer update",
    }
    fp32_updates: ClassVar[bool] = False  # every replica applies the same seeded update, bf16/fp16 weights alike

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """Joiners may be alive beside the first nodes: reserve a slot for each."""
        return [node_bundle(cfg)] * (cfg.nodes.count + len(Spsa.opts(cfg).join))

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = Spsa.opts(cfg)
        codec_field = "scale" if o.codec == "linear" else "g_min"
        try:
            o.make_codec()
        except ValueError as err:
            raise ConfigError(f"spsa.{codec_field}", getattr(o, codec_field), str(err)) from None
        for name in ("eps", "samples", "verify_every", "lr", "steps"):
            if getattr(o, name) is not None and not getattr(o, name) > 0:
                raise ConfigError(f"spsa.{name}", getattr(o, name), "must be > 0")
        try:
            check_step_rule(o.step, o.samples)
        except ValueError as err:
            raise ConfigError("spsa.samples", o.samples, f"with spsa.step: {o.step}: {err}") from None
        try:
            keep = mask_threshold(o.density)
        except ValueError as err:
            raise ConfigError("spsa.density", o.density, str(err)) from None
        if keep != 256 * o.density:  # the mask keeps round(256 * density) / 256 of the weights
            low, high = math.floor(256 * o.density), math.ceil(256 * o.density)
            raise ConfigError(
                "spsa.density",
                o.density,
                f"a multiple of 1/256 in [1/256, 1]: the nearest are "
                f"{low / 256} ({low}/256) and {high / 256} ({high}/256)",
            )
        for i, pattern in enumerate(o.include or []):
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"spsa.include[{i}]", pattern, f"not a regular expression: {err}") from None
        check_membership(cfg.nodes.count, o, None)  # the steps, where known, at the start of `run`

    @staticmethod
    def check(ctx: RunContext) -> None:
        """churn.kill against SPSA's steps and leaves (`check_kills`); spsa.include must match a weight
        SPSA tunes: the names come from the driver's architecture (weights or not), so a pattern that
        matches none stops the run before Ray starts."""
        opts = Spsa.opts(ctx.cfg)
        sizes = ctx.data.train.sizes(ctx.cfg.nodes.count + len(opts.join))
        steps = planned_steps(ctx.cfg, opts, sizes)
        check_kills(ctx.cfg, steps, {ev.node: ev.step for ev in opts.leave}, "spsa.leave")
        include = opts.include
        if not include:
            return
        try:
            trainable_parameters(ctx.architecture, include)
        except ValueError:
            names = [n for n, _ in trainable_parameters(ctx.architecture)]
            some = names[:: max(1, len(names) // 4)][:4]
            raise ConfigError(
                "spsa.include",
                include,
                f"matches none of the {len(names)} weights SPSA would tune "
                f"(e.g. {', '.join(some)}): give regexes (re.search) of their "
                "names, or null for all",
            ) from None

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts = ctx.cfg, Spsa.opts(ctx.cfg)
        sizes = ctx.data.train.sizes(cfg.nodes.count + len(opts.join))  # one shard per slot; None: the nodes know
        steps = planned_steps(cfg, opts, sizes)
        if steps is not None:
            check_membership(cfg.nodes.count, opts, steps)
        with NodeGroup(SpsaNode, cfg, Ledger(), bundles=self.bundles(cfg)) as group:  # joiners' slots too
            return SpsaRun(ctx, group, steps, opts).run()
