"""The measured frontier's warnings (`FRONTIER`): an explicit setting on the wrong side of what was measured
for the run's length is said in one line, with the dial off or on (`dial.resolve`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from raylowcomm.strategies.lofi.config import LofiConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Frontier:
    """A setting measured on the wrong side for runs of `kind` over `lo` up to `hi` (in `unit`, steps or
    epochs a node): `wrong` says whether the options hold it, `says` what was measured."""

    kind: str
    unit: str
    lo: float
    hi: float
    wrong: Callable[[LofiConfig], bool]
    says: str


def period_of(o) -> int | None:
    """`average_every` where it is one number of steps or epochs, else None."""
    return o.average_every if isinstance(o.average_every, int) else None


FRONTIER = (
    Frontier(
        "batchnorm",
        "steps",
        0,
        90,
        lambda o: o.compress == "topk" and (period_of(o) or 99) <= 8,
        "compress: topk every <= 8 steps on a BatchNorm vision model at under ~90 steps a node: measured "
        "-7.7 ± 7.5 points from DDP (top-k 3% every 6, 5 seeds) against -0.3 ± 2.3 for int2 every 8 with "
        "compress_block: 128 and dense: [head, vectors] (8 seeds)",
    ),
    Frontier(
        "batchnorm",
        "steps",
        0,
        90,
        lambda o: o.compress == "int4" and (period_of(o) or 0) >= 16,
        "compress: int4 every >= 16 steps on a BatchNorm vision model at under ~90 steps a node: measured "
        "-9.1 ± 7.2 points from DDP against -0.3 ± 2.3 for int2 every 8 with compress_block: 128 and "
        "dense: [head, vectors] (8 seeds)",
    ),
    Frontier(
        "batchnorm",
        "steps",
        90,
        math.inf,
        lambda o: o.compress == "int2",
        "compress: int2 on a BatchNorm vision model at over ~90 steps a node: measured -1.5 ± 4.3 points "
        "from DDP at 1/109 of its bytes (3 seeds) against -0.4 ± 1.6 at 1/428 for top-k 3% every 6 (8 seeds)",
    ),
    Frontier(
        "language",
        "epochs",
        0,
        1.5,
        lambda o: o.compress == "int4" and o.average_every is None,
        "one int4 average of a language model trained for about one epoch: measured -1.4 ± 1.5 points from "
        "DDP against -0.5 ± 2.2 for one int4 round halfway (average_every: half the steps), for the same "
        "bytes (6 seeds)",
    ),
)
"""What the warnings say: the settings the decision table advises against for the run's length."""


def warn_off_frontier(o: LofiConfig, given: set[str], run) -> None:
    """One warning line where the user's `compress` is on the wrong side of the measured frontier for
    the run's length."""
    if "compress" not in given:
        return
    kind = {"other": "language"}.get(run.kind, run.kind)
    for f in FRONTIER:
        length = run.steps if f.unit == "steps" else run.epochs
        if f.kind == kind and f.lo < length <= f.hi and f.wrong(o):
            logger.warning("[lofi] %s; this run: %d steps a node. Try lofi.dial: auto", f.says, run.steps)
