"""Where Ray meets the rest: starting or joining a cluster, actor resources, threads, and where a
process's log lines go (the CLI's, and every actor's)."""

from __future__ import annotations

import logging
import os
import sys

import torch

_package_logger = logging.getLogger("raylowcomm")


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is now (Ray forwards an actor's stdout to the driver)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def log_to_stdout(level: int = logging.INFO) -> None:
    """Send raylowcomm's log lines to stdout (the CLI's process, each actor's), unless logging is
    configured already: then the process's own handlers get them, once."""
    if not _package_logger.handlers and not logging.getLogger().handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _package_logger.addHandler(handler)
    _package_logger.setLevel(level)


def init_ray(num_cpus: int | None = None, verbose: bool = False) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local embedded Ray kept on 127.0.0.1. Unless
    `verbose`, what actors print stays in their log files (the driver's progress view says what
    they do; their errors come back as exceptions) and Ray's own INFO lines are off.

    A Ray already initialised (e.g. by the caller's own `ray.init`) is used as it is. Otherwise
    every actor gets the settings of `raylowcomm.env.job_env` (hub offline unless the user set
    it, Ray Train's polling interval) through the job's runtime_env (where a submitted job's own
    runtime_env sets one, the job's value stands). For the local Ray only, this process's environment gets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and RAY_DEDUP_LOGS=0 unless set (Ray's own processes
    inherit them). Ray reads both once, when `ray` is first imported — and raylowcomm's modules,
    like a user's program, may import ray before this runs — so the values Ray read are set from
    the environment here too; then the local node binds 127.0.0.1 whichever came first.
    """
    import json
    import sys
    import warnings

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    from raylowcomm.env import LOCAL_RAY_DEFAULTS, job_env

    # In a `ray job submit` driver, Ray refuses to merge a variable the job's runtime_env sets too.
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    taken = (job.get("runtime_env") or {}).get("env_vars") or {}
    runtime_env = {"env_vars": {k: v for k, v in job_env().items() if k not in taken}}
    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(
            address=os.environ["RAY_ADDRESS"],
            runtime_env=runtime_env,
            log_to_driver=verbose,
            logging_level=logging.INFO if verbose else logging.WARNING,
        )
        return
    for key, value in LOCAL_RAY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # A local loopback-only cluster needs no token auth.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray._private import ray_constants, ray_logging

    for module, name, key in (
        (ray_constants, "ENABLE_RAY_CLUSTER", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
        (ray_logging, "RAY_DEDUP_LOGS", "RAY_DEDUP_LOGS"),
    ):
        if hasattr(module, name):
            setattr(module, name, os.environ[key].lower() in ("true", "1"))  # as Ray parses it (env_bool)
        else:
            warnings.warn(
                f"this Ray has no {module.__name__}.{name}: {key} counts only if set before `import ray`", stacklevel=2
            )
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=verbose,
        runtime_env=runtime_env,
        logging_level=logging.INFO if verbose else logging.WARNING,
    )


def actor_options(cpus: float, gpus: float, max_restarts: int = 0, resources: dict[str, float] | None = None) -> dict:
    """Resources of a node/stage actor; where it runs is its bundle's business (`execution.Gang`)."""
    opts = {"num_cpus": cpus, "num_gpus": gpus}
    if resources:
        opts["resources"] = dict(resources)
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


def wire_nbytes(obj) -> int:
    """Size Ray's serialiser gives an object (data + metadata): what ray.put stores or a task's
    inline argument or reply carries."""
    import ray

    ser = ray._private.worker.global_worker.get_serialization_context().serialize(obj)
    return ser.total_bytes + len(ser.metadata or b"")
