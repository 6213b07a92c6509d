"""The one place that knows the bundled datasets: their kind, classes, shift sets, and which
task a model family trains on them. Config validation, data loading and task choice read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["image", "labelled_text", "text"]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    kind: Kind
    num_classes: int | None = None
    shift: str | None = None
    """Asset name of the dataset's real distribution-shift set, scored as shift_*."""


DATASETS = {d.name: d for d in (
    DatasetInfo("mnist", "image", num_classes=10, shift="uci_digits"),
    DatasetInfo("rotten_tomatoes", "labelled_text", num_classes=2),
    DatasetInfo("hamlet", "text"),
    DatasetInfo("speeches", "text"),
)}

TASKS = {
    ("timm", "image"): "image_classification",
    ("hf_classifier", "labelled_text"): "text_classification",
    ("hf_causal_lm", "labelled_text"): "prompt_classification",
    ("hf_causal_lm", "text"): "causal_lm",
}
"""(model family, dataset kind) -> the task that trains and scores that model on that data."""

FAMILIES_FOR_KIND = {kind: sorted(f for f, k in TASKS if k == kind) for kind in ("image", "labelled_text", "text")}
FAMILY_DATA = {kind: " or ".join(d.name for d in DATASETS.values() if d.kind == kind) for kind in ("image", "labelled_text", "text")}
"""Dataset names of each kind, for error messages."""


def dataset(name: str) -> DatasetInfo:
    return DATASETS[name]


def task_name(family: str, data: str) -> str | None:
    """The task a `family` model trains on dataset `data`, None when they do not fit."""
    return TASKS.get((family, DATASETS[data].kind))


def num_classes(family: str, data: str) -> int | None:
    """Classes of a new classifier head: the dataset's, or None where the task keeps the model's own head."""
    return DATASETS[data].num_classes if task_name(family, data) in ("image_classification", "text_classification") else None
