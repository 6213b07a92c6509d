"""Robust rules in lo-fi's peer rounds (`lofi.aggregate`, `lofi.on_bad_payload`): the options' defaults
and refusals without Ray, the mean's bits kept, and small Ray runs where one node sends a wrong update:
the median keeps the replicas identical and its record marks the node; `drop` finishes a run that a
non-finite update would stop."""

from __future__ import annotations

import math

import pytest
import torch

from raylowcomm.config import ConfigError
from raylowcomm.core.aggregation import average_decoded
from raylowcomm.core.compression import make_codec
from raylowcomm.storage import Storage
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.payload import DeltaCodec
from raylowcomm.strategies.lofi.robust_average import NOT_FINITE, RECORD, marker, robust_details
from tests.strategies.test_lofi import run_lofi


def _raw(lofi: dict, nodes: int = 3, bad: list[dict] = ()) -> dict:
    return {
        "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 96, "test_size": 48, "image_size": 16},
        "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
        "nodes": {"count": nodes, "cpus": 1},
        "strategies": ["lofi"],
        "checkpoint_every": 4,
        "log_every": 1000,
        "lofi": {"average_every": 1, "compress": "int8", "bn_recalibrate": False, **lofi},
        "bad_nodes": list(bad),
    }


def test_the_defaults_are_todays_mean():
    o = LofiConfig()
    assert (o.aggregate, o.clip_kappa, o.trim, o.on_bad_payload, o.bad_norm_factor) == ("mean", 2.0, 0.25, "fail", 10.0)
    from_dict(_raw({"aggregate": "median", "on_bad_payload": "drop", "bad_norm_factor": 5.0}))
    from_dict(_raw({"aggregate": "clip", "clip_kappa": 1.5}))
    from_dict(_raw({"aggregate": "trimmed_mean", "trim": 0.2, "fragments": 1}))
    from_dict(_raw({"aggregate": "median", "quorum": 2}))


@pytest.mark.parametrize(
    "lofi, field, fix",
    [
        ({"aggregate": "mode"}, "lofi.aggregate", "expected one of"),
        ({"aggregate": "clip", "clip_kappa": 0}, "lofi.clip_kappa", "> 0"),
        ({"aggregate": "trimmed_mean", "trim": 0.5}, "lofi.trim", "[0, 0.5)"),
        ({"on_bad_payload": "skip"}, "lofi.on_bad_payload", "expected one of"),
        ({"aggregate": "median", "on_bad_payload": "drop", "bad_norm_factor": 0.5}, "lofi.bad_norm_factor", ">= 1"),
        ({"clip_kappa": 3.0}, "lofi.clip_kappa", "lofi.aggregate: clip"),
        ({"aggregate": "median", "trim": 0.1}, "lofi.trim", "lofi.aggregate: trimmed_mean"),
        ({"on_bad_payload": "drop", "bad_norm_factor": 4.0}, "lofi.bad_norm_factor", "lofi.aggregate"),
        ({"aggregate": "clip", "on_bad_payload": "drop", "bad_cosine_factor": 1.5}, "lofi.bad_cosine_factor", "(0, 1]"),
        ({"aggregate": "clip", "bad_cosine_factor": 0.3}, "lofi.bad_cosine_factor", "on_bad_payload: drop"),
        ({"aggregate": "median", "compress": "none"}, "lofi.aggregate", "lofi.exchange: peers"),
        ({"on_bad_payload": "drop", "exchange": "driver", "compress": "none"}, "lofi.on_bad_payload", "star"),
    ],
)
def test_refusals_name_the_field_and_the_fix(lofi, field, fix):
    with pytest.raises(ConfigError) as err:
        from_dict(_raw(lofi))
    assert field in str(err.value) and fix in str(err.value)
    assert "\n" not in str(err.value)


def test_adapters_are_refused():
    raw = _raw({"aggregate": "median"})
    raw["model"]["lora"] = {"r": 4}
    with pytest.raises(ConfigError, match="lofi.aggregate.*model.lora"):
        from_dict(raw)


