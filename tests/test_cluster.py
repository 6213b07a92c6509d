"""Real Ray clusters that the tests make and always tear down: a sweep submitted as a Ray job to a
`ray start` cluster, and a run submitted to a 2-host cluster (network namespaces) whose node
actors land on both hosts. Each cluster lives in its own namespaces, so it cannot collide with
the session's loopback Ray. Every cluster runs with token authentication and a token of its own:
the jobs below are submitted with it, and a client without it is refused."""

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from raylowcomm.cluster import NamespaceCluster
from tests.test_resume import checkpoint_step

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 256, "test_size": 100, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1},
    "strategies": ["lofi"],
    "log_every": 1000,
    "checkpoint_every": 1000,
    "lofi": {"bn_recalibrate": False},
}
# The job's entrypoint gets the cluster's environment (token auth included: the driver inherits
# RAY_AUTH_MODE=token and the token's path from the head's Ray); this shows (and checks) adding to
# it a variable that raylowcomm also passes to its actors (Ray refuses to merge one set twice).
RUNTIME_ENV = {"env_vars": {"HF_HUB_OFFLINE": "1"}}
# What a crafted request without the token gets from the jobs API: the HTTP status.
POST_JOB = """
import json, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1] + "/api/jobs/", data=json.dumps({"entrypoint": sys.argv[2]}).encode(),
                                 headers={"Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(request, timeout=30).status)
except urllib.error.HTTPError as err:
    print(err.code)
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None,
        reason="needs root, iproute2 and nsenter",
    ),
]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _clusters():
    """Starts clusters on demand and tears every one down at exit, also when a test or a start fails."""
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
    for cluster in made:
        assert not any(Path("/var/run/netns", ns).exists() for ns in cluster.hosts + [cluster.switch])


@pytest.fixture
def make_cluster():
    with _clusters() as make:
        yield make


@pytest.fixture(scope="module")
def two_hosts():
    """One 2-host cluster of 2 CPUs a host for this file's 2-host tests (a start and a teardown are ~20 s)."""
    with _clusters() as make:
        yield make(hosts=2, cpus=2)


@pytest.mark.heavy
def test_sweep_submitted_as_a_job_writes_results(make_cluster, tmp_path):
    cluster = make_cluster(hosts=1, cpus=2)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**TINY, "nodes": {"count": 1, "cpus": 1}}))
    (tmp_path / "sweep.yaml").write_text(
        yaml.safe_dump(
            {
                "base": "base.yaml",
                "space": {"optim.lr": {"grid": [0.01, 0.1]}},
                "metric": "id_accuracy",
                "mode": "max",
                "name": "job",
            }
        )
    )
    store = tmp_path / "store"
    proc = cluster.submit(
        ["raylowcomm", "tune", str(tmp_path / "sweep.yaml"), "--storage-path", str(store)],
        working_dir=REPO,
        runtime_env=RUNTIME_ENV,
    )
    assert "succeeded" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((store / "job" / "summary.json").read_text())
    assert len(summary["trials"]) == 2 and all(t["status"] == "done" for t in summary["trials"])
    assert "best id_accuracy" in proc.stdout and (store / "job" / "sweep.png").exists()


def test_two_host_run_places_node_actors_on_both_hosts(two_hosts, tmp_path):
    # 2 CPUs per host: both actors would fit on one host, so SPREAD is what puts them apart.
    cluster = two_hosts
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**TINY, "nodes": {"count": 2, "cpus": 1, "placement": "SPREAD"}}))
    proc = cluster.submit(
        ["raylowcomm", "run", str(config), "--out", str(tmp_path / "out")], working_dir=REPO, runtime_env=RUNTIME_ENV
    )
    assert "succeeded" in proc.stdout, proc.stdout[-3000:]
    record = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert "id_accuracy" in record["metrics"]
    nodes = cluster.node_ids()
    assert sorted(nodes.values()) == sorted(cluster.addresses)
    used = {n["ray_node_id"] for n in record["nodes"]}
    assert used == set(nodes), f"actors ran on {used}, cluster nodes {nodes}"
    # model.source auto asked the other host whether it can load the model (it draws it from the seed):
    # the nodes loaded it themselves, only the recipe crossed
    kinds = record["comm"]["by_kind"]
    assert "setup/model_recipe" in kinds and "setup/initial_weights" not in kinds, sorted(kinds)


