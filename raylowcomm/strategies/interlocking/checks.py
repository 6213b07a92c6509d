"""Interlocking's checks of a config before anything starts (`validate_config`), and of its options
against the loaded model and data (`check_loaded`): split out of the strategy so that it keeps to
running the stages."""

from __future__ import annotations

import dataclasses

from raylowcomm import catalog
from raylowcomm.common.batches import num_examples
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.interlock.splitting import is_hf_decoder, is_timm_cnn, model_units
from raylowcomm.models import ASSET_TIMM_ARCH
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.interlocking.config import InterlockingConfig


def refuse_churn(cfg: RunConfig) -> None:
    """No churn section: a stage holds layers no other has, and none is restarted."""
    if cfg.churn.active:
        raise ConfigError(
            "churn",
            "set",
            "interlocking's stages each hold layers no other has and are not restarted: run churn "
            "with lofi, ddp or spsa, or remove the churn section",
        )


def validate_heads(cfg: RunConfig, o: InterlockingConfig) -> None:
    """interlocking.aux_positions: a fraction of the positions, below 1 only for a decoder's tokens."""
    if not 0 < o.aux_positions <= 1:
        raise ConfigError("interlocking.aux_positions", o.aux_positions, "a fraction in (0, 1] of the positions")
    if o.aux_positions < 1 and cfg.model.family != "hf_causal_lm":
        raise ConfigError(
            "interlocking.aux_positions",
            o.aux_positions,
            "reads a subset of a decoder's token positions: set it to 1 for this model",
        )


def validate_config(cfg: RunConfig, o: InterlockingConfig) -> None:
    """The options ``o`` of ``cfg``, before the model or data load: what interlocking can run."""
    refuse_churn(cfg)
    for name in ("stages", "micro_batches", "max_batches_ahead"):
        if getattr(o, name) < 1:
            raise ConfigError(f"interlocking.{name}", getattr(o, name), "must be >= 1")
    if not 1 <= o.n <= o.stages:
        raise ConfigError("interlocking.n", o.n, f"must be in 1..interlocking.stages ({o.stages})")
    if cfg.optim.batch_size % o.micro_batches:
        raise ConfigError(
            "interlocking.micro_batches",
            o.micro_batches,
            f"must divide optim.batch_size ({cfg.optim.batch_size}) evenly",
        )
    validate_heads(cfg, o)
    if o.time_budget_s is not None and o.time_budget_s <= 0:
        raise ConfigError("interlocking.time_budget_s", o.time_budget_s, "must be > 0, or null for no budget")
    for name, per_stage in (("aux_widths", False), ("split", True)):
        value = getattr(o, name)
        if value is not None and (not value or min(value) < 1 or (per_stage and len(value) != o.stages)):
            raise ConfigError(
                f"interlocking.{name}",
                value,
                "must be a non-empty list of positive numbers" + (", one per stage" if per_stage else ""),
            )
    if cfg.model.family == "hf_classifier":
        raise ConfigError(
            "model.family", cfg.model.family, "interlocking splits timm CNNs and causal LMs (hf_causal_lm)"
        )
    if cfg.data.node_files is not None or cfg.data.eval_on_nodes:
        field = "data.node_files" if cfg.data.node_files is not None else "data.eval_on_nodes"
        raise ConfigError(
            field,
            getattr(cfg.data, field[5:]),
            "interlocking trains one model on one stream of batches and scores it on the driver's sets: not offered",
        )
    kind = catalog.declared_kind(cfg.data.name, cfg.data.source, cfg.data.columns)
    if cfg.model.family == "hf_causal_lm" and kind not in ("text", None):
        raise ConfigError(
            "data.name",
            cfg.data.name,
            f"interlocking trains a causal LM on plain text: {catalog.FAMILY_DATA['text']}",
        )
    arch = cfg.model.timm_arch or ASSET_TIMM_ARCH.get(cfg.model.name, cfg.model.name)
    if cfg.model.family == "timm" and not any(kind in arch for kind in ("resnet", "efficientnet", "mobilenet")):
        raise ConfigError(
            "model.name",
            cfg.model.name,
            "interlocking splits timm ResNets and EfficientNet/MobileNet models (e.g. resnet18)",
        )
    if cfg.model.family == "hf_causal_lm" and cfg.model.lora is not None:
        raise ConfigError(
            "model.lora",
            dataclasses.asdict(cfg.model.lora),
            "interlocking splits a causal LM's own "
            "decoder layers, not adapters wrapped around them: train it without LoRA "
            "(model.lora: null)",
        )


def check_loaded(ctx: RunContext, opts: InterlockingConfig) -> None:
    """The options against the loaded model and data: how many units (stem + blocks, or decoder
    layers) the model has and how many test rows time a measured split are known only now."""
    cfg, family = ctx.cfg, ctx.spec.family
    if family == "timm" and not is_timm_cnn(ctx.architecture):
        raise ConfigError(
            "model.name",
            cfg.model.name,
            "has neither ResNet layers (layer1..4) nor conv_stem + "
            "blocks: interlocking splits timm ResNets and EfficientNet/MobileNet models "
            "(e.g. resnet18)",
        )
    if family == "hf_causal_lm" and not is_hf_decoder(ctx.architecture):
        field = "model.path" if cfg.model.path else "model.name"
        raise ConfigError(
            field,
            getattr(cfg.model, field[6:]),
            "is not a Llama-style decoder (model.embed_tokens, "
            "layers, norm, rotary_emb and lm_head): interlocking splits those",
        )
    units, what = model_units(ctx.architecture, family), "stem + blocks" if family == "timm" else "decoder layers"
    if opts.split is not None and sum(opts.split) != units:
        raise ConfigError(
            "interlocking.split",
            opts.split,
            f"must add up to the model's {units} units ({what}), one entry per stage",
        )
    if opts.stages > units:
        raise ConfigError("interlocking.stages", opts.stages, f"the model has only {units} units ({what}) to split")
    micro, test = cfg.optim.batch_size // opts.micro_batches, num_examples(ctx.data.eval_sets["test"])
    if opts.balance == "measured" and opts.split is None and test < micro:
        raise ConfigError(
            "interlocking.balance",
            opts.balance,
            f"times a micro-batch ({micro} rows) of the test "
            f"set, which has {test}: raise data.test_size, or use blocks or params",
        )
