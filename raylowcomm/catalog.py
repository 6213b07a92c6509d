"""The one place that knows the bundled datasets (named presets of the general data path: where
their files are, which columns hold what, their shift sets and prompts), which task a model
family trains on each kind of data, and the small task description that travels to nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["image", "labelled_text", "text"]
ROLES = ("text", "text_pair", "image", "label")
"""What a column can be for (data.columns: role -> column name)."""

PROMPT_TEMPLATE = " It was"
"""A causal LM classifies "<review> It was" by its next token: LABEL_WORDS[label] (MeZO's SST-2 prompt)."""
LABEL_WORDS = (" terrible", " great")


@dataclass(frozen=True)
class ShiftPreset:
    """A bundled distribution-shift set: an asset read like the training data."""

    asset: str
    source: str
    columns: dict[str, str]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    kind: Kind
    asset: str
    """The asset holding its files (raylowcomm/assets.py); `data.files` / `data.path` replace them."""
    source: str
    """The `datasets` builder that reads the asset's file."""
    columns: dict[str, str]
    """Roles (text, text_pair, image, label) -> the file's column names."""
    shift: dict[str, ShiftPreset] = field(default_factory=dict)
    """Real distribution-shift sets scored as shift/<name>_* (data.shift: auto)."""
    template: str | None = None
    label_words: tuple[str, ...] | None = None


_DIGITS = {"image": "pixels", "label": "label"}
_REVIEWS = {"text": "text", "label": "label"}

DATASETS = {
    d.name: d
    for d in (
        DatasetInfo(
            "mnist", "image", "mnist", "csv", _DIGITS, shift={"uci_digits": ShiftPreset("uci_digits", "csv", _DIGITS)}
        ),
        DatasetInfo(
            "rotten_tomatoes",
            "labelled_text",
            "rotten_tomatoes",
            "csv",
            _REVIEWS,
            shift={"amazon_reviews": ShiftPreset("amazon_reviews", "csv", _REVIEWS)},
            template=PROMPT_TEMPLATE,
            label_words=LABEL_WORDS,
        ),
        DatasetInfo("hamlet", "text", "hamlet", "text", {"text": "text"}),
        DatasetInfo("speeches", "text", "speeches", "text", {"text": "text"}),
    )
}

TASKS = {
    ("timm", "image"): "image_classification",
    ("hf_classifier", "labelled_text"): "text_classification",
    ("hf_causal_lm", "labelled_text"): "prompt_classification",
    ("hf_causal_lm", "text"): "causal_lm",
}
"""(model family, data kind) -> the task that trains and scores that model on that data."""

NEW_HEAD_TASKS = ("image_classification", "text_classification")
"""Tasks that give the model a new classifier head with the data's class count."""

FAMILIES_FOR_KIND = {kind: sorted(f for f, k in TASKS if k == kind) for kind in ("image", "labelled_text", "text")}
FAMILY_DATA = {
    kind: " or ".join(d.name for d in DATASETS.values() if d.kind == kind)
    for kind in ("image", "labelled_text", "text")
}
"""Dataset names of each kind, for error messages."""


@dataclass(frozen=True)
class TaskSpec:
    """What a node needs to build its task (tasks.make_task): small and picklable, decided on the
    driver from the data and the model (image size and normalisation from the model's config)."""

    name: str
    image_size: int = 32
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)


def task_of(family: str, kind: Kind) -> str | None:
    """The task a `family` model trains on data of `kind`, None when they do not fit."""
    return TASKS.get((family, kind))


def declared_kind(name: str, source: str | None, columns: dict[str, str]) -> Kind | None:
    """The data's kind as far as the config alone says it: a preset's, or from the roles named in
    `columns`; None when only the data's schema can tell (checked when it is read)."""
    if source is None:
        return DATASETS[name].kind if name in DATASETS else None
    if "image" in columns:
        return "image"
    return "labelled_text" if "label" in columns else None


def task_name(family: str, data: str) -> str | None:
    """The task a `family` model trains on the preset `data`, None when they do not fit."""
    return task_of(family, DATASETS[data].kind)
