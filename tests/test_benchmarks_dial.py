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


def test_lengths_are_kept_apart_and_each_compared_with_its_own_ddp_paired_by_seed():
    """--lengths: a setting at 62 steps is summarised, compared and put on a frontier against DDP at 62
    steps only; its difference to DDP is paired by seed, over the seeds both ran."""
    short = [{**r, "length": "62"} for r in (row("ddp", 0, 0.86, 1000), row("ddp", 1, 0.88, 1000))]
    short += [{**r, "length": "62"} for r in (row("a", 0, 0.85, 10), row("a", 1, 0.86, 10), row("a", 2, 0.99, 10))]
    long = [{**r, "length": "125"} for r in (row("ddp", 0, 0.91, 2000), row("a", 0, 0.90, 20))]
    summary = {(r["length"], r["setting"]): r for r in summarize(short + long)}
    assert summary[("62", "a")]["ddp_bytes_over_these"] == pytest.approx(100)
    assert summary[("125", "a")]["ddp_bytes_over_these"] == pytest.approx(100)
    paired = summary[("62", "a")]["id_minus_ddp"]  # seeds 0 and 1 only: seed 2 has no DDP run beside it
    assert paired["mean"] == pytest.approx(-0.015) and paired["half_width"] > 0
    assert summary[("125", "a")]["id_minus_ddp"]["mean"] == pytest.approx(-0.01)
    assert summary[("62", "ddp")]["id_minus_ddp"] is None
    assert frontier(list(summary.values()), "w", "62") == ["a"]  # its mean over 3 seeds (0.90) beats DDP's
    assert frontier(list(summary.values()), "w", "125") == ["a", "ddp"]
