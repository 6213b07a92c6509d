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


def test_a_run_is_read_from_its_seed_folder_and_a_failed_one_runs_again(tmp_path, monkeypatch):
    """`measure` keeps each (workload, length, setting, seed) in OUT/dial/<workload>/<length>/<setting>/seed_<s>
    (`raylowcomm.seeds.seed_config`'s folder): a results.json there is read, not rerun; a failed one runs again
    with that seed, into that folder."""
    import json

    from benchmarks import dial

    where = dial.run_dir(tmp_path, "mnist", "ddp", 3, "62")
    where.mkdir(parents=True)
    (where / "results.json").write_text(json.dumps([{"strategy": "ddp", "error": "RuntimeError: killed"}]))
    ran = []

    def fake_run(cfg, out, bar=None):
        ran.append((cfg.seed, out))
        record = {"strategy": "ddp", "metrics": {"id_accuracy": 0.9}, "comm": {"by_phase": {}, "total_bytes": 5}}
        record.update(details={"steps_per_worker": 62}, train_s=1.0, wall_s=2.0)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps([record]))

    monkeypatch.setattr("benchmarks.sweep.run", fake_run)
    row = dial.measure(tmp_path, "mnist", "ddp", 3, "62")
    assert ran == [(3, where)] and row["id"] == 0.9 and row["steps"] == 62
    assert dial.measure(tmp_path, "mnist", "ddp", 3, "62") == row and len(ran) == 1  # read, not rerun
