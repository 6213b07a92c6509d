"""optim.budget_s (`bench ... --budget-s`): every strategy trains until the step at which its own
training clock reaches the budget, its epochs repeating, and its record says where it stopped."""

import json

import pytest
import yaml

from raylowcomm.cli import main
from raylowcomm.config import ConfigError
from raylowcomm.strategies import from_dict

BUDGET_S = 3.0
TINY = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi", "ddp", "spsa", "interlocking"],
    "log_every": 1000,
    "checkpoint_every": 1000,
    "lofi": {"average_every": 4, "compress": "int8", "bn_recalibrate": False},
    "spsa": {"lr": 0.001, "samples": 2},
    "interlocking": {"stages": 2, "micro_batches": 1, "aux_widths": [8]},
}


@pytest.mark.slow
def test_a_budget_stops_every_strategy_at_the_step_that_reaches_it(ray_session, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "bench"
    assert main(["bench", "local", str(config), "--budget-s", str(BUDGET_S), "--out", str(out)]) == 0
    records = json.loads((out / "local" / "results.json").read_text())
    assert [r["strategy"] for r in records] == TINY["strategies"] and not any("error" in r for r in records)
    epoch = 256 // 2 // 16  # steps in one pass over a node's shard (interlocking: twice as many batches)
    for r in records:
        budget = r["details"]["budget"]
        assert budget["stopped_by"] == "budget", r["strategy"]
        # the clock reached the budget in the last step (or round), not before it
        assert budget["train_s"] >= BUDGET_S > budget["train_s"] - budget["last_step_s"], (r["strategy"], budget)
        assert budget["steps"] > epoch, r["strategy"]  # epochs repeated: the budget, not `epochs`, ended it
    lofi = next(r for r in records if r["strategy"] == "lofi")
    assert lofi["details"]["averaging_steps"][-1] == lofi["details"]["budget"]["steps"]  # the final round's step
    ddp = next(r for r in records if r["strategy"] == "ddp")
    steps = ddp["details"]["steps_per_worker"]
    assert ddp["comm"]["by_kind"]["train/budget_votes"] == 4 * 2 * steps  # one float32 per rank and step


@pytest.mark.parametrize(
    "budget, lofi",
    [
        (0, {}),  # not a budget
        (5, {"average_every": 4, "compress": "int8", "quorum": 1}),  # quorum rounds count node-steps
        (5, {"average_every": 4, "compress": "int8", "overlap": 2}),  # a round would be in flight at the end
    ],
)
def test_a_budget_is_refused_where_it_cannot_end_a_run(budget, lofi):
    raw = {**TINY, "strategies": ["lofi"], "optim": {**TINY["optim"], "budget_s": budget}, "lofi": lofi}
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field_name == "optim.budget_s"
