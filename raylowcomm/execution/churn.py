"""Churn injected into a run (`churn:` in a config): slow nodes and preemptions, for benchmarks and
tests. Each node process holds a `Churn` and calls it after every training step; it sleeps where its
node is slow, and where a preemption is due it books the event in storage and exits at once, as a
SIGKILL'd process would (nothing flushed, no checkpoint of that step). A restarted process reads the
booked events and does not fire them again, and a timed one that came due while it was not running
(restarting, or a driver resuming) is skipped, not fired late. The victims and times of `kill_every_s` are drawn from
`churn.seed` (`preemptions`): every replay of a config kills the same nodes at the same times.

What was injected reaches the record from storage (`booked_events`), whoever died in between."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from raylowcomm.config.schema import ChurnConfig, RunConfig
from raylowcomm.storage import Storage

EVENTS = "churn"
"""The strategy's folder in storage that holds one JSON file per injected event."""
START = f"{EVENTS}/start.json"
"""The strategy's start, wall clock: what `kill_every_s` times count from, on every process."""


@dataclass(frozen=True)
class Preemption:
    node: int
    at_s: float | None = None
    """Seconds after the strategy's start (kill_every_s); None: at `at_step`."""
    at_step: int | None = None

    def booked(self, step: int) -> dict:
        """The event as the record books it."""
        when = {"at_step": self.at_step} if self.at_step is not None else {"at_s": self.at_s}
        return {"kind": "kill", "node": self.node, **when, "step": step}

    @property
    def name(self) -> str:
        when = f"step{self.at_step}" if self.at_step is not None else f"s{self.at_s:g}"
        return f"kill_node{self.node}_{when}"


def preemptions(churn: ChurnConfig, nodes: int, seed: int, horizon: int = 10_000) -> list[Preemption]:
    """Every preemption of a run: those at a step, then the i-th of `kill_every_s` (i = 1, 2, ...,
    `horizon`) at i × kill_every_s seconds on a node drawn from the seed (churn.seed, else `seed`)."""
    events = [Preemption(ev.node, at_step=ev.at_step) for ev in churn.kill]
    if churn.kill_every_s:
        draw = random.Random(churn.seed if churn.seed is not None else seed)
        events += [Preemption(draw.randrange(nodes), at_s=i * churn.kill_every_s) for i in range(1, horizon + 1)]
    return events


def mark_start(storage: Storage, prefix: str) -> None:
    """The driver, as a strategy starts (a resumed run keeps the first start)."""
    if not storage.exists(f"{prefix}/{START}"):
        storage.write_json(f"{prefix}/{START}", {"t": time.time()})


def booked_events(storage: Storage, prefix: str) -> list[dict]:
    """The events the nodes booked, in the order they happened."""
    names = [n for n in storage.list(f"{prefix}/{EVENTS}") if n != os.path.basename(START)]
    events = [storage.read_json(f"{prefix}/{EVENTS}/{n}") for n in names]
    return sorted(events, key=lambda e: e["wall_t"])


class Churn:
    """One node process's share of the run's churn: call it with each step's number and duration."""

    @classmethod
    def for_node(cls, cfg: RunConfig, node: int, nodes: int, storage: Storage, prefix: str) -> Churn | None:
        """Node `node`'s churn in strategy `prefix`'s run of `cfg`; None where the run has none."""
        return cls(cfg.churn, node, nodes, cfg.seed, storage, prefix) if cfg.churn.active else None

    def __init__(self, churn: ChurnConfig, node: int, nodes: int, seed: int, storage: Storage, prefix: str):
        self.node, self.storage, self.folder = node, storage, f"{prefix}/{EVENTS}"
        self.factor = next((ev.factor for ev in churn.slow if ev.node == node), 1.0)
        mine = [p for p in preemptions(churn, nodes, seed) if p.node == node]
        self.at_step = {p.at_step: p for p in mine if p.at_step is not None}
        self.timed = sorted((p for p in mine if p.at_s is not None), key=lambda p: p.at_s)
        self.start = storage.read_json(f"{prefix}/{START}")["t"] if self.timed else None
        if self.timed:  # what came due while this process did not run (a restart, a resume) is not fired late
            now = time.time() - self.start
            self.timed = [p for p in self.timed if p.at_s > now]
        self.slept_s = 0.0
        if self.factor > 1 and not storage.exists(self._path("slow")):
            self._book("slow", {"kind": "slow", "node": node, "factor": self.factor})

    @property
    def active(self) -> bool:
        return self.factor > 1 or bool(self.at_step) or bool(self.timed)

    def __call__(self, step: int, step_s: float) -> None:
        """After step `step`, which took `step_s` seconds: sleep where slow, exit where preempted."""
        if self.factor > 1:
            pause = (self.factor - 1) * step_s
            time.sleep(pause)
            self.slept_s += pause
        due = self.at_step.get(step)
        if due is None and self.timed and time.time() - self.start >= self.timed[0].at_s:
            due = self.timed.pop(0)
        if due is not None and not self.storage.exists(self._path(due.name)):
            self._book(due.name, due.booked(step))
            os._exit(1)

    def _path(self, name: str) -> str:
        return f"{self.folder}/{name}.json"

    def _book(self, name: str, event: dict) -> None:
        self.storage.write_json(self._path(name), {**event, "wall_t": time.time()})
