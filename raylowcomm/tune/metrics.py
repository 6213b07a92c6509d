"""The metrics a trial reports to Tune, known from its config before Ray starts, so that a sweep
whose `metric` (or a column, or ASHA's metric) no trial reports stops at once with one line naming
it and the metrics that exist, not after a whole trial ran.

A trial (`trials._trial`) reports each strategy's progress while it trains (`ctx.report`: step,
steps, bytes, train_loss, and the curve's evaluations), then the strategy's record metrics (its
evaluation sets' metrics, named by `tasks.metric_names` itself: id_*, val_*, shift_* and shift/<name>_*,
each * a metric of the task's `summarize`) with total_bytes, wall_s and ray_nodes_used; with several
strategies every name is prefixed by its strategy (lofi/id_accuracy). Tune adds its own counters.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from pathlib import Path

from raylowcomm import catalog
from raylowcomm.config import RunConfig

PROGRESS = ("step", "steps", "bytes", "train_loss")
"""What every strategy reports while it trains (ctx.report)."""
FINISHED = ("total_bytes", "wall_s", "ray_nodes_used")
"""What a trial reports beside a finished strategy's record metrics."""
TUNE = ("training_iteration", "time_total_s", "time_this_iter_s")
"""Tune's own counters, in every result of every trial."""


def task_metrics(cfg: RunConfig) -> set[str]:
    """The metrics the run's task scores (accuracy and loss; a language model's loss and perplexity),
    read off each task's own `summarize`; every task's where only the data's schema tells the task."""
    from raylowcomm.tasks import TASK_CLASSES, ImageClassification

    classes = {"image_classification": ImageClassification, **TASK_CLASSES}
    kind = catalog.declared_kind(cfg.data.name, cfg.data.source, cfg.data.columns)
    task = catalog.task_of(cfg.model.family, kind) if kind is not None else None
    ones = defaultdict(lambda: 1)  # any sums: only the names of what summarize makes of them count here
    chosen = [classes[task]] if task in classes else list(classes.values())
    return {name for cls in chosen for name in cls.summarize(ones)}


def eval_sets(cfg: RunConfig) -> list[str]:
    """The run's evaluation sets, named as the driver holds them: test, val (data.val_size), and
    shift/<name> for each shift set (a preset's with data.shift auto, or the user's own)."""
    data = cfg.data
    if data.shift == "auto":
        preset = catalog.DATASETS.get(data.name) if data.source is None else None
        shifts = list(preset.shift) if preset is not None else []
    else:
        shifts = [] if data.shift == "none" else list(data.shift)
    return ["test"] + (["val"] if data.val_size else []) + [f"shift/{s}" for s in shifts]


def strategy_metrics(cfg: RunConfig) -> set[str]:
    """What one strategy of `cfg` reports, unprefixed: its progress, its record metrics (named by the
    records' own `tasks.metric_names`), its totals."""
    from raylowcomm.tasks import metric_names

    task = task_metrics(cfg)
    scored = metric_names({name: dict.fromkeys(task, 0.0) for name in eval_sets(cfg)})
    return set(PROGRESS) | set(FINISHED) | set(scored)


def reported(cfg: RunConfig) -> set[str]:
    """Every metric name a trial of `cfg` reports to Tune."""
    own = strategy_metrics(cfg)
    names = own if len(cfg.strategies) == 1 else {f"{s}/{m}" for s in cfg.strategies for m in own}
    return names | set(TUNE)


def unreported(path: Path, named: list[tuple[str, str]], configs: list[RunConfig]) -> str | None:
    """The message for the first of `named` ((where, metric): metric, columns[i], asha.metric) that no
    trial of any of `configs` (the sweep's base and every value it tries) reports, or None."""
    known = set().union(*(reported(c) for c in configs))
    missing = next(((where, m) for where, m in named if m not in known), None)
    if missing is None:
        return None
    own = sorted(set().union(*(strategy_metrics(c) for c in configs)))
    several = sorted({s for c in configs if len(c.strategies) > 1 for s in c.strategies})
    prefixed = f", each after its strategy's name ({', '.join(f'{s}/' for s in several)})" if several else ""
    close = difflib.get_close_matches(missing[1], sorted(known), n=1, cutoff=0.6)
    return (
        f"sweep file {path}: {missing[0]} = {missing[1]!r}: no trial reports it; the trials report "
        f"{', '.join(own)}{prefixed}, and Tune's {', '.join(TUNE)}: name one of these"
        + (f" (did you mean {close[0]!r}?)" if close else "")
    )
