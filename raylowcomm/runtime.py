"""Where Ray meets the rest: starting or joining a cluster, actor resources, threads."""

from __future__ import annotations

import os

import torch


def init_ray(num_cpus: int | None = None) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local embedded Ray kept on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    # A local loopback-only cluster (see raylowcomm/__init__.py) needs no token auth.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


def actor_options(cpus: float, gpus: float, max_restarts: int = 0, placement: str = "PACK",
                  resources: dict[str, float] | None = None) -> dict:
    """Options of a node/stage actor. Inside a reservation (a Tune trial's placement group) the
    actor is captured by it and the reservation's strategy decides where it runs."""
    import ray

    opts = {"num_cpus": cpus, "num_gpus": gpus}
    if resources:
        opts["resources"] = dict(resources)
    if placement == "SPREAD" and ray.util.get_current_placement_group() is None:
        opts["scheduling_strategy"] = "SPREAD"
    if max_restarts:
        opts.update(max_restarts=max_restarts, max_task_retries=max_restarts)
    return opts


def setup_threads(cpus: float) -> None:
    """Ray only sets OMP_NUM_THREADS when unset, and not interop threads: be explicit."""
    n = max(1, int(cpus))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # only settable before the first parallel op; fine if already set
        pass


def device_for(gpus: float) -> str:
    return "cuda" if gpus > 0 and torch.cuda.is_available() else "cpu"
