"""raylowcomm: fine-tune pretrained models across machines that cannot afford to talk much."""

import os

# Assets are local files; never let a loader wander off to a hub unless the user asks for it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Progress lines of different nodes differ only in numbers; Ray would fold them into one.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# A local embedded Ray must stay on 127.0.0.1: Ray reads this at import time, and with it a
# single-node Ray binds every listener to loopback (RAY_NOTES.md). Not set when joining a cluster.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

__version__ = "0.1.0"
