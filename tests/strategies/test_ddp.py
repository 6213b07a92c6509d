import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from ray.train import TrainingFailedError
from safetensors.torch import load_file

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import ConfigError
from raylowcomm.config.schema import ChurnConfig, KillAt
from raylowcomm.models import state_dict_of
from raylowcomm.runner import prepare
from raylowcomm.storage import Storage
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.ddp import Ddp
from raylowcomm.strategies.ddp.worker import all_gather_nbytes
from tests.strategies.test_lofi import tiny_config
from tests.test_data_sources import LABELS, reviews, write


def _restart_config(max_restarts: int):
    """32 steps per worker, evaluated and checkpointed every 8. Few reports: each waits until Ray
    Train's controller has taken the one before (it polls every 0.5 s: `env.JOB_DEFAULTS`)."""
    cfg = tiny_config()
    cfg.strategies, cfg.eval_every, cfg.checkpoint_every, cfg.nodes.max_restarts = ["ddp"], 8, 8, max_restarts
    return cfg


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    return Ddp().run(prepare(_restart_config(2), tmp_path_factory.mktemp("plain"))).to_dict()


@pytest.mark.slow
def test_ddp_counts_the_gradients_it_all_reduces(ray_session, uninterrupted, tmp_path):
    cfg = _restart_config(2)  # the run of `uninterrupted`, evaluated every 8 steps
    ctx, rec = prepare(cfg, tmp_path), uninterrupted
    steps = rec["details"]["steps_per_worker"]
    grad_bytes = sum(p.numel() * p.element_size() for p in ctx.load_driver_weights().parameters() if p.requires_grad)
    # every step each of the 2 ranks hands every gradient to all-reduce, once
    assert rec["comm"]["by_kind"]["train/gradient_allreduce"] == steps * 2 * grad_bytes
    # the curve's bytes are the setup plus the gradients all-reduced up to each point
    curve, setup = rec["curve"], rec["comm"]["by_phase"]["setup"]
    assert [p["step"] for p in curve] == [8, 16, 24, steps] and steps == 32
    assert [p["bytes"] for p in curve[:-1]] == [setup + s * 2 * grad_bytes for s in (8, 16, 24)]
    assert (
        curve[-1]["bytes"] == rec["comm"]["total_bytes"] and curve[-1]["id_accuracy"] == rec["metrics"]["id_accuracy"]
    )
    assert all(a["wall_s"] < b["wall_s"] for a, b in zip(curve, curve[1:])) and curve[-1]["wall_s"] == rec["train_s"]
    assert rec["comm"]["by_kind"]["setup/model_recipe"] == 2 * payload_nbytes(ctx.recipe)  # the nodes load it
    initial = state_dict_of(ctx.load_driver_weights())
    assert rec["comm"]["by_kind"]["setup/ddp_initial_broadcast"] == payload_nbytes(initial)
    assert rec["comm"]["by_kind"]["setup/shard_sizes"] == all_gather_nbytes(
        [(w["examples"], None) for w in rec["nodes"]], 2
    )
    assert rec["samples_seen"] == 2 * steps * cfg.optim.batch_size
    assert {"id_accuracy", "shift_accuracy"} <= rec["metrics"].keys()
    assert len(rec["nodes"]) == 2


def train_worker_actors() -> set[str]:
    """Every Ray Train worker actor the cluster has made, dead or alive."""
    import ray._private.state

    return {a for a, info in ray._private.state.actors().items() if info["ActorClassName"] == "RayTrainWorker"}


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_data_stops_every_rank_without_a_restart(ray_session, tmp_path):
    """Node 1's file is not on its host: that would recur after every restart, so the ranks agree
    to stop, and the driver raises the rank's own error after one attempt, with restarts left."""
    write(tmp_path / "far_0.csv", reviews(24))
    write(tmp_path / "eval.csv", reviews(8, 100))
    cfg = from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"},
            "data": {
                "name": "mine",
                "source": "csv",
                "files": str(tmp_path / "eval.csv"),
                "node_files": str(tmp_path / "far_{node}.csv"),
                "node_files_on_driver": False,
                "columns": {"text": "review", "label": "stars"},
                "classes": LABELS,
                "test_size": 8,
                "max_length": 16,
                "shift": "none",
            },
            "optim": {"name": "sgd", "lr": 0.01, "batch_size": 4, "epochs": 1},
            "nodes": {"count": 2, "cpus": 1, "max_restarts": 2},
            "strategies": ["ddp"],
            "log_every": 1000,
        }
    )
    ctx, before = prepare(cfg, tmp_path / "out"), train_worker_actors()
    with pytest.raises(ConfigError) as err:
        Ddp().run(ctx)
    assert err.value.field_name == "data.node_files[1]", str(err.value)
    assert len(train_worker_actors() - before) == 2, "one attempt of two workers: a data error is not retried"


