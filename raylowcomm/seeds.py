"""A run over several seeds: one run per seed in its own folder, OUT/seeds.json summarising them."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.checks import check_seed
from raylowcomm.resume import check_resumable
from raylowcomm.runner import run

logger = logging.getLogger("raylowcomm")


def seed_config(cfg: RunConfig, seed: int, out_dir: str | Path) -> RunConfig:
    """`cfg` for one seed of a multi-seed run: only `seed` changes (the test, val and training rows
    stay those of data.shuffle_seed); it writes into OUT/seed_<seed>, its state under `storage`
    in seed_<seed> too, so seeds never share a checkpoint."""
    one = copy.deepcopy(cfg)
    one.seed, one.out_dir = seed, str(Path(out_dir) / f"seed_{seed}")
    if one.storage:
        one.storage = f"{one.storage.rstrip('/')}/seed_{seed}"
    return one


def check_seeds_resumable(cfg: RunConfig, seeds: list[int], out_dir: str | Path) -> None:
    """`--resume OUT --seeds ...`: OUT must hold a multi-seed run, and each seed folder that holds a
    run must have been started with this config (the others start afresh)."""
    started = [s for s in seeds if (Path(out_dir) / f"seed_{s}" / "config.yaml").is_file()]
    if not started and not (Path(out_dir) / "seeds.json").is_file():
        raise ConfigError("--resume", str(out_dir), "holds no multi-seed run (no seeds.json, no seed_<s>/config.yaml)")
    for s in started:
        check_resumable(seed_config(cfg, s, out_dir), Path(out_dir) / f"seed_{s}")


def run_seeds(
    cfg: RunConfig,
    seeds: list[int],
    out_dir: str | Path | None = None,
    verbose: bool = False,
    bar: bool | None = None,
    resume: bool = False,
) -> dict:
    """`run` once per seed, into OUT/seed_<s>, then OUT/seeds.json (rewritten after each seed):
    per strategy the mean and 95% interval of every metric, the bytes and the time, and the
    paired difference to DDP (raylowcomm.seedstats.summarize). `resume`: the seeds whose folder
    holds a run continue it (as `run(resume=True)`), the others run afresh. Returns the summary."""
    from raylowcomm.seedstats import format_table as seeds_table
    from raylowcomm.seedstats import summarize

    out = Path(out_dir or cfg.out_dir)
    for seed in seeds:  # all of them before the first runs
        check_seed("seeds", seed)
    if resume:
        check_seeds_resumable(cfg, seeds, out)
    per_seed: dict[int, list[dict]] = {}
    summary: dict = {}
    for i, seed in enumerate(seeds, 1):
        one = seed_config(cfg, seed, out)
        logger.info("##### seed %d (%d of %d): %s #####", seed, i, len(seeds), one.out_dir)
        again = resume and (Path(one.out_dir) / "config.yaml").is_file()
        per_seed[seed] = run(one, verbose=verbose, bar=bar, resume=again)
        summary = {
            **summarize(per_seed),
            "planned": list(seeds),
            "dirs": {s: f"seed_{s}" for s in per_seed},
            "config": {**cfg.to_dict(), "seed": None, "out_dir": str(out)},
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "seeds.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info("\n%s", seeds_table(summary))
    logger.info("seeds: %s; again: raylowcomm report %s", out / "seeds.json", out)
    return summary
