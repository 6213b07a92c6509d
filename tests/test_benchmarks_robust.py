"""The robust-rounds benchmark's arithmetic and table: intervals, the difference to the clean mean
paired by seed, failed runs counted and shown (no run, no Ray)."""

import json

import pytest

from benchmarks.robust import run_dir, summarize, table


def row(scenario: str, rule: str, seed: int, acc: float, dropped: int = 0) -> dict:
    return {"workload": "mnist", "scenario": scenario, "rule": rule, "seed": seed, "id": acc, "dropped": dropped}


def test_summary_pairs_each_run_with_the_clean_mean_of_its_seed():
    rows = [
        row("clean", "mean", 0, 0.90),
        row("clean", "mean", 1, 0.80),
        row("sign_flip", "mean", 0, 0.10),
        row("sign_flip", "mean", 1, 0.20),
        row("sign_flip", "median", 0, 0.88),
        row("sign_flip", "median", 1, 0.79),
        row("sign_flip", "median", 2, 0.50),  # no clean mean on seed 2: averaged, not paired
        row("nonfinite", "clip", 0, 0.89, dropped=1),
        {"workload": "mnist", "scenario": "nonfinite", "rule": "mean", "seed": 0, "error": "ValueError: non-finite"},
    ]
    summary = {(r["scenario"], r["rule"]): r for r in summarize(rows)}
    assert summary["clean", "mean"]["minus_clean_mean"] is None
    assert summary["clean", "mean"]["id"]["mean"] == pytest.approx(0.85)
    assert summary["clean", "mean"]["id"]["half_width"] > 0
    flip = summary["sign_flip", "mean"]["minus_clean_mean"]
    assert flip["mean"] == pytest.approx(-0.70) and flip["half_width"] > 0  # -0.8 and -0.6
    median = summary["sign_flip", "median"]
    assert median["seeds"] == [0, 1, 2] and median["minus_clean_mean"]["n"] == 2
    assert median["minus_clean_mean"]["mean"] == pytest.approx(-0.015)
    clip = summary["nonfinite", "clip"]
    assert clip["id"]["half_width"] is None and clip["dropped"] == 1  # one seed: no interval
    failed = summary["nonfinite", "mean"]
    assert failed["id"] is None and failed["failed"] == [{"seed": 0, "error": "ValueError: non-finite"}]


def test_table_shows_points_signed_differences_and_failures():
    rows = [
        row("clean", "mean", 0, 0.90),
        row("clean", "mean", 1, 0.80),
        row("noise", "trimmed_mean", 0, 0.87),
        row("noise", "trimmed_mean", 1, 0.79),
        {"workload": "mnist", "scenario": "nonfinite", "rule": "mean", "seed": 0, "error": "ValueError: nan"},
    ]
    text = table(summarize(rows), "mnist", "python -m benchmarks.robust --seeds 2")
    lines = text.splitlines()
    assert lines[0] == "`python -m benchmarks.robust --seeds 2`"
    by_rule = {line.split(" | ")[0] + " " + line.split(" | ")[1]: line for line in lines if line.startswith("| ")}
    assert "85.0 ± 63.5" in by_rule["| clean mean"] and by_rule["| clean mean"].endswith("| - | 0 |")
    assert "| 83.0 ± 50.8 | -2.0 ± 12.7 |" in by_rule["| noise trimmed_mean"]
    assert "| 0 (1 failed: ValueError: nan) | fails | - |" in by_rule["| nonfinite mean"]


def test_a_finished_run_is_read_from_its_seed_folder_not_run_again(tmp_path, monkeypatch):
    from benchmarks import robust

    where = run_dir(tmp_path, "mnist", "sign_flip", "clip", 2)
    where.mkdir(parents=True)
    record = {"strategy": "lofi", "metrics": {"id_accuracy": 0.7}, "details": {"dropped_payloads": [0, 0, 0, 2]}}
    (where / "results.json").write_text(json.dumps([{**record, "train_s": 1.0}]))
    monkeypatch.setattr("benchmarks.sweep.run", lambda *a, **k: pytest.fail("ran again"))
    got = robust.measure(tmp_path, "mnist", "sign_flip", "clip", 2)
    assert got == {
        "workload": "mnist",
        "scenario": "sign_flip",
        "rule": "clip",
        "seed": 2,
        "id": 0.7,
        "dropped": 2,
        "train_s": 1.0,
    }
