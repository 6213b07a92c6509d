"""`lofi.compress_scale: shared` (`core.summable`) in lo-fi's peer rounds: its refusals without Ray, and a
small Ray run whose nodes stay identical every round and book the bytes of per-node scales."""

from __future__ import annotations

import math

import pytest
import torch

from raylowcomm.config import ConfigError
from raylowcomm.strategies import from_dict
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.strategies.test_lofi_robust import _raw
from tests.strategies.test_lofi_rounds import round_files


def test_shared_scales_are_accepted_where_codes_add():
    from_dict(_raw({"compress": "int2", "compress_scale": "shared"}))
    from_dict(_raw({"compress": "int4", "compress_scale": "shared", "dense": ["vectors"], "dense_codec": "int8"}))
    from_dict(_raw({"compress": "int8", "compress_scale": "shared", "final_round": "int8", "average_every": 2}))
    from_dict(_raw({"compress": "int4", "compress_scale": "shared", "overlap": 1, "average_every": 2}))


@pytest.mark.parametrize(
    "lofi, other, fix",
    [
        ({"compress": "topk"}, "lofi.compress: topk", "set lofi.compress to int8, int4 or int2"),
        ({"compress": "sign"}, "lofi.compress: sign", "set lofi.compress to int8, int4 or int2"),
        ({"compress": "none", "exchange": "peers"}, "lofi.compress: none", "set lofi.compress to int8"),
        ({"dense": ["vectors"], "dense_codec": "none"}, "lofi.dense_codec: none", "set dense_codec to int8"),
        ({"final_round": "exact"}, "lofi.final_round: exact", "set final_round: compressed or int8"),
        ({"quorum": 2}, "quorum rounds", "use lockstep peer rounds"),
        ({"aggregate": "median"}, "lofi.aggregate: median", "set lofi.aggregate: mean"),
        ({"on_bad_payload": "drop"}, "lofi.on_bad_payload: drop", "set on_bad_payload: fail"),
    ],
)
def test_refusals_name_both_fields_and_the_fix(lofi, other, fix):
    with pytest.raises(ConfigError) as err:
        from_dict(_raw({"compress_scale": "shared", **lofi}))
    message = str(err.value)
    assert "lofi.compress_scale" in message and other in message and fix in message
    assert "or lofi.compress_scale: node" in message and "\n" not in message


def test_adapters_are_refused():
    raw = _raw({"compress_scale": "shared"})
    raw["model"]["lora"] = {"r": 4}
    with pytest.raises(ConfigError, match="lofi.compress_scale.*model.lora"):
        from_dict(raw)


@pytest.mark.slow
def test_shared_int2_rounds_keep_the_nodes_identical_at_the_bytes_of_node_scales(ray_session, tmp_path):
    runs = {}
    for scale in ("node", "shared"):
        cfg = tiny_config(average_every=8, compress="int2", bn_recalibrate=False, compress_scale=scale)
        _, runs[scale] = run_lofi(cfg, tmp_path / scale)
    shared, node = runs["shared"], runs["node"]
    kinds = shared["comm"]["by_kind"]
    assert len(shared["details"]["averaging_steps"]) - 1 == 3 and kinds["train/verify_hash"] > 0  # checked each round
    for kind in ("train/outer_gradients", "final/outer_gradients"):
        assert kinds[kind] == node["comm"]["by_kind"][kind] > 0
    files = {scale: round_files(tmp_path / scale / "state") for scale in runs}
    a, b = files["shared"]
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("global."))  # the same global model, bit for bit
    residual = "residual.conv_stem.weight"
    assert a[residual].dtype == torch.float64 and not torch.equal(a[residual], b[residual])
    assert not torch.equal(a[residual], files["node"][0][residual])  # settled on the shared grid, not its own
    assert all(math.isfinite(n["metrics"]["id_loss"]) for n in shared["nodes"])


@pytest.mark.slow
@pytest.mark.heavy
def test_overlapped_fragments_settle_in_the_exchange_thread_and_keep_the_nodes_identical(ray_session, tmp_path):
    """A round in flight while the nodes train on (overlap, keep_training): each node settles its residual
    in the exchange's thread, before the round lands and its round file is written."""
    cfg = tiny_config(
        average_every=8,
        compress="int4",
        compress_scale="shared",
        bn_recalibrate=False,
        fragments=2,
        overlap=2,
        keep_training=True,
    )
    _, rec = run_lofi(cfg, tmp_path)
    assert rec["comm"]["by_kind"]["train/verify_hash"] > 0  # hash-checked (a mismatch raises)
    a, b = round_files(tmp_path / "state")
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("global."))
    assert not torch.equal(a["residual.conv_stem.weight"], b["residual.conv_stem.weight"])
