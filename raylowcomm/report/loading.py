"""What a report reads: a bench folder's bench.json, a run folder's results.json and config.yaml,
a multi-seed run's seeds.json, each through raylowcomm.common.files, so that a missing, cut-off or
foreign file (a results.json holding `{}`) is one error naming it, not an empty report."""

from __future__ import annotations

from pathlib import Path

import yaml

from raylowcomm.common.files import FileError, read_json, read_records, read_text

REWRITE = "rerun the command that wrote it (raylowcomm run, bench or run --seeds), or report on another folder"
"""What to do about a damaged file a report reads: the saved results are the report's only input."""


class ReportError(Exception):
    """DIR is not something a report can be built from."""


def load_bench(bench_dir: str | Path) -> dict:
    """bench.json with each run's records attached (None where results.json is missing)."""
    bench_dir = Path(bench_dir)
    if not bench_dir.is_dir():
        raise ReportError(f"{bench_dir} is not a directory")
    if (bench_dir / "bench.json").exists():
        bench = read_json(bench_dir / "bench.json", REWRITE, dict, "a bench's mapping (mode, config, runs)")
    elif (bench_dir / "results.json").exists():
        bench = {
            "mode": "local",
            "config": _read_config(bench_dir),
            "runs": [{"label": bench_dir.name, "rate": None, "dir": "."}],
        }
    elif (bench_dir / "seeds.json").exists():  # raylowcomm run --seeds: one run per seed
        seeds = read_json(bench_dir / "seeds.json", REWRITE, dict, "a multi-seed run's summary (a mapping)")
        bench = {
            "mode": "local",
            "config": seeds.get("config"),
            "confidence": seeds.get("confidence"),
            "runs": [
                {"label": f"seed {s}", "rate": None, "dir": d, "seed": int(s)} for s, d in seeds.get("dirs", {}).items()
            ],
        }
    elif (bench_dir / "benchmarks").is_dir():
        bench = {"mode": "local", "config": None, "runs": []}
    else:
        raise ReportError(f"{bench_dir} has no bench.json, results.json, seeds.json or benchmarks/ to report on")
    runs = bench.setdefault("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) and ("dir" in r or "label" in r) for r in runs):
        raise FileError(bench_dir / "bench.json", "has no list of runs, each with its dir", REWRITE)
    for run in runs:
        path = bench_dir / str(run.get("dir", run.get("label"))) / "results.json"
        run["records"] = read_records(path, REWRITE) if path.exists() else None  # None: that run wrote none
    return bench


def _read_config(run_dir: Path) -> dict | None:
    """The run's config.yaml as a mapping (None where absent); damaged: a FileError naming it."""
    from raylowcomm.config import yaml_problem

    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    try:
        config = yaml.safe_load(read_text(path, REWRITE))
    except yaml.YAMLError as err:
        raise FileError(path, f"is {yaml_problem(err)}", REWRITE) from None
    if not isinstance(config, dict):
        raise FileError(path, "holds no config mapping", REWRITE)
    return config
