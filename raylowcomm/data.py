"""Datasets as dicts of tensors: loaded with `datasets` from the cached asset files (or your own),
split into test / val / train once with a fixed seed, and sharded across nodes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from raylowcomm import assets, catalog
from raylowcomm.config import ConfigError, DataConfig
from raylowcomm.seeding import epoch_seed

Split = dict[str, torch.Tensor]

PROMPT_TEMPLATE = " It was"
"""A causal LM classifies "<review> It was" by its next token: LABEL_WORDS[label] (MeZO's SST-2 prompt)."""
LABEL_WORDS = (" terrible", " great")


@dataclass
class Datasets:
    train: Split
    test: Split
    val: Split | None = None
    shift: Split | None = None
    shift_name: str | None = None


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


def batch_order(n: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The batches of one epoch (full batches only), a pure function of (seed, epoch)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))
    return [perm[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def eval_batches(split: Split, batch_size: int):
    n = num_examples(split)
    for i in range(0, n, batch_size):
        yield {k: v[i : i + batch_size] for k, v in split.items()}


def _digits(name: str, path: str | None) -> Split:
    from datasets import load_dataset

    file = Path(path) if path else assets.require(name)
    table = load_dataset("csv", data_files=str(file), split="train")
    side = json.loads((file.parent / "meta.json").read_text())["side"] if (file.parent / "meta.json").exists() else None
    pixels = torch.tensor([[int(p) for p in row.split()] for row in table["pixels"]], dtype=torch.uint8)
    side = side or int(round(pixels.shape[1] ** 0.5))
    return {"pixels": pixels.view(-1, side, side), "labels": torch.tensor(list(table["label"]), dtype=torch.long)}


def _reviews(path: str | None, tokenizer, max_length: int) -> Split:
    from datasets import load_dataset

    table = load_dataset("csv", data_files=str(path or assets.require("rotten_tomatoes")), split="train")
    tokenizer.padding_side = "right"  # tasks.trim_padding cuts batches to their longest row
    enc = tokenizer(list(table["text"]), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": torch.tensor(list(table["label"]), dtype=torch.long)}


def _prompted_reviews(path: str | None, tokenizer, max_length: int) -> Split:
    """Review + PROMPT_TEMPLATE, right-padded; the review is cut so the template always fits."""
    from datasets import load_dataset

    table = load_dataset("csv", data_files=str(path or assets.require("rotten_tomatoes")), split="train")
    template = tokenizer(PROMPT_TEMPLATE, add_special_tokens=False)["input_ids"]
    words = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in LABEL_WORDS]
    if any(len(w) != 1 for w in words):
        raise ValueError(f"label words {LABEL_WORDS} must be single tokens for this tokenizer, got {words}")
    if max_length <= len(template):
        raise ConfigError("data.max_length", max_length, f"must exceed the prompt's {len(template)} tokens")
    reviews = tokenizer(list(table["text"]), add_special_tokens=False, truncation=True, max_length=max_length - len(template))["input_ids"]
    ids = torch.full((len(reviews), max_length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(reviews), max_length), dtype=torch.long)
    for i, review in enumerate(reviews):
        row = review + template
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    choices = torch.tensor([w[0] for w in words]).expand(len(reviews), -1).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(table["label"], dtype=torch.long), "choice_ids": choices}


def _text_blocks(name: str, path: str | None, tokenizer, block: int) -> Split:
    from datasets import load_dataset

    table = load_dataset("text", data_files=str(path or assets.require(name)), split="train")
    ids = tokenizer("\n".join(table["text"]), return_tensors="pt")["input_ids"][0]
    n = len(ids) // block
    return {"input_ids": ids[: n * block].view(n, block)}


def load_datasets(cfg: DataConfig, tokenizer=None, prompt: bool = False) -> Datasets:
    """Fixed test / val / train split (by `shuffle_seed`), train trimmed to `train_size`.
    `prompt`: labelled text as prompts for a causal LM (see PromptClassification)."""
    kind = catalog.dataset(cfg.name).kind
    if kind == "image":
        full = _digits(cfg.name, cfg.path)
    elif kind == "labelled_text" and prompt:
        full = _prompted_reviews(cfg.path, tokenizer, cfg.max_length)
    elif kind == "labelled_text":
        full = _reviews(cfg.path, tokenizer, cfg.max_length)
    else:
        full = _text_blocks(cfg.name, cfg.path, tokenizer, cfg.max_length)
    n = num_examples(full)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.shuffle_seed))
    needed = cfg.test_size + cfg.val_size + (cfg.train_size or 1)
    if needed > n:
        raise ConfigError("data.train_size", cfg.train_size, f"{cfg.name} has {n} examples; test_size + val_size + train_size must not exceed it")
    test = take(full, order[: cfg.test_size])
    val = take(full, order[cfg.test_size : cfg.test_size + cfg.val_size]) if cfg.val_size else None
    rest = order[cfg.test_size + cfg.val_size :]
    train = take(full, rest[: cfg.train_size] if cfg.train_size else rest)
    shift_name = catalog.dataset(cfg.name).shift if cfg.shift == "auto" else None
    shift = _digits(shift_name, None) if shift_name else None
    return Datasets(train=train, test=test, val=val, shift=shift, shift_name=shift_name)
