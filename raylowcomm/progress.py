"""One progress view on the driver, fed by what each strategy reports while it trains (step of
the planned steps, train loss, bytes sent so far): a bar with its ETA on a terminal, and about
ten plain log lines per strategy elsewhere (a job's log, CI), so that every line appears once."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("raylowcomm")


class ProgressView:
    def __init__(self, bar: bool | None = None):
        self.use_bar = sys.stderr.isatty() if bar is None else bar
        self.name, self.bar, self.logged = None, None, -1

    def update(self, strategy: str, metrics: dict) -> None:
        step, total = metrics.get("step"), metrics.get("steps")
        if step is None:
            return
        if strategy != self.name:
            self.close()
            self.name, self.logged = strategy, -1
            if self.use_bar:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=strategy, unit="step", dynamic_ncols=True, file=sys.stderr)
        parts = {}
        if "train_loss" in metrics:
            parts["loss"] = f"{metrics['train_loss']:.4f}"
        if "bytes" in metrics:
            parts["sent"] = f"{metrics['bytes'] / 1e6:,.1f} MB"
        if self.bar is not None:
            self.bar.total = total or self.bar.total
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(step - self.bar.n)
        elif total is None or step == total or step * 10 // total > self.logged:
            self.logged = step * 10 // total if total else step
            logger.info("[%s] step %s%s %s", strategy, step, f"/{total}" if total else "",
                        " ".join(f"{k} {v}" for k, v in parts.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None
