"""The comparison harness end to end: a tiny model, every strategy, on a real 2-host cluster with
a shaped link (root only) and on the session's local Ray; the report, plots and curves exist,
and the bytes the report gives DDP are the gradients its all-reduce hook counted."""

import json
import os
import shutil

import pytest
import timm
import yaml

from raylowcomm.bench import BenchError, baseline_budget, wan_runs
from raylowcomm.cli import main
from raylowcomm.config import ConfigError
from raylowcomm.report import summarize_run

TINY = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["ddp", "lofi", "spsa", "interlocking"],
    "eval_every": 4,
    "log_every": 1000,
    "checkpoint_every": 1000,
    "spsa": {"lr": 0.001, "samples": 2},
    "interlocking": {"stages": 2, "micro_batches": 1, "aux_widths": [8]},
}


def _check_bench(out, labels, strategies, curve_points=2):
    bench = json.loads((out / "bench.json").read_text())
    assert [r["label"] for r in bench["runs"]] == labels and all(r["returncode"] == 0 for r in bench["runs"])
    for name in ("report.md", "curves_time.png", "curves_bytes.png"):
        assert (out / name).stat().st_size > 0
    report = (out / "report.md").read_text()
    grad_bytes = sum(
        p.numel() * p.element_size() for p in timm.create_model("test_efficientnet", num_classes=10).parameters()
    )
    for label in labels:
        records = json.loads((out / label / "results.json").read_text())
        assert [r["strategy"] for r in records] == strategies and not any("error" in r for r in records)
        for r in records:
            assert len(r["curve"]) >= curve_points and r["curve"][-1]["bytes"] == r["comm"]["total_bytes"]
            assert len({n["ray_node_id"] for n in r["nodes"]}) == (2 if label != "local" else 1)
        ddp = next(r for r in records if r["strategy"] == "ddp")
        steps = ddp["details"]["steps_per_worker"]
        assert ddp["comm"]["by_kind"]["train/gradient_allreduce"] == steps * 2 * grad_bytes
        row = next(row for row in summarize_run(records, "id_accuracy")["rows"] if row["strategy"] == "ddp")
        assert row["total_bytes"] == ddp["comm"]["total_bytes"]
        assert f"## {label}" in report
    return bench


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root, iproute2 and tc")
@pytest.mark.heavy
def test_wan_bench_on_two_hosts_at_one_rate(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "wan"
    namespaces = set(os.listdir("/var/run/netns")) if os.path.isdir("/var/run/netns") else set()
    assert main(["bench", "wan", str(config), "--rate", "100mbit", "--out", str(out)]) == 0
    bench = _check_bench(out, ["100mbit"], TINY["strategies"])
    link = bench["runs"][0]["link"]
    assert 50 < link["mbit_per_s"] < 110  # the link was really shaped to about 100 Mbit/s
    assert set(os.listdir("/var/run/netns")) <= namespaces  # hosts and switch torn down


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root, iproute2 and tc")
@pytest.mark.heavy
def test_wan_bench_on_four_hosts_places_one_actor_per_host(tmp_path):
    config = tmp_path / "tiny.yaml"
    tiny = {**TINY, "nodes": {"count": 4, "cpus": 0.5}, "strategies": ["ddp", "lofi"]}
    config.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "wan"
    assert main(["bench", "wan", str(config), "--hosts", "4", "--rate", "1gbit", "--out", str(out)]) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["hosts"] == 4 and bench["config"]["nodes"]["placement"] == "STRICT_SPREAD"
    for record in json.loads((out / "1gbit" / "results.json").read_text()):
        hosts = [n["ray_node_id"] for n in record["nodes"]]  # the namespaces share one hostname
        assert len(hosts) == 4 and len(set(hosts)) == 4, (record["strategy"], hosts)  # one actor on each host


@pytest.mark.slow
def test_local_bench_at_equal_time_writes_the_same_report_and_stops_every_strategy_at_its_budget(ray_session, tmp_path):
    """`--budget-s`: every strategy trains until the step at which its own training clock reaches the
    budget, its epochs repeating, and its record says where it stopped."""
    budget_s = 2.0
    config = tmp_path / "tiny.yaml"
    lofi = {"average_every": 4, "compress": "int8", "bn_recalibrate": False}  # rounds: the budget ends between them
    data = {**TINY["data"], "train_size": 64}  # an epoch of 2 steps a node (4 batches for interlocking)
    config.write_text(yaml.safe_dump({**TINY, "data": data, "lofi": lofi, "eval_every": 0}))
    out = tmp_path / "local"
    assert main(["bench", "local", str(config), "--budget-s", str(budget_s), "--out", str(out)]) == 0
    _check_bench(out, ["local"], TINY["strategies"], curve_points=1)  # how many steps fit in 2 s is the machine's
    records = json.loads((out / "local" / "results.json").read_text())
    for r in records:
        epoch = 64 // 16 if r["strategy"] == "interlocking" else 64 // 2 // 16
        budget = r["details"]["budget"]
        assert budget["stopped_by"] == "budget" and budget["train_s"] >= budget_s, r["strategy"]
        if r["strategy"] in ("spsa", "interlocking"):  # one clock, read before and after the last step: exact
            assert budget_s > budget["train_s"] - budget["last_step_s"], (r["strategy"], budget)
        assert budget["steps"] > epoch, r["strategy"]  # epochs repeated: the budget, not `epochs`, ended it
    lofi_record = next(r for r in records if r["strategy"] == "lofi")
    assert lofi_record["details"]["averaging_steps"][-1] == lofi_record["details"]["budget"]["steps"]
    ddp = next(r for r in records if r["strategy"] == "ddp")
    steps = ddp["details"]["steps_per_worker"]
    assert ddp["comm"]["by_kind"]["train/budget_votes"] == 4 * 2 * steps  # one float32 per rank and step


def test_repeats_interleave_the_rates_each_in_its_own_folder():
    """ABBA: each rate's two runs sit around the other rate's, so their medians meet the same minutes."""
    runs = wan_runs(["1gbit", "100mbit"], repeats=3)
    assert [(r["rate"], r["dir"], r["label"]) for r in runs] == [
        ("1gbit", "1gbit", "1gbit #1"),
        ("100mbit", "100mbit", "100mbit #1"),
        ("100mbit", "100mbit_2", "100mbit #2"),
        ("1gbit", "1gbit_2", "1gbit #2"),
        ("1gbit", "1gbit_3", "1gbit #3"),
        ("100mbit", "100mbit_3", "100mbit #3"),
    ]
    assert wan_runs(["100mbit"]) == [{"label": "100mbit", "rate": "100mbit", "dir": "100mbit"}]  # as before repeats
    with pytest.raises(ConfigError, match="--repeats"):
        wan_runs(["1gbit", "1gbit"])  # one folder per rate and repeat: a rate given twice would overwrite its run
    with pytest.raises(ConfigError, match="--repeats"):
        wan_runs(["1gbit"], repeats=0)


def test_wan_bench_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "nodes": {"count": 3, "cpus": 1}}))
    if os.geteuid() == 0 and shutil.which("tc"):
        assert main(["bench", "wan", str(config), "--out", str(tmp_path / "x")]) == 2
        assert "nodes.count" in capsys.readouterr().err
        config.write_text(yaml.safe_dump(TINY))
        assert main(["bench", "wan", str(config), "--rate", "fast", "--out", str(tmp_path / "x")]) == 2
        assert "--rate" in capsys.readouterr().err
        assert main(["bench", "wan", str(config), "--hosts", "4", "--out", str(tmp_path / "x")]) == 2
        assert "set nodes.count: 4" in capsys.readouterr().err  # 4 hosts, one node each
    else:
        assert main(["bench", "wan", str(config), "--out", str(tmp_path / "x")]) == 2
        assert "root" in capsys.readouterr().err
    assert main(["bench", "wan", str(config), "--hosts", "1", "--out", str(tmp_path / "x")]) == 2
    assert "'--hosts' = 1" in capsys.readouterr().err
    assert main(["bench", "local", str(config), "--hosts", "4", "--out", str(tmp_path / "x")]) == 2
    assert "only `bench wan` makes hosts" in capsys.readouterr().err
    assert main(["bench", "local", str(config), "--repeats", "2", "--out", str(tmp_path / "x")]) == 2
    assert "only `bench wan` repeats" in capsys.readouterr().err
    for rates in (["--rate", "1gbit", "--rate", "1gbit"], ["--repeats", "0"]):
        assert main(["bench", "wan", str(config), *rates, "--out", str(tmp_path / "x")]) == 2
        assert "--repeats" in capsys.readouterr().err
    for budget in ("-3", "inf", "soon"):
        assert main(["bench", "local", str(config), "--budget-s", budget, "--out", str(tmp_path / "x")]) == 2
        assert "'--budget-s'" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({**TINY, "strategies": ["lofi"]}))
    assert main(["bench", "local", str(config), "--budget-s", "--out", str(tmp_path / "x")]) == 2  # ddp's time
    assert "add ddp to strategies" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_budget_from_ddp_runs_ddp_alone_first_and_gives_its_time_to_every_strategy(tmp_path, monkeypatch):
    """`bench local --budget-s ddp`, the runs themselves stubbed by what they write: DDP alone first, with no
    budget, into OUT/ddp_time; then every strategy with its `train_s` as the budget, which bench.json books."""
    from raylowcomm import runner
    from raylowcomm.bench import bench_local
    from raylowcomm.strategies import load_config

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "strategies": ["ddp", "lofi"]}))
    cfg = load_config(str(config), ["optim.budget_s=1"])  # as the CLI loads it: a budget's checks run up front
    calls = []

    def fake_run(cfg, out):
        calls.append((list(cfg.strategies), cfg.optim.budget_s, out.name))
        records = [{"strategy": name, "train_s": 12.5} for name in cfg.strategies]
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps(records))
        return records

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr("raylowcomm.bench._report", lambda out: None)
    meta = bench_local(cfg, tmp_path / "out", budget_from_ddp=True)
    assert calls == [(["ddp"], None, "ddp_time"), (["ddp", "lofi"], 12.5, "local")]
    assert meta["budget"] == {"seconds": 12.5, "from": "ddp", "rate": None, "dir": "ddp_time"}
    assert meta["config"]["optim"]["budget_s"] == 12.5
    (tmp_path / "out" / "ddp_time" / "results.json").write_text(json.dumps([{"strategy": "ddp", "error": "boom"}]))
    with pytest.raises(BenchError, match="boom"):
        baseline_budget(tmp_path / "out" / "ddp_time" / "results.json")


