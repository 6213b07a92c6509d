"""One run of a benchmark's sweep over settings and seeds, resumable: each (setting, seed) is a
`raylowcomm run` of the setting's config in the seed's own folder, named as every multi-seed run names
it (`raylowcomm.seeds.seed_config`: SETTING_DIR/seed_<s>), and a run whose results.json is there is
read, not repeated, so a sweep killed halfway goes on where it stopped. The intervals over the seeds
come from `raylowcomm.seedstats`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from raylowcomm.config import RunConfig
from raylowcomm.runner import run
from raylowcomm.seeds import seed_config

logger = logging.getLogger(__name__)


def seed_record(cfg: RunConfig, seed: int, setting_dir: Path, what: str, rerun_failed: bool = False) -> dict:
    """The record of ``cfg`` (one strategy) at ``seed``, in SETTING_DIR/seed_<seed>: read from its
    results.json, or run there first. ``rerun_failed``: a run that failed (its actors were killed, say)
    runs again, from the start. ``what`` names the run in the log."""
    one = seed_config(cfg, seed, setting_dir)
    where = Path(one.out_dir)
    path = where / "results.json"
    if rerun_failed and path.is_file() and any("error" in rec for rec in json.loads(path.read_text())):
        shutil.rmtree(where)
    if not path.is_file():
        logger.info("%s seed %d -> %s", what, seed, where)
        run(one, where, bar=False)
    [rec] = json.loads(path.read_text())
    return rec
