"""TensorBoard event files for every run: ``OUT/tensorboard/<strategy>/``.

View them with ``tensorboard --logdir OUT/tensorboard``: one TensorBoard "run" per strategy, so
lo-fi, DDP, SPSA and interlocking share every chart.

Two sources feed it:

- ``progress(strategy, metrics)`` — what a strategy reports while it trains (``RunContext.report``:
  ``{"step": 10, "train_loss": 0.3}``, sometimes with evaluation metrics). Written at once, with
  the real time of the call, so the curves grow while the run is going.
- ``record(record)`` — the finished strategy's ``RunRecord.to_dict()``: every learning-curve point
  (``curve_point``: step, training wall time, samples, bytes so far, id_*/shift_* metrics; SPSA's
  also forward passes so far) and
  the final metrics and byte totals. A record with ``"error"`` writes nothing.

Tags (stable; ``<m>`` is a metric name as the strategy reports it, e.g. ``id_accuracy``,
``shift_loss``, ``val_accuracy``):

====================================  ======================================  ====================
tag                                   value                                   horizontal axis
====================================  ======================================  ====================
``train/loss``                        ``train_loss`` (``train_<x>`` →         step
                                      ``train/<x>``)
``eval/<m>``                          evaluation metric                       step
``comm/bytes_sent``                   bytes sent so far, all phases           step
``train/samples_seen``                training samples seen by all nodes      step
``train/forwards``                    forward passes run by all nodes (SPSA's step
                                      curve points carry them)
``eval_vs_time/<m>``                  evaluation metric                       training wall time, ms
``comm_vs_time/bytes_sent``           bytes sent so far, all phases           training wall time, ms
``final/<m>``                         the record's final metrics              last curve step
``final/total_bytes``                 ledger total                            last curve step
``final/bytes_<phase>``               ledger total per phase (setup, train,   last curve step
                                      final, ...)
``final/train_s``, ``final/wall_s``   seconds training / for the whole        last curve step
                                      strategy
====================================  ======================================  ====================

How time is shown. A TensorBoard scalar only has a step (an integer) and a wall-clock time, and its
"Relative" axis measures from each series' *first* point, which would drop the offset of the first
evaluation. So the ``*_vs_time/`` families put the curve's training wall time (evaluation excluded,
as in ``curve_point``) in the step, in **milliseconds** (``global_step = round(wall_s * 1000)``):
with the default "Step" axis their x is exact and lines of different strategies compare directly.
The step-indexed points taken from the curve carry ``walltime = t0 + wall_s`` (``t0``: when this
log first wrote for the strategy), so the "Wall"/"Relative" axes are roughly right for them too;
``train/loss`` carries the real time of each report, so its "Relative" axis is the elapsed time of
training as the driver saw it (evaluation pauses included) — the curve has no training loss to put
on the exact time axis.

An evaluation metric already written live by ``progress`` at a step is not written again from the
curve (the same step would otherwise show two points); the bytes, samples and time-axis tags come
from the curve only (a ``train_<x>`` key in a curve point goes to ``train/<x>`` and
``train_vs_time/<x>``). A strategy that fails after reporting progress keeps its live points.
Values are stored as float32, as TensorBoard does (bytes above 16 MB lose their last digits).
"""

from __future__ import annotations

import threading
import time
from numbers import Real
from pathlib import Path
from typing import Any

TIME_SCALE = 1000
"""Step units per second of training wall time in the ``*_vs_time/`` tags (milliseconds)."""

_CURVE_AXES = ("step", "steps", "wall_s", "samples", "bytes")  # "steps": the planned total, for progress bars


def metric_tag(key: str) -> str:
    """The step-indexed tag of a reported metric: ``train_<x>`` → ``train/<x>``, else ``eval/<key>``."""
    return f"train/{key[len('train_') :]}" if key.startswith("train_") else f"eval/{key}"


def time_tag(key: str) -> str:
    """The time-indexed tag of a curve metric: ``eval_vs_time/<key>`` (``train_<x>`` → ``train_vs_time/<x>``)."""
    family, name = metric_tag(key).split("/", 1)
    return f"{family}_vs_time/{name}"


def time_step(wall_s: float) -> int:
    """The ``global_step`` of a point at ``wall_s`` seconds of training in the ``*_vs_time/`` tags."""
    return round(float(wall_s) * TIME_SCALE)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, Real):
        return None
    return float(v)


def _dir_name(strategy: str) -> str:
    name = str(strategy).replace("/", "_").replace("\\", "_").strip()
    return name if name not in ("", ".", "..") else "_"


