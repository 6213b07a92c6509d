"""Bad input, all of it: every malformed input to the `raylowcomm` CLI ends with exit code 2 and
exactly one stderr line, `error: ...`, naming the field, flag or path — before Ray starts and
before any model or dataset loads (no Ray, no weights: these tests are fast)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from raylowcomm.cli import main

# A config that validates (the model is never built: every case fails before `prepare`).
GOOD = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 64, "test_size": 32, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 8, "epochs": 1},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi"],
}


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _config(tmp: Path, **changes) -> str:
    raw = {**GOOD, "out_dir": str(tmp / "out"), **changes}
    for dotted in [k for k in raw if "." in k]:  # model.path=... -> nested
        section, key = dotted.split(".", 1)
        raw[section] = {**raw.get(section, {}), key: raw.pop(dotted)}
    return str(_write(tmp / "cfg.yaml", raw))


def _sweep(tmp: Path, **changes) -> str:
    _write(tmp / "base.yaml", GOOD)
    sweep = {"base": "base.yaml", "space": {"optim.lr": {"grid": [0.01, 0.1]}}, "metric": "id_accuracy", "mode": "max",
             "storage_path": str(tmp / "store"), **changes}
    return str(_write(tmp / "sweep.yaml", sweep))


def _sweep_with_bad_base(tmp: Path) -> str:
    sweep = _sweep(tmp)
    _write(tmp / "base.yaml", "optim: [\n")
    return sweep


def _file(tmp: Path) -> str:
    return str(_write(tmp / "a_file", "not a folder\n"))


def _binary(tmp: Path) -> str:
    path = tmp / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81 not text")
    return str(path)


# (id, argv builder from tmp_path, text the error line must contain)
CASES = [
    # --- the config file itself
    ("malformed-yaml", lambda t: ["run", str(_write(t / "bad.yaml", "optim:\n  lr: 0.1\n  momentum: [0.9,\n"))],
     "line 4, column 1"),
    ("malformed-yaml-names-file", lambda t: ["run", str(_write(t / "bad.yaml", "optim: {lr: 0.1\n"))], "bad.yaml"),
    ("yaml-tab-indent", lambda t: ["run", str(_write(t / "tab.yaml", "optim:\n\tlr: 0.1\n"))], "line 2, column 1"),
    ("yaml-list-not-mapping", lambda t: ["run", str(_write(t / "list.yaml", "- lofi\n- ddp\n"))], "mapping"),
    ("yaml-scalar-not-mapping", lambda t: ["run", str(_write(t / "s.yaml", "lofi\n"))], "s.yaml"),
    ("missing-config-file", lambda t: ["run", str(t / "nope.yaml")], "nope.yaml"),
    ("config-is-a-folder", lambda t: ["run", str(t)], "is a folder"),
    ("config-not-text", lambda t: ["run", _binary(t)], "bin.yaml"),
    # --- strategies
    ("empty-strategies", lambda t: ["run", _config(t, strategies=[])], "'strategies'"),
    ("empty-strategies-by-set", lambda t: ["run", _config(t), "--set", "strategies=[]"], "'strategies'"),
    ("unknown-strategy", lambda t: ["run", _config(t, strategies=["lofi", "gossip"])], "strategies[1]"),
    ("duplicate-strategy", lambda t: ["run", _config(t, strategies=["lofi", "lofi"])], "'strategies'"),
    ("strategies-not-a-list", lambda t: ["run", _config(t, strategies={"lofi": 1})], "'strategies'"),
    ("options-section", lambda t: ["run", _config(t, options={"lofi": {}})], "'options'"),
    # --- fields: unknown, wrong type, out of range
    ("unknown-top-level-field", lambda t: ["run", _config(t, epochs=3)], "'epochs'"),
    ("unknown-section-field", lambda t: ["run", _config(t), "--set", "optim.lrr=0.1"], "optim.lrr"),
    ("unknown-strategy-field", lambda t: ["run", _config(t, lofi={"every": 3})], "lofi.every"),
    ("wrong-type", lambda t: ["run", _config(t), "--set", "optim.lr=fast"], "optim.lr"),
    ("section-not-a-mapping", lambda t: ["run", _config(t, optim=3)], "'optim'"),
    ("wrong-literal", lambda t: ["run", _config(t), "--set", "optim.name=adam"], "optim.name"),
    ("out-of-range", lambda t: ["run", _config(t), "--set", "optim.momentum=1.5"], "optim.momentum"),
    ("length-groups-of-images", lambda t: ["run", _config(t), "--set", "optim.group_by_length=true"], "optim.group_by_length"),
    ("zero-nodes", lambda t: ["run", _config(t), "--set", "nodes.count=0"], "nodes.count"),
    ("negative-cpus", lambda t: ["run", _config(t), "--set", "nodes.cpus=-1"], "nodes.cpus"),
    ("bad-placement", lambda t: ["run", _config(t), "--set", "nodes.placement=STRICT"], "nodes.placement"),
    ("strategy-option-range", lambda t: ["run", _config(t), "--set", "lofi.average_every=0"], "lofi.average_every"),
    ("greedy-soup-without-val", lambda t: ["run", _config(t), "--set", "lofi.soup=greedy"], "lofi.soup"),
    ("empty-aux-widths", lambda t: ["run", _config(t, strategies=["interlocking"], interlocking={"aux_widths": []})],
     "interlocking.aux_widths"),
    ("spsa-bad-codec", lambda t: ["run", _config(t, strategies=["spsa"]), "--set", "spsa.codec=zip"], "spsa.codec"),
    # --- data and model
    ("bad-data-name", lambda t: ["run", _config(t), "--set", "data.name=cifar"], "data.name"),
    ("family-data-mismatch", lambda t: ["run", _config(t), "--set", "model.family=hf_classifier"], "model.family"),
    ("missing-model-path", lambda t: ["run", _config(t, **{"model.path": str(t / "weights")})], "model.path"),
    ("missing-data-path", lambda t: ["run", _config(t, **{"data.path": str(t / "digits.csv")})], "data.path"),
    # --- --set
    ("set-without-equals", lambda t: ["run", _config(t), "--set", "optim.lr"], "--set"),
    ("set-empty-key", lambda t: ["run", _config(t), "--set", "=0.1"], "--set"),
    ("set-into-non-section", lambda t: ["run", _config(t), "--set", "optim.lr.x=1"], "optim.lr"),
    ("set-malformed-value", lambda t: ["run", _config(t), "--set", "strategies=[lofi,"], "strategies"),
    ("set-missing-argument", lambda t: ["run", _config(t), "--set"], "--set"),
    # --- output folder
    ("out-is-a-file", lambda t: ["run", _config(t), "--out", _file(t)], "--out"),
    ("out-under-a-file", lambda t: ["run", _config(t), "--out", _file(t) + "/run"], "--out"),
    ("out-dir-field-is-a-file", lambda t: ["run", _config(t, out_dir=_file(t))], "out_dir"),
    # --- the command line
    ("unknown-flag", lambda t: ["run", _config(t), "--bogus"], "--bogus"),
    ("unknown-subcommand", lambda t: ["frobnicate"], "frobnicate"),
    ("no-subcommand", lambda t: [], "command"),
    ("run-without-config", lambda t: ["run"], "config"),
    ("assets-bad-action", lambda t: ["assets", "delete"], "delete"),
    ("assets-unknown-name", lambda t: ["assets", "fetch", "imagenet"], "imagenet"),
    # --- bench
    ("bench-bad-mode", lambda t: ["bench", "fast", _config(t)], "fast"),
    ("bench-local-bad-config", lambda t: ["bench", "local", _config(t), "--set", "optim.lr=-1"], "optim.lr"),
    ("bench-local-malformed-yaml", lambda t: ["bench", "local", str(_write(t / "b.yaml", "a: [\n"))], "b.yaml"),
    ("bench-local-with-rate", lambda t: ["bench", "local", _config(t), "--rate", "1gbit"], "--rate"),
    ("bench-local-out-is-a-file", lambda t: ["bench", "local", _config(t), "--out", _file(t)], "--out"),
    ("bench-wan-bad-rate", lambda t: ["bench", "wan", _config(t), "--rate", "fast"], "--rate"),
    # --- tune
    ("tune-missing-sweep", lambda t: ["tune", str(t / "sweep.yaml")], "sweep.yaml"),
    ("tune-malformed-sweep", lambda t: ["tune", str(_write(t / "sweep.yaml", "space:\n  optim.lr: {grid: [1, 2}\n"))],
     "line 2"),
    ("tune-sweep-not-mapping", lambda t: ["tune", str(_write(t / "sweep.yaml", "- 1\n"))], "sweep.yaml"),
    ("tune-unknown-key", lambda t: ["tune", _sweep(t, spaces={})], "'spaces'"),
    ("tune-bad-space-value", lambda t: ["tune", _sweep(t, space={"optim.lr": {"grid": [0.1, -1]}})], "space.optim.lr"),
    ("tune-bad-set", lambda t: ["tune", _sweep(t), "--set", "optim.lr"], "--set"),
    ("tune-malformed-base", lambda t: ["tune", _sweep_with_bad_base(t)], "base"),
    ("tune-storage-path-is-a-file", lambda t: ["tune", _sweep(t), "--storage-path", _file(t)], "--storage-path"),
    # --- report
    ("report-missing-dir", lambda t: ["report", str(t / "runs")], "runs"),
    ("report-dir-is-a-file", lambda t: ["report", _file(t)], "a_file"),
    ("report-empty-dir", lambda t: ["report", str(t)], "no bench.json"),
    ("report-bad-fraction", lambda t: ["report", str(t), "--target-fraction", "2"], "--target-fraction"),
    ("report-fraction-not-a-number", lambda t: ["report", str(t), "--target-fraction", "most"], "--target-fraction"),
]


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything tries to start or join Ray; restore the environment after."""
    import ray

    import raylowcomm.runner
    import raylowcomm.runtime

    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError("Ray was started on bad input")

    for target in (ray, raylowcomm.runtime, raylowcomm.runner):
        monkeypatch.setattr(target, "init" if target is ray else "init_ray", refuse)
    saved = dict(os.environ)
    yield started  # the test session's own Ray may be up already: what counts is that nothing tried to start one
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, no_ray, argv, expected):
    code = main(argv(tmp_path))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]
    assert not no_ray, "Ray was started on bad input"


def test_enough_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_out_not_writable(tmp_path, capsys, no_ray):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere; the parent-is-a-file cases cover an output that cannot be made")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["run", _config(tmp_path), "--out", str(locked / "run")]) == 2
    finally:
        locked.chmod(0o700)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "not writable" in lines[0]


def test_help_is_not_an_error(capsys):
    assert main(["run", "--help"]) == 0
    assert "--set" in capsys.readouterr().out
