"""Data as dicts of tensors (`Split`): any `datasets` source, read the same way on the driver and
on every node, split into test / val / train by a fixed seed, and sharded across nodes.

The driver never holds a training row. `describe_data` decides what the data is from schemas and
the label column (kind, columns, classes); `prepare_data` loads only the evaluation sets and
returns the training data as a recipe (`TrainSource`): small and picklable, it travels to a node,
which opens its own files (data.node_files) or the shared source (Arrow, memory-mapped) and
encodes only the rows it trains on. Rows become tensors in `Encoder`, with the class map the
driver decided, so every node and every shift set numbers the classes the same way.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylowcomm import assets, catalog
from raylowcomm.catalog import Kind, TaskSpec
from raylowcomm.config import ConfigError, DataConfig, RunConfig
from raylowcomm.seeding import epoch_seed, group_order_seed

logger = logging.getLogger("raylowcomm")

Split = dict[str, torch.Tensor]


def num_examples(split: Split) -> int:
    return len(next(iter(split.values())))


def take(split: Split, index: torch.Tensor) -> Split:
    return {k: v[index] for k, v in split.items()}


def shard_indices(n: int, num_shards: int, seed: int) -> list[torch.Tensor]:
    """Disjoint shards that together cover range(n), sizes differing by at most one."""
    if num_shards > n:
        raise ValueError(f"cannot split {n} examples into {num_shards} non-empty shards")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i::num_shards].sort().values for i in range(num_shards)]


@functools.lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """A shard's row order in epoch `epoch`, a pure function of (n, seed, epoch); cached, as
    every step of the epoch reads it (drawing it anew cost 25 ms a step for 100,000 rows).
    Callers index it and never write to it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))


GROUP_BATCHES = 8
"""optim.group_by_length sorts each run of 8 batches' rows by length: on the MiniLM main job a
step's real tokens go from 55% of its trimmed batch to 88% (86% for DDP, whose ranks wait for
the longest batch), where whole-epoch sorting would reach 98% but order the epoch by length."""


def length_grouped_batch(mask: torch.Tensor, i: int, batch_size: int, seed: int, epoch: int, group_seed: int) -> torch.Tensor:
    """Batch `i` of an epoch with rows of similar length together (rows of `mask`, the attention
    mask): the epoch's shuffled rows (`epoch_permutation`) are cut into groups of GROUP_BATCHES
    batches, each group sorted by length and cut into batches, which the group takes in an order
    drawn from `group_seed`. Nodes share `group_seed`, so at each step every DDP rank takes a
    batch of the same length rank in its group (no rank waits long for another's longer batch).
    Only batch i's group is sorted: a step's cost does not grow with the shard."""
    group, place = divmod(i, GROUP_BATCHES)
    span = GROUP_BATCHES * batch_size
    rows = epoch_permutation(len(mask), seed, epoch)[group * span : (group + 1) * span]
    rows = rows[: len(rows) // batch_size * batch_size]
    chunks = rows[mask[rows].sum(1).argsort(descending=True, stable=True)].split(batch_size)
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(group_order_seed(group_seed, epoch, group)))
    return chunks[int(order[place])]


def eval_batches(split: Split, batch_size: int):
    n = num_examples(split)
    for i in range(0, n, batch_size):
        yield {k: v[i : i + batch_size] for k, v in split.items()}


# --- sources: where rows come from -------------------------------------------------------------

SUFFIX_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                   ".txt": "text", ".arrow": "arrow"}


def _is_builder(source: str | None) -> bool:
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


