"""What an interlocking run records beyond every strategy's fields: its `details` (the pipeline's
shape, step times, each head's metrics, what the driver fetched) and its stages' goodput."""

from __future__ import annotations

from dataclasses import asdict

from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.config import RunConfig
from raylowcomm.core.interlock.splitting import units_per_stage
from raylowcomm.strategies.base import budget_details
from raylowcomm.strategies.interlocking.building import Stages
from raylowcomm.strategies.interlocking.config import InterlockingConfig


def stage_goodput(busy: list[float], train_s: float) -> dict:
    """A stage's useful time is its forwards, backwards and optimizer steps (every one reaches the model:
    a lost stage ends the run); the rest of the training phase it waits for activations or gradients,
    the pipeline's bubble and transfers (`idle_at_barriers_s`)."""
    return goodput([NodeAccount(k, b, max(0.0, train_s - b), 0.0) for k, b in enumerate(busy)], train_s)


def run_details(
    cfg: RunConfig,
    opts: InterlockingConfig,
    built: Stages,
    trained: dict,
    infos: list[dict],
    busy: list[float],
    per_set: dict,
    stage_losses: list[list[float]],
    fetched_eval: dict,
) -> dict:
    """The record's `details`: the stages as built (`built`), the training phase (`trained`, as
    `train_interlocked` returns it, with what the driver fetched), the stages' `infos` and busy seconds,
    each head's final metrics per set and each stage's head losses."""
    K, train_s, batches = opts.stages, trained["train_s"], trained["batches"]
    return {
        "stages": K,
        "n": opts.width,
        "rule": opts.rule,
        "micro_batches": opts.micro_batches,
        "stage_batches": opts.max_batches_ahead if opts.overlap else 1,
        "micro_batch_size": cfg.optim.batch_size // opts.micro_batches,
        "balance": opts.balance,
        "units_per_stage": units_per_stage(built.modules, built.family),
        "batches": batches,
        "step_time_s": train_s / batches if batches else None,
        **(
            {  # it stops submitting at the budget; the batches in flight then finish
                "budget": {
                    **budget_details(cfg.optim.budget_s, trained["stopped_at_s"], batches, trained["last_step_s"]),
                    "train_s_with_batches_in_flight": train_s,
                }
            }
            if cfg.optim.budget_s is not None and "stopped_at_s" in trained
            else {}
        ),
        "steady_step_time_s": max(
            (i["median_step_interval_s"] for i in infos if i["median_step_interval_s"] is not None), default=None
        ),
        "busy_fraction": [b / train_s for b in busy] if train_s > 0 else None,
        "heads": {
            name: {f"head{k}" + ("_final" if k == K - 1 else "_aux"): m for k, m in enumerate(heads_m)}
            for name, heads_m in per_set.items()
        },
        "train_head_loss_last": [v[-1] if v else None for v in stage_losses],
        "driver_fetched": {"train": trained["fetched"], "eval": fetched_eval},
        "lm_head_untied": built.untied,
        **({"measured_costs_s": asdict(built.balance)} if built.balance != opts.balance else {}),
    }
