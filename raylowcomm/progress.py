"""One progress view on the driver, fed by what each strategy reports while it trains (step of
the planned steps, train loss, bytes sent so far): a bar with its ETA on a terminal, and about
ten plain log lines per strategy elsewhere (a job's log, CI), so that every line appears once."""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time

logger = logging.getLogger("raylowcomm")


class ProgressView:
    def __init__(self, bar: bool | None = None):
        self.use_bar = sys.stderr.isatty() if bar is None else bar
        self.name, self.bar, self.logged, self.step = None, None, -1, -1

    def update(self, strategy: str, metrics: dict) -> None:
        step, total = metrics.get("step"), metrics.get("steps")
        if step is None or (strategy == self.name and step < self.step):  # workers' posts and the strategy's own
            return  # reports may arrive out of order
        if strategy != self.name:
            self.close()
            self.name, self.logged, self.step = strategy, -1, -1
            if self.use_bar:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=strategy, unit="step", dynamic_ncols=True, file=sys.stderr)
        again, self.step = step == self.step, step  # a step already shown: its bytes on the bar, not a second line
        parts = {}
        if "train_loss" in metrics:
            parts["loss"] = f"{metrics['train_loss']:.4f}"
        if "bytes" in metrics:
            parts["sent"] = f"{metrics['bytes'] / 1e6:,.1f} MB"
        if self.bar is not None:
            self.bar.total = total or self.bar.total
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(step - self.bar.n)
        elif not again and (total is None or step == total or step * 10 // total > self.logged):
            self.logged = step * 10 // total if total else step
            logger.info(
                "[%s] step %s%s %s",
                strategy,
                step,
                f"/{total}" if total else "",
                " ".join(f"{k} {v}" for k, v in parts.items()),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None


class ProgressBoard:
    """Each worker's latest step and loss while it trains (a zero-CPU actor on the driver's node):
    lo-fi nodes and DDP ranks train for minutes between the driver's calls, so they post here
    and the driver reads it, instead of the view jumping from 0 to done."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.latest: dict[int, tuple] = {}
        self.posts, self.nbytes = 0, 0

    def post(self, worker: int, step: int, steps: int | None, loss: float, nbytes: int) -> None:
        self.latest[worker] = (step, steps, loss)
        self.posts, self.nbytes = self.posts + 1, self.nbytes + nbytes

    def read(self) -> tuple[dict, int, int]:
        return self.latest, self.posts, self.nbytes


class ProgressPoster:
    """A worker's side of the board, called by `train_steps` after every step: at most one post
    every `every_s` seconds (and the last step), fire and forget, with the mean loss since the
    last post. Created on the driver, pickled to the worker with the board's handle."""

    def __init__(self, board, worker: int | None = None, steps: int | None = None, every_s: float = 2.0):
        self.board, self.worker, self.steps, self.every_s = board, worker, steps, every_s
        self._last, self._losses = 0.0, []

    def __call__(self, step: int, loss: float, last: bool = False) -> None:
        self._losses.append(loss)
        now = time.monotonic()
        if not last and now - self._last < self.every_s:
            return
        message = (self.worker, step, self.steps, sum(self._losses) / len(self._losses))
        self.board.post.remote(*message, len(pickle.dumps(message, protocol=5)))
        self._last, self._losses = now, []


class LiveProgress:
    """The driver's side, for a whole run: one board, and a thread that turns the workers' latest
    posts into the followed strategy's `report` each second, once every worker has posted (step:
    the slowest worker's; loss: the workers' mean). Posts are monitoring, not a strategy's
    communication: their count and bytes go to the record's details, outside its ledger (as Ray's
    own heartbeats are)."""

    def __init__(self, every_s: float = 1.0, post_every_s: float = 2.0):
        self.every_s, self.post_every_s, self.report, self._seen = every_s, post_every_s, None, None
        self.steps, self.workers, self._failed = None, 1, False
        self._lock = threading.Lock()

    def __enter__(self) -> LiveProgress:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.board = ray.remote(ProgressBoard).options(num_cpus=0, scheduling_strategy=here).remote()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="raylowcomm-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import ray

        self._stop.set()
        self._thread.join()
        ray.kill(self.board)

    def follow(self, report) -> None:
        """From now on posts are the strategy's that `report` belongs to."""
        import ray

        with self._lock:
            ray.get(self.board.reset.remote())
            self.report, self.steps, self.workers, self._seen = report, None, 1, None

    def expect(self, workers: int, steps: int | None) -> None:
        """The followed strategy's worker count and planned steps (None: the workers' posts say)."""
        self.workers, self.steps = workers, steps

    def poster(self, worker: int | None = None, steps: int | None = None) -> ProgressPoster:
        return ProgressPoster(self.board, worker, steps, self.post_every_s)

    def details(self) -> dict:
        """The followed strategy's posts so far: how many, and their bytes."""
        import ray

        _, posts, nbytes = ray.get(self.board.read.remote())
        return {"progress_posts": posts, "progress_bytes": nbytes}

    def _pump(self) -> None:
        import ray

        while not self._stop.wait(self.every_s):
            with self._lock:
                try:  # the view must never stop a run: a failed read or report is said once, and the run goes on
                    latest, _, _ = ray.get(self.board.read.remote(), timeout=10)
                    if len(latest) < self.workers or self.report is None or tuple(latest.items()) == self._seen:
                        continue
                    self._seen = tuple(latest.items())
                    steps = self.steps or max((s for _, s, _ in latest.values() if s), default=None)
                    self.report(
                        {
                            "step": min(step for step, _, _ in latest.values()),
                            **({"steps": steps} if steps else {}),
                            "train_loss": sum(loss for _, _, loss in latest.values()) / len(latest),
                        }
                    )
                except Exception as err:
                    if not self._failed:
                        logger.warning(
                            "live progress: %s: %s (the strategies' own reports go on)", type(err).__name__, err
                        )
                    self._failed = True


class NoLiveProgress:
    """Where no one watches live (a Tune trial, tests): workers get no poster."""

    def expect(self, workers: int, steps: int | None) -> None:
        pass

    def poster(self, worker: int | None = None, steps: int | None = None) -> None:
        return None