def _absolute(files):
    """Local paths made absolute on the driver: a node actor does not run in the driver's folder."""
    if isinstance(files, dict):
        return {k: _absolute(v) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [_absolute(v) for v in files]
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
        if self.files is None and self.asset is None and not self._local_dir() and _is_builder(self.source):
            raise ConfigError(self.files_name, None, f"the {self.source!r} builder reads files: give them")

    @property
    def files_name(self) -> str:
        return self.files_field or f"{self.field}.files"

    def _local_dir(self) -> str | None:
        files = _patterns(self.files)
        for path in ([self.source] if self.source else []) + (files if len(files) == 1 else []):
            if path and not _is_builder(path) and Path(path).is_dir():
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
            name, value = (self.files_name, self.files) if self.source is None or _is_builder(self.source) else (f"{self.field}.source", self.source)
            raise ConfigError(name, value, f"datasets cannot read it ({type(err).__name__}: {err})") from None

    def _pick(self, data):
        if not hasattr(data, "keys"):
            return data
        names = list(data.keys())
        name = self.split or (names[0] if len(names) == 1 else "train" if "train" in names else None)
        if name not in names:
            raise ConfigError(f"{self.field}.{self.split_field}", self.split, f"the source's splits are {', '.join(names)}: name one")
        return data[name]

    def open(self):
        """The split as a `datasets.Dataset`: Arrow, memory-mapped, nothing read into memory yet."""
        return self._pick(self._load(streaming=False))

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
    for role, column in given.items():
        if column not in found:
            raise ConfigError(f"{field_name}.columns.{role}", column, f"no such column; the data has {', '.join(map(str, found))}")
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
        raise ConfigError(f"{field_name}.columns", given, f"name the text or image column (roles: text, text_pair, image, label); "
                                                          f"the data has {', '.join(map(str, found))}")
    if "image" in columns and "label" not in columns:
        raise ConfigError(f"{field_name}.columns.label", None, f"images need a label column; the data has {', '.join(map(str, found))}")
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


# --- rows -> tensors ---------------------------------------------------------------------------

GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")


def _image_array(value) -> np.ndarray:
    """One image as uint8 (H, W) grey or (H, W, 3) colour: a PIL image, an array, or a string of
    whitespace-separated pixels of a square grey image (the bundled digit CSVs)."""
    if hasattr(value, "convert"):
        return np.asarray(value.convert("L" if value.mode in GREY_MODES else "RGB"))
    array = np.array(list(map(int, value.split())) if isinstance(value, str) else value).astype(np.uint8)
    if array.ndim == 1:
        side = round(len(array) ** 0.5)
        if side * side != len(array):
            raise ValueError(f"a flat image of {len(array)} pixels is not square")
        return array.reshape(side, side)
    return array[..., 0] if array.ndim == 3 and array.shape[-1] == 1 else array[..., :3]


def pixels(values, size: int) -> torch.Tensor:
    """uint8 images as they are: (N, H, W) grey, (N, 3, H, W) once any is colour; resized to
    size x size (bilinear) only when their sizes differ, so that they stack."""
    from PIL import Image

    arrays = []
    for i, value in enumerate(values):
        try:
            arrays.append(_image_array(value))
        except (ValueError, TypeError, OSError) as err:
            raise UnreadableValue("image", i, f"{type(err).__name__}: {err}") from None
    if any(a.ndim == 3 for a in arrays):
        arrays = [a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=-1) for a in arrays]
    if len({a.shape for a in arrays}) > 1:
        arrays = [np.asarray(Image.fromarray(a).resize((size, size), Image.BILINEAR)) for a in arrays]
    x = torch.from_numpy(np.stack(arrays)) if arrays else torch.zeros(0, size, size, dtype=torch.uint8)
    return x.permute(0, 3, 1, 2).contiguous() if x.dim() == 4 else x


