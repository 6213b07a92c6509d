"""Real Ray clusters that the tests make and always tear down: a sweep submitted as a Ray job to a
`ray start` cluster, and a run submitted to a 2-host cluster (network namespaces) whose node
actors land on both hosts. Each cluster lives in its own namespaces, so it cannot collide with
the session's loopback Ray."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from raylowcomm.cluster import NamespaceCluster

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
    "strategies": ["lofi"], "log_every": 1000, "checkpoint_every": 1000,
    "lofi": {"bn_recalibrate": False},
}
# The job's entrypoint gets the cluster's environment; this shows (and checks) adding to it.
RUNTIME_ENV = {"env_vars": {"RAY_AUTH_MODE": "disabled"}}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@pytest.fixture
def make_cluster():
    """Start clusters; the finalizer tears every one down, also when a test or a start fails."""
    made = []

    def make(**kwargs) -> NamespaceCluster:
        cluster = NamespaceCluster(**kwargs)
        made.append(cluster)
        cluster.start()
        return cluster

    # A CI timeout's SIGTERM would skip finalizers and leave the cluster running: unwind instead.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield make
    finally:
        signal.signal(signal.SIGTERM, previous)
    for cluster in made:
        cluster.stop()
        assert not any(Path("/var/run/netns", ns).exists() for ns in cluster.hosts + [cluster.switch])


def test_sweep_submitted_as_a_job_writes_results(make_cluster, tmp_path):
    cluster = make_cluster(hosts=1, cpus=2)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**TINY, "nodes": {"count": 1, "cpus": 1}}))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "base.yaml", "space": {"optim.lr": {"grid": [0.01, 0.1]}}, "metric": "id_accuracy", "mode": "max",
        "name": "job"}))
    store = tmp_path / "store"
    proc = cluster.submit(["raylowcomm", "tune", str(tmp_path / "sweep.yaml"), "--storage-path", str(store)],
                          working_dir=REPO, runtime_env=RUNTIME_ENV)
    assert "succeeded" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((store / "job" / "summary.json").read_text())
    assert len(summary["trials"]) == 2 and all(t["status"] == "done" for t in summary["trials"])
    assert "best id_accuracy" in proc.stdout and (store / "job" / "sweep.png").exists()


def test_two_host_run_places_node_actors_on_both_hosts(make_cluster, tmp_path):
    # 2 CPUs per host: both actors would fit on one host, so SPREAD is what puts them apart.
    cluster = make_cluster(hosts=2, cpus=2)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**TINY, "nodes": {"count": 2, "cpus": 1, "placement": "SPREAD"}}))
    proc = cluster.submit(["raylowcomm", "run", str(config), "--out", str(tmp_path / "out")], working_dir=REPO,
                          runtime_env=RUNTIME_ENV)
    assert "succeeded" in proc.stdout, proc.stdout[-3000:]
    record = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert "id_accuracy" in record["metrics"]
    nodes = cluster.node_ids()
    assert sorted(nodes.values()) == sorted(cluster.addresses)
    used = {n["ray_node_id"] for n in record["nodes"]}
    assert used == set(nodes), f"actors ran on {used}, cluster nodes {nodes}"
