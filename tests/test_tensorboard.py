"""TensorBoard event files from a hand-made record and progress reports, read back. No Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raylowcomm.tensorboard import TensorBoardLog, metric_tag, time_step, time_tag

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

CURVE = [
    {
        "step": 10,
        "wall_s": 4.25,
        "samples": 640,
        "bytes": 1_000_000,
        "id_accuracy": 0.5,
        "id_loss": 1.7,
        "shift_accuracy": 0.25,
    },
    {
        "step": 20,
        "wall_s": 8.5,
        "samples": 1280,
        "bytes": 2_000_123,
        "id_accuracy": 0.75,
        "id_loss": 0.9,
        "shift_accuracy": 0.3,
    },
    {
        "step": 30,
        "wall_s": 12.125,
        "samples": 1920,
        "bytes": 3_456_789,
        "id_accuracy": 0.8125,
        "id_loss": 0.61,
        "shift_accuracy": 0.33,
    },
]
RECORD = {
    "strategy": "lofi",
    "metrics": {"id_accuracy": 0.8125, "id_loss": 0.61, "shift_accuracy": 0.33},
    "comm": {
        "total_bytes": 3_456_789,
        "by_phase": {"setup": 1_000_000, "train": 0, "final": 2_456_789},
        "by_kind": {},
        "messages": 7,
    },
    "wall_s": 20.5,
    "train_s": 12.125,
    "samples_seen": 1920,
    "samples_per_s": 158.3,
    "peak_rss_bytes": 10**9,
    "nodes": [{"node": 0}],
    "details": {"note": "x"},
    "weights": None,
    "curve": CURVE,
}
LOSSES = {1: 2.5, 10: 1.25, 20: 0.75, 30: 0.5}


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def expect(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """What TensorBoard stores: the step as is, the value as float32."""
    return [(s, float(np.float32(v))) for s, v in points]


def load(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tags():
    assert metric_tag("train_loss") == "train/loss" and metric_tag("id_accuracy") == "eval/id_accuracy"
    assert time_tag("shift_loss") == "eval_vs_time/shift_loss" and time_tag("train_loss") == "train_vs_time/loss"
    assert time_step(8.5) == 8500 and time_step(0.0014) == 1


def test_record_and_progress_round_trip(tmp_path: Path):
    tb = TensorBoardLog(tmp_path)
    for step, loss in LOSSES.items():
        tb.progress("lofi", {"step": step, "train_loss": loss})
    tb.progress("ddp", {"step": 5, "train_loss": 3.0, "id_accuracy": 0.4})  # another strategy, live eval
    tb.progress("ddp", {"train_loss": 9.0})  # no step: ignored
    tb.record(RECORD)
    tb.close()
    tb.close()  # idempotent

    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir()) == ["ddp", "lofi"]
    acc = load(tmp_path / "tensorboard" / "lofi")
    assert scalars(acc, "train/loss") == expect(list(LOSSES.items()))
    for m in ("id_accuracy", "id_loss", "shift_accuracy"):
        assert scalars(acc, f"eval/{m}") == expect([(p["step"], p[m]) for p in CURVE])
        assert scalars(acc, f"eval_vs_time/{m}") == expect([(round(p["wall_s"] * 1000), p[m]) for p in CURVE])
    assert scalars(acc, "comm/bytes_sent") == expect([(p["step"], p["bytes"]) for p in CURVE])
    assert scalars(acc, "comm_vs_time/bytes_sent") == expect([(round(p["wall_s"] * 1000), p["bytes"]) for p in CURVE])
    assert scalars(acc, "train/samples_seen") == expect([(p["step"], p["samples"]) for p in CURVE])
    # the bytes come back to float32 precision only
    for (_, got), p in zip(scalars(acc, "comm/bytes_sent"), CURVE):
        assert got == pytest.approx(p["bytes"], rel=2**-23)

    final = {
        "total_bytes": 3_456_789,
        "bytes_setup": 1_000_000,
        "bytes_train": 0,
        "bytes_final": 2_456_789,
        "train_s": 12.125,
        "wall_s": 20.5,
        **RECORD["metrics"],
    }
    for key, value in final.items():
        assert scalars(acc, f"final/{key}") == expect([(30, value)]), key
    assert sorted(acc.Tags()["scalars"]) == sorted(
        ["train/loss", "train/samples_seen", "comm/bytes_sent", "comm_vs_time/bytes_sent"]
        + [f"{fam}/{m}" for fam in ("eval", "eval_vs_time") for m in ("id_accuracy", "id_loss", "shift_accuracy")]
        + [f"final/{k}" for k in final]
    )

    # the curve points carry walltime t0 + wall_s: the Relative axis keeps their spacing
    times = [e.wall_time for e in acc.Scalars("eval/id_accuracy")]
    assert np.diff(times) == pytest.approx(np.diff([p["wall_s"] for p in CURVE]), abs=1e-3)

    ddp = load(tmp_path / "tensorboard" / "ddp")
    assert scalars(ddp, "train/loss") == [(5, 3.0)]
    assert scalars(ddp, "eval/id_accuracy") == expect([(5, 0.4)])


def test_live_eval_is_not_written_twice(tmp_path: Path):
    # as SPSA does: every evaluation but the final one is also reported live
    with TensorBoardLog(tmp_path) as tb:
        for p in CURVE[:-1]:
            tb.progress(
                "spsa",
                {
                    "step": p["step"],
                    "train_loss": 0.7,
                    **{m: p[m] for m in ("id_accuracy", "id_loss", "shift_accuracy")},
                },
            )
        tb.record(dict(RECORD, strategy="spsa"))
    acc = load(tmp_path / "tensorboard" / "spsa")
    for m in ("id_accuracy", "id_loss", "shift_accuracy"):
        assert scalars(acc, f"eval/{m}") == expect([(p["step"], p[m]) for p in CURVE])
        assert scalars(acc, f"eval_vs_time/{m}") == expect([(round(p["wall_s"] * 1000), p[m]) for p in CURVE])


def test_spsa_forward_passes_are_an_axis_not_a_metric(tmp_path: Path):
    curve = [dict(p, forwards=4 * p["step"]) for p in CURVE]
    with TensorBoardLog(tmp_path) as tb:
        tb.record(dict(RECORD, strategy="spsa", curve=curve))
    acc = load(tmp_path / "tensorboard" / "spsa")
    assert scalars(acc, "train/forwards") == expect([(p["step"], 4 * p["step"]) for p in CURVE])
    assert not any("forwards" in t for t in acc.Tags()["scalars"] if t != "train/forwards")


def test_error_record_writes_nothing(tmp_path: Path):
    tb = TensorBoardLog(tmp_path)
    tb.record({"strategy": "spsa", "error": "RuntimeError: node 1 died", "wall_s": 3.0})
    tb.record({"strategy": "interlocking", "error": "ValueError: x"})
    tb.close()
    assert not (tmp_path / "tensorboard").exists()


def test_record_without_curve(tmp_path: Path):
    with TensorBoardLog(tmp_path) as tb:
        tb.record(
            {
                "strategy": "ddp",
                "metrics": {"id_accuracy": 0.9, "note": "text"},
                "comm": {"total_bytes": 5},
                "curve": [],
            }
        )
    acc = load(tmp_path / "tensorboard" / "ddp")
    assert scalars(acc, "final/id_accuracy") == expect([(0, 0.9)])
    assert scalars(acc, "final/total_bytes") == [(0, 5.0)]
    assert "eval/id_accuracy" not in acc.Tags()["scalars"]


def test_report_links_tensorboard(tmp_path: Path):
    import json

    from raylowcomm.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([RECORD]))
    assert "tensorboard --logdir" not in write_report(run).read_text()
    with TensorBoardLog(run) as tb:
        tb.record(RECORD)
    assert f"`tensorboard --logdir {run / 'tensorboard'}`" in write_report(run).read_text()


def test_robust_rounds_write_each_nodes_figures_by_round(tmp_path: Path):
    row = {"norm": 2.0, "cosine": 0.5, "scale": 1.0, "trimmed": 0.0, "dropped": None}
    rounds = [
        {
            "round": 1,
            "nodes": [{"node": 0, **row}, {"node": 1, **row, "norm": "nan", "cosine": None, "dropped": "not finite"}],
        },
        {"round": 2, "nodes": [{"node": 0, **row, "cosine": 0.25}, {"node": 1, **row, "scale": 0.5}]},
    ]
    with TensorBoardLog(tmp_path) as tb:
        tb.record({"strategy": "lofi", "metrics": {}, "details": {"robust_rounds": rounds}})
    acc = load(tmp_path / "tensorboard" / "lofi")
    assert scalars(acc, "robust/node0/cosine") == expect([(1, 0.5), (2, 0.25)])
    assert scalars(acc, "robust/node1/dropped") == expect([(1, 1.0), (2, 0.0)])
    assert scalars(acc, "robust/node1/norm") == expect([(2, 2.0)]), "a non-finite norm is not a point"
    assert scalars(acc, "robust/node1/scale") == expect([(1, 1.0), (2, 0.5)])