class TensorBoardLog:
    """OUT/tensorboard/<strategy>/ event files: train loss, evaluation metrics and bytes sent,
    against step and against training wall time; robust rounds' per-node figures against the round.
    One SummaryWriter per strategy, created on the first thing written for it; ``close()`` flushes
    and closes them all (also as a context manager)."""

    def __init__(self, out_dir: str | Path, flush_secs: int = 10):
        self.root = Path(out_dir) / "tensorboard"
        self.flush_secs = flush_secs
        self._writers: dict[str, Any] = {}
        self._t0: dict[str, float] = {}
        self._written: dict[str, set[tuple[str, int]]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ writers

    def log_dir(self, strategy: str) -> Path:
        return self.root / _dir_name(strategy)

    def _writer(self, strategy: str):
        w = self._writers.get(strategy)
        if w is None:
            from torch.utils.tensorboard import SummaryWriter

            w = SummaryWriter(log_dir=str(self.log_dir(strategy)), flush_secs=self.flush_secs)
            self._writers[strategy] = w
            self._t0.setdefault(strategy, time.time())
            self._written.setdefault(strategy, set())
        return w

    # ---------------------------------------------------------------------------------------- API

    def progress(self, strategy: str, metrics: dict) -> None:
        """A strategy's live report: ``{"step": int, "train_loss": float, ...}``. Every numeric key
        but ``step`` is written at that step (``metric_tag``), except the curve axes ``wall_s``,
        ``samples`` and ``bytes``, which come from the record; without a step, nothing is."""
        step = _number(metrics.get("step"))
        if step is None:
            return
        values = {k: x for k, v in metrics.items() if k not in _CURVE_AXES and (x := _number(v)) is not None}
        if not values:
            return
        with self._lock:
            w, written = self._writer(strategy), self._written.setdefault(strategy, set())
            for key, value in values.items():
                tag = metric_tag(key)
                w.add_scalar(tag, value, global_step=int(step))
                written.add((tag, int(step)))

    def record(self, record: dict) -> None:
        """One finished strategy (``RunRecord.to_dict()``): its curve and final figures, then a flush.
        A record with ``"error"`` (or without a strategy) writes nothing."""
        if not isinstance(record, dict) or "error" in record or not record.get("strategy"):
            return
        strategy = record["strategy"]
        curve = [p for p in record.get("curve") or [] if isinstance(p, dict) and _number(p.get("step")) is not None]
        with self._lock:
            w = self._writer(strategy)
            t0, written = self._t0[strategy], self._written[strategy]
            for p in curve:
                self._curve_point(w, p, t0, written)
            last = int(curve[-1]["step"]) if curve else 0
            for key, value in final_figures(record).items():
                w.add_scalar(f"final/{key}", value, global_step=last)
            self._robust_rounds(w, (record.get("details") or {}).get("robust_rounds") or [])
            w.flush()

    @staticmethod
    def _robust_rounds(w, rounds: list[dict]) -> None:
        """Each node's part in each robust round (`details.robust_rounds`, docs/robust.md), by round:
        its Δ's norm, cosine to the round's aggregate, clip factor and whether the round left it out."""
        for r in rounds:
            for row in r.get("nodes") or []:
                tag = f"robust/node{row['node']}"
                for key in ("norm", "cosine", "scale"):
                    value = _number(row.get(key))
                    if value is not None:
                        w.add_scalar(f"{tag}/{key}", value, global_step=int(r["round"]))
                w.add_scalar(f"{tag}/dropped", float(row.get("dropped") is not None), global_step=int(r["round"]))

    @staticmethod
    def _curve_point(w, p: dict, t0: float, written: set) -> None:
        """One learning-curve point: by step, and by wall time where it has one; bytes and samples under
        their own tags; a metric the strategy already reported at that step is not written twice."""
        step = int(p["step"])
        wall = _number(p.get("wall_s"))
        walltime = t0 + wall if wall is not None else None
        ms = time_step(wall) if wall is not None else None
        for key, v in p.items():
            value = _number(v)
            if key in ("step", "wall_s") or value is None:
                continue
            if key == "bytes":
                w.add_scalar("comm/bytes_sent", value, global_step=step, walltime=walltime)
                if ms is not None:
                    w.add_scalar("comm_vs_time/bytes_sent", value, global_step=ms, walltime=walltime)
                continue
            if key in ("samples", "forwards"):
                tag = "train/samples_seen" if key == "samples" else "train/forwards"
                w.add_scalar(tag, value, global_step=step, walltime=walltime)
                continue
            tag = metric_tag(key)
            if (tag, step) not in written:
                w.add_scalar(tag, value, global_step=step, walltime=walltime)
                written.add((tag, step))
            if ms is not None:
                w.add_scalar(time_tag(key), value, global_step=ms, walltime=walltime)

    def close(self) -> None:
        """Flush and close every writer; calling it again is harmless."""
        with self._lock:
            writers, self._writers = self._writers, {}
        for w in writers.values():
            w.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def final_figures(record: dict) -> dict[str, float]:
    """A record's final metrics, total bytes, bytes by phase and times: the final/ scalars."""
    comm = record.get("comm") or {}
    final = {k: x for k, v in (record.get("metrics") or {}).items() if (x := _number(v)) is not None}
    if (x := _number(comm.get("total_bytes"))) is not None:
        final["total_bytes"] = x
    for phase, v in (comm.get("by_phase") or {}).items():
        if (x := _number(v)) is not None:
            final[f"bytes_{phase}"] = x
    for key in ("train_s", "wall_s"):
        if (x := _number(record.get(key))) is not None:
            final[key] = x
    return final
