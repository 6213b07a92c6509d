"""Where rows come from and what they hold: a `SourceSpec` (small and picklable: what
`datasets` takes, opened on the host that reads it), the column each role reads, the data's kind
and its labels' names."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raylowcomm import assets
from raylowcomm.catalog import Kind
from raylowcomm.config import ConfigError

# --- sources: where rows come from -------------------------------------------------------------

SUFFIX_BUILDERS = {
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}


def is_builder(source: str | None) -> bool:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return source in _PACKAGED_DATASETS_MODULES


def _saved(path: str | None) -> bool:
    """A folder written by `save_to_disk` (a Dataset or a DatasetDict), which only load_from_disk reads."""
    return path is not None and any((Path(path) / f).is_file() for f in ("state.json", "dataset_dict.json"))


def _patterns(files) -> list[str]:
    if files is None:
        return []
    if isinstance(files, dict):
        return [p for v in files.values() for p in _patterns(v)]
    return [files] if isinstance(files, str) else list(files)


def absolute(files):
    """Local paths made absolute on the driver: a node actor does not run in the driver's folder."""
    if isinstance(files, dict):
        return {k: absolute(v) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [absolute(v) for v in files]
    return files if files is None or "://" in files else os.path.abspath(os.path.expanduser(files))


@dataclass(frozen=True)
class SourceSpec:
    """Where rows come from, as `datasets` takes it: small and picklable, opened where it is used.
    `source` None: the builder follows the files' suffix (a folder: save_to_disk or imagefolder)."""

    source: str | None
    files: Any = None
    split: str | None = None
    field: str = "data"
    """The config section to name in errors ({field}.files, {field}.columns.<role>, ...)."""
    split_field: str = "split"
    files_field: str | None = None
    """The field naming the files in errors; None: {field}.files."""
    asset: str | None = None
    """A bundled asset holding the files: materialised on the host that opens it."""

    def check(self) -> None:
        """Files and folders exist: a clear error now, not a traceback in a node."""
        base = Path(self.source) if self.source and Path(self.source).is_dir() else Path.cwd()
        for pattern in _patterns(self.files):
            if "://" not in pattern and not glob.glob(str(base / os.path.expanduser(pattern))):
                raise ConfigError(self.files_name, self.files, f"{pattern!r} matches no file; check the path")
        if self.source and self.source.startswith(("/", ".", "~")) and not Path(self.source).expanduser().exists():
            raise ConfigError(f"{self.field}.source", self.source, "no such folder; check the path")
        if self.source is None and self.files is None and self.asset is None:
            raise ConfigError(f"{self.field}.source", None, "give this set's source or files")
        if self.files is None and self.asset is None and not self._local_dir() and is_builder(self.source):
            raise ConfigError(self.files_name, None, f"the {self.source!r} builder reads files: give them")

    @property
    def files_name(self) -> str:
        return self.files_field or f"{self.field}.files"

    @property
    def where(self) -> str:
        """The files as errors name them: the field, and the file or folder where it is one."""
        files = _patterns(self.files.get(self.split or "train") if isinstance(self.files, dict) else self.files)
        path = files[0] if len(files) == 1 else self.source if self.source and not is_builder(self.source) else None
        return f"{self.files_name} ({path})" if path else self.files_name

    def _local_dir(self) -> str | None:
        files = _patterns(self.files)
        for path in ([self.source] if self.source else []) + (files if len(files) == 1 else []):
            if path and not is_builder(path) and Path(path).is_dir():
                return path
        return None

    def _arguments(self) -> tuple[str, dict]:
        """(path, kwargs) for load_dataset."""
        files = str(assets.require(self.asset)) if self.asset and self.files is None else self.files
        folder = self._local_dir() if self.source is None or self.source == "imagefolder" else None
        if folder and self.source is None:
            return "imagefolder", {"data_dir": folder}
        if folder:
            return self.source, {"data_dir": folder}
        source = self.source or SUFFIX_BUILDERS.get(Path(_patterns(files)[0]).suffix.lower(), "csv")
        return source, ({"data_files": files} if files is not None else {})

    def _load(self, streaming: bool):
        from datasets import load_dataset, load_from_disk

        saved = self._local_dir()
        try:
            if _saved(saved):
                return load_from_disk(saved)
            path, kwargs = self._arguments()
            return load_dataset(path, streaming=streaming, **kwargs)
        except (FileNotFoundError, ConnectionError, ValueError) as err:
            by_files = self.source is None or is_builder(self.source)
            name, value = (self.files_name, self.files) if by_files else (f"{self.field}.source", self.source)
            raise ConfigError(name, value, f"datasets cannot read it ({type(err).__name__}: {err})") from None

    def _pick(self, data):
        if not hasattr(data, "keys"):
            return data
        names = list(data.keys())
        name = self.split or (names[0] if len(names) == 1 else "train" if "train" in names else None)
        if name not in names:
            raise ConfigError(
                f"{self.field}.{self.split_field}", self.split, f"the source's splits are {', '.join(names)}: name one"
            )
        return data[name]

    def open(self):
        """The split as a `datasets.Dataset`: Arrow, memory-mapped, nothing read into memory yet."""
        return self._pick(self._load(streaming=False))

    def stream(self):
        """The split as a stream, read where it is iterated: nothing of it is cached on this host (a
        folder written by save_to_disk is a memory-mapped Dataset already)."""
        return self._pick(self._load(streaming=True))

    def peek(self) -> tuple[list[str], dict[str, Any]]:
        """(split names, column -> feature or None) from the schema or the first row only."""
        data = self._load(streaming=True)
        splits = list(data.keys()) if hasattr(data, "keys") else []
        part = self._pick(data)
        if part.features:
            return splits, dict(part.features)
        row = next(iter(part), None)
        if row is None:
            raise ConfigError(self.files_name, self.files, "holds no rows")
        return splits, dict.fromkeys(row)


# --- columns, kinds and classes ----------------------------------------------------------------

DEFAULT_COLUMNS = {"image": ("image", "img"), "text": ("text", "sentence"), "label": ("label", "labels")}


def _is_image(feature) -> bool:
    return type(feature).__name__ == "Image"


def resolve_columns(found: dict[str, Any], given: dict[str, str], field_name: str) -> dict[str, str]:
    """Role -> column: the names given, checked against the data, else the default names present."""
    has = ", ".join(map(str, found))
    for role, column in given.items():
        if column not in found:
            raise ConfigError(f"{field_name}.columns.{role}", column, f"no such column; the data has {has}")
    columns = dict(given)
    for role, names in DEFAULT_COLUMNS.items():
        exclusive = {"image": "text", "text": "image"}.get(role)
        if role in columns or exclusive in columns:
            continue
        hit = next((n for n in names if n in found), None)
        if role == "image" and hit is None:
            hit = next((n for n, f in found.items() if _is_image(f)), None)
        if hit is not None:
            columns[role] = hit
    if "image" not in columns and "text" not in columns:
        raise ConfigError(
            f"{field_name}.columns",
            given,
            f"name the text or image column (roles: text, text_pair, image, label); the data has {has}",
        )
    if "image" in columns and "label" not in columns:
        raise ConfigError(f"{field_name}.columns.label", None, f"images need a label column; the data has {has}")
    return columns


def kind_of(columns: dict[str, str]) -> Kind:
    if "image" in columns:
        return "image"
    return "labelled_text" if "label" in columns else "text"


def label_key(value, feature) -> str:
    """A label's name: ClassLabel names are the data's own, other values are compared as text."""
    names = getattr(feature, "names", None)
    return names[value] if names is not None and value >= 0 else str(value)  # ClassLabel -1: no label


def sorted_labels(values) -> list[str]:
    """Distinct raw labels in class order: numeric for whole numbers (2 before 10), else by name."""
    values = set(values)
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return [str(v) for v in sorted(values)]
    return sorted(str(v) for v in values)
