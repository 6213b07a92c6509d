"""Which settings can take effect in a run: one rule for every field of the schema, so a setting
the run would ignore is refused (or, where it is meant for another strategy of the run, said in one
warning line), never silently dropped.

A rule takes the run's config and the object holding the field (a section, a strategy's options, an
entry of a list such as churn.kill) and returns why the field cannot take effect, with the fix, or
None. Only fields the user set away from their default are asked: a field left at its documented
default changes nothing. Shared fields that only some strategies honour are named by each strategy
that does not (`Strategy.ignores`); each strategy's own fields have rules of its own
(`Strategy.option_rules`). `tests/test_applicability.py` walks the schema: a new field without a
rule fails it.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from raylowcomm.config.bad_nodes import check_bad_nodes
from raylowcomm.config.schema import ConfigError, RunConfig

logger = logging.getLogger("raylowcomm")

Rule = Callable[[RunConfig, Any], "str | None"]
"""(the run's config, the object that holds the field) -> why the field cannot take effect, or None."""


def always(cfg: RunConfig, holder: Any) -> None:
    """The field takes effect in every run that can start (its range is checked elsewhere)."""
    return None


def needs(test: Callable[[RunConfig, Any], bool], why: str) -> Rule:
    """A field that takes effect only where `test(cfg, holder)` holds; `why` says what it needs and the fix."""

    def rule(cfg: RunConfig, holder: Any) -> str | None:
        return None if test(cfg, holder) else why

    return rule


def _family(*families: str) -> Callable[[RunConfig, Any], bool]:
    return lambda cfg, _: cfg.model.family in families


SHARED_RULES: dict[str, Rule] = {
    "model.name": always,
    "model.family": always,
    "model.path": always,
    "model.pretrained": always,
    "model.config_overrides": always,  # checks.validate: only with pretrained: false on a Hugging Face model
    "model.timm_arch": needs(_family("timm"), "names a timm architecture: only with model.family: timm; remove it"),
    "model.lora": always,
    "model.lora.r": always,
    "model.lora.alpha": always,
    "model.lora.dropout": always,
    "model.lora.target_modules": always,
    "model.merge": always,  # checks.validate_lora: only with model.lora
    "model.dtype": always,
    "model.memory_format": needs(
        _family("timm"), "lays out an image model's 4-D weights: only with model.family: timm; remove it"
    ),
    "model.source": always,
    "data.name": always,
    "data.source": always,
    "data.files": always,
    "data.path": always,
    "data.split": always,
    "data.test_split": always,
    "data.columns": always,
    "data.classes": always,
    "data.train_size": always,
    "data.test_size": always,
    "data.val_size": always,
    "data.shift": always,
    "data.shift.source": always,
    "data.shift.files": always,
    "data.shift.split": always,
    "data.shift.columns": always,
    "data.shift_size": needs(
        lambda cfg, d: d.shift != "none", "sizes the shift sets, and data.shift is none: remove it or set data.shift"
    ),
    "data.node_files": always,
    "data.node_files_on_driver": needs(
        lambda cfg, d: d.node_files is not None, "says where data.node_files lie, and none are given: remove it"
    ),
    "data.eval_on_nodes": always,
    "data.template": needs(
        _family("hf_causal_lm"), "prompts a causal LM to classify: only with model.family: hf_causal_lm; remove it"
    ),
    "data.label_words": needs(
        _family("hf_causal_lm"), "the words a causal LM answers with: only with model.family: hf_causal_lm; remove it"
    ),
    "data.image_size": needs(_family("timm"), "resizes images: this model reads text; remove it"),
    "data.max_length": needs(
        lambda cfg, _: cfg.model.family != "timm", "cuts text to tokens: this model reads images; remove it"
    ),
    "data.shuffle_seed": always,
    "optim.name": always,
    "optim.lr": always,
    "optim.momentum": needs(
        lambda cfg, o: o.name == "sgd", "is SGD's momentum; optim.name adamw keeps moments of its own: remove it"
    ),
    "optim.weight_decay": always,
    "optim.batch_size": always,
    "optim.epochs": always,
    "optim.max_steps": always,
    "optim.budget_s": always,
    "optim.group_by_length": always,  # checks._check_data: text only
    "optim.eval_batch_size": always,
    "optim.precision": always,
    "nodes.count": always,
    "nodes.cpus": always,
    "nodes.gpus": always,
    "nodes.max_restarts": always,
    "nodes.placement": always,
    "nodes.hosts": always,
    "nodes.start_timeout_s": always,
    "nodes.wait_for_resources": always,
    "nodes.resources": always,
    "churn.slow": always,
    "churn.slow.node": always,
    "churn.slow.factor": always,
    "churn.kill": always,
    "churn.kill.node": always,
    "churn.kill.at_step": always,
    "churn.kill_every_s": always,
    "churn.seed": needs(
        lambda cfg, c: c.kill_every_s is not None,
        "draws the victims of churn.kill_every_s, which is not set: remove it or set kill_every_s",
    ),
    "churn.cpu_quota": always,
    "bad_nodes": lambda cfg, _: check_bad_nodes(cfg),  # refuses a bad entry itself, naming its field
    "bad_nodes.node": always,
    "bad_nodes.update": always,
    "bad_nodes.scale": always,
    "bad_nodes.round": always,
    "strategies": always,
    "seed": always,
    "out_dir": always,
    "storage": always,
    "log_every": always,
    "checkpoint_every": always,
    "eval_every": always,
}
"""Every shared field's rule, by its dotted name (entries of a list or mapping by the list's name)."""

INTERNAL = {"options"}
"""RunConfig fields no user writes (each strategy's section fills `options`)."""


def _nested(tp) -> type | None:
    """The dataclass a field holds, alone, in a list, as a mapping's values or optionally; else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    origin = typing.get_origin(tp)
    if origin in (list, dict, typing.Union, types.UnionType):
        for arg in typing.get_args(tp)[1:] if origin is dict else typing.get_args(tp):
            if (found := _nested(arg)) is not None:
                return found
    return None


def schema_paths(cls: type, prefix: str = "") -> Iterator[str]:
    """The dotted name of every field of `cls`, recursing into the dataclasses its fields hold: the
    names the rule tables must cover."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not prefix and cls is RunConfig and f.name in INTERNAL:
            continue
        path = f"{prefix}{f.name}"
        if not dataclasses.is_dataclass(hints[f.name]):  # a section (model, data, ...) is its fields
            yield path
        inner = _nested(hints[f.name])
        if inner is not None:
            yield from schema_paths(inner, path + ".")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def set_fields(holder: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted name, value, holder) of every field set away from its default in `holder`, entries of
    lists and mappings of dataclasses included (an entry's fields have no default to leave unset)."""
    for f in dataclasses.fields(holder):
        if not prefix and isinstance(holder, RunConfig) and f.name in INTERNAL:
            continue
        value, path = getattr(holder, f.name), f"{prefix}{f.name}"
        if value == _default(f):
            continue
        if not dataclasses.is_dataclass(f.default_factory):  # a section (model, data, ...) is its fields
            yield path, value, holder
        entries = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        for entry in entries:
            if dataclasses.is_dataclass(entry):
                yield from set_fields(entry, path + ".")


def check_applicability(cfg: RunConfig, strategies: Mapping[str, Any]) -> None:
    """Refuse (ConfigError) a set field that cannot take effect in this run; say in one warning line a
    field or section that only a strategy the run also holds cannot use."""
    for path, value, holder in set_fields(cfg):
        why = SHARED_RULES[path](cfg, holder)
        if why is not None:
            raise ConfigError(path, value, f"cannot take effect here: {why}")
        ignored = {name: strategies[name].ignores[path] for name in cfg.strategies if path in strategies[name].ignores}
        if ignored and len(ignored) == len(cfg.strategies):
            raise ConfigError(
                path, value, f"cannot take effect here: {'; '.join(f'{s}: {w}' for s, w in ignored.items())}; remove it"
            )
        for name, why in ignored.items():
            logger.warning("%s: %s=%r does not apply to %s: %s", name, path, value, name, why)
    for name, strategy in strategies.items():
        opts = cfg.options[name]
        if name not in cfg.strategies:
            if opts != strategy.Config():
                logger.warning(
                    "the %s section is set, but %s is not among the run's strategies: it is unused", name, name
                )
            continue
        for path, value, holder in set_fields(opts, name + "."):
            rule = strategy.option_rules.get(path[len(name) + 1 :])
            if rule is None:
                raise TypeError(f"strategy {name} has no rule for {path} in its option_rules (docs/python-api.md)")
            why = rule(cfg, holder)
            if why is not None:
                raise ConfigError(path, value, f"cannot take effect here: {why}")