def test_a_client_without_the_token_is_refused(two_hosts, tmp_path):
    """On the 2-host cluster, the jobs API and the GCS refuse a client without the cluster's token
    or with another one, through Ray's CLI and through a request made by hand from the other host;
    nothing runs; with the token it does."""
    cluster = two_hosts

    def jobs() -> set[str]:
        listed = cluster.run(0, [cluster.ray, "job", "list", f"--address={cluster.dashboard}"])
        return set(re.findall(r"raysubmit_\w+", listed.stdout + listed.stderr))

    before = jobs()  # the file's other tests share the cluster
    job_dir, marker = tmp_path / "job", tmp_path / "ran"
    job_dir.mkdir()
    touch = ["python", "-c", f"open({str(marker)!r}, 'w')"]

    anonymous = cluster.submit(touch, working_dir=job_dir, check=False, timeout=120, auth=False)
    assert anonymous.returncode != 0
    assert (
        "AuthenticationError: Authentication required: Unauthorized: Missing authentication token" in anonymous.stderr
    ), anonymous.stderr[-2000:]
    wrong = cluster.submit(touch, working_dir=job_dir, check=False, timeout=120, auth=secrets.token_hex(32))
    assert wrong.returncode != 0
    assert "AuthenticationError: Authentication failed: Forbidden: Invalid authentication token" in wrong.stderr, (
        wrong.stderr[-2000:]
    )
    by_hand = cluster.run(1, [sys.executable, "-c", POST_JOB, cluster.dashboard, f"touch {marker}"], auth=False)
    assert by_hand.stdout.split() == ["401"], by_hand.stdout
    gcs = cluster.run(1, [cluster.ray, "status", f"--address={cluster.address}"], check=False, auth=False)
    assert gcs.returncode != 0 and "InvalidAuthToken" in gcs.stderr, gcs.stderr[-2000:]
    assert jobs() == before and not marker.exists(), "a refused job ran"

    accepted = cluster.submit(touch, working_dir=job_dir, timeout=300)
    assert "succeeded" in accepted.stdout and marker.exists(), accepted.stdout[-3000:]


def _kill_actor_on(cluster: NamespaceCluster, host: int, actor_class: str) -> int:
    """SIGKILL the process of one `actor_class` actor on `host` (a node that crashes); its pid."""
    inode = os.stat(f"/var/run/netns/{cluster.hosts[host]}").st_ino
    for pid in NamespaceCluster._pids_in({inode}):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            continue
        if f"ray::{actor_class}" in cmdline:
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"no {actor_class} actor on host {host}")


@pytest.mark.heavy
def test_pinned_nodes_run_on_their_named_hosts_also_after_a_restart(make_cluster, tmp_path):
    """nodes.hosts names host 1 for node 0 and host 0 for node 1 (PACK alone would put both on one
    host: each has room for two): lo-fi's node actors and DDP's ranks run there, and lo-fi's node 0,
    killed mid-run, restarts on host 1 again, in its own bundle of the run's placement group."""
    cluster = make_cluster(hosts=2, cpus=2)
    storage, hosts = tmp_path / "shared", cluster.node_ids()
    pinned = [cluster.addresses[1], cluster.addresses[0]]
    cfg = {
        **TINY,
        "strategies": ["lofi", "ddp"],
        "storage": str(storage),
        "checkpoint_every": 4,
        "optim": {**TINY["optim"], "epochs": 8},
        "nodes": {"count": 2, "cpus": 1, "hosts": pinned},
    }
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(cfg))
    driver = cluster.start_on(0, ["raylowcomm", "run", str(tmp_path / "pinned.yaml"), "--out", str(tmp_path / "out")])
    checkpoint, deadline = storage / "lofi" / "checkpoints" / "node0.safetensors", time.time() + 300
    while checkpoint_step(checkpoint) < 4:
        assert driver.poll() is None and time.time() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.05)
    _kill_actor_on(cluster, 1, "LofiNode")
    out, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0 and "node 0 died" in out and "restarting it" in out, out[-3000:]
    lofi, ddp = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "error" not in lofi and "error" not in ddp, out[-3000:]
    assert [hosts[n["ray_node_id"]] for n in sorted(lofi["nodes"], key=lambda n: n["node"])] == pinned
    assert [hosts[n["ray_node_id"]] for n in sorted(ddp["nodes"], key=lambda n: n["rank"])] == pinned


