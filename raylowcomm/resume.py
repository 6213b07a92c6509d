"""Resuming a run: only with the config it was started with, keeping the strategies it finished."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from raylowcomm.config import ConfigError, RunConfig, yaml_problem


def check_resumable(cfg: RunConfig, out_dir: str | Path) -> None:
    """A run can be resumed from `out_dir` only with the config it was started with."""
    saved = Path(out_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError("--resume", str(out_dir), "holds no run (no config.yaml): give the folder a run wrote")
    before, now = _saved_config(saved), yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    before.pop("out_dir", None), now.pop("out_dir", None)  # OUT itself, however the first run spelled it
    changed = sorted(_differences(before, now))
    if changed:
        raise ConfigError(
            "--resume",
            str(out_dir),
            f"the run there had other settings ({', '.join(changed[:5])}): resume with the config it was started with",
        )


def _saved_config(saved: Path) -> dict:
    """The config a run wrote to OUT/config.yaml; a damaged one (truncated, not YAML, not a mapping)
    is a ConfigError naming the file and, for bad YAML, the line, not a parser's traceback."""
    try:
        before = yaml.safe_load(saved.read_text())
        problem = "is empty" if before is None else "holds no config mapping"
    except yaml.YAMLError as err:
        before, problem = None, yaml_problem(err)
    except (UnicodeDecodeError, OSError) as err:
        before, problem = None, f"cannot be read ({err})"
    if not isinstance(before, dict):
        raise ConfigError(
            "--resume",
            str(saved),
            f"{problem}: the run's saved config is damaged; copy the config "
            "the run was started with over it, or start afresh in a new folder",
        )
    return before


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if a != b else []


def finished_records(out_dir: Path) -> dict[str, dict]:
    """The strategies a stopped run finished (results.json), by name: a resumed run keeps them."""
    path = out_dir / "results.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    return {r["strategy"]: r for r in records if "error" not in r}