@dataclass(frozen=True)
class Encoder:
    """Rows -> tensors for one task, the same on the driver and on every node: the class map, the
    tokenizer and the prompt travel inside it."""

    task: str
    classes: tuple[str, ...] | None = None
    tokenizer: Any = None
    max_length: int = 64
    image_size: int = 32
    template: str = ""
    label_words: tuple[str, ...] = ()

    def check(self) -> None:
        """What only the tokenizer can tell, checked on the driver before any actor starts."""
        if self.task != "prompt_classification":
            return
        words = [self.tokenizer(w, add_special_tokens=False)["input_ids"] for w in self.label_words]
        if any(len(w) != 1 for w in words):
            raise ConfigError("data.label_words", list(self.label_words), f"each must be one token for this tokenizer, got {words}")
        template = self.tokenizer(self.template, add_special_tokens=False)["input_ids"]
        if self.max_length <= len(template):
            raise ConfigError("data.max_length", self.max_length, f"must exceed the prompt's {len(template)} tokens")

    def labels(self, values, feature, label_field: str) -> torch.Tensor:
        index = {name: i for i, name in enumerate(self.classes)}
        keys = [label_key(v, feature) for v in values]
        unknown = sorted(set(keys) - index.keys())
        if unknown:
            raise ConfigError(label_field, unknown, f"labels not among the training classes {list(self.classes)}: "
                                                   "relabel them by name, or list every class in data.classes")
        return torch.tensor([index[k] for k in keys], dtype=torch.long)

    def encode(self, rows: dict[str, list], features, columns: dict[str, str], label_field: str) -> Split:
        """Rows (column -> values, as `Dataset[indices]` reads them) as one Split."""
        if self.task == "image_classification":
            out = {"pixels": pixels(rows[columns["image"]], self.image_size)}
        elif self.task == "prompt_classification":
            out = self._prompts(_texts(rows[columns["text"]]))
        else:
            pairs = _texts(rows[columns["text_pair"]], "text_pair") if "text_pair" in columns else None
            out = self._tokens(_texts(rows[columns["text"]]), pairs)
        out["labels"] = self.labels(rows[columns["label"]], features[columns["label"]], label_field)
        return out

    def _tokens(self, texts: list[str], pairs: list[str] | None) -> Split:
        """Right-padded to the longest row (tasks.trim_padding cuts each batch to its own)."""
        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(texts, pairs, padding="longest", truncation=True, max_length=self.max_length, return_tensors="pt")
        keep = ("input_ids", "attention_mask") + (("token_type_ids",) if pairs is not None and "token_type_ids" in enc else ())
        return {k: enc[k] for k in keep}

    def _prompts(self, texts: list[str]) -> Split:
        """Text + template, right-padded; the text is cut so the template always fits."""
        template = self.tokenizer(self.template, add_special_tokens=False)["input_ids"]
        words = [self.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in self.label_words]
        rows = [r + template for r in self.tokenizer(texts, add_special_tokens=False, truncation=True,
                                                     max_length=self.max_length - len(template))["input_ids"]]
        width = max(map(len, rows), default=0)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask, "choice_ids": torch.tensor(words).expand(len(rows), -1).contiguous()}

    def rows(self, spec: SourceSpec, columns: dict[str, str], label_field: str) -> Rows:
        """`spec`'s rows, opened here; `label_field`: the config field an unknown label is blamed on."""
        return Rows(spec, columns, self, label_field)


class UnreadableValue(ValueError):
    """A value the image or text reader cannot take: its role and its position in the rows read."""

    def __init__(self, role: str, position: int, reason: str):
        super().__init__(reason)
        self.role, self.position, self.reason = role, position, reason


def _texts(values, role: str = "text") -> list[str]:
    """Text as text, a missing value as ""; anything else (a number, a list) is not guessed at."""
    for i, t in enumerate(values):
        if t is not None and not isinstance(t, str):
            raise UnreadableValue(role, i, f"{type(t).__name__} {str(t)[:40]!r} is not text")
    return [t if t is not None else "" for t in values]


class Rows:
    """The examples of one split by index. Classification: a row each, encoded when selected (only
    those rows are read). Language modelling: blocks of max_length tokens cut from the whole text
    joined by newlines, so the whole text is tokenised wherever its blocks are counted."""

    def __init__(self, spec: SourceSpec, columns: dict[str, str], encoder: Encoder, label_field: str):
        self.spec, self.ds = spec, spec.open()
        self.columns, self.encoder, self.label_field = columns, encoder, label_field
        self.blocks = None
        if encoder.task == "causal_lm":
            try:
                text = "\n".join(_texts(self.ds[columns["text"]]))
            except UnreadableValue as err:
                raise self._unreadable(err, torch.arange(len(self.ds))) from None
            ids = encoder.tokenizer(text, return_tensors="pt")["input_ids"][0]
            n = len(ids) // encoder.max_length
            self.blocks = {"input_ids": ids[: n * encoder.max_length].view(n, encoder.max_length)}

    def __len__(self) -> int:
        return num_examples(self.blocks) if self.blocks is not None else self.ds.num_rows

    def select(self, index: torch.Tensor | None = None) -> Split:
        """The examples at `index` (None: all), in that order."""
        index = torch.arange(len(self)) if index is None else index
        if self.blocks is not None:
            return take(self.blocks, index)
        wanted = list(dict.fromkeys(self.columns.values()))
        try:
            rows = self._read(wanted, index)
            return self.encoder.encode(rows, self.ds.features, self.columns, self.label_field)
        except UnreadableValue as err:
            raise self._unreadable(err, index) from None

    def _read(self, wanted: list[str], index: torch.Tensor) -> dict[str, list]:
        """The rows at `index`; a file that fails to decode as it is read (a corrupt image) is
        found by reading the rows one at a time."""
        if not len(index):
            return {c: [] for c in wanted}
        table = self.ds.select_columns(wanted)
        try:
            return table[index.tolist()]
        except (OSError, ValueError):
            for position, at in enumerate(index.tolist()):
                try:
                    table[at]
                except (OSError, ValueError) as err:
                    role = "image" if self.encoder.task == "image_classification" else "text"
                    raise UnreadableValue(role, position, f"{type(err).__name__}: {err}") from None
            raise

    def _unreadable(self, err: UnreadableValue, index: torch.Tensor) -> ConfigError:
        """Names the column and the row (its number in the split) whose value cannot be read."""
        what = "an image" if err.role == "image" else "text"
        return ConfigError(f"{self.spec.field}.columns.{err.role}", self.columns[err.role],
                           f"row {int(index[err.position])} of {self.spec.files_name} is unreadable as {what} ({err.reason}): "
                           "fix or drop that row, or name another column")


