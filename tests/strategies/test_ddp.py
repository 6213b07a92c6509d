import json

import pytest

from raylowcomm.cli import main
from raylowcomm.ledger import payload_nbytes
from raylowcomm.models import state_dict_of
from raylowcomm.runner import prepare
from raylowcomm.strategies.ddp import Ddp
from tests.strategies.test_lofi import tiny_config


@pytest.mark.slow
def test_ddp_counts_the_gradients_it_all_reduces(ray_session, tmp_path):
    cfg = tiny_config()
    cfg.strategies, cfg.eval_every = ["ddp"], 10
    ctx = prepare(cfg, tmp_path)
    rec = Ddp().run(ctx).to_dict()
    steps = rec["details"]["steps_per_worker"]
    grad_bytes = sum(p.numel() * p.element_size() for p in ctx.model.parameters() if p.requires_grad)
    # every step each of the 2 ranks hands every gradient to all-reduce, once
    assert rec["comm"]["by_kind"]["train/gradient_allreduce"] == steps * 2 * grad_bytes
    # the curve's bytes are the setup plus the gradients all-reduced up to each point
    curve, setup = rec["curve"], rec["comm"]["by_phase"]["setup"]
    assert [p["step"] for p in curve] == [10, 20, 30, steps]
    assert [p["bytes"] for p in curve[:-1]] == [setup + s * 2 * grad_bytes for s in (10, 20, 30)]
    assert curve[-1]["bytes"] == rec["comm"]["total_bytes"] and curve[-1]["id_accuracy"] == rec["metrics"]["id_accuracy"]
    assert all(a["wall_s"] < b["wall_s"] for a, b in zip(curve, curve[1:])) and curve[-1]["wall_s"] == rec["train_s"]
    assert rec["comm"]["by_kind"]["setup/initial_weights"] == 2 * payload_nbytes(state_dict_of(ctx.model))
    assert rec["samples_seen"] == 2 * steps * cfg.optim.batch_size
    assert {"id_accuracy", "shift_accuracy"} <= rec["metrics"].keys()
    assert len(rec["nodes"]) == 2


@pytest.mark.slow
def test_run_command_writes_results_for_every_strategy(tmp_path, ray_session):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({
        "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
        "optim": {"batch_size": 16, "epochs": 1}, "strategies": ["lofi", "ddp"],
    }))
    out = tmp_path / "out"
    assert main(["run", str(config), "--out", str(out), "--set", "optim.lr=0.01"]) == 0
    records = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in records] == ["lofi", "ddp"]
    for r in records:
        assert {"strategy", "metrics", "comm", "wall_s", "samples_per_s", "peak_rss_bytes"} <= r.keys()
        assert {"total_bytes", "by_phase"} <= r["comm"].keys()
        assert (out / "state" / r["strategy"] / "model.safetensors").exists()
    lofi, ddp = records
    assert lofi["comm"]["by_phase"]["train"] == 0 and ddp["comm"]["by_phase"]["train"] > 0
    assert len(lofi["nodes"]) == 2 and "id_accuracy" in lofi["nodes"][0]["metrics"]
