"""What an SPSA run records beyond every strategy's fields: its `details` (the recipe, the bytes a step
moved, on the wire and as codes, and where a step's time went)."""

from __future__ import annotations

from raylowcomm.config import RunConfig
from raylowcomm.strategies.spsa.config import SpsaConfig
from raylowcomm.strategies.spsa.counts import DriverCounts


def run_details(
    cfg: RunConfig,
    opts: SpsaConfig,
    counts: DriverCounts,
    steps: int,
    infos: list[dict],
    *,
    step0: dict,
    budget: dict | None,
    codec_bytes: int,
    node_forwards: int,
    slots: int,
    relay_bytes: int,
    curve_eval_s: float,
) -> dict:
    """The record's `details` after ``steps`` steps: the options, the driver's ``counts`` per step, and
    the nodes' largest compute and replay seconds (their ``infos``); ``step0``: the metrics before the
    first step; ``budget``: where a run on optim.budget_s stopped."""
    compute, replay = (max((i[key] for i in infos), default=0.0) for key in ("compute_s", "replay_s"))
    total = {key: sum(values) for key, values in counts.per_step.items()}
    return {
        **({"budget": budget} if budget else {}),
        "step0_metrics": step0,
        "steps": steps,
        "codec": opts.codec,
        "codec_bytes": codec_bytes,
        "perturbation": opts.perturbation,
        "samples_per_node_step": opts.samples,
        "estimator": opts.estimator,
        "step_rule": opts.step,
        "density": opts.density,
        "forwards": counts.forwards,
        "forwards_per_node_step": node_forwards,
        "lr": opts.lr or cfg.optim.lr,
        "eps": opts.eps,
        "shard_slots": slots,
        "verified": counts.verified,
        "grad_bytes": total["payload"],
        "grad_wire_bytes": total["wire"],
        "grad_relay_bytes": relay_bytes,
        "payload_bytes_per_step": total["payload"] / steps,
        "wire_bytes_per_step": total["wire"] / steps,
        "control_wire_bytes_per_step": total["control"] / steps,
        "mean_step_s": total["wall"] / steps,
        "curve_eval_s": curve_eval_s,
        "mean_compute_s": compute / steps,
        "mean_replay_s": replay / steps,
        "mean_exchange_s": max(0.0, (total["wall"] - compute - replay) / steps),
    }
