"""`model.config_overrides`: applied to a Hugging Face config before a random initialisation
(`models.load_base`), and checked against what the tokenizer and the data will feed the model
(`check_overrides`, in `runner.prepare`): an override that contradicts them (a vocabulary smaller
than the tokenizer's, fewer positions than data.max_length, another number of classes) would fail
only inside a node or stage, at its first batch, as an index error far from its cause."""

from __future__ import annotations

from raylowcomm.config import ConfigError, ModelConfig, RunConfig

LABEL_KEYS = ("num_labels", "id2label", "label2id")
"""Overrides that set a classifier's number of classes (transformers derives num_labels from id2label)."""


def apply_overrides(cfg: ModelConfig, config) -> None:
    """Set each `model.config_overrides` field on the Hugging Face `config`; a field the config does
    not have is an error naming it (a typo would otherwise add an attribute nothing reads)."""
    for key, value in (cfg.config_overrides or {}).items():
        if not hasattr(config, key):
            raise ConfigError(f"model.config_overrides.{key}", value, f"not a field of {type(config).__name__}")
        setattr(config, key, value)


def check_overrides(
    cfg: RunConfig, config, tokenizer, num_classes: int | None, columns: dict[str, str] | None = None
) -> None:
    """Refuse, before any actor starts, an override that contradicts the tokenizer or the data: the
    token ids the tokenizer emits must index the embedding (vocab_size), each example's
    data.max_length tokens a position (max_position_embeddings), a text pair's segment ids the token
    types (type_vocab_size), and a new head must have the data's classes (num_labels). `config`: the
    model's config as built (the overrides applied); `columns`: the data's (a "text_pair" column
    makes pairs)."""
    overrides = cfg.model.config_overrides or {}
    if not overrides or tokenizer is None:
        return
    source = cfg.model.path or cfg.model.name
    vocab = len(tokenizer)
    if "vocab_size" in overrides and config.vocab_size < vocab:
        raise ConfigError(
            "model.config_overrides.vocab_size",
            overrides["vocab_size"],
            f"below the {vocab} tokens of {source}'s tokenizer, whose ids (up to {vocab - 1}) would index "
            f"past the embedding: set it to at least {vocab}, or leave it out (the tokenizer's own size)",
        )
    positions = getattr(config, "max_position_embeddings", None)
    if "max_position_embeddings" in overrides and positions is not None and positions < cfg.data.max_length:
        raise ConfigError(
            "model.config_overrides.max_position_embeddings",
            overrides["max_position_embeddings"],
            f"below data.max_length ({cfg.data.max_length} tokens an example or block): raise it to at least "
            f"{cfg.data.max_length}, or lower data.max_length",
        )
    pairs = "text_pair" in (columns or {}) and "token_type_ids" in tokenizer.model_input_names
    if "type_vocab_size" in overrides and pairs and config.type_vocab_size < 2:
        raise ConfigError(
            "model.config_overrides.type_vocab_size",
            overrides["type_vocab_size"],
            "the data's text pairs give the tokenizer's segment ids 0 and 1: set it to at least 2, or leave it out",
        )
    given = [key for key in LABEL_KEYS if key in overrides]
    if given and num_classes is not None and config.num_labels != num_classes:
        raise ConfigError(
            f"model.config_overrides.{given[0]}",
            overrides[given[0]],
            f"gives the head {config.num_labels} classes where the data has {num_classes}: leave it out "
            "(the head is sized to the data's classes)",
        )