@pytest.mark.heavy
def test_a_budget_from_ddp_gives_every_strategy_ddps_time_to_finish(ray_session, tmp_path):
    """`--budget-s ddp`: DDP runs alone first, unbudgeted, and its training seconds become every strategy's
    budget in the comparison; the bench says so."""
    config = tmp_path / "tiny.yaml"
    data = {**TINY["data"], "train_size": 64}
    lofi = {"average_every": 2, "compress": "int8", "bn_recalibrate": False}
    config.write_text(yaml.safe_dump({**TINY, "data": data, "strategies": ["ddp", "lofi"], "lofi": lofi}))
    out = tmp_path / "local"
    assert main(["bench", "local", str(config), "--budget-s", "ddp", "--out", str(out)]) == 0
    (alone,) = json.loads((out / "ddp_time" / "results.json").read_text())
    assert "budget" not in alone["details"] and alone["details"]["steps_per_worker"] == 64 // 2 // 16
    bench = json.loads((out / "bench.json").read_text())
    assert bench["budget"]["seconds"] == alone["train_s"] == bench["config"]["optim"]["budget_s"]
    records = json.loads((out / "local" / "results.json").read_text())
    assert [r["strategy"] for r in records] == ["ddp", "lofi"]
    assert all(r["details"]["budget"]["budget_s"] == alone["train_s"] for r in records)
