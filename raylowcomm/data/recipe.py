"""What the data is, decided on the driver from schemas, first rows and the role columns only
(`describe_data` -> `DataPlan`): its columns, task and classes, each node's own files
(`NodeFiles`), the shift sets, and which rows are test / val / train (`SplitRule`). Bad input is a
ConfigError naming its field, before the model loads or any actor starts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from raylowcomm import assets, catalog
from raylowcomm.catalog import Kind
from raylowcomm.config import ConfigError, DataConfig, RunConfig, kind_mismatch
from raylowcomm.data.rows import EMPTY, first_empty, unreadable
from raylowcomm.data.sources import SourceSpec, absolute, is_builder, kind_of, label_key, resolve_columns, sorted_labels

logger = logging.getLogger("raylowcomm")

# --- which examples are test / val / train -----------------------------------------------------


@dataclass(frozen=True)
class SplitRule:
    """Test, val and train examples of a split as a pure function of its size: the same indices on
    the driver and on every node."""

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
            raise ConfigError(
                field_name,
                self.train_size or self.test_size,
                f"the data has {n} examples; test_size + val_size + train_size must not exceed it",
            )
        held = self.test_size + self.val_size
        rest = order[held:]
        return {
            "test": order[: self.test_size],
            "val": order[self.test_size : held],
            "train": rest[: self.train_size] if self.train_size else rest,
        }


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
    if source is None or is_builder(source):
        return SourceSpec(source, absolute(files), split, field=field_name)
    return SourceSpec(os.path.abspath(source) if Path(source).exists() else source, files, split, field=field_name)


def _pool(data: DataConfig, preset: catalog.DatasetInfo | None) -> SourceSpec | None:
    """The source the seeded split draws from; None when a builder has no files (rows on the nodes only)."""
    files = data.files if data.files is not None else data.path
    if preset is not None:
        return SourceSpec(preset.source, absolute(files), data.split, asset=preset.asset if files is None else None)
    if is_builder(data.source) and files is None:
        return None
    return _user_spec(data.source, files, data.split, "data")


def _node_files(data: DataConfig, preset: catalog.DatasetInfo | None) -> NodeFiles | None:
    if data.node_files is None:
        return None
    builder = data.source if is_builder(data.source) else preset.source if preset is not None else None
    files = absolute(data.node_files)
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
        entries = {
            n: (SourceSpec(p.source, field=f"data.shift.{n}", asset=p.asset), p.columns)
            for n, p in (preset.shift if preset is not None else {}).items()
            if _available(p.asset)
        }
    else:
        inherit = pool.source if pool is not None else None  # a builder, a folder or a hub id
        entries = {
            n: (_user_spec(s.source or inherit, s.files, s.split, f"data.shift.{n}"), s.columns)
            for n, s in data.shift.items()
        }
    out = {}
    for name, (spec, given) in entries.items():
        spec.check()
        found = spec.peek()[1]
        inherited = {r: c for r, c in columns.items() if c in found and r not in given}
        resolved = resolve_columns(found, {**inherited, **given}, spec.field)
        for role in columns:
            if role not in resolved:
                raise ConfigError(
                    f"{spec.field}.columns.{role}", None, f"the training data has a {role} column; name this set's"
                )
        out[name] = (spec, {r: resolved[r] for r in columns})
        _check_filled(spec, out[name][1])
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


def _check_filled(spec: SourceSpec, columns: dict[str, str], streamed: bool = False) -> None:
    """Every cell of the columns a run reads holds a value (where the driver can read the rows): an
    empty label would become a class of its own, an empty text or image an example of nothing.
    `streamed`: read once as a stream, so that no copy of a node's training rows stays on the driver."""
    ds = spec.stream() if streamed else spec.open()
    for role, column in columns.items():
        row = first_empty(ds, column, role == "label")
        if row is not None:
            raise unreadable(spec, role, column, row, EMPTY)


def _check_labels(spec: SourceSpec, label: str, classes: tuple[str, ...]) -> None:
    ds = spec.open()
    unknown = sorted({label_key(v, ds.features[label]) for v in ds.unique(label)} - set(classes))
    if unknown:
        raise ConfigError(
            spec.field, unknown, f"labels not among the training classes {list(classes)}: relabel them by name"
        )


def _classes(
    data: DataConfig, pool: SourceSpec | None, nodes: list[SourceSpec], label: str, feature
) -> tuple[str, ...]:
    """Label names in class order: data.classes, the ClassLabel's names, or the sorted distinct
    labels of the driver's own data (of the node files only where the driver can read them)."""
    if data.classes:
        return tuple(map(str, data.classes))
    if getattr(feature, "names", None):
        return tuple(feature.names)
    sources = [pool] if pool is not None else nodes
    if not sources:
        raise ConfigError(
            "data.classes", None, "the training files live on the nodes only: list the label names in class order"
        )
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
        raise ConfigError(
            "data.label_words",
            None,
            "a causal LM classifies by the next token after each text + "
            "data.template: give one word per class, in class order "
            f"{list(classes)}",
        )
    if len(words) != len(classes):
        raise ConfigError("data.label_words", list(words), f"one per class: {len(classes)} classes {list(classes)}")
    return template, words


def describe_data(cfg: RunConfig) -> DataPlan:
    """What the data is (columns, kind, task, classes) from schemas, first rows and the columns the
    run reads only: every row of those columns (data.files' and, with node_files_on_driver, each
    node file's, streamed) is checked for empty cells, and the labels give the classes. Bad input
    is a ConfigError naming its field, before the model loads or any actor starts."""
    data = cfg.data
    preset = catalog.DATASETS.get(data.name) if data.source is None else None
    pool, nodes = _pool(data, preset), _node_files(data, preset)
    node_specs = [nodes.spec(k) for k in range(cfg.nodes.count)] if nodes and data.node_files_on_driver else []
    if pool is None and nodes is None:
        raise ConfigError(
            "data.files", None, f"the {data.source!r} builder reads files: give data.files or data.node_files"
        )
    if pool is None and not data.eval_on_nodes:
        raise ConfigError(
            "data.files",
            None,
            "node_files train on the nodes; the driver scores on data.files: "
            "give them, or set data.eval_on_nodes: true",
        )
    for spec in ([pool] if pool else []) + node_specs:
        spec.check()
    if pool is None and not node_specs and not data.columns:
        raise ConfigError(
            "data.columns",
            data.columns,
            "nothing here to read the columns from (node files on the "
            "nodes only, no data.files): name them, e.g. "
            "{text: review, label: stars}",
        )
    splits, found = (pool or node_specs[0]).peek() if pool or node_specs else ([], dict.fromkeys(data.columns.values()))
    columns = resolve_columns(found, {**(preset.columns if preset else {}), **data.columns}, "data")
    kind = kind_of(columns)
    task = catalog.task_of(cfg.model.family, kind)
    if task is None:
        raise kind_mismatch(data, cfg.model.family, kind, columns)
    for spec in node_specs:
        resolve_columns(spec.peek()[1], columns, "data")
        _check_filled(spec, columns, streamed=True)
    test = _test_split(data, pool, splits)
    for spec in [s for s in (pool, test) if s is not None]:
        _check_filled(spec, columns)
    label = columns.get("label")
    classes = _classes(data, pool, node_specs, label, found.get(label)) if label is not None else None
    template, words = _prompt(data, preset, task, classes)
    shifts = _shifts(data, preset, pool, columns, classes)
    return DataPlan(data.name, task, columns, classes, pool, test, shifts, nodes, template, words)
