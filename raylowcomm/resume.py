"""Resuming a run: only with the config it was started with, keeping the strategies it finished,
and only from files that can be read: its results.json and the state files (checkpoints, round
files, JSON) of the strategies that continue are checked on the driver before any actor starts."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from raylowcomm.common.files import FileError, read_records
from raylowcomm.config import ConfigError, RunConfig, yaml_problem
from raylowcomm.storage import Storage

logger = logging.getLogger("raylowcomm")
RESULTS_FIX = "delete it to run every strategy again, or rerun without --resume to start afresh"
STATE_FILES = (".safetensors", ".json")
"""The state files a resumed strategy reads whose damage can be told without loading them: safetensors
(checkpoints, round files, Ray Train's checkpoints of DDP) by their header, JSON by parsing it."""


def check_resumable(cfg: RunConfig, out_dir: str | Path) -> None:
    """A run can be resumed from `out_dir` only with the config it was started with, its results.json
    and the state its unfinished strategies continue from readable (`check_state`); else a ConfigError
    naming --resume, the file and the fix, before Ray starts."""
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
    try:
        finished = finished_records(Path(out_dir))
    except FileError as err:
        raise ConfigError("--resume", err.path, f"{err.problem}: {err.fix}") from None
    check_state(cfg, out_dir, finished)


def check_state(cfg: RunConfig, out_dir: str | Path, finished: dict[str, dict]) -> None:
    """Every state file a strategy that continues (not in `finished`) will read, in `storage` (else
    OUT/state), checked on the driver without loading it: a checkpoint cut off by a killed write
    would otherwise kill its node actor with safetensors' 'incomplete metadata', naming neither the
    file nor what to do. Storage that cannot be listed is left to the run's own probe of it
    (`config.checks.check_storage`, before Ray starts), which says why."""
    from pyarrow import ArrowException

    uri = cfg.storage or str(Path(out_dir) / "state")
    try:
        storage = Storage(uri).quick()
        listed = {s: storage.walk(s) for s in cfg.strategies if s not in finished}
    except (OSError, ArrowException) as err:
        logger.warning("--resume: the state in %s was not checked: %s", uri, " ".join(str(err).split()))
        return
    for name, files in listed.items():
        for rel in (f for f in files if f.endswith(STATE_FILES)):
            problem = _state_problem(storage, rel)
            if problem is not None:
                raise ConfigError(
                    "--resume",
                    storage.uri_of(rel),
                    f"{problem}: delete {storage.uri_of(name)} so that {name} starts over (finished strategies "
                    "are kept), or rerun without --resume to start the whole run afresh",
                )


def _state_problem(storage: Storage, rel: str) -> str | None:
    """Why state file `rel` cannot be read, or None."""
    from pyarrow import ArrowException

    try:
        if rel.endswith(".safetensors"):
            return storage.tensors_problem(rel)
        storage.read_json(rel)
    except FileError as err:
        return err.problem
    except (OSError, ArrowException) as err:
        return f"cannot be read ({err})"
    return None


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
    """The strategies a stopped run finished (results.json), by name: a resumed run keeps them. None
    finished where the file is absent; a damaged one is a FileError naming it."""
    path = Path(out_dir) / "results.json"
    records = read_records(path, RESULTS_FIX) if path.exists() else []
    return {r["strategy"]: r for r in records if "error" not in r}
