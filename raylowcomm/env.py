"""The process environment raylowcomm wants, set only where it is needed — never at import.

`import raylowcomm` changes nothing: a program that imports it and then runs its own
`ray.init(address=...)`, or loads its own Hugging Face models, behaves exactly as without it.

- Hub access: the CLI entry point (`raylowcomm.cli.main`) and the Python API's
  `raylowcomm.run(cfg)` default the Hugging Face libraries to offline before anything loads a
  model or dataset, and `runtime.init_ray` hands the same values to every actor (runtime_env);
  a value the user set (e.g. HF_HUB_OFFLINE=0 for a hub id in `model.name`) is kept. The same
  runtime_env carries JOB_DEFAULTS (Ray Train's polling interval).
- A local embedded Ray: `runtime.init_ray` keeps it on 127.0.0.1 and stops it folding the nodes'
  progress lines (LOCAL_RAY_DEFAULTS), for the local case only.
"""

from __future__ import annotations

import os
import sys

HUB_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
"""Assets are local files; no loader wanders off to a hub unless the user asks for it."""

JOB_DEFAULTS = {
    # Ray Train's controller polls its workers (by default every few seconds): a DDP run's fit
    # returns only at the first poll after its workers finish, so a shorter interval ends it sooner.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
"""Settings for the actors of a raylowcomm job (its runtime_env), local or on a cluster."""

LOCAL_RAY_DEFAULTS = {
    # A single-node Ray that binds every listener (GCS, raylet, workers) to loopback. Ray reads
    # it when `ray` is imported; runtime.init_ray also corrects the value Ray read (see there).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Progress lines of different nodes differ only in numbers; Ray would fold them into one.
    "RAY_DEDUP_LOGS": "0",
}


def job_env() -> dict[str, str]:
    """What every actor of the job gets: the hub settings and JOB_DEFAULTS, the user's value
    where set, else the default (offline for the hub)."""
    return {key: os.environ.get(key, default) for key, default in {**HUB_DEFAULTS, **JOB_DEFAULTS}.items()}


def set_hub_defaults() -> None:
    """Default this process's Hugging Face loaders to offline (values already set are kept).
    Takes effect for libraries not imported yet: call it before loading anything."""
    for key, default in HUB_DEFAULTS.items():
        os.environ.setdefault(key, default)


def quiet_loaders(hf_model: bool) -> None:
    """Off unless --verbose: datasets' progress bars and, for a Hugging Face model (or where the
    caller imported transformers), transformers' bars and load report (a new head's weights
    "MISSING" is what fine-tuning expects); their errors still show. A timm run does not pay
    transformers' import (over a second) for this."""
    import datasets

    datasets.disable_progress_bars()
    if hf_model or "transformers" in sys.modules:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