def _deltas(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(5, 7, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g)} for _ in range(n)
    ]


def _codec(**opts) -> DeltaCodec:
    o = LofiConfig(compress="int8", **opts)
    state = {"w": torch.zeros(5, 7), "b": torch.zeros(7)}
    return DeltaCodec(o, state, {"w", "b"})


def test_the_mean_keeps_average_decoded_and_drop_with_mean_gives_its_bits():
    deltas, weights = _deltas(3), [1.0, 2.0, 1.0]
    plain, dropping = _codec(), _codec(on_bad_payload="drop")
    payloads = [plain.encode(d) for d in deltas]
    assert plain.robust is None
    mean = plain.average(payloads, weights)
    expected = average_decoded(make_codec("int8"), payloads, plain.parts[0][1], weights, dtype=torch.float64)
    assert all(torch.equal(mean[k], expected[k]) for k in mean)
    dropped = dropping.average(payloads, weights, round_=1)
    assert all(torch.equal(mean[k], dropped[k]) for k in mean)


def test_a_nonfinite_delta_is_a_marker_left_out_of_its_round():
    deltas = _deltas(3)
    deltas[1]["w"][0, 0] = math.nan
    codec = _codec(aggregate="median", on_bad_payload="drop")
    payloads = [codec.encode(d) for d in deltas]
    assert set(payloads[1]) == set(marker()) == {NOT_FINITE}
    out = codec.average(payloads, [1.0] * 3, round_=1)
    clean = _codec(aggregate="median").average([payloads[0], payloads[2]], [1.0, 1.0])
    assert all(torch.equal(out[k], clean[k]) for k in out)
    with pytest.raises(ValueError, match="non-finite"):
        _codec().encode(deltas[1])


def test_the_median_ignores_one_sign_flipped_node():
    deltas = _deltas(5)
    deltas[4] = {k: -10 * v for k, v in deltas[4].items()}
    codec = _codec(aggregate="median", compress_block=4)
    out = codec.average([codec.encode(d) for d in deltas], [1.0] * 5)
    honest = torch.stack([d["w"] for d in deltas[:4]])
    assert bool((out["w"] >= honest.min(0).values - 0.1).all() and (out["w"] <= honest.max(0).values + 0.1).all())


def test_a_median_run_marks_the_sign_flipped_node(ray_session, tmp_path):
    bad = [{"node": 2, "update": "sign_flip", "scale": 10}]
    _, rec = run_lofi(from_dict(_raw({"aggregate": "median"}, bad=bad)), tmp_path / "median")
    rounds = rec["details"]["robust_rounds"]
    assert rounds and rec["details"]["dropped_payloads"] == [0, 0, 0]
    for r in rounds:
        cosines = {row["node"]: row["cosine"] for row in r["nodes"]}
        assert cosines[2] < 0 and cosines[2] == min(cosines.values()), r


def test_drop_finishes_a_run_a_nonfinite_node_would_stop(ray_session, tmp_path):
    bad = [{"node": 1, "update": "nonfinite", "round": 2}]
    _, rec = run_lofi(from_dict(_raw({"on_bad_payload": "drop"}, bad=bad)), tmp_path / "drop")
    assert rec["details"]["dropped_payloads"] == [0, 1, 0]
    second = rec["details"]["robust_rounds"][1]
    assert [row["dropped"] for row in second["nodes"]] == [None, "not finite", None]


def test_the_record_names_each_rounds_nodes_and_counts_their_drops(tmp_path):
    storage = Storage(tmp_path)
    row = {"norm": 1.0, "cosine": 0.5, "scale": 1.0, "trimmed": 0.0, "dropped": None}
    storage.write_json(RECORD, {"1": [{"at": 0, **row}, {"at": 1, **row, "dropped": "not finite"}]})
    assert robust_details(storage, LofiConfig()) == {}
    details = robust_details(storage, LofiConfig(aggregate="median"), members=[[3, 1]])
    assert [r["node"] for r in details["robust_rounds"][0]["nodes"]] == [3, 1]
    assert details["dropped_payloads"] == [0, 1, 0, 0]
