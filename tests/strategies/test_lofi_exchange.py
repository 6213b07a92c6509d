"""The exchange protocol is the seat a new topology plugs into: the smallest exchange the docs show,
put in place of the star, runs a lo-fi run to the star's own model, bytes and scores."""

import torch
from safetensors.torch import load_file

from raylowcomm.strategies import lofi
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.test_docs import shown_python


def test_the_smallest_exchange_shown_lands_the_stars_model_bit_for_bit(ray_session, tmp_path, monkeypatch):
    cfg = tiny_config(average_every=8, bn_recalibrate=False)
    _, star = run_lofi(cfg, tmp_path / "star")
    plain_star = shown_python("docs/python-api.md", "class PlainStar")["PlainStar"]
    monkeypatch.setattr(lofi, "exchange_for", lambda opts: plain_star)
    _, plain = run_lofi(cfg, tmp_path / "plain")
    assert (star["details"]["exchange"], plain["details"]["exchange"]) == ("driver", "plain-star")
    assert star["details"]["averaging_steps"] == plain["details"]["averaging_steps"] == [8, 16, 24, 32]
    a, b = load_file(star["weights"]), load_file(plain["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain["comm"]["by_kind"] == star["comm"]["by_kind"]
    assert plain["metrics"] == star["metrics"]