@pytest.mark.slow
def test_ddp_with_lora_all_reduces_exactly_the_adapter_and_head_gradients(ray_session, tmp_path):
    from raylowcomm.strategies import from_dict
    from tests.conftest import trainable_nbytes

    cfg = from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier", "lora": {"r": 4, "alpha": 8}},
            "data": {"name": "rotten_tomatoes", "train_size": 64, "test_size": 16, "max_length": 24, "shift": "none"},
            "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 8, "epochs": 1},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["ddp"],
            "log_every": 1000,
            "checkpoint_every": 100,
        }
    )
    ctx = prepare(cfg, tmp_path)
    rec = Ddp().run(ctx).to_dict()
    steps, adapters = rec["details"]["steps_per_worker"], trainable_nbytes(ctx.load_driver_weights())
    assert steps == 4 and adapters < 0.01 * payload_nbytes(state_dict_of(ctx.load_driver_weights()))
    assert [w["allreduce_bytes"] for w in rec["nodes"]] == [steps * adapters] * 2
    assert rec["comm"]["by_kind"]["train/gradient_allreduce"] == 2 * steps * adapters
    assert rec["comm"]["by_kind"]["final/model_checkpoint"] == adapters
    assert (tmp_path / "ddp" / "adapter" / "adapter_model.safetensors").exists()
    checkpoints = sorted(
        p for p in (tmp_path / "state" / "ddp" / "ray_train" / "ddp").glob("checkpoint_*") if p.is_dir()
    )
    tensors, _ = Storage(checkpoints[-1]).load_tensors("state.safetensors")
    trained = {k for k, p in ctx.load_driver_weights().named_parameters() if p.requires_grad}
    assert {k[len("model.") :] for k in tensors if k.startswith("model.")} == trained, (
        "the frozen base is not checkpointed"
    )