# --- which examples are test / val / train -----------------------------------------------------

@dataclass(frozen=True)
class SplitRule:
    """Test, val and train examples of a split as a pure function of its size: the same indices on
    the driver and on every node (and the same as before nodes loaded their own data)."""

    shuffle_seed: int
    test_size: int
    val_size: int
    train_size: int | None
    needs_train: bool = True
    """False where the split is evaluation data only (data.files beside data.node_files)."""

    def parts(self, n: int) -> dict[str, torch.Tensor]:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.shuffle_seed))
        if self.test_size + self.val_size + (self.train_size or int(self.needs_train)) > n:
            field_name = "data.train_size" if self.train_size else "data.test_size"
            raise ConfigError(field_name, self.train_size or self.test_size,
                              f"the data has {n} examples; test_size + val_size + train_size must not exceed it")
        held = self.test_size + self.val_size
        rest = order[held:]
        return {"test": order[: self.test_size], "val": order[self.test_size : held],
                "train": rest[: self.train_size] if self.train_size else rest}


# --- what the data is, decided on the driver ---------------------------------------------------

@dataclass(frozen=True)
class NodeFiles:
    """data.node_files: each node's own training files, resolved by the node's index on its host."""

    files: tuple[str, ...] | str
    """One entry per node, or one pattern with {node}."""
    source: str | None

    def spec(self, node: int) -> SourceSpec:
        if isinstance(self.files, str):
            entry = self.files.replace("{node}", str(node))
        elif node < len(self.files):
            entry = self.files[node]
        else:
            raise ConfigError("data.node_files", list(self.files), f"no entry for node {node}: give one per node")
        return SourceSpec(self.source, entry, field="data", files_field=f"data.node_files[{node}]")


@dataclass(frozen=True)
class DataPlan:
    """What the data is: its columns, task and classes, and where each part of it comes from."""

    name: str
    task: str
    columns: dict[str, str]
    classes: tuple[str, ...] | None
    pool: SourceSpec | None
    """The training split of data.source / data.files / the preset (with node_files: evaluation data only)."""
    test: SourceSpec | None
    """A split of its own scored as the test set (data.test_split)."""
    shifts: dict[str, tuple[SourceSpec, dict[str, str]]]
    nodes: NodeFiles | None
    template: str = ""
    label_words: tuple[str, ...] = ()

    @property
    def kind(self) -> Kind:
        return kind_of(self.columns)

    @property
    def num_classes(self) -> int | None:
        """Classes of a new classifier head; None where the task keeps the model's own head."""
        return len(self.classes) if self.task in catalog.NEW_HEAD_TASKS else None


def _user_spec(source: str | None, files, split: str | None, field_name: str) -> SourceSpec:
    """A source as the user wrote it: a builder's files made absolute (nodes do not run in the
    driver's folder), files inside a folder or hub dataset left relative to it."""
    if source is None or _is_builder(source):
        return SourceSpec(source, _absolute(files), split, field=field_name)
    return SourceSpec(os.path.abspath(source) if Path(source).exists() else source, files, split, field=field_name)


