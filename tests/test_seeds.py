"""Several seeds, one comparison: the statistics of raylowcomm.seedstats against values worked
by hand (t quantiles: 12.7062047 for 1 dof, 4.3026527 for 2), and one small real run over two
seeds through `raylowcomm run --seeds`."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from raylowcomm import seedstats
from raylowcomm.cli import main

T1, T2 = 12.706204736174694, 4.302652729749462  # Student t, 97.5% quantile, 1 and 2 dof


def test_interval_of_three_values():
    got = seedstats.interval([1.0, 2.0, 3.0])
    assert got["n"] == 3 and got["mean"] == 2.0 and got["sd"] == pytest.approx(1.0)
    assert got["half_width"] == pytest.approx(T2 / math.sqrt(3))  # 2.48414
    assert got["low"] == pytest.approx(2 - 2.4841377, abs=1e-6) and got["high"] == pytest.approx(4.4841377, abs=1e-6)


def test_interval_of_two_values_and_another_confidence():
    assert seedstats.interval([0.5, 0.7])["half_width"] == pytest.approx(T1 * 0.1)  # sd 0.1414 / sqrt 2 = 0.1
    assert seedstats.interval([0.5, 0.7], 0.90)["half_width"] == pytest.approx(6.313751514675 * 0.1)


def test_one_seed_has_a_mean_and_no_interval_none_has_neither():
    one = seedstats.interval([0.91])
    assert one["mean"] == 0.91 and one["half_width"] is None and one["low"] is None and one["sd"] is None
    assert seedstats.interval([])["mean"] is None
    assert seedstats.shown("id_accuracy", one) == "0.9100 (n=1, no interval)"


def test_an_interval_in_a_benchmark_table_reads_mean_plus_minus_half_width():
    three = seedstats.interval([1.0, 2.0, 3.0])  # half-width T2 / sqrt(3) = 2.48414
    assert seedstats.plus_minus(three, 2) == "2.00 ± 2.48"
    assert seedstats.plus_minus(three, 1, scale=100) == "200.0 ± 248.4"
    assert seedstats.plus_minus(seedstats.interval([0.5]), 3, sign="+") == "+0.500"
    assert seedstats.plus_minus(None) == seedstats.plus_minus(seedstats.interval([])) == "-"


def _record(name: str, acc: float, shift: float = 0.5, total: int = 1_000_000, wall: float = 10.0) -> dict:
    return {
        "strategy": name,
        "metrics": {"id_accuracy": acc, "id_loss": 1.0 - acc, "shift_accuracy": shift, "val_accuracy": 0.3},
        "comm": {"total_bytes": total, "by_phase": {"setup": total // 2, "train": total // 2, "final": 0}},
        "wall_s": wall,
        "train_s": wall / 2,
    }


def _failed(name: str, error: str = "RuntimeError: boom\nat line 3") -> dict:
    return {"strategy": name, "error": error, "wall_s": 1.0}


# ddp 0.90 0.92 0.94; lofi 0.89 0.89 0.92: lofi - ddp = -0.01 -0.03 -0.02, mean -0.02, sd 0.01
PER_SEED = {
    0: [_record("lofi", 0.89, total=0), _record("ddp", 0.90, total=2_000_000)],
    1: [_record("lofi", 0.89, total=0), _record("ddp", 0.92, total=2_000_000)],
    2: [_record("lofi", 0.92, total=0), _record("ddp", 0.94, total=4_000_000)],
}


def test_summary_means_intervals_and_paired_difference_to_ddp():
    summary = seedstats.summarize(PER_SEED)
    assert summary["seeds"] == [0, 1, 2] and summary["baseline"] == "ddp"
    lofi, ddp = summary["strategies"]
    assert lofi["strategy"] == "lofi" and lofi["seeds_ok"] == [0, 1, 2] and lofi["failed"] == []
    assert set(lofi["stats"]) == {
        "id_accuracy",
        "id_loss",
        "shift_accuracy",
        "bytes_total",
        "bytes_setup",
        "bytes_train",
        "bytes_final",
        "wall_s",
        "train_s",
    }  # val_* is not compared
    assert ddp["stats"]["id_accuracy"]["mean"] == pytest.approx(0.92)
    assert ddp["stats"]["id_accuracy"]["half_width"] == pytest.approx(T2 * 0.02 / math.sqrt(3))
    assert ddp["stats"]["bytes_total"]["mean"] == pytest.approx(8e6 / 3)
    paired = lofi["vs_ddp"]["id_accuracy"]
    assert paired["values"] == pytest.approx([-0.01, -0.03, -0.02]) and paired["seeds"] == [0, 1, 2]
    assert paired["mean"] == pytest.approx(-0.02) and paired["half_width"] == pytest.approx(T2 * 0.01 / math.sqrt(3))
    assert lofi["vs_ddp"]["shift_accuracy"]["mean"] == pytest.approx(0.0)
    assert set(lofi["vs_ddp"]) == {"id_accuracy", "id_loss", "shift_accuracy"} and ddp["vs_ddp"] == {}
    table = seedstats.format_table(summary)
    assert "-0.0200 ± 0.0248 (n=3)" in table and "0.9200 ± 0.0497" in table and "2.67 ± " in table


def test_a_failed_seed_is_counted_and_left_out_of_the_statistics():
    per_seed = {**PER_SEED, 2: [_failed("lofi"), _record("ddp", 0.94)]}
    lofi, ddp = seedstats.summarize(per_seed)["strategies"]
    assert lofi["seeds_ok"] == [0, 1] and lofi["failed"] == [{"seed": 2, "error": "RuntimeError: boom"}]
    assert lofi["stats"]["id_accuracy"]["n"] == 2 and lofi["stats"]["id_accuracy"]["mean"] == pytest.approx(0.89)
    assert lofi["vs_ddp"]["id_accuracy"]["values"] == pytest.approx([-0.01, -0.03])  # seeds 0 and 1 only
    assert lofi["vs_ddp"]["id_accuracy"]["half_width"] == pytest.approx(T1 * 0.01)
    assert ddp["stats"]["id_accuracy"]["n"] == 3
    table = seedstats.format_table(seedstats.summarize(per_seed))
    assert "lofi      2/3" in table and "FAILED" in table and "seed 2: RuntimeError: boom" in table


def test_a_failed_ddp_seed_leaves_that_seed_out_of_the_pairs_and_no_ddp_no_pairs():
    lofi = seedstats.summarize({**PER_SEED, 1: [_record("lofi", 0.89), _failed("ddp")]})["strategies"][0]
    assert lofi["vs_ddp"]["id_accuracy"]["seeds"] == [0, 2] and lofi["stats"]["id_accuracy"]["n"] == 3
    alone = seedstats.summarize({s: [r for r in rs if r["strategy"] == "lofi"] for s, rs in PER_SEED.items()})
    assert alone["baseline"] is None and alone["strategies"][0]["vs_ddp"] == {}
    assert "paired − ddp (no ddp)" in seedstats.format_table(alone)


TINY = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 128, "test_size": 32, "image_size": 16},
    "optim": {"batch_size": 16, "max_steps": 3},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi", "ddp"],
    "lofi": {"bn_recalibrate": False},
}


def test_a_seed_changes_only_seed_out_dir_and_storage_and_resume_checks_each_started_seed(tmp_path):
    from raylowcomm.config import ConfigError
    from raylowcomm.seeds import check_seeds_resumable, seed_config
    from raylowcomm.strategies import from_dict

    cfg = from_dict({**TINY, "storage": "s3://bucket/run/", "out_dir": str(tmp_path)})
    one = seed_config(cfg, 7, tmp_path)
    assert (one.seed, one.out_dir, one.storage) == (7, str(tmp_path / "seed_7"), "s3://bucket/run/seed_7")
    assert {**one.to_dict(), "seed": 0, "out_dir": "", "storage": ""} == {
        **cfg.to_dict(),
        "seed": 0,
        "out_dir": "",
        "storage": "",
    }
    assert cfg.seed == 0 and cfg.storage == "s3://bucket/run/"  # the caller's config is left alone
    (tmp_path / "seed_7").mkdir()
    (tmp_path / "seed_7" / "config.yaml").write_text(yaml.safe_dump(one.to_dict(), sort_keys=False))
    check_seeds_resumable(cfg, [7, 8], tmp_path)  # seed 7 continues, seed 8 starts afresh
    cfg.optim.lr = 0.5
    with pytest.raises(ConfigError, match="optim.lr"):
        check_seeds_resumable(cfg, [7, 8], tmp_path)


@pytest.mark.slow
@pytest.mark.heavy
def test_run_over_two_seeds_writes_each_seed_and_their_summary(tmp_path, ray_session, caplog):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "tiny.yaml"), "--seeds", "0,1", "--out", str(out)]) == 0
    summary = json.loads((out / "seeds.json").read_text())
    records = {s: json.loads((out / f"seed_{s}" / "results.json").read_text()) for s in (0, 1)}
    assert [yaml.safe_load((out / f"seed_{s}" / "config.yaml").read_text())["seed"] for s in (0, 1)] == [0, 1]
    assert summary["seeds"] == [0, 1] and summary["baseline"] == "ddp"
    assert [e["strategy"] for e in summary["strategies"]] == ["lofi", "ddp"]
    for entry in summary["strategies"]:
        assert entry["seeds_ok"] == [0, 1] and entry["failed"] == []
        mine = {s: next(r for r in records[s] if r["strategy"] == entry["strategy"]) for s in (0, 1)}
        for key in ("id_accuracy", "shift_accuracy"):
            assert entry["stats"][key]["mean"] == pytest.approx(sum(mine[s]["metrics"][key] for s in (0, 1)) / 2)
        assert entry["stats"]["bytes_total"]["mean"] == pytest.approx(
            sum(mine[s]["comm"]["total_bytes"] for s in (0, 1)) / 2
        )
        assert entry["stats"]["id_accuracy"]["n"] == 2
    ddp_acc = [next(r for r in records[s] if r["strategy"] == "ddp")["metrics"]["id_accuracy"] for s in (0, 1)]
    lofi_acc = [records[s][0]["metrics"]["id_accuracy"] for s in (0, 1)]
    paired = summary["strategies"][0]["vs_ddp"]["id_accuracy"]
    assert paired["values"] == pytest.approx([a - b for a, b in zip(lofi_acc, ddp_acc)])
    assert "paired − ddp" in caplog.text  # the table, logged as run() logs its own
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "## Across seeds" in report and "## seed 1" in report
