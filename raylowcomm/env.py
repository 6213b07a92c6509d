"""The process environment raylowcomm wants, set only where it is needed — never at import.

`import raylowcomm` changes nothing: a program that imports it and then runs its own
`ray.init(address=...)`, or loads its own Hugging Face models, behaves exactly as without it.

- Hub access: the CLI entry point (`raylowcomm.cli.main`) and the Python API's
  `raylowcomm.run(cfg)` default the Hugging Face libraries to offline before anything loads a
  model or dataset, and `runtime.init_ray` hands the same values to every actor (runtime_env);
  a value the user set (e.g. HF_HUB_OFFLINE=0 for a hub id in `model.name`) is kept.
- A local embedded Ray: `runtime.init_ray` keeps it on 127.0.0.1 and stops it folding the nodes'
  progress lines (LOCAL_RAY_DEFAULTS), for the local case only.
"""

from __future__ import annotations

import os

HUB_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
"""Assets are local files; no loader wanders off to a hub unless the user asks for it."""

LOCAL_RAY_DEFAULTS = {
    # A single-node Ray that binds every listener (GCS, raylet, workers) to loopback. Ray reads
    # it when `ray` is imported; runtime.init_ray also corrects the value Ray read (see there).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Progress lines of different nodes differ only in numbers; Ray would fold them into one.
    "RAY_DEDUP_LOGS": "0",
}


def hub_env() -> dict[str, str]:
    """The hub settings in effect: the user's value where set, else the offline default."""
    return {key: os.environ.get(key, default) for key, default in HUB_DEFAULTS.items()}


def set_hub_defaults() -> None:
    """Default this process's Hugging Face loaders to offline (values already set are kept).
    Takes effect for libraries not imported yet: call it before loading anything."""
    for key, default in HUB_DEFAULTS.items():
        os.environ.setdefault(key, default)
