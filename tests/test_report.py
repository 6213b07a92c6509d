"""The report from hand-made results: interpolation, ratios to DDP, files, no DDP, the CLI. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylowcomm import report
from raylowcomm.cli import main


def point(step: int, wall_s: float, bytes_sent: int, acc: float) -> dict:
    return {
        "step": step,
        "wall_s": wall_s,
        "samples": 32 * step,
        "bytes": bytes_sent,
        "id_accuracy": acc,
        "shift_accuracy": acc / 2,
    }


def record(name: str, curve: list[dict], total_bytes: int, note: str | None = None) -> dict:
    last = curve[-1]
    return {
        "strategy": name,
        "metrics": {"id_accuracy": last["id_accuracy"], "shift_accuracy": last["shift_accuracy"], "id_loss": 1.0},
        "comm": {"total_bytes": total_bytes, "by_phase": {"setup": 0, "train": total_bytes, "final": 0}, "by_kind": {}},
        "train_s": last["wall_s"],
        "wall_s": last["wall_s"] + 5,
        "samples_seen": last["samples"],
        "details": {"curve_note": note} if note else {},
        "curve": curve,
    }


# DDP reaches 0.855 (95% of 0.9) between 0.8 at 20 s / 200 MB and 0.9 at 30 s / 300 MB: 25.5 s, 255 MB.
DDP = record(
    "ddp",
    [point(10, 10, 100_000_000, 0.5), point(20, 20, 200_000_000, 0.8), point(30, 30, 300_000_000, 0.9)],
    300_000_000,
)
# lo-fi crosses 0.855 between 0.6 at 6 s and 0.86 at 12 s: 6 + 6 * 0.255 / 0.26 s.
LOFI = record(
    "lofi",
    [point(10, 6, 10_000_000, 0.6), point(20, 12, 10_000_000, 0.86), point(30, 18, 20_000_000, 0.88)],
    20_000_000,
    note="averaged snapshots; each point adds 1.2 s, the measured time to collect one model over the link",
)
SPSA_FAILED = {"strategy": "spsa", "error": "RuntimeError: node 1 died", "wall_s": 3.0}
SPSA_SLOW = record("spsa", [point(10, 5, 1_000, 0.3), point(20, 10, 2_000, 0.4)], 2_000)
LOFI_TTT = 6 + 6 * 0.255 / 0.26


def make_bench(root: Path, runs: dict[str, list[dict]], benchmarks: dict[str, object] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for label, records in runs.items():
        (root / label).mkdir()
        (root / label / "results.json").write_text(json.dumps(records))
        entries.append(
            {"label": label, "rate": label, "dir": label, "collect_note": f"collecting one model took 1.2 s at {label}"}
        )
    cfg = {
        "model": {"name": "efficientnet_lite0"},
        "data": {"name": "mnist", "train_size": 2000},
        "nodes": {"count": 2},
        "strategies": ["ddp", "lofi", "spsa"],
        "eval_every": 10,
    }
    (root / "bench.json").write_text(json.dumps({"mode": "wan", "config": cfg, "runs": entries}))
    for name, data in (benchmarks or {}).items():
        (root / "benchmarks").mkdir(exist_ok=True)
        (root / "benchmarks" / f"{name}.json").write_text(json.dumps(data))
    return root


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    faster_ddp = record("ddp", [dict(p, wall_s=p["wall_s"] / 2) for p in DDP["curve"]], 300_000_000)
    lofi_scaling = {
        "steps_per_actor": 30,
        "rows": [
            {"strategy": "lofi", "nodes": 2, "samples_per_s": 210.5, "by_phase": {"setup": 1, "train": 0, "final": 2}}
        ],
    }
    return make_bench(
        tmp_path / "bench",
        {"100mbit": [DDP, LOFI, SPSA_FAILED], "1gbit": [faster_ddp, LOFI, SPSA_SLOW]},
        {"lofi_scaling": lofi_scaling},
    )


def test_crossing_interpolates_linearly_between_points():
    assert report.crossing(DDP["curve"], "id_accuracy", 0.855) == pytest.approx(25.5)
    assert report.crossing(DDP["curve"], "id_accuracy", 0.855, axis="bytes") == pytest.approx(255_000_000)
    assert report.crossing(LOFI["curve"], "id_accuracy", 0.855) == pytest.approx(LOFI_TTT)
    assert report.crossing(DDP["curve"], "id_accuracy", 0.4) == 10  # the first point already reaches it
    assert report.crossing(DDP["curve"], "id_accuracy", 0.95) is None
    # a loss: lower is better, reached going down
    loss = [{"wall_s": 0, "id_loss": 3.0}, {"wall_s": 10, "id_loss": 2.0}, {"wall_s": 20, "id_loss": 1.0}]
    assert report.crossing(loss, "id_loss", 1.5) == pytest.approx(15)


def test_summary_ratios_to_ddp():
    s = report.summarize_run([DDP, LOFI, SPSA_FAILED], "id_accuracy")
    assert s["target"] == pytest.approx(0.855) and s["note"] is None
    rows = {r["strategy"]: r for r in s["rows"]}
    assert rows["ddp"]["speedup_vs_ddp"] == pytest.approx(1) and rows["ddp"]["bytes_vs_ddp"] == 1
    assert rows["lofi"]["time_to_target_s"] == pytest.approx(LOFI_TTT)
    assert rows["lofi"]["speedup_vs_ddp"] == pytest.approx(25.5 / LOFI_TTT)
    assert rows["lofi"]["bytes_vs_ddp"] == pytest.approx(20 / 300)
    assert rows["spsa"]["error"].startswith("RuntimeError")
    slow = report.summarize_run([DDP, SPSA_SLOW], "id_accuracy")["rows"][1]
    assert (
        slow["time_to_target_s"] is None
        and slow["speedup_vs_ddp"] is None
        and slow["bytes_vs_ddp"] == pytest.approx(2_000 / 300e6)
    )


def test_loss_target_is_ddp_final_over_fraction():
    def lm(name: str, losses: list[float]) -> dict:
        curve = [
            {"step": i, "wall_s": 10.0 * (i + 1), "samples": i, "bytes": 100 * (i + 1), "id_loss": v}
            for i, v in enumerate(losses)
        ]
        return {
            "strategy": name,
            "metrics": {"id_loss": losses[-1], "id_perplexity": 9.0},
            "comm": {"total_bytes": 100 * len(losses)},
            "train_s": 1.0,
            "wall_s": 1.0,
            "samples_seen": 1,
            "curve": curve,
        }

    records = [lm("ddp", [3.0, 2.0, 1.9]), lm("spsa", [3.0, 2.5, 1.0])]
    assert report.primary_metric(records) == "id_loss"
    s = report.summarize_run(records, "id_loss")
    assert s["target"] == pytest.approx(1.9 / 0.95)
    ddp, spsa = s["rows"]
    assert ddp["time_to_target_s"] == pytest.approx(20)  # 2.0 is exactly the target
    assert spsa["time_to_target_s"] == pytest.approx(20 + 10 * 0.5 / 1.5)


def test_report_files_and_content(bench: Path):
    path = report.write_report(bench)
    text = path.read_text()
    for name in ("report.md", "curves_time.png", "curves_bytes.png"):
        assert (bench / name).stat().st_size > 0
    assert (bench / "curves_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "## 100mbit" in text and "## 1gbit" in text
    assert "collecting one model took 1.2 s at 100mbit" in text  # bench.json's collect note
    assert "measured time to collect one model" in text  # the record's curve_note
    assert "FAILED" in text and "RuntimeError: node 1 died" in text
    assert f"{LOFI_TTT:.1f} s" in text and f"{25.5 / LOFI_TTT:.2f}×" in text
    assert "not reached" in text  # SPSA at 1gbit
    assert "### lofi_scaling" in text and "210.5" in text
    assert "shift_accuracy" in text


def test_missing_or_failed_ddp(tmp_path: Path):
    bench = make_bench(tmp_path / "noddp", {"a": [LOFI, SPSA_SLOW], "b": [dict(SPSA_FAILED, strategy="ddp"), LOFI]})
    text = report.write_report(bench).read_text()
    assert "DDP is not in this run" in text and "DDP failed in this run" in text
    s = report.summarize_run([LOFI, SPSA_SLOW], "id_accuracy")
    assert s["target"] is None and all(r["speedup_vs_ddp"] is None and r["bytes_vs_ddp"] is None for r in s["rows"])
    assert (bench / "curves_time.png").exists() and (bench / "curves_bytes.png").exists()


def test_plain_run_directory(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([DDP, LOFI]))
    assert "## run" in report.write_report(run).read_text()


def test_multi_seed_directory(tmp_path: Path):
    """`run --seeds` output: the table across seeds, recomputed from each seed's results.json, then one
    section per seed; lo-fi failed in seed 5, so its mean and its paired difference to DDP (0.88 - 0.9) are seed 3's
    alone, without an interval; DDP's two equal seeds have an interval of width 0."""
    root = tmp_path / "seeds"
    for seed in (3, 5):
        (root / f"seed_{seed}").mkdir(parents=True)
        lofi = LOFI if seed == 3 else {**SPSA_FAILED, "strategy": "lofi"}
        (root / f"seed_{seed}" / "results.json").write_text(json.dumps([DDP, lofi]))
    (root / "seeds.json").write_text(json.dumps({"confidence": 0.95, "dirs": {"3": "seed_3", "5": "seed_5"}}))
    text = report.write_report(root).read_text()
    assert text.index("## Across seeds") < text.index("## seed 3") < text.index("## seed 5")
    assert "2 seeds (3, 5)" in text and "| ddp | 2/2 | id_accuracy | 0.9000 ± 0.0000 |" in text
    assert "| lofi | 1/2 | id_accuracy | 0.8800 (n=1, no interval) | -0.0200 (n=1, no interval) |" in text
    assert "seed 5: RuntimeError: node 1 died" in text


def test_cli_report(bench: Path, tmp_path: Path, capsys):
    assert main(["report", str(bench)]) == 0
    assert "report.md" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert main(["report", str(bench), "--target-fraction", "1.5"]) == 2


def test_a_benchmarks_plots_are_shown_above_its_tables():
    lines = report.benchmark_section("dial", {"plots": ["dial_mnist.png"], "runs": [{"setting": "ddp", "id": 0.9}]})
    assert lines[2] == "![dial_mnist.png](benchmarks/dial_mnist.png)"
    assert not any("plots" in line for line in lines) and any("ddp" in line for line in lines)
