"""`lofi.dial: auto` (`lofi.dial`): the measured rule's choice for each row of the decision table, the
nearest row outside what was measured, explicit settings winning, the step down to the byte budget, the
warning for a setting on the wrong side of the frontier; and, on Ray, the predicted bytes of a run
against its ledger."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest
from torch import nn

from raylowcomm.config import ConfigError, LoraConfig
from raylowcomm.finetune import FullWeights
from raylowcomm.strategies.lofi import dial
from raylowcomm.strategies.lofi.options import LofiOptions
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.strategies.test_lofi_options import config


class Convnet(nn.Module):
    """A BatchNorm vision model with a timm-style new head (`pretrained_cfg` names it)."""

    pretrained_cfg = {"classifier": "classifier"}

    def __init__(self, norm: type = nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Conv2d(3, 256, 3)
        self.conv = nn.Conv2d(256, 256, 3)
        self.norm = norm(256)
        self.classifier = nn.Linear(256, 10)


class Encoder(nn.Module):
    """A LayerNorm language model with a Hugging Face classifier's new head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(384, 1536)
        self.out = nn.Linear(1536, 384)
        self.norm = nn.LayerNorm(384)
        self.classifier = nn.Linear(384, 2)


def context(steps: int, model: nn.Module | None = None, family: str = "timm", epochs: int = 1, **lofi):
    """A loaded run without Ray: 2 nodes, batches of 16, each shard `steps` / `epochs` batches."""
    cfg = config(**lofi)
    cfg.optim.epochs = epochs
    shard = steps // epochs * cfg.optim.batch_size
    return SimpleNamespace(
        cfg=cfg,
        architecture=model or Convnet(),
        spec=SimpleNamespace(family=family, lora=None),
        fine_tune=FullWeights(),
        data=SimpleNamespace(train=SimpleNamespace(sizes=lambda n: [shard] * n)),
    ), shard


def resolved(steps: int, model=None, family="timm", epochs=1, **lofi):
    ctx, shard = context(steps, model, family, epochs, dial="auto", **lofi)
    return dial.resolve(ctx, ctx.cfg.options["lofi"], shard)


def test_a_batchnorm_vision_model_at_62_steps_gets_ternary_rounds_with_the_head_and_vectors_whole():
    o = resolved(62)
    assert (o.average_every, o.compress, o.compress_block, o.dense) == (8, "int2", 128, ["head", "vectors"])
    record = o.dial_record
    assert record["chose"]["final_round"] == "compressed" and "short" in record["reason"]
    assert "ternary-rounds-every-8-steps" in record["reason"] and "outside" not in record["reason"]
    assert 0 < record["predicted_bytes"] <= 0.01 * record["ddp_bytes"]


def test_a_batchnorm_vision_model_at_125_steps_gets_topk_3_percent_every_6():
    o = resolved(125)
    assert (o.average_every, o.compress, o.topk_fraction, o.dense) == (6, "topk", 0.03, [])
    assert "longer" in o.dial_record["reason"] and "outside" not in o.dial_record["reason"]


def test_a_language_model_gets_one_int4_round_halfway_at_1_epoch_and_one_int4_average_at_2():
    one = resolved(50, Encoder(), "hf_classifier")
    assert (one.average_every, one.compress) == (25, "int4") and "1 epoch" in one.dial_record["reason"]
    two = resolved(100, Encoder(), "hf_classifier", epochs=2)
    assert (two.average_every, two.compress) == (None, "int4") and "2 epochs" in two.dial_record["reason"]
    # a round halfway costs what one average does at 2 nodes, where the driver fetches each payload too
    assert one.dial_record["predicted_bytes"] == two.dial_record["predicted_bytes"]


def test_lora_gets_one_int4_average_of_what_trains():
    ctx, shard = context(62, Encoder(), "hf_classifier", dial="auto")
    ctx.cfg.model.lora = LoraConfig()
    for p in ctx.architecture.layer.parameters():
        p.requires_grad = False  # the frozen base
    ctx.fine_tune = SimpleNamespace(trainable_only=lambda: True)
    o = dial.resolve(ctx, ctx.cfg.options["lofi"], shard)
    assert (o.average_every, o.compress) == (None, "int4") and "LoRA" in o.dial_record["reason"]
    trained = sum(p.numel() for p in ctx.architecture.parameters() if p.requires_grad)
    assert o.dial_record["ddp_bytes"] == 2 * 62 * 4 * trained


def test_outside_what_was_measured_the_nearest_row_and_the_reason_says_so():
    short = resolved(32)
    assert short.compress == "int2"
    assert (
        "outside what was measured: 32 steps a node (measured: 62), so the nearest row" in short.dial_record["reason"]
    )
    other = resolved(100, Convnet(norm=lambda channels: nn.GroupNorm(8, channels)), "timm", epochs=2)
    assert other.compress == "int4" and "not a language model" in other.dial_record["reason"]


def test_explicit_settings_win_and_are_named_in_the_reason(caplog):
    with caplog.at_level(logging.INFO, logger=dial.logger.name):
        o = resolved(62, compress="topk")
    assert (o.compress, o.average_every, o.dense) == ("topk", 8, ["head", "vectors"])
    assert "compress" not in o.dial_record["chose"] and o.dial_record["kept"] == {"compress": "topk"}
    line = next(r.getMessage() for r in caplog.records if "dial: auto chose" in r.getMessage())
    assert (
        line.startswith("[lofi] dial: auto chose average_every=8, compress_block=128")
        and "kept your compress=topk" in line
    )
    # and on the wrong side of the frontier for 62 steps: one warning
    assert any(r.levelno == logging.WARNING and "Try lofi.dial: auto" in r.getMessage() for r in caplog.records)


