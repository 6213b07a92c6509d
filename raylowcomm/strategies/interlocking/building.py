"""Interlocking's stages as the driver builds them before any actor starts: the driver's copy of the
model (its lm_head untied from the embedding), split depth-wise into K modules by `balance` or
`split`, an aux head beside every stage but the last, and stage 0's source of micro-batches. One
function for `Interlocking.run` and for the benchmarks that time the same stages in process
(benchmarks/interlocking_schedule.py), so both always build exactly the same thing."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from raylowcomm.common.batches import Source, batch_at
from raylowcomm.core.interlock.heads import aux_heads
from raylowcomm.core.interlock.splitting import measure_balance, split_model, untie_lm_head
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.interlocking.config import InterlockingConfig
from raylowcomm.tasks import make_task


@dataclass
class Stages:
    """What `build_stages` returns: the parts the stage actors are loaded with, and how they were cut."""

    model: nn.Module
    """The driver's float copy of the model, its modules shared with `modules`: final weights land in it."""
    modules: list[nn.Module]
    """One per stage, in order."""
    heads: list[nn.Module]
    """The aux heads, one per stage but the last."""
    source: Source
    """Stage 0's micro-batches and the evaluation sets (the training rows are read where stage 0 runs)."""
    balance: object
    """The balance the split used: interlocking.balance, or the costs it measured (`measure_balance`)."""
    untied: bool
    """Whether the decoder's lm_head was untied from its input embedding before the split."""
    family: str
    """The model's family (`ModelSpec.family`): how it was split."""


def stage_source(ctx: RunContext) -> Source:
    """One stream of batches from one source, with the driver's evaluation sets: stage 0 reads the
    training rows (`Source.train`) on its own host."""
    cfg, task = ctx.cfg, ctx.data.task
    return Source(
        "image" if ctx.spec.family == "timm" else "tokens",
        None,
        ctx.eval_sets(),
        cfg.optim.batch_size,
        cfg.seed,
        task.image_size,
        cfg.eval_rows,
        task.mean,
        task.std,
    )


def build_stages(ctx: RunContext, opts: InterlockingConfig) -> Stages:
    """The K stages of the run of ``ctx`` (options ``opts``). A measured balance (no fixed split) is
    timed on a micro-batch of the test set: the driver holds no training row."""
    cfg, family = ctx.cfg, ctx.spec.family
    model = copy.deepcopy(ctx.load_driver_weights()).float().train()
    untied = family == "hf_causal_lm" and untie_lm_head(model)
    source, balance = stage_source(ctx), opts.balance
    if opts.balance == "measured" and opts.split is None:
        size = cfg.optim.batch_size // opts.micro_batches
        x = make_task(ctx.data.task).inputs(batch_at(ctx.data.eval_sets["test"], 0, size, cfg.seed))
        balance = measure_balance(model, family, x, ctx.spec.num_classes, opts.aux_widths, cfg.nodes.cpus)
    modules = split_model(model, family, opts.stages, balance, opts.split)
    heads = aux_heads(
        model,
        modules,
        family,
        ctx.spec.num_classes,
        opts.aux_widths,
        opts.aux_init_from_lm_head,
        opts.aux_positions,
        cfg.seed,
    )
    return Stages(model, modules, heads, source, balance, untied, family)
