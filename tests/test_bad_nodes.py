"""Bad nodes (`bad_nodes:`): the wrong updates themselves, plain torch against hand-computed cases, and
the config refusals before anything starts."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from raylowcomm.config import ConfigError
from raylowcomm.core.bad_updates import BadNode, bad_update, corrupt, learning_rate_of, relabelled, update_seed
from raylowcomm.strategies import from_dict

BASE = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 64, "test_size": 32, "image_size": 16},
    "optim": {"batch_size": 8},
    "nodes": {"count": 3},
    "strategies": ["lofi"],
    "lofi": {"compress": "int8", "average_every": 2},
}


def _delta() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(40, 50, generator=gen, dtype=torch.float64),
        "a.bias": torch.randn(100, generator=gen, dtype=torch.float64),
        "b.weight": torch.randn(10, 990, generator=gen, dtype=torch.float64),
    }


def _norm(state: dict) -> float:
    return math.sqrt(sum(float(t.square().sum()) for t in state.values()))


def test_sign_flip_is_minus_scale_times_delta_exactly():
    delta = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), "b": torch.tensor([3.0])}
    out = corrupt(delta, "sign_flip", 10.0, seed=0)
    assert torch.equal(out["w"], torch.tensor([-10.0, 20.0, -5.0], dtype=torch.float64))
    assert torch.equal(out["b"], torch.tensor([-30.0])) and out["b"].dtype == torch.float32
    assert torch.equal(delta["w"], torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)), "the caller's Δ is kept"


def test_noise_is_the_seeds_draw_and_its_norm_is_scale_times_the_deltas():
    """n = 12,000 entries of std s·‖Δ‖/√n: ‖noise‖/(s·‖Δ‖) = χ_n/√n, whose std is about 1/√(2n) = 0.0065;
    0.05 is nearly eight of them."""
    delta, scale, seed = _delta(), 10.0, update_seed(0, 2, 3)
    out = corrupt(delta, "noise", scale, seed)
    n = sum(t.numel() for t in delta.values())
    assert n == 12_000
    std = scale * _norm(delta) / math.sqrt(n)
    gen = torch.Generator().manual_seed(seed)
    expected = {k: torch.randn(t.shape, generator=gen, dtype=torch.float64) * std for k, t in delta.items()}
    assert all(torch.equal(out[k], expected[k]) for k in delta)
    assert abs(_norm(out) / (scale * _norm(delta)) - 1) < 0.05
    again, other_round = corrupt(delta, "noise", scale, seed), corrupt(delta, "noise", scale, update_seed(0, 2, 4))
    assert all(torch.equal(out[k], again[k]) for k in delta)
    assert not torch.equal(out["a.weight"], other_round["a.weight"])


def test_nonfinite_puts_one_nan_at_its_round_only():
    delta = _delta()
    entries = [BadNode(node=1, update="nonfinite", round=2)]
    for round_ in (1, 3):
        assert bad_update(entries, 1, round_, 0, delta) is delta
    assert bad_update(entries, 0, 2, 0, delta) is delta, "another node sends its own Δ"
    out = bad_update(entries, 1, 2, 0, delta)
    flat = torch.cat([t.reshape(-1) for t in out.values()])
    assert int(torch.isnan(flat).sum()) == 1 and math.isnan(float(out["a.weight"][0, 0]))
    assert torch.equal(out["b.weight"], delta["b.weight"])


def test_an_entry_without_a_round_applies_every_round():
    delta, entries = _delta(), [BadNode(node=0, update="sign_flip", scale=2.0)]
    for round_ in (1, 2, 7):
        assert torch.equal(bad_update(entries, 0, round_, 0, delta)["a.bias"], -2.0 * delta["a.bias"])


def test_a_node_that_trains_wrongly_sends_its_own_delta_as_it_is():
    delta = _delta()
    entries = [BadNode(node=1, update="learning_rate", scale=100.0), BadNode(node=2, update="permuted_labels")]
    assert bad_update(entries, 1, 1, 0, delta) is delta and bad_update(entries, 2, 3, 0, delta) is delta


def test_a_learning_rate_node_trains_at_scale_times_the_runs_and_the_others_at_the_runs():
    entries = [BadNode(node=1, update="learning_rate", scale=100.0), BadNode(node=2, update="sign_flip")]
    assert learning_rate_of(entries, 1, 0.01) == 0.01 * 100.0
    assert learning_rate_of(entries, 0, 0.01) == 0.01 and learning_rate_of(entries, 2, 0.01) == 0.01


def test_permuted_labels_shift_every_label_by_one_class_on_that_node_only():
    split = {"images": torch.zeros(5, 2), "labels": torch.tensor([0, 1, 2, 9, 4])}
    entries = [BadNode(node=2, update="permuted_labels")]
    out = relabelled(entries, 2, split, 10)
    assert torch.equal(out["labels"], torch.tensor([1, 2, 3, 0, 5])) and out["images"] is split["images"]
    assert torch.equal(split["labels"], torch.tensor([0, 1, 2, 9, 4])), "the caller's rows are kept"
    assert relabelled(entries, 1, split, 10) is split
    with pytest.raises(ValueError, match="classification task"):
        relabelled(entries, 2, split, None)


def _cfg(bad, **top):
    return from_dict({**BASE, **top, "bad_nodes": bad})


@pytest.mark.parametrize(
    ("bad", "top", "field", "says"),
    [
        ([{"node": 3, "update": "sign_flip"}], {}, "bad_nodes[0].node", "0..2"),
        ([{"node": 1, "update": "noise", "scale": 0}], {}, "bad_nodes[0].scale", "finite number > 0"),
        ([{"node": 1, "update": "noise", "scale": float("inf")}], {}, "bad_nodes[0].scale", "finite number > 0"),
        ([{"node": 1, "update": "nonfinite", "scale": 3}], {}, "bad_nodes[0].scale", "no scale"),
        ([{"node": 1, "update": "nonfinite", "round": 0}], {}, "bad_nodes[0].round", ">= 1"),
        ([{"node": 1, "update": "permuted_labels", "scale": 3}], {}, "bad_nodes[0].scale", "no scale"),
        ([{"node": 1, "update": "learning_rate", "round": 2}], {}, "bad_nodes[0].round", "from the start"),
        ([{"node": 1, "update": "bitflip"}], {}, "bad_nodes[0].update", "sign_flip"),
        ([{"node": 1, "update": "noise"}, {"node": 1, "update": "sign_flip"}], {}, "bad_nodes", "once"),
        ([{"node": 1, "update": "noise"}], {"strategies": ["ddp"]}, "bad_nodes", "add lofi"),
        ([{"node": 1, "update": "noise"}], {"lofi": {}}, "bad_nodes", "lofi.exchange: peers"),
    ],
)
def test_a_bad_node_that_cannot_take_effect_is_refused(bad, top, field, says):
    with pytest.raises(ConfigError, match=says) as err:
        _cfg(bad, **top)
    assert err.value.field_name == field and "\n" not in str(err.value)


def test_with_lofi_and_a_rounds_free_lofi_run_the_section_is_taken():
    cfg = _cfg([{"node": 2, "update": "sign_flip", "scale": 4}], lofi={"exchange": "peers"})
    assert cfg.bad_nodes == [BadNode(node=2, update="sign_flip", scale=4.0)]


def test_a_node_that_trains_wrongly_needs_no_peer_rounds():
    cfg = _cfg([{"node": 1, "update": "learning_rate", "scale": 100}], lofi={})
    assert cfg.options["lofi"].exchange == "auto" and cfg.bad_nodes[0].scale == 100.0


def test_beside_lofi_a_strategy_that_ignores_it_says_so_in_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="raylowcomm"):
        _cfg([{"node": 1, "update": "noise"}], strategies=["lofi", "ddp"])
    lines = [r.getMessage() for r in caplog.records if "bad_nodes" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("ddp:"), lines
