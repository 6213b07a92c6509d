"""`raylowcomm run --resume OUT` after the driver was SIGKILLed mid-training: finished strategies
are kept, a lo-fi or SPSA run continues from its last checkpoint in storage, and the final
weights equal an uninterrupted run's bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from raylowcomm.config import ConfigError
from raylowcomm.resume import check_resumable
from raylowcomm.runner import run
from raylowcomm.storage import Storage
from raylowcomm.strategies import from_dict

CONFIG = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 512, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 3},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi", "spsa"],
    "checkpoint_every": 8,
    "log_every": 1000,
    "lofi": {"bn_recalibrate": False, "average_every": 24},
    "spsa": {"steps": 48, "lr": 1e-4},
}


def _cli(*args: str) -> subprocess.Popen:
    env = {
        k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"
    }  # each run starts its own local Ray, as a user's would
    return subprocess.Popen(
        [sys.executable, "-m", "raylowcomm.cli", "run", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def checkpoint_step(path: Path) -> int:
    """The step of a node checkpoint (training.save_checkpoint's metadata), -1 until it exists."""
    try:
        return Storage(path.parent).load_tensors(path.name)[1]["step"]
    except FileNotFoundError:  # not written yet (writes are atomic: never half a file)
        return -1


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGKILL the driver and everything it started (its local Ray too) once `ready()` holds."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, "the run never reached the point to kill it at"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


ROBUST_LOFI = {**CONFIG["lofi"], "exchange": "peers", "compress": "int8", "aggregate": "clip", "on_bad_payload": "drop"}
"""Peer rounds through a robust rule (clip, and drop's screening): what the nodes and node 0's round record
keep must carry a resume as the plain mean's do."""


SECURE = {
    "lofi": {**ROBUST_LOFI, "compress": "int2", "compress_scale": "shared", "secure": True, "bn_recalibrate": True},
    "nodes": {"count": 3, "cpus": 0.5},
    "data": {**CONFIG["data"], "train_size": 768},
}
"""Secure rounds (lofi.secure) on 3 nodes of the same 16 steps an epoch: a resumed run's nodes have new key
pairs and a new roster, and its masks cancel as the first run's did."""
SECURE["lofi"].update(aggregate="mean", on_bad_payload="fail")


@pytest.mark.slow
@pytest.mark.parametrize(
    "overlay",
    [
        {},
        pytest.param({"lofi": ROBUST_LOFI}, marks=pytest.mark.heavy),
        pytest.param(SECURE, marks=pytest.mark.heavy),
    ],
    ids=["star", "robust", "secure"],
)
def test_a_killed_driver_resumes_to_the_uninterrupted_weights(ray_session, tmp_path, overlay):
    cfg = {**CONFIG, **overlay}
    lofi_options, nodes = cfg["lofi"], cfg["nodes"]["count"]
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    state = out / "state"
    # the uninterrupted run, on the session's Ray, while the CLI runs go on their own (every run is deterministic)
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(run, from_dict(cfg), tmp_path / "clean", bar=False)

        # killed in lo-fi's second averaging round, after a checkpoint past the first average
        first = _cli(str(config), "--out", str(out))
        _kill_when(
            first,
            lambda: (
                min(checkpoint_step(state / "lofi" / "checkpoints" / f"node{k}.safetensors") for k in range(nodes))
                >= 32
            ),
        )
        assert not (out / "results.json").exists()

        # resumed: lo-fi finishes from its checkpoints; killed again in SPSA past a checkpoint
        second = _cli(str(config), "--resume", str(out))
        _kill_when(
            second,
            lambda: (
                (state / "spsa" / "driver.json").exists()
                and json.loads((state / "spsa" / "driver.json").read_text())["step"] >= 16
            ),
        )
        uninterrupted.result()
    lofi = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in lofi] == ["lofi"] and "error" not in lofi[0]
    restored = [t["restored_from"] for n in lofi[0]["nodes"] for t in n["train"] if t["restored_from"] is not None]
    assert restored and min(restored) >= 32, "lo-fi nodes did not resume from their checkpoints"

    log = _finish(_cli(str(config), "--resume", str(out)))
    assert "lofi: finished before, kept" in log
    records = json.loads((out / "results.json").read_text())
    assert records[0] == lofi[0], "the finished strategy was rerun"
    assert "[spsa] resuming at step" in log
    if lofi_options.get("aggregate", "mean") != "mean":  # the round record came through the kill, as the clean run's
        clean_rounds = json.loads((tmp_path / "clean" / "results.json").read_text())[0]["details"]["robust_rounds"]
        assert records[0]["details"]["robust_rounds"] == clean_rounds
    for name in ("lofi", "spsa"):
        clean, resumed = (
            load_file(str(tmp_path / "clean" / "state" / name / "model.safetensors")),
            load_file(str(state / name / "model.safetensors")),
        )
        assert clean.keys() == resumed.keys()
        assert all(torch.equal(clean[k], resumed[k]) for k in clean), (
            f"{name}: resumed weights differ from the uninterrupted run's"
        )