def test_over_the_byte_budget_the_choice_steps_down_a_longer_period_then_a_cheaper_codec():
    o = resolved(62, dial_bytes=0.002)
    record = o.dial_record
    assert "stepped down" in record["reason"] and "average_every 8 -> 16" in record["reason"]
    assert o.average_every == 32  # a BatchNorm model keeps a round before its end
    assert o.compress == "sign" and record["predicted_bytes"] <= 0.002 * record["ddp_bytes"]
    pinned = resolved(62, dial_bytes=0.002, average_every=8, compress="int2")
    assert "still over" in pinned.dial_record["reason"] and pinned.average_every == 8


@pytest.mark.parametrize(
    "steps, lofi, warned",
    [
        (62, {"compress": "topk", "average_every": 6, "topk_fraction": 0.03}, "compress: topk every <= 8"),
        (62, {"compress": "int4", "average_every": 16}, "int4 every >= 16"),
        (125, {"compress": "int2", "average_every": 8}, "compress: int2 on a BatchNorm"),
        (62, {"compress": "int2", "average_every": 8}, None),
        (125, {"compress": "topk", "average_every": 6, "topk_fraction": 0.03}, None),
    ],
)
def test_a_setting_on_the_wrong_side_of_the_frontier_is_warned_of_once(caplog, steps, lofi, warned):
    ctx, shard = context(steps, **lofi)
    with caplog.at_level(logging.WARNING, logger=dial.logger.name):
        assert dial.resolve(ctx, ctx.cfg.options["lofi"], shard) is ctx.cfg.options["lofi"]  # dial off: as given
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert warned in lines[0] and "Try lofi.dial: auto" in lines[0] and f"{steps} steps a node" in lines[0]


def test_the_options_check_resolves_once_into_the_config_and_validates_the_choice():
    ctx, _ = context(62, dial="auto")
    LofiOptions.of(ctx.cfg.options["lofi"]).check(ctx)
    o = ctx.cfg.options["lofi"]
    assert (o.compress, o.average_every) == ("int2", 8) and o.dial_record is not None
    LofiOptions.of(o).check(ctx)
    assert ctx.cfg.options["lofi"] is o  # resolved already: kept as it is
    assert config(dial=False).options["lofi"].dial == "off"  # YAML reads a bare `dial: off` as false
    with pytest.raises(ConfigError, match="dial_bytes"):
        config(dial="auto", dial_bytes=0)
    with pytest.raises(ConfigError, match="set lofi.dial: auto"):
        config(dial_bytes=0.5)


def test_the_predicted_bytes_are_the_ledgers_outer_gradients(ray_session, tmp_path):
    """tiny_config: 2 nodes, 32 steps a node of a BatchNorm convnet: the short row (nearest to 62)."""
    cfg = tiny_config(dial="auto", dial_bytes=0.05)
    ctx, rec = run_lofi(cfg, tmp_path)
    chosen = rec["details"]["dial"]
    assert chosen["chose"]["compress"] == "int2" and rec["details"]["exchange"] == "peers"
    kinds = rec["comm"]["by_kind"]
    counted = kinds.get("train/outer_gradients", 0) + kinds["final/outer_gradients"]
    assert chosen["predicted_bytes"] == counted
    assert math.isclose(chosen["ddp_bytes"] / (2 * 32), sum(4 * p.numel() for p in ctx.architecture.parameters()))


def test_the_run_folder_keeps_the_config_as_written_so_a_resume_resolves_it_the_same_way(tmp_path):
    """config.yaml is what --resume compares the user's config with: it holds `dial: auto`, not the choice,
    while the run itself trains the resolved settings."""
    import yaml

    from raylowcomm.resume import check_resumable
    from raylowcomm.runner import prepare

    cfg = tiny_config(dial="auto", dial_bytes=0.05)
    ctx = prepare(cfg, tmp_path)
    assert ctx.cfg.options["lofi"].compress == "int2"
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["lofi"]
    assert saved["dial"] == "auto" and saved["compress"] == "none"
    check_resumable(tiny_config(dial="auto", dial_bytes=0.05), tmp_path)  # the same config resumes


def test_with_shared_scales_the_dial_keeps_to_codes_that_add_and_counts_masked_bytes():
    """compress_scale: shared (what lofi.secure needs): the longer row's top-k becomes the short row's int2,
    a step down stops at int2 (sign codes do not add), and secure rounds' predicted bytes are the masked ones."""
    o = resolved(200, compress_scale="shared")
    assert (o.compress, o.average_every, o.dense) == ("int2", 8, ["head", "vectors"])
    assert "compress_scale: shared adds codes, and the row's topk are not" in o.dial_record["reason"]
    starved = resolved(62, compress_scale="shared", dial_bytes=1e-9)
    assert starved.compress == "int2" and "still over dial_bytes" in starved.dial_record["reason"]
    ctx, shard = context(200, dial="auto", compress_scale="shared")
    run, sizes = dataclasses.replace(dial.run_of(ctx, shard), nodes=4), dial.Sizes.of(ctx)
    plain = dial.predicted_bytes(o, run, sizes)
    assert plain < dial.predicted_bytes(dataclasses.replace(o, secure=True), run, sizes) < 3 * plain