def _pool(data: DataConfig, preset: catalog.DatasetInfo | None) -> SourceSpec | None:
    """The source the seeded split draws from; None when a builder has no files (rows on the nodes only)."""
    files = data.files if data.files is not None else data.path
    if preset is not None:
        return SourceSpec(preset.source, _absolute(files), data.split, asset=preset.asset if files is None else None)
    if _is_builder(data.source) and files is None:
        return None
    return _user_spec(data.source, files, data.split, "data")


def _node_files(data: DataConfig, preset: catalog.DatasetInfo | None) -> NodeFiles | None:
    if data.node_files is None:
        return None
    builder = data.source if _is_builder(data.source) else preset.source if preset is not None else None
    files = _absolute(data.node_files)
    return NodeFiles(files if isinstance(files, str) else tuple(files), builder)


def _test_split(data: DataConfig, pool: SourceSpec | None, splits: list[str]) -> SourceSpec | None:
    """data.test_split, else the source's own "test" split when training rows come from another."""
    name = data.test_split
    if name is None and "test" in splits and len(splits) > 1 and (pool.split or "train") != "test":
        name = "test"
    if name is None:
        return None
    if pool is None:
        raise ConfigError("data.test_split", name, "needs data.files (or data.source) to take the split from")
    return SourceSpec(pool.source, pool.files, name, field="data", split_field="test_split", asset=pool.asset)


def _shifts(data: DataConfig, preset, pool: SourceSpec | None, columns: dict[str, str], classes) -> dict:
    """name -> (source, columns): the preset's sets (auto) or the user's, with the training roles
    and only labels the training data has (matched by name)."""
    if data.shift == "none":
        return {}
    if data.shift == "auto":
        entries = {n: (SourceSpec(p.source, field=f"data.shift.{n}", asset=p.asset), p.columns)
                   for n, p in (preset.shift if preset is not None else {}).items() if _available(p.asset)}
    else:
        inherit = pool.source if pool is not None else None  # a builder, a folder or a hub id
        entries = {n: (_user_spec(s.source or inherit, s.files, s.split, f"data.shift.{n}"), s.columns) for n, s in data.shift.items()}
    out = {}
    for name, (spec, given) in entries.items():
        spec.check()
        found = spec.peek()[1]
        inherited = {r: c for r, c in columns.items() if c in found and r not in given}
        resolved = resolve_columns(found, {**inherited, **given}, spec.field)
        for role in columns:
            if role not in resolved:
                raise ConfigError(f"{spec.field}.columns.{role}", None, f"the training data has a {role} column; name this set's")
        out[name] = (spec, {r: resolved[r] for r in columns})
        if classes is not None:
            _check_labels(spec, resolved["label"], classes)
    return out


def _available(asset: str) -> bool:
    """A bundled shift set that cannot be fetched (no package index) is skipped, not fatal: `auto`
    scores on it where it exists."""
    try:
        assets.require(asset)
        return True
    except assets.AssetError as err:
        logger.warning("shift set %s skipped: %s", asset, err)
        return False


def _check_labels(spec: SourceSpec, label: str, classes: tuple[str, ...]) -> None:
    ds = spec.open()
    unknown = sorted({label_key(v, ds.features[label]) for v in ds.unique(label)} - set(classes))
    if unknown:
        raise ConfigError(spec.field, unknown, f"labels not among the training classes {list(classes)}: relabel them by name")


def _classes(data: DataConfig, pool: SourceSpec | None, nodes: list[SourceSpec], label: str, feature) -> tuple[str, ...]:
    """Label names in class order: data.classes, the ClassLabel's names, or the sorted distinct
    labels of the driver's own data (of the node files only where the driver can read them)."""
    if data.classes:
        return tuple(map(str, data.classes))
    if getattr(feature, "names", None):
        return tuple(feature.names)
    sources = [pool] if pool is not None else nodes
    if not sources:
        raise ConfigError("data.classes", None, "the training files live on the nodes only: list the label names in class order")
    values = set()
    for spec in sources:
        ds = spec.open()
        if getattr(ds.features[label], "names", None):
            return tuple(ds.features[label].names)
        values |= set(ds.unique(label))
    return tuple(sorted_labels(values))


