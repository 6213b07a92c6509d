"""The dial benchmark's arithmetic: its intervals, its ratio to DDP and its frontier (no run)."""

import pytest

from benchmarks.dial import frontier, summarize


def row(setting: str, seed: int, acc: float, mb: float) -> dict:
    return {
        "workload": "w",
        "setting": setting,
        "seed": seed,
        "id": acc,
        "shift": None,
        "after_setup_bytes": mb * 1e6,
        "train_s": 10.0,
    }


def test_summary_means_ratios_and_frontier():
    rows = [
        row("ddp", 0, 0.92, 3000),
        row("ddp", 1, 0.94, 3000),
        row("cheap", 0, 0.80, 3),
        row("cheap", 1, 0.82, 3),
        row("mid", 0, 0.91, 30),
        row("bad", 0, 0.70, 300),
        row("tie", 0, 0.81, 3),
        {"workload": "w", "setting": "broken", "seed": 0, "error": "RuntimeError: x"},
    ]
    summary = {r["setting"]: r for r in summarize(rows)}
    assert "broken" not in summary  # a failed run is reported, not averaged
    assert summary["ddp"]["id"]["mean"] == pytest.approx(0.93) and summary["ddp"]["id"]["half_width"] > 0
    assert summary["cheap"]["ddp_bytes_over_these"] == pytest.approx(1000)
    assert summary["mid"]["id"]["half_width"] is None  # one seed: no interval
    # "bad" has more bytes and less accuracy than "mid"; "tie" (equal bytes, equal mean) beats neither
    assert frontier(list(summary.values()), "w") == ["cheap", "tie", "mid", "ddp"]
    # a setting level with DDP in accuracy at fewer bytes takes DDP off the frontier
    level = summarize(rows + [row("level", 0, 0.93, 30)])
    assert frontier(level, "w")[-1] == "level"
