"""What a new user sees: `raylowcomm run` prints every line once, and none of Ray's noise."""

import collections
import os
import subprocess
import sys

import pytest
import yaml

NOISE = ("PlacementGroupCleaner", "Failed to query Ray Train Controller", "core_worker.cc", "constructor arguments",
         "broadcast_buffers", "Traceback")


@pytest.mark.slow
def test_a_run_prints_every_line_once_and_no_noise(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 256, "test_size": 64, "image_size": 16},
        "optim": {"batch_size": 16, "max_steps": 6}, "nodes": {"count": 2, "cpus": 1},
        "strategies": ["lofi", "ddp"], "lofi": {"bn_recalibrate": False},
    }))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raylowcomm.cli", "run", str(config), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    twice = [line for line, n in collections.Counter(lines).items() if n > 1]
    assert not twice, twice
    assert not [line for line in lines if any(noise in line for noise in NOISE)]
    assert "=== lofi ===" in lines and "=== ddp ===" in lines and any(line.startswith("[lofi] step 6/6") for line in lines)
    assert (tmp_path / "out" / "timings.json").exists()