def _prompt(data: DataConfig, preset, task: str, classes) -> tuple[str, tuple[str, ...]]:
    """(template, label words): the config's, else the preset's; required for prompt classification."""
    template = data.template if data.template is not None else (preset.template if preset and preset.template else "")
    words = tuple(data.label_words) if data.label_words is not None else (preset.label_words if preset else None) or ()
    if task != "prompt_classification":
        return template, words
    if not words:
        raise ConfigError("data.label_words", None, f"a causal LM classifies by the next token after each text + data.template: "
                                                    f"give one word per class, in class order {list(classes)}")
    if len(words) != len(classes):
        raise ConfigError("data.label_words", list(words), f"one per class: {len(classes)} classes {list(classes)}")
    return template, words


def describe_data(cfg: RunConfig) -> DataPlan:
    """What the data is (columns, kind, task, classes) from schemas, first rows and the label column
    only: bad input is a ConfigError naming its field, before the model loads or any actor starts."""
    data = cfg.data
    preset = catalog.DATASETS.get(data.name) if data.source is None else None
    pool, nodes = _pool(data, preset), _node_files(data, preset)
    node_specs = [nodes.spec(k) for k in range(cfg.nodes.count)] if nodes and data.node_files_on_driver else []
    if pool is None and nodes is None:
        raise ConfigError("data.files", None, f"the {data.source!r} builder reads files: give data.files or data.node_files")
    if pool is None and not data.eval_on_nodes:
        raise ConfigError("data.files", None, "node_files train on the nodes; the driver scores on data.files: "
                                              "give them, or set data.eval_on_nodes: true")
    for spec in ([pool] if pool else []) + node_specs:
        spec.check()
    if pool is None and not node_specs and not data.columns:
        raise ConfigError("data.columns", data.columns, "nothing here to read the columns from (node files on the nodes only, "
                                                        "no data.files): name them, e.g. {text: review, label: stars}")
    splits, found = (pool or node_specs[0]).peek() if pool or node_specs else ([], dict.fromkeys(data.columns.values()))
    columns = resolve_columns(found, {**(preset.columns if preset else {}), **data.columns}, "data")
    kind = kind_of(columns)
    task = catalog.task_of(cfg.model.family, kind)
    if task is None:
        raise ConfigError("model.family", cfg.model.family,
                          f"data '{data.name}' is {kind.replace('_', ' ')}: use {' or '.join(catalog.FAMILIES_FOR_KIND[kind])}")
    for spec in node_specs:
        resolve_columns(spec.peek()[1], columns, "data")
    test = _test_split(data, pool, splits)
    classes = _classes(data, pool, node_specs, columns["label"], found.get(columns["label"])) if "label" in columns else None
    template, words = _prompt(data, preset, task, classes)
    shifts = _shifts(data, preset, pool, columns, classes)
    return DataPlan(data.name, task, columns, classes, pool, test, shifts, nodes, template, words)


# --- training data that each node loads itself -------------------------------------------------

@dataclass(frozen=True)
class TrainSource:
    """The training data as a recipe, not rows: small and picklable. `load` runs on a node and
    reads what that node trains on: its own files, or its shard of the shared source, which is
    exactly the shard the driver used to send (same split rule, same shard indices)."""

    encoder: Encoder
    columns: dict[str, str]
    rule: SplitRule
    seed: int
    """The run seed: which shard a node gets (shard_indices)."""
    pool: SourceSpec | None = None
    test: SourceSpec | None = None
    nodes: NodeFiles | None = None
    num_rows: int | None = None
    """The shared source's example count as the driver saw it: a node that finds another fails."""
    eval_on_nodes: bool = False

    def load(self, node: int, count: int) -> Split:
        """Node `node` of `count`'s training rows, read on the calling host."""
        if self.nodes is not None:
            return self._own(node, "train")
        rows = self._shared()
        return self._shard(rows, self.rule.parts(len(rows))["train"], node, count)

    def load_holdout(self, node: int, count: int) -> Split:
        """Node `node`'s own held-out rows (data.eval_on_nodes): test_size of its own files, or its
        shard of the shared source's test rows."""
        if not self.eval_on_nodes:
            raise ValueError("held-out rows on the nodes need data.eval_on_nodes: true")
        if self.nodes is not None:
            return self._own(node, "test")
        if self.test is not None:
            rows = self.encoder.rows(self.test, self.columns, "data.test_split")
            return self._shard(rows, torch.arange(len(rows)), node, count)
        rows = self._shared()
        return self._shard(rows, self.rule.parts(len(rows))["test"], node, count)

    def load_all(self) -> Split:
        """The whole training split of a shared source, in the calling process (tests, benchmarks)."""
        if self.nodes is not None:
            raise ValueError("with data.node_files each node holds its own rows: load(node, count)")
        rows = self._shared()
        return rows.select(self.rule.parts(len(rows))["train"])

    def sizes(self, count: int) -> list[int] | None:
        """Each node's training examples, known without reading them (shared source); None with
        node files, whose sizes only the nodes know (ask each for num_examples of its load)."""
        if self.nodes is not None:
            return None
        rest = self.num_rows - self.rule.test_size - self.rule.val_size
        n = min(self.rule.train_size, rest) if self.rule.train_size else rest
        return [len(range(k, n, count)) for k in range(count)]

    def _own(self, node: int, part: str) -> Split:
        spec = self.nodes.spec(node)
        rows = self.encoder.rows(spec, self.columns, spec.files_field)
        if not self.eval_on_nodes:
            return rows.select()
        rule = SplitRule(self.rule.shuffle_seed, self.rule.test_size, 0, None)
        return rows.select(rule.parts(len(rows))[part])

    def _shared(self) -> Rows:
        rows = self.encoder.rows(self.pool, self.columns, "data.classes")
        if self.num_rows is not None and len(rows) != self.num_rows:
            raise RuntimeError(f"the training source changed since the driver read it: {self.num_rows} examples then, "
                               f"{len(rows)} here ({self.pool.files or self.pool.source})")
        return rows

    def _shard(self, rows: Rows, index: torch.Tensor, node: int, count: int) -> Split:
        return rows.select(index[shard_indices(len(index), count, self.seed)[node]])


