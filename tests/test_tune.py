"""Sweep files are checked before Ray starts; a real sweep keeps each trial's node actors inside
that trial's own placement group and picks the best trial."""

import json
from pathlib import Path

import pytest
import yaml

from raylowcomm.cli import main
from raylowcomm.strategies import from_dict
from raylowcomm.tune import SweepError, format_trials, load_sweep, run_sweep, trial_bundles
from tests.test_cli_errors import no_ray as no_ray  # a fixture, used by its name

REPO = Path(__file__).resolve().parents[1]
BASE = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi"],
    "log_every": 1000,
    "checkpoint_every": 1000,
    "lofi": {"bn_recalibrate": False},
}


def write_sweep(tmp_path: Path, **changes) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    sweep = {
        "base": "base.yaml",
        "space": {"optim.lr": {"grid": [0.001, 0.1]}},
        "metric": "id_accuracy",
        "mode": "max",
        "storage_path": str(tmp_path / "store"),
        **changes,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"spaces": {}}, "'spaces'"),
        ({"space": {"optim.lrr": {"grid": [0.1]}}}, "optim.lrr"),
        ({"space": {"optim.lr": {"grid": [0.1, -1]}}}, "space.optim.lr value -1"),
        ({"space": {"optim.momentum": {"uniform": [0.5, 1.5]}}}, "space.optim.momentum value 1.5"),
        ({"space": {"optim.lr": {"loguniform": [0, 1]}}}, "bounds must be > 0"),
        ({"space": {"optim.lr": {"normal": [0, 1]}}}, "one of grid, choice, uniform, loguniform"),
        ({"space": {"interlocking.n": {"grid": [1, 2]}}}, "which this sweep does not run"),
        ({"space": {}}, "'space' is empty"),
        ({"base": "missing.yaml"}, "no such file"),
        ({"mode": "maximum"}, "'mode'"),
        ({"set": {"strategies": ["lofi", "ddp"]}}, "e.g. lofi/id_accuracy"),
        ({"set": {"nodes.placement": "STRICT"}}, "nodes.placement"),
        ({"set": {"nodes.hosts": ["10.0.0.2", "10.0.0.3"]}}, "nodes.hosts: pinning is for a run, not a sweep"),
        ({"space": {"nodes.hosts": {"choice": [["10.0.0.2", "10.0.0.3"]]}}}, "nodes.hosts: pinning is for a run"),
        (
            {"set": {"strategies": ["lofi", "ddp"]}, "metric": "lofi/id_accuracy", "columns": ["shift_accuracy"]},
            "columns[0] = 'shift_accuracy'",
        ),
    ],
)
def test_bad_sweep_files_fail_before_ray(tmp_path, changes, message):
    with pytest.raises(SweepError) as err:
        load_sweep(write_sweep(tmp_path, **changes))
    assert message in str(err.value)


LANGUAGE_MODEL = {
    **BASE,
    "model": {"name": "SmolLM2-135M", "family": "hf_causal_lm"},
    "data": {"name": "hamlet", "train_size": 64, "test_size": 32},
}
"""A language model on plain text: its metrics are loss and perplexity, not accuracy."""


def _any_sweep(tmp: Path, changes: dict) -> Path:
    """A sweep (`write_sweep`) with `changes`; with `language_model: True` among them its base config
    trains LANGUAGE_MODEL instead of BASE's image classifier."""
    language_model = changes.pop("language_model", False)
    sweep = write_sweep(tmp, **changes)
    if language_model:
        (tmp / "base.yaml").write_text(yaml.safe_dump(LANGUAGE_MODEL))
    return sweep


METRIC_CASES = [
    (
        "tune-metric-no-trial-reports",
        {"metric": "accuracy"},
        ("metric = 'accuracy'", "no trial reports it", "id_accuracy", "shift_accuracy", "train_loss"),
    ),
    ("tune-column-no-trial-reports", {"columns": ["val_accuracy"]}, ("columns[0] = 'val_accuracy'", "id_loss")),
    (
        "tune-asha-metric-no-trial-reports",
        {"asha": {"metric": "loss", "mode": "min"}},
        ("asha.metric = 'loss'", "train_loss"),
    ),
    (
        "tune-prefixed-metric-of-another-task",
        {"set": {"strategies": ["lofi", "ddp"]}, "metric": "lofi/id_perplexity"},
        ("metric = 'lofi/id_perplexity'", "lofi/", "ddp/", "id_accuracy"),
    ),
    (
        "tune-accuracy-of-a-language-model",
        {"language_model": True},
        ("metric = 'id_accuracy'", "id_perplexity", "train_loss"),
    ),
    (
        "tune-strategy-prefix-with-one-strategy",
        {"metric": "lofi/id_accuracy"},
        ("metric = 'lofi/id_accuracy'", "no trial reports it", "did you mean 'id_accuracy'?"),
    ),
]


