"""Calibrating from a config: its strategies run here for a few steps on the local Ray, and what they
measured stands for the whole run (its steps, and its rounds in proportion to them)."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path

from raylowcomm.planner.calibrate import costs_of
from raylowcomm.planner.costs import Cost

logger = logging.getLogger(__name__)


def calibrate_config(path: Path, steps: int) -> list[Cost]:
    """Each strategy's Cost for the config's full run, from a run of `steps` steps (at least two of lo-fi's
    rounds, where it averages): per-step compute and bytes as measured, the full run's steps, rounds scaled."""
    from raylowcomm.common.batches import steps_per_epoch
    from raylowcomm.runner import prepare, run
    from raylowcomm.strategies import load_config
    from raylowcomm.strategies.lofi import Lofi
    from raylowcomm.strategies.lofi.config import round_gaps
    from raylowcomm.strategies.spsa import Spsa
    from raylowcomm.training import total_steps

    cfg = load_config(str(path), [])
    with tempfile.TemporaryDirectory(prefix="raylowcomm-plan-") as tmp:
        train = prepare(cfg, Path(tmp) / "check").data.train
        sizes = train.sizes(cfg.nodes.count)
        if not sizes:
            raise KeyError("data.node_files: only the nodes know their shards; calibrate from a run folder instead")
        full = total_steps(cfg.optim, min(sizes))
        lengths = {  # the full run's steps: interlocking's batches run over the whole set, SPSA's may be its own
            "interlocking": total_steps(cfg.optim, train.sizes(1)[0]),
            "spsa": (Spsa.opts(cfg).steps if "spsa" in cfg.strategies else None) or full,
        }
        short = steps
        if "lofi" in cfg.strategies:
            gaps = round_gaps(Lofi.opts(cfg), steps_per_epoch(min(sizes), cfg.optim.batch_size))
            short = max(short, 2 * gaps[0] if gaps else 0)
        cfg.optim.max_steps, cfg.eval_every = min(full, short), 0
        logger.info("plan: calibrating on %d of the run's %d steps", cfg.optim.max_steps, full)
        costs = costs_of(run(cfg, Path(tmp) / "run"))
    return [replace(cost.for_steps(lengths.get(cost.strategy, full)), curve=[]) for cost in costs]
