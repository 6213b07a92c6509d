"""Churn injected into runs: the schedule replays from its seed, bad entries are refused before anything
starts, and a lo-fi run whose node is preempted at a step (and another slowed) ends with the clean run's
model, every event booked in its record."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from raylowcomm.common import cpu_quota
from raylowcomm.common.cpu_quota import GROUP, PERIOD_US, cap_cpu, quota_unavailable
from raylowcomm.config import ConfigError
from raylowcomm.config.schema import ChurnConfig, KillAt, SlowNode
from raylowcomm.execution.churn import Preemption, preemptions
from raylowcomm.strategies import from_dict
from tests.strategies.test_lofi import run_lofi, tiny_config


def test_preemptions_replay_from_their_seed():
    churn = ChurnConfig(kill=[KillAt(node=1, at_step=5)], kill_every_s=30.0, seed=7)
    first, again = preemptions(churn, 4, seed=0, horizon=50), preemptions(churn, 4, seed=123, horizon=50)
    assert first == again  # churn.seed, not the run's, draws the victims
    assert first[0] == Preemption(1, at_step=5)
    assert [p.at_s for p in first[1:]] == [30.0 * i for i in range(1, 51)]
    assert {p.node for p in first[1:]} == {0, 1, 2, 3}
    other = preemptions(ChurnConfig(kill_every_s=30.0, seed=8), 4, seed=0, horizon=50)
    assert [p.node for p in other] != [p.node for p in first[1:]]
    unseeded = ChurnConfig(kill_every_s=30.0)
    assert preemptions(unseeded, 4, seed=7, horizon=50) == first[1:]  # no churn.seed: the run's seed


@pytest.mark.parametrize(
    "churn, field",
    [
        ({"slow": [{"node": 2, "factor": 3}]}, "churn.slow[0].node"),
        ({"slow": [{"node": 0, "factor": 0.5}]}, "churn.slow[0].factor"),
        ({"slow": [{"node": 0}, {"node": 0, "factor": 2}]}, "churn.slow"),
        ({"kill": [{"node": 1, "at_step": 0}]}, "churn.kill[0].at_step"),
        ({"kill": [{"node": -1, "at_step": 3}]}, "churn.kill[0].node"),
        ({"kill_every_s": 0}, "churn.kill_every_s"),
    ],
)
def test_bad_churn_is_refused_naming_the_entry(churn, field):
    raw = {"nodes": {"count": 2}, "strategies": ["lofi"], "churn": churn}
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field_name == field


def test_interlocking_refuses_churn():
    with pytest.raises(ConfigError) as err:
        from_dict({"strategies": ["interlocking"], "churn": {"slow": [{"node": 0, "factor": 2}]}})
    assert err.value.field_name == "churn"


@pytest.mark.slow
def test_a_preempted_node_restarts_and_the_run_ends_as_the_clean_one(ray_session, tmp_path):
    clean_cfg = tiny_config(bn_recalibrate=False)
    _, clean = run_lofi(clean_cfg, tmp_path / "clean")
    cfg = tiny_config(bn_recalibrate=False)
    cfg.churn = ChurnConfig(slow=[SlowNode(node=0, factor=2)], kill=[KillAt(node=1, at_step=6)])
    _, rec = run_lofi(cfg, tmp_path / "churn")
    kinds = [(e["kind"], e["node"]) for e in rec["details"]["churn"]]
    assert sorted(kinds) == [("kill", 1), ("slow", 0)]
    kill = next(e for e in rec["details"]["churn"] if e["kind"] == "kill")
    assert kill["step"] == 6 and kill["at_step"] == 6
    restored = [t["restored_from"] for t in rec["nodes"][1]["train"] if t["restored_from"] is not None]
    assert restored == [4]  # the checkpoint before the preemption (checkpoint_every 4): step 6 was lost
    a, b = load_file(clean["weights"]), load_file(rec["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_cpu_quota_puts_the_process_in_its_own_cgroup_and_clears_those_of_exited_processes(tmp_path):
    """The cgroup files as plain files: what is written where (the kernel's side is Linux's)."""
    assert "no cgroup v1 cpu controller" in quota_unavailable(tmp_path)
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    assert quota_unavailable(tmp_path) is None
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / GROUP / exited.stdout.strip()
    stale.mkdir(parents=True)
    mine = cap_cpu(0.5, root=tmp_path)
    assert mine == tmp_path / GROUP / str(os.getpid()) and not stale.exists()
    assert (mine / "cpu.cfs_quota_us").read_text() == str(PERIOD_US // 2)
    assert (mine / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    assert (mine / "cgroup.procs").read_text() == str(os.getpid())


def test_every_node_process_takes_its_quota_first_when_asked(tmp_path, monkeypatch):
    """`start_process`, which node actors, DDP workers and interlocking stages all call first: the quota
    where churn.cpu_quota asks (with no churn events at all), none where it does not."""
    from raylowcomm import actors

    monkeypatch.setattr(cpu_quota, "CPU_CGROUP", tmp_path)
    monkeypatch.setattr(actors, "setup_threads", lambda cpus: None)  # this test process keeps its threads
    monkeypatch.setattr(actors, "log_to_stdout", lambda: None)
    assert actors.start_process(0.5, 0) == "cpu" and not (tmp_path / GROUP).exists()
    assert actors.start_process(0.5, 0, cpu_quota=True) == "cpu"
    assert (tmp_path / GROUP / str(os.getpid()) / "cpu.cfs_quota_us").read_text() == str(PERIOD_US // 2)
    quota_only = ChurnConfig(cpu_quota=True)
    assert not quota_only.active, "a quota alone injects no events (interlocking runs under it)"


def test_a_cpu_quota_where_no_cgroup_can_be_written_stops_the_config(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_quota, "CPU_CGROUP", tmp_path)  # no controller there
    cfg = tiny_config(average_every=8).to_dict()
    cfg["churn"] = {"cpu_quota": True}
    with pytest.raises(ConfigError) as err:
        from_dict(cfg)
    assert err.value.field_name == "churn.cpu_quota" and "cgroup" in str(err.value)
