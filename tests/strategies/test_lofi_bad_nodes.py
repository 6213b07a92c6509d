"""A bad node in lo-fi's peer rounds (`bad_nodes:`): a sign-flipped node moves the global model away
from the clean run's and the record names it; a non-finite update stops the run with the codec's
non-finite error."""

import pytest
import torch

from raylowcomm.strategies import from_dict
from tests.strategies.test_lofi import run_lofi
from tests.strategies.test_lofi_rounds import round_files


def _config(bad: list[dict]):
    return from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["lofi"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "lofi": {"average_every": 2, "compress": "int8", "bn_recalibrate": False},
            "bad_nodes": bad,
        }
    )


def _global(state_dir) -> dict:
    return {k: v for k, v in round_files(state_dir)[0].items() if k.startswith("global.")}


def test_a_sign_flipped_node_moves_the_global_model_and_the_record_names_it(ray_session, tmp_path):
    _, clean = run_lofi(_config([]), tmp_path / "clean")
    _, bad = run_lofi(_config([{"node": 1, "update": "sign_flip", "scale": 10}]), tmp_path / "bad")
    assert "bad_nodes" not in clean["details"]
    assert bad["details"]["bad_nodes"] == [{"node": 1, "update": "sign_flip", "scale": 10.0, "round": None}]
    before, after = _global(tmp_path / "clean" / "state"), _global(tmp_path / "bad" / "state")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_nonfinite_update_stops_the_run(ray_session, tmp_path):
    with pytest.raises(Exception, match="non-finite"):
        run_lofi(_config([{"node": 0, "update": "nonfinite", "round": 2}]), tmp_path)
