"""What a run shows and keeps of its strategies as they go: TensorBoard, the progress view,
the caller's callback and OUT/timings.json, fed from the strategy's thread and the live view's."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from raylowcomm.progress import LiveProgress, ProgressView
from raylowcomm.tensorboard import TensorBoardLog


class RunProgress:
    """A run's view of its strategies: each report goes to TensorBoard, the progress view and the
    caller's `progress`, one at a time (the strategy's thread and the live view's both report);
    each record to TensorBoard and timings.json."""

    def __init__(
        self,
        board: TensorBoardLog,
        view: ProgressView,
        live: LiveProgress,
        progress: Callable[[str, dict], None] | None,
        out: Path,
        timings: dict,
    ) -> None:
        self.board, self.view, self.live, self.progress = board, view, live, progress
        self.out, self.timings, self.lock = out, timings, threading.Lock()

    def report_to(self, name: str) -> Callable[[dict], None]:
        def report(metrics: dict) -> None:
            with self.lock:
                self.board.progress(name, metrics)
                self.view.update(name, metrics)
                if self.progress is not None:
                    self.progress(name, metrics)

        self.live.follow(report)
        return report

    def finished(self, name: str, record: dict) -> None:
        if "error" not in record:
            record["details"].update(self.live.details())
        with self.lock:
            self.view.close()
        self.board.record(record)
        self.timings[name] = strategy_timing(record)
        (self.out / "timings.json").write_text(json.dumps(self.timings, indent=2))


def strategy_timing(record: dict) -> dict:
    """Where a strategy's wall time went: training (the strategy's own train_s, evaluation left
    out) and the rest (actors and data out, evaluation, collecting the result), and the parts the
    strategy timed itself (details.phases_s: starting actors, evaluating, collecting, saving)."""
    wall, train = record["wall_s"], record.get("train_s")
    return {
        "wall_s": wall,
        "train_s": train,
        "setup_eval_collect_s": round(wall - train, 3) if train is not None else None,
        "phases_s": record.get("details", {}).get("phases_s", {}),
    }