@dataclass
class PreparedData:
    """What the driver holds: evaluation sets only ("test", "val", "shift/<name>"), the classes,
    the training recipe for the nodes, and the task they build (tasks.make_task)."""

    eval_sets: dict[str, Split]
    classes: list[str] | None
    train: TrainSource
    task: TaskSpec
    plan: DataPlan


def prepare_data(cfg: RunConfig, tokenizer=None, image_cfg: dict | None = None, plan: DataPlan | None = None) -> PreparedData:
    """The driver's side: evaluation sets loaded, training rows left where they are. `image_cfg`:
    the model's preprocessing (models.image_preprocessing: input_size, mean, std)."""
    d, plan = cfg.data, plan or describe_data(cfg)
    image_cfg = image_cfg or {}
    image_size = d.image_size or image_cfg.get("input_size", (3, 32, 32))[-1]
    encoder = Encoder(plan.task, plan.classes, tokenizer, d.max_length, image_size, plan.template, plan.label_words)
    encoder.check()
    rule = SplitRule(d.shuffle_seed, 0 if plan.test else d.test_size, d.val_size, None if plan.nodes else d.train_size,
                     needs_train=plan.nodes is None)
    sets, num_rows = {}, None
    if plan.pool is not None:
        rows = encoder.rows(plan.pool, plan.columns, "data.classes")
        num_rows, parts = len(rows), rule.parts(len(rows))
        if not d.eval_on_nodes:
            if plan.test is not None:
                sets["test"] = encoder.rows(plan.test, plan.columns, "data.test_split").select()
            else:
                sets["test"] = rows.select(parts["test"])
            if d.val_size:
                sets["val"] = rows.select(parts["val"])
    for name, (spec, columns) in plan.shifts.items():
        rows = encoder.rows(spec, columns, spec.field)
        sample = None  # data.shift_size: a fixed sample of a large shift set
        if d.shift_size and len(rows) > d.shift_size:
            sample = torch.randperm(len(rows), generator=torch.Generator().manual_seed(d.shuffle_seed))[: d.shift_size].sort().values
        sets[f"shift/{name}"] = rows.select(sample)
    task = TaskSpec(plan.task, image_size, tuple(image_cfg.get("mean", (0.5,) * 3)), tuple(image_cfg.get("std", (0.5,) * 3)))
    train = TrainSource(encoder, plan.columns, rule, cfg.seed, None if plan.nodes else plan.pool, plan.test, plan.nodes,
                        None if plan.nodes else num_rows, d.eval_on_nodes)
    logger.info("data %s: %s, %s", plan.name, plan.task, ", ".join(f"{k} {num_examples(v)}" for k, v in sets.items()) or "no driver-side sets")
    return PreparedData(sets, list(plan.classes) if plan.classes else None, train, task, plan)

