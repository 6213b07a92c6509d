"""Rows -> tensors, the same on the driver and on every node: `Encoder` (the class map, the
tokenizer and the prompt), `pixels`, and `Rows`, a split's examples by index. A value no reader
can take (an empty cell, a corrupt image, a number where text belongs) is an error naming its
column, its file and its row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raylowcomm.common.batches import Split, num_examples, take
from raylowcomm.config import ConfigError
from raylowcomm.data.sources import SourceSpec, label_key

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
        if _empty(value):
            raise UnreadableValue("image", i, EMPTY)
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
            raise ConfigError(
                "data.label_words", list(self.label_words), f"each must be one token for this tokenizer, got {words}"
            )
        template = self.tokenizer(self.template, add_special_tokens=False)["input_ids"]
        if self.max_length <= len(template):
            raise ConfigError("data.max_length", self.max_length, f"must exceed the prompt's {len(template)} tokens")

    def labels(self, values, feature, label_field: str) -> torch.Tensor:
        index = {name: i for i, name in enumerate(self.classes)}
        for i, value in enumerate(values):
            if _empty_label(value, feature):
                raise UnreadableValue("label", i, EMPTY)
        keys = [label_key(v, feature) for v in values]
        unknown = sorted(set(keys) - index.keys())
        if unknown:
            raise ConfigError(
                label_field,
                unknown,
                f"labels not among the training classes {list(self.classes)}: "
                "relabel them by name, or list every class in data.classes",
            )
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
        enc = self.tokenizer(
            texts, pairs, padding="longest", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        pair_types = pairs is not None and "token_type_ids" in enc
        keep = ("input_ids", "attention_mask") + (("token_type_ids",) if pair_types else ())
        return {k: enc[k] for k in keep}

    def _prompts(self, texts: list[str]) -> Split:
        """Text + template, right-padded; the text is cut so the template always fits."""
        template = self.tokenizer(self.template, add_special_tokens=False)["input_ids"]
        words = [self.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in self.label_words]
        rows = [
            r + template
            for r in self.tokenizer(
                texts, add_special_tokens=False, truncation=True, max_length=self.max_length - len(template)
            )["input_ids"]
        ]
        width = max(map(len, rows), default=0)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        choices = torch.tensor(words).expand(len(rows), -1).contiguous()
        return {"input_ids": ids, "attention_mask": mask, "choice_ids": choices}

    def rows(self, spec: SourceSpec, columns: dict[str, str], label_field: str) -> Rows:
        """`spec`'s rows, opened here; `label_field`: the config field an unknown label is blamed on."""
        return Rows(spec, columns, self, label_field)


class UnreadableValue(ValueError):
    """A value the image, text or label reader cannot take: its role and its position in the rows read."""

    def __init__(self, role: str, position: int, reason: str):
        super().__init__(reason)
        self.role, self.position, self.reason = role, position, reason


EMPTY = "its cell is empty"


def _empty(value) -> bool:
    """A missing cell as the readers give it: None (a CSV, JSON or Parquet null) or a float NaN."""
    return value is None or (isinstance(value, float) and value != value)


def _empty_label(value, feature) -> bool:
    """A label cell that holds no label: empty, blank text, or a ClassLabel's -1 (no label)."""
    if _empty(value) or (isinstance(value, str) and not value.strip()):
        return True
    return getattr(feature, "names", None) is not None and value == -1


def _texts(values, role: str = "text") -> list[str]:
    """Text as text; an empty cell or anything else (a number, a list) is not guessed at."""
    values = list(values)
    for i, t in enumerate(values):
        if _empty(t):
            raise UnreadableValue(role, i, EMPTY)
        if not isinstance(t, str):
            raise UnreadableValue(role, i, f"{type(t).__name__} {str(t)[:40]!r} is not text")
    return values


def unreadable(spec: SourceSpec, role: str, column: str, row: int, reason: str) -> ConfigError:
    """Names the column and the row (its number in the split) whose value cannot be read."""
    what = {"image": "an image", "label": "a label"}.get(role, "text")
    return ConfigError(
        f"{spec.field}.columns.{role}",
        column,
        f"row {row} of {spec.where} is unreadable as {what} ({reason}): fix or drop that row, or name another column",
    )


def first_empty(ds, column: str, label: bool) -> int | None:
    """The first row whose `column` cell is empty (as `_empty`, for a label `_empty_label`), read in
    Arrow batches without decoding a value, from a Dataset or a stream alike; None when every cell
    is filled."""
    import pyarrow as pa
    import pyarrow.compute as pc

    class_label = getattr((ds.features or {}).get(column), "names", None) is not None
    seen = 0
    for batch in ds.select_columns([column]).with_format("arrow").iter(batch_size=65536):
        values = batch[column]
        empty = pc.is_null(values, nan_is_null=True)
        if label and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            empty = pc.or_(empty, pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), False))
        if label and class_label:
            empty = pc.or_(empty, pc.fill_null(pc.equal(values, -1), False))
        row = pc.index(empty, True).as_py()
        if row >= 0:
            return seen + row
        seen += len(batch)
    return None


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
        return unreadable(self.spec, err.role, self.columns[err.role], int(index[err.position]), err.reason)
