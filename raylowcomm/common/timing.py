"""Clocks every strategy shares: training time with evaluation left out, wall seconds per part of
a run, and the process's peak memory."""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager


class TrainClock:
    """Training time with evaluation (or anything else that is not training) left out: wrap that
    work in `paused()`. Every strategy measures its curve's and record's times with one."""

    def __init__(self) -> None:
        self.start, self.paused_s = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused_s

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t


class Stopwatch:
    """Wall seconds per named part of a strategy's run (actors starting, training, evaluation,
    collection, saving): the record's `details.phases_s`, which says where the time went."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    @contextmanager
    def __call__(self, part: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - t)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = round(self.parts.get(part, 0.0) + seconds, 3)


def _status_bytes(field: str) -> int | None:
    """A memory line of Linux's /proc/self/status (VmRSS, VmHWM) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return None


def rss_bytes() -> int:
    """This process's resident memory now (Linux's VmRSS; 0 where /proc is not there)."""
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, which is this program's own, where
    ru_maxrss keeps the peak of the process it was forked from across exec (a parent that held
    gigabytes shows as this process's peak); ru_maxrss elsewhere."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def best_of(work, repeat: int) -> float:
    """The shortest of `repeat` timed calls of `work`: what a benchmark reports for a piece of work whose
    slower calls are the machine's noise (a first call's warm-up among them)."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return min(times)
