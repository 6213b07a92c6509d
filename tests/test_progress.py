"""The driver's view moves while workers train: their posts reach it between the driver's calls."""

import math

import pytest

from raylowcomm.progress import LiveProgress, ProgressView
from raylowcomm.runner import prepare
from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.lofi import Lofi
from tests.strategies.test_lofi import tiny_config


@pytest.mark.parametrize("strategy", [Lofi, pytest.param(Ddp, marks=pytest.mark.heavy)])
def test_workers_steps_reach_the_driver_while_they_train(ray_session, tmp_path, strategy):
    ctx = prepare(tiny_config(bn_recalibrate=False), tmp_path)
    seen = []
    with LiveProgress(every_s=0.01, post_every_s=0) as live:  # every step posted, read 100 times a second
        live.follow(seen.append)
        rec = strategy().run(ctx.for_strategy(ctx.report, live)).to_dict()
        details = live.details()
    steps = rec["details"].get("steps_per_node") or rec["details"]["steps_per_worker"]
    assert details["progress_posts"] == 2 * steps, "one post per worker per step, each counted"
    assert details["progress_bytes"] > 0
    assert not any("progress" in kind for kind in rec["comm"]["by_kind"]), (
        "monitoring stays out of the strategy's ledger"
    )
    live_steps = [m["step"] for m in seen]
    assert any(s < steps for s in live_steps), "the view moved before training ended"
    assert live_steps == sorted(live_steps) and all(m["steps"] == steps for m in seen)
    assert all(math.isfinite(m["train_loss"]) for m in seen)


def test_the_view_logs_each_step_once_whoever_reports_it(caplog):
    view = ProgressView(bar=False)
    with caplog.at_level("INFO", logger="raylowcomm"):
        for step in (5, 10, 10, 7, 10):  # a worker's post and the strategy's own report of the same step
            view.update("lofi", {"step": step, "steps": 10, "train_loss": 0.5})
    assert [r.getMessage() for r in caplog.records] == ["[lofi] step 5/10 loss 0.5000", "[lofi] step 10/10 loss 0.5000"]