@pytest.mark.heavy
def test_state_on_shared_storage_survives_a_lost_host(make_cluster, tmp_path):
    """Each host has its own scratch (TMPDIR); only `storage` is shared. A GPU run is placed on the
    host that advertises one (the driver has no CUDA); an SPSA node joins on the other host from
    the checkpoint and log in storage; a lo-fi node whose host is lost restarts on the other host
    from its checkpoint in storage, and the average equals the uninterrupted run's."""
    scratch = [tmp_path / f"scratch{i}" for i in range(2)]
    for d in scratch:
        d.mkdir()
    # host 0 (head) has room for a restarted node; the "slot" resource puts the SPSA joiner apart
    cluster = make_cluster(
        hosts=2,
        cpus=[2, 1],
        gpus=[0, 1],
        resources=[{"slot": 1}, {"slot": 1}],
        host_env=[{"TMPDIR": str(d)} for d in scratch],
    )
    storage, hosts = tmp_path / "shared", cluster.node_ids()
    gpu_cfg = {**TINY, "nodes": {"count": 1, "cpus": 1, "gpus": 1}, "optim": {**TINY["optim"], "max_steps": 2}}
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(gpu_cfg))
    proc = cluster.run(
        0, ["raylowcomm", "run", str(tmp_path / "gpu.yaml"), "--out", str(tmp_path / "gpu")], timeout=600
    )
    gpu_node = json.loads((tmp_path / "gpu" / "results.json").read_text())[0]["nodes"][0]
    assert hosts[gpu_node["ray_node_id"]] == cluster.addresses[1], proc.stdout[-2000:]

    spsa = {
        **TINY,
        "strategies": ["spsa"],
        "storage": str(storage),
        "checkpoint_every": 4,
        "nodes": {"count": 1, "cpus": 1, "resources": {"slot": 1}},
        "spsa": {"steps": 12, "lr": 1e-4, "join": [{"step": 6}]},
    }
    (tmp_path / "spsa.yaml").write_text(yaml.safe_dump(spsa))
    proc = cluster.run(
        0, ["raylowcomm", "run", str(tmp_path / "spsa.yaml"), "--out", str(tmp_path / "spsa")], timeout=600
    )
    record = json.loads((tmp_path / "spsa" / "results.json").read_text())[0]
    first, joiner = record["nodes"]
    assert joiner["joined_from_checkpoint_step"] == 4, proc.stdout[-2000:]
    assert hosts[joiner["ray_node_id"]] != hosts[first["ray_node_id"]], proc.stdout[-2000:]
    assert joiner["final_hash"] == first["final_hash"] and record["details"]["verified"][-1]["nodes"] == [0, 1]

    lofi = {
        **TINY,
        "storage": str(storage),
        "checkpoint_every": 4,
        "optim": {**TINY["optim"], "epochs": 8},
        "nodes": {"count": 2, "cpus": 1, "placement": "SPREAD"},
    }
    (tmp_path / "lofi.yaml").write_text(yaml.safe_dump(lofi))
    clean = cluster.run(
        0,
        [
            "raylowcomm",
            "run",
            str(tmp_path / "lofi.yaml"),
            "--out",
            str(tmp_path / "clean"),
            "--set",
            f"storage={tmp_path / 'clean_storage'}",
        ],
        timeout=600,
    )
    driver = cluster.start_on(0, ["raylowcomm", "run", str(tmp_path / "lofi.yaml"), "--out", str(tmp_path / "lost")])
    checkpoints = [storage / "lofi" / "checkpoints" / f"node{k}.safetensors" for k in range(2)]
    deadline = time.time() + 300
    while min(checkpoint_step(p) for p in checkpoints) < 8:
        assert driver.poll() is None and time.time() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.05)
    cluster.kill_host(1)
    out, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, out[-3000:]
    record = json.loads((tmp_path / "lost" / "results.json").read_text())[0]
    restored = [t["restored_from"] for n in record["nodes"] for t in n["train"] if t["restored_from"] is not None]
    assert restored and min(restored) >= 8, out[-3000:]
    assert {hosts[n["ray_node_id"]] for n in record["nodes"]} == {cluster.addresses[0]}, "the lost node did not move"
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "clean_storage" / "lofi" / "model.safetensors"))
    b = load_file(str(storage / "lofi" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a), clean.stdout[-1000:]
    assert not [p for d in scratch for p in d.rglob("*.safetensors")], "state was written to a host's own disk"