@pytest.mark.parametrize("changes, expected", [c[1:] for c in METRIC_CASES], ids=[c[0] for c in METRIC_CASES])
def test_a_sweep_metric_no_trial_reports_stops_before_ray(tmp_path, capsys, no_ray, changes, expected):
    """Known from the config (tune.metrics), not after a whole trial ran: exit 2, one line naming the
    metric and the metrics that exist."""
    assert main(["tune", str(_any_sweep(tmp_path, dict(changes)))]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], lines[0]
    assert not no_ray


@pytest.mark.parametrize(
    "changes",
    [
        {"metric": "shift/uci_digits_accuracy"},  # the preset's own shift set
        {"metric": "val_accuracy", "set": {"data.val_size": 8}},
        {"metric": "val_loss", "space": {"data.val_size": {"grid": [0, 8]}}},  # a value the sweep tries
        {"metric": "total_bytes", "mode": "min", "columns": ["wall_s", "ray_nodes_used"]},
        {"metric": "ddp/id_loss", "mode": "min", "set": {"strategies": ["lofi", "ddp"]}, "columns": ["lofi/bytes"]},
        {"metric": "id_perplexity", "mode": "min", "language_model": True},
    ],
)
def test_a_metric_some_trial_reports_is_taken(tmp_path, changes):
    assert load_sweep(_any_sweep(tmp_path, dict(changes))).spec.metric == changes["metric"]


@pytest.mark.parametrize("path", sorted((REPO / "tune_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    sweep = load_sweep(path)
    assert sweep.samples and sweep.cfg.strategies


def test_the_table_shows_the_listed_columns_beside_the_metric(tmp_path):
    spec = load_sweep(
        write_sweep(
            tmp_path, set={"strategies": ["lofi", "ddp"]}, metric="lofi/id_accuracy", columns=["ddp/id_accuracy"]
        )
    ).spec
    trial = {
        "values": {"optim.lr": 0.1},
        "metric": 0.75,
        "columns": {"ddp/id_accuracy": 0.8125},
        "status": "done",
        "error": None,
        "iterations": 3,
    }
    header, row = format_trials(spec, [trial]).split()[:4], format_trials(spec, [trial]).splitlines()[2].split()
    assert header == ["optim.lr", "lofi/id_accuracy", "ddp/id_accuracy", "status"] and row[:3] == [
        "0.1",
        "0.7500",
        "0.8125",
    ]


def test_trial_reserves_one_bundle_per_actor():
    cfg = from_dict({**BASE, "nodes": {"count": 3, "cpus": 0.5, "resources": {"fast": 1}}})
    inside, outside = trial_bundles(cfg)
    assert inside == [{}] + [{"CPU": 0.5, "fast": 1.0}] * 3 and outside == []
    # Ray Train places DDP's workers in its own placement group, outside the trial's
    inside, outside = trial_bundles(from_dict({**BASE, "strategies": ["ddp"]}))
    assert inside == [{}] and outside == [{"CPU": 1.0}] * 2


@pytest.mark.slow
def test_two_trial_sweep_keeps_actors_in_each_trials_reservation(ray_session, tmp_path):
    sweep = load_sweep(
        write_sweep(tmp_path, name="two", asha={"metric": "train_loss", "mode": "min", "grace_period": 5})
    )
    summary = run_sweep(sweep)

    trials = summary["trials"]
    assert len(trials) == 2 and all(t["status"] == "done" for t in trials)
    assert summary["best"]["metric"] == max(t["metric"] for t in trials)
    assert {t["values"]["optim.lr"] for t in trials} == {0.001, 0.1}
    groups = set()
    for t in trials:
        trial_dir = Path(t["path"])
        last = json.loads((trial_dir / "result.json").read_text().strip().splitlines()[-1])
        assert last["training_iteration"] == 2 and "train_loss" in last  # progress, then the final metrics
        record = json.loads((trial_dir / "run" / "results.json").read_text())[0]
        assert record["metrics"]["id_accuracy"] == pytest.approx(last["id_accuracy"])
        actors = record["nodes"]
        assert len({a["pid"] for a in actors}) == 2
        assert last["placement_group"] and all(a["placement_group"] == last["placement_group"] for a in actors)
        groups.add(last["placement_group"])
        assert (trial_dir / "progress.csv").exists()
    assert len(groups) == 2, "each trial has its own reservation"
    experiment = Path(summary["experiment"])
    assert (experiment / "sweep.png").stat().st_size > 0 and (experiment / "summary.json").exists()