def _kill_after_first_checkpoint(storage: Path, rank: int, killed: dict, stop: threading.Event) -> None:
    """SIGKILL DDP rank `rank`'s process once Ray Train has registered a checkpoint (its run
    snapshot names the latest); each rank's checkpoint file names the process that wrote it."""
    run = storage / "ddp" / "ray_train" / "ddp"
    while not stop.is_set():
        try:
            latest = json.loads((run / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
            writer = Storage(run / latest["checkpoint_dir_name"]).load_tensors(f"rank{rank}.safetensors")[1]["writer"]
        except Exception:  # none yet, or still being written
            time.sleep(0.02)
            continue
        os.kill(writer["pid"], signal.SIGKILL)
        killed.update(writer, checkpoint=latest["checkpoint_dir_name"], step=latest["metrics"]["step"])
        return


def _run_while_killing(ctx, rank: int = 1):
    killed, stop = {}, threading.Event()
    thread = threading.Thread(
        target=_kill_after_first_checkpoint, args=(Path(ctx.storage.uri), rank, killed, stop), daemon=True
    )
    thread.start()
    try:
        return Ddp().run(ctx).to_dict(), killed
    finally:
        stop.set()
        thread.join()


def _weights(rec) -> dict:
    return load_file(rec["weights"])


def _assert_same_run(rec, plain) -> None:
    """Same steps, samples, curve metrics, final metrics, losses, lineage bytes and final weights."""
    assert rec["details"]["steps_per_worker"] == plain["details"]["steps_per_worker"]
    assert rec["samples_seen"] == plain["samples_seen"] and rec["metrics"] == plain["metrics"]
    drop = ("wall_s", "bytes")
    assert [{k: v for k, v in p.items() if k not in drop} for p in rec["curve"]] == [
        {k: v for k, v in p.items() if k not in drop} for p in plain["curve"]
    ]
    assert [p["bytes"] for p in rec["curve"][:-1]] == [p["bytes"] for p in plain["curve"][:-1]]
    assert [n["mean_loss"] for n in rec["nodes"]] == [n["mean_loss"] for n in plain["nodes"]]
    assert rec["comm"]["by_kind"]["train/gradient_allreduce"] == plain["comm"]["by_kind"]["train/gradient_allreduce"]
    mine, theirs = _weights(rec), _weights(plain)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)  # bit-exact on CPU gloo


@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_from_its_checkpoint_as_if_uninterrupted(
    ray_session, uninterrupted, tmp_path
):
    rec, killed = _run_while_killing(prepare(_restart_config(2), tmp_path))
    assert killed, "no checkpoint of rank 1 appeared"
    details = rec["details"]
    assert details["restarts"] == 1 and len(details["attempts"]) == 2, details
    first, second = details["attempts"]
    assert first["resumed_from"] == 0 and second["resumed_from"] >= killed["step"] >= 8 and second["step"] == 32
    assert first["step"] >= second["resumed_from"] and second["resumed_from"] % 8 == 0
    assert killed["pid"] not in {n["pid"] for n in rec["nodes"]}  # the group was started again
    _assert_same_run(rec, uninterrupted)
    assert rec["goodput"]["restarts"] == 2 and uninterrupted["goodput"]["restarts"] == 0  # both ranks restarted
    assert 0 < rec["goodput"]["goodput"] < uninterrupted["goodput"]["goodput"] <= 1
    # what the failure cost is in the ledger on top: the setup again, and steps all-reduced twice
    extra = rec["comm"]["by_phase"]["train"] - uninterrupted["comm"]["by_phase"]["train"]
    setup = rec["comm"]["by_phase"]["setup"]
    assert rec["comm"]["by_kind"]["train/restart_setup_again"] == setup
    assert extra == setup + rec["comm"]["by_kind"].get("train/gradient_allreduce_redone", 0)
    assert (
        rec["comm"]["by_kind"].get("train/gradient_allreduce_redone", 0)
        == 2 * details["allreduce_redone_bytes_per_rank_at_least"]
    )


@pytest.mark.slow
@pytest.mark.heavy
def test_a_rank_preempted_by_churn_restarts_the_group_as_if_uninterrupted(ray_session, uninterrupted, tmp_path):
    cfg = _restart_config(2)
    cfg.churn = ChurnConfig(kill=[KillAt(node=1, at_step=12)])
    rec = Ddp().run(prepare(cfg, tmp_path)).to_dict()
    assert rec["details"]["churn"] == [
        {"kind": "kill", "node": 1, "at_step": 12, "step": 12, "wall_t": rec["details"]["churn"][0]["wall_t"]}
    ]
    # the group resumes from the last checkpoint Ray Train had taken (step 8, or none yet: 0)
    assert rec["details"]["restarts"] == 1 and rec["details"]["attempts"][1]["resumed_from"] in (0, 8)
    _assert_same_run(rec, uninterrupted)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_failed_run_resumes_from_its_latest_checkpoint(ray_session, uninterrupted, tmp_path):
    """No restarts allowed: the run fails; `run --resume` (ctx.resume) continues from its checkpoint."""
    with pytest.raises(TrainingFailedError):
        _run_while_killing(prepare(_restart_config(0), tmp_path))
    rec = Ddp().run(prepare(_restart_config(0), tmp_path, resume=True)).to_dict()
    attempts = rec["details"]["attempts"]
    assert rec["details"]["restarts"] == 0 and len(attempts) == 2 and attempts[1]["resumed_from"] >= 8, attempts
    _assert_same_run(rec, uninterrupted)
    # a new run (no --resume) starts afresh, not from the old checkpoints
    rec = Ddp().run(prepare(_restart_config(0), tmp_path)).to_dict()
    assert [a["resumed_from"] for a in rec["details"]["attempts"]] == [0]
