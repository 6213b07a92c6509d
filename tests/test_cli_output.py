"""What a new user sees: `raylowcomm run` prints every line once, and none of Ray's noise, and
writes a record for every strategy."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

NOISE = (
    "PlacementGroupCleaner",
    "Failed to query Ray Train Controller",
    "core_worker.cc",
    "constructor arguments",
    "broadcast_buffers",
    "Traceback",
)


@pytest.mark.slow
def test_a_run_prints_every_line_once_and_no_noise(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
                "data": {"name": "mnist", "train_size": 256, "test_size": 64, "image_size": 16},
                "optim": {"batch_size": 16, "max_steps": 6},
                "nodes": {"count": 2, "cpus": 1},
                "strategies": ["lofi", "ddp"],
                "lofi": {"bn_recalibrate": False},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "raylowcomm.cli", "run", str(config), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    twice = [line for line, n in collections.Counter(lines).items() if n > 1]
    assert not twice, twice
    assert not [line for line in lines if any(noise in line for noise in NOISE)]
    assert (
        "=== lofi ===" in lines and "=== ddp ===" in lines and any(line.startswith("[lofi] step 6/6") for line in lines)
    )
    assert (tmp_path / "out" / "timings.json").exists()
    records = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["strategy"] for r in records] == ["lofi", "ddp"]
    for r in records:
        assert {"strategy", "metrics", "comm", "wall_s", "samples_per_s", "peak_rss_bytes"} <= r.keys()
        assert {"total_bytes", "by_phase"} <= r["comm"].keys()
        assert Path(r["weights"]).exists() and Path(r["weights"]).name == "model.safetensors"
    lofi, ddp = records
    assert lofi["comm"]["by_phase"]["train"] == 0 and ddp["comm"]["by_phase"]["train"] > 0
    assert len(lofi["nodes"]) == 2 and "id_accuracy" in lofi["nodes"][0]["metrics"]