def test_resuming_with_another_config_names_what_changed(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(from_dict({**CONFIG, "out_dir": "elsewhere"}).to_dict()))
    check_resumable(from_dict({**CONFIG, "out_dir": str(tmp_path)}), tmp_path)  # OUT may be spelled differently
    changed = from_dict({**CONFIG, "optim": {**CONFIG["optim"], "lr": 0.1}})
    with pytest.raises(ConfigError, match=r"other settings \(optim.lr\)"):
        check_resumable(changed, tmp_path)
    with pytest.raises(ConfigError, match="holds no run"):
        check_resumable(changed, tmp_path / "empty")


@pytest.mark.slow
def test_a_kept_strategy_after_the_last_one_run_stays_in_the_results(ray_session, tmp_path):
    """Resuming a run whose first strategy failed reruns it and keeps the finished second one in
    results.json, although no strategy runs after it (it was lost when the kept one came last)."""
    cfg = from_dict(
        {
            **CONFIG,
            "optim": {**CONFIG["optim"], "epochs": 1},
            "spsa": {"steps": 4, "lr": 1e-4},
            "lofi": {"bn_recalibrate": False},
        }
    )
    first = run(cfg, tmp_path, bar=False)
    failed = [{"strategy": "lofi", "error": "RuntimeError: the node died", "wall_s": 1.0}, first[1]]
    (tmp_path / "results.json").write_text(json.dumps(failed))
    again = run(cfg, tmp_path, bar=False, resume=True)
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["strategy"] for r in written] == ["lofi", "spsa"] and "error" not in written[0]
    assert written[1] == json.loads(json.dumps(first[1], default=str)) and written == json.loads(
        json.dumps(again, default=str)
    )
    assert written[0]["metrics"] == first[0]["metrics"], "the rerun lo-fi is the first run's"


# CI's time: the killed-driver resume (bit for bit) and a quorum node's preemption and rejoin each run in CI
@pytest.mark.heavy
def test_a_killed_driver_of_quorum_rounds_resumes_and_finishes(tmp_path):
    """The payloads the driver owned die with it: every node adopts the global model of the node that
    had landed the most rounds and the run finishes, every node ending with the same model (hash-checked)."""
    config = tmp_path / "cfg.yaml"
    lofi = {"bn_recalibrate": False, "average_every": 8, "compress": "int8", "quorum": 2}
    optim = {**CONFIG["optim"], "epochs": 2}  # 32 steps a node, 4 rounds
    config.write_text(yaml.safe_dump({**CONFIG, "optim": optim, "strategies": ["lofi"], "lofi": lofi}))
    out = tmp_path / "run"
    first = _cli(str(config), "--out", str(out))
    rounds = out / "state" / "lofi" / "quorum_rounds.json"
    _kill_when(first, lambda: rounds.exists() and len(json.loads(rounds.read_text())) >= 2)
    log = _finish(_cli(str(config), "--resume", str(out)))
    assert "quorum rounds resume from round" in log
    [rec] = json.loads((out / "results.json").read_text())
    # two rounds had landed on the driver; a node lands a round at its next segment, so the nodes hold round 1 at least
    assert "error" not in rec and rec["details"]["resumed_after_round"] >= 1
    assert rec["details"]["rounds"] > rec["details"]["resumed_after_round"]
