"""Every config field has an applicability rule (a new field cannot forget one), and a setting that
cannot take effect is refused, or said in one warning line where another strategy of the run uses it."""

from __future__ import annotations

import logging

import pytest

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.applicability import SHARED_RULES, schema_paths
from raylowcomm.strategies import STRATEGIES, from_dict

BASE = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 64, "test_size": 32, "image_size": 16},
    "optim": {"batch_size": 8},
    "strategies": ["lofi"],
}


def _with(**sections) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for name, fields in sections.items():
        raw[name] = {**raw.get(name, {}), **fields} if isinstance(fields, dict) else fields
    return raw


def test_every_shared_field_has_a_rule():
    assert set(schema_paths(RunConfig)) == set(SHARED_RULES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_option_of_every_strategy_has_a_rule(name):
    strategy = STRATEGIES[name]
    assert set(schema_paths(strategy.Config)) == set(strategy.option_rules)


def test_ignored_fields_are_shared_fields():
    for strategy in STRATEGIES.values():
        assert set(strategy.ignores) <= set(SHARED_RULES), strategy.name


REFUSED = [
    ("sync-every-s-without-time", _with(lofi={"sync_every_s": 5}), "lofi.sync_every_s"),
    ("grace-without-quorum", _with(lofi={"compress": "int8", "grace_s": 2}), "lofi.grace_s"),
    ("dense-codec-without-dense", _with(lofi={"dense_codec": "int2"}), "lofi.dense_codec"),
    ("topk-fraction-with-int8", _with(lofi={"compress": "int8", "topk_fraction": 0.1}), "lofi.topk_fraction"),
    ("block-without-codec", _with(lofi={"compress_block": 128}), "lofi.compress_block"),
    ("error-feedback-without-codec", _with(lofi={"error_feedback": False}), "lofi.error_feedback"),
    ("mix-without-overlap", _with(lofi={"compress": "int8", "average_every": 2, "mix": 0.5}), "lofi.mix"),
    ("outer-lr-without-nesterov", _with(lofi={"outer_lr": 0.5}), "lofi.outer_lr"),
    ("lora-average-without-lora", _with(lofi={"lora_average": "factors"}), "lofi.lora_average"),
    ("staleness-in-lockstep", _with(lofi={"compress": "int8", "average_every": 2, "staleness": 1}), "lofi.staleness"),
    (
        "both-budgets",
        _with(strategies=["interlocking"], optim={"batch_size": 8, "budget_s": 5}, interlocking={"time_budget_s": 20}),
        "interlocking.time_budget_s",
    ),
    ("interlocking-rule-at-n-1", _with(strategies=["interlocking"], interlocking={"rule": "sum"}), "interlocking.rule"),
    ("spsa-scale-with-log", _with(strategies=["spsa"], spsa={"scale": 0.5}), "spsa.scale"),
    ("momentum-with-adamw", _with(optim={"batch_size": 8, "name": "adamw", "momentum": 0.5}), "optim.momentum"),
    ("template-on-an-image-model", _with(data={**BASE["data"], "template": " It was"}), "data.template"),
    ("max-length-on-an-image-model", _with(data={**BASE["data"], "max_length": 32}), "data.max_length"),
    ("churn-seed-without-kill-every", _with(churn={"seed": 3}), "churn.seed"),
    ("restarts-for-spsa-alone", _with(strategies=["spsa"], nodes={"max_restarts": 3}), "nodes.max_restarts"),
    ("checkpoints-for-interlocking-alone", _with(strategies=["interlocking"], checkpoint_every=10), "checkpoint_every"),
    ("count-for-interlocking-alone", _with(strategies=["interlocking"], nodes={"count": 4}), "nodes.count"),
]


@pytest.mark.parametrize("raw, field", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_setting_that_cannot_take_effect_is_refused(raw, field):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field_name == field and "cannot take effect" in str(err.value)


def test_a_field_at_its_default_is_not_asked():
    from_dict(_with(lofi={"sync_every_s": None, "grace_s": 0.0, "dense_codec": "int8"}))


def test_a_field_another_strategy_of_the_run_uses_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="raylowcomm"):
        from_dict(_with(strategies=["lofi", "spsa"], nodes={"max_restarts": 3}))
    lines = [r.getMessage() for r in caplog.records if "nodes.max_restarts" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("spsa:"), lines


def test_a_section_of_a_strategy_the_run_does_not_hold_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="raylowcomm"):
        from_dict(_with(spsa={"eps": 0.01}))
    assert [r.getMessage() for r in caplog.records] == [
        "the spsa section is set, but spsa is not among the run's strategies: it is unused"
    ]
