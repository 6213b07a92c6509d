"""raylowcomm: fine-tune pretrained models across machines that cannot afford to talk much.

Python API (docs/python-api.md)::

    import raylowcomm
    cfg = raylowcomm.load_config("x.yaml", ["optim.lr=0.01"])   # validated; raylowcomm.ConfigError if not
    records = raylowcomm.run(cfg)                               # one record dict per strategy
    summary = raylowcomm.run_seeds(cfg, [0, 1, 2])              # the same per seed, and mean ± 95% interval

`import raylowcomm` is cheap and has no side effects: it sets no environment variable and
imports neither Ray nor torch; the names below load on first use (raylowcomm/env.py says which
environment the CLI and `run` set, and when).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "run": "raylowcomm.runner",
    "run_seeds": "raylowcomm.seeds",
    "load_config": "raylowcomm.strategies",
    "from_dict": "raylowcomm.strategies",
    "RunConfig": "raylowcomm.config",
    "ConfigError": "raylowcomm.config",
}

__all__ = ["ConfigError", "RunConfig", "from_dict", "load_config", "run", "run_seeds", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
