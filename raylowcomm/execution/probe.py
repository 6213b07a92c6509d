"""Asking every host of the cluster a question about its own files, before actors start there:
whether the nodes can load the model's weights themselves (model.source: auto)."""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _answer(check: Callable[[], bool]) -> bool:
    return check() is True


def hosts_without(check: Callable[[], bool], timeout_s: float = 60.0) -> list[str]:
    """Addresses of the live hosts, other than the driver's own, where `check()` is not True: it
    says no, fails, or does not answer within `timeout_s`. One zero-CPU task per host, pinned to
    it; on a local Ray (one host: the driver's) nothing runs."""
    own = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != own]
    if not others:
        return []
    ask = ray.remote(num_cpus=0, max_retries=0)(_answer)
    refs = {
        ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(check): n[
            "NodeManagerAddress"
        ]
        for n in others
    }
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    yes = set()
    for ref in ready:
        try:
            if ray.get(ref):
                yes.add(ref)
        except ray.exceptions.RayError:
            pass
    return sorted(host for ref, host in refs.items() if ref not in yes)
