import dataclasses
import threading
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.averaging import average_state_dicts
from raylowcomm.finetune import build_model
from raylowcomm.models import state_dict_of
from raylowcomm.runner import prepare
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.tasks import make_task, score_sets


def tiny_config(**lofi):
    return from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 512, "test_size": 200, "image_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 2},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["lofi"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "lofi": lofi,
        }
    )


def run_lofi(cfg, out):
    ctx = prepare(cfg, out)
    return ctx, Lofi().run(ctx).to_dict()


def test_lofi_end_to_end_two_actors(ray_session, tmp_path):
    cfg = tiny_config(bn_recalibrate=True)
    ctx, rec = run_lofi(cfg, tmp_path)
    by_phase = rec["comm"]["by_phase"]
    assert by_phase["train"] == 0, "lo-fi must not communicate while training"
    state_bytes = payload_nbytes(state_dict_of(ctx.load_driver_weights()))
    # the nodes draw the same random initialisation themselves (model.source auto): only its recipe crosses
    assert rec["comm"]["by_kind"]["setup/model_recipe"] == 2 * payload_nbytes(ctx.recipe) < 4096
    assert "setup/initial_weights" not in rec["comm"]["by_kind"]
    assert rec["comm"]["by_kind"]["final/node_weights"] == 2 * state_bytes
    assert rec["comm"]["by_kind"]["setup/data_recipe"] == 2 * payload_nbytes(
        ctx.data.train
    )  # how to read it, not the rows
    assert not any("data_shard" in kind for kind in rec["comm"]["by_kind"]), "no training row crosses"
    assert len(rec["nodes"]) == 2 and all(
        "id_accuracy" in n["metrics"] and "shift_accuracy" in n["metrics"] for n in rec["nodes"]
    )
    assert {"id_accuracy", "shift_accuracy"} <= rec["metrics"].keys()
    assert "average_without_bn_recalibration" in rec["details"]
    good = rec["goodput"]  # each node's training over the node-seconds the training phase reserved
    assert 0 < good["goodput"] <= 1 and good["restarts"] == 0 and len(good["nodes"]) == 2
    assert [a["useful_s"] for a in good["nodes"]] == [sum(t["train_s"] for t in n["train"]) for n in rec["nodes"]]
    steps = rec["details"]["steps_per_node"]
    assert rec["samples_seen"] == 2 * steps * 16 and steps == 2 * (256 // 16)

    # The saved model is the exact average of the nodes' final weights (BN stats aside), bit for bit: the
    # driver's StreamingAverage of the same two float32 states as this one (float64 addition of two terms is
    # commutative, so whichever arrived first gives the same sum; then one division by 2, one rounding).
    nodes = [load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / f"node{k}.safetensors")) for k in range(2)]
    expected = average_state_dicts([{k[6:]: v for k, v in n.items() if k.startswith("model.")} for n in nodes])
    saved = load_file(rec["weights"])
    for name, value in saved.items():
        if "running_" not in name and "num_batches" not in name:
            assert torch.equal(value, expected[name]), name
    # nodes really trained apart: their weights differ
    assert not torch.equal(nodes[0]["model.conv_stem.weight"], nodes[1]["model.conv_stem.weight"])


def test_averaging_rounds_are_counted(ray_session, tmp_path):
    cfg = tiny_config(average_every=8, outer_optimizer="nesterov", bn_recalibrate=False)
    ctx, rec = run_lofi(cfg, tmp_path)
    state_bytes = payload_nbytes(state_dict_of(ctx.load_driver_weights()))
    rounds = len(rec["details"]["averaging_steps"]) - 1  # the last average is the final one
    assert rounds == 3
    kinds = rec["comm"]["by_kind"]
    assert kinds["train/node_weights"] == rounds * 2 * state_bytes
    assert kinds["train/global_weights"] == rounds * 2 * state_bytes


@pytest.mark.slow
def test_curve_point_is_the_average_a_shorter_run_would_have_made(ray_session, tmp_path):
    one_epoch = tiny_config(bn_recalibrate=False)
    one_epoch.optim.epochs = 1
    _, short = run_lofi(one_epoch, tmp_path / "short")
    two_epochs = tiny_config(bn_recalibrate=False)
    two_epochs.eval_every = 16  # one epoch = 256 / 16 steps
    _, long = run_lofi(two_epochs, tmp_path / "long")
    curve = long["curve"]
    assert [p["step"] for p in curve] == [16, 32]
    # the snapshot average at step 16 scores exactly what stopping there and averaging scores
    assert {k: curve[0][k] for k in short["metrics"]} == short["metrics"]
    assert curve[-1]["bytes"] == long["comm"]["total_bytes"] and curve[-1]["wall_s"] > curve[0]["wall_s"]
    # lo-fi sends nothing while training: a point costs the setup plus one collection of the nodes' models
    assert curve[0]["bytes"] == long["comm"]["by_phase"]["setup"] + long["comm"]["by_kind"]["final/node_weights"]
    assert curve[0]["samples"] == 2 * 16 * 16


def kill_own_worker(marker: str) -> int | None:
    """SIGKILL the first Ray worker of this test session (a descendant of the test process: the raylet is its
    child) whose command line names `marker`, as a preemption would; its pid, or None while there is none."""
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if any(marker in part for part in cmdline):
            proc.kill()
            return proc.pid
    return None


def _kill_a_node_when_checkpointed(ckpt_dir, killed: list):
    """Kills one node's training process once every node has a checkpoint, whichever it finds first: one of
    this test session's own Ray workers (descendants of the test process, which started Ray: driver → raylet →
    worker), never another run's on the machine."""
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            ready = all(load_file(str(ckpt_dir / f"node{k}.safetensors")) is not None for k in range(2))
        except Exception:
            ready = False
        if ready:
            pid = kill_own_worker("LofiNode.train")
            if pid is not None:
                killed.append(pid)
                return
        time.sleep(0.005)


# CI's time: a killed node restarting from its checkpoint and ending bit for bit as the clean run is
# test_churn's preempted-node test; curves through a run are test_curve_point's
@pytest.mark.heavy
def test_killed_node_restarts_from_its_checkpoint(ray_session, tmp_path):
    cfg = tiny_config(bn_recalibrate=False)
    cfg.optim.epochs, cfg.eval_every = 3, 16
    _, clean = run_lofi(cfg, tmp_path / "clean")
    killed: list = []
    killer = threading.Thread(
        target=_kill_a_node_when_checkpointed, args=(tmp_path / "killed" / "state" / "lofi" / "checkpoints", killed)
    )
    killer.start()
    _, rec = run_lofi(cfg, tmp_path / "killed")
    killer.join()
    assert killed, "no node was killed"
    restored = [t for n in rec["nodes"] for t in n["train"] if t["restored_from"] is not None]
    assert restored, "the killed node did not resume from a checkpoint"
    assert rec["comm"]["by_phase"]["train"] > 0  # the restarted node re-fetched its weights and shard
    # Resuming from the checkpoint is exact: the average equals the uninterrupted run's, bit for bit.
    a, b = load_file(clean["weights"]), load_file(rec["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(rec["nodes"]) == 2
    # the curve survives the restart: every point, scored from the same snapshots as the clean run's
    assert [p["step"] for p in rec["curve"]] == [16, 32, 48]
    assert [p["id_accuracy"] for p in rec["curve"]] == [p["id_accuracy"] for p in clean["curve"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["delta", pytest.param("factors", marks=pytest.mark.heavy)]
)  # factors' arithmetic is tests/test_lora.py's; the path through the nodes is delta's in CI
def test_lofi_with_lora_sends_adapters_only_and_averages_them_exactly(ray_session, tmp_path, how):
    """Real MiniLM with r=4 adapters on 2 nodes: only adapters and head cross; the saved model is
    base + mean_k scale·B_k·A_k (delta) or base + scale·mean(B)·mean(A) (factors)."""
    from raylowcomm.lora import AdapterAverage, lora_layers
    from tests.conftest import trainable_nbytes

    cfg = from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier", "lora": {"r": 4, "alpha": 8}},
            "data": {"name": "rotten_tomatoes", "train_size": 64, "test_size": 32, "max_length": 32, "shift": "none"},
            "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 8, "epochs": 1},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["lofi"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "lofi": {"lora_average": how},
        }
    )
    ctx, rec = run_lofi(cfg, tmp_path)
    kinds = rec["comm"]["by_kind"]
    assert (
        kinds["final/node_adapters"]
        == 2 * trainable_nbytes(ctx.load_driver_weights())
        < 0.03 * 2 * payload_nbytes(state_dict_of(ctx.load_driver_weights()))
    )
    assert "final/node_weights" not in kinds
    trainable = {k for k, p in ctx.load_driver_weights().named_parameters() if p.requires_grad}
    nodes = []
    for k in range(2):
        saved = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / f"node{k}.safetensors"))
        assert {name[len("model.") :] for name in saved if name.startswith("model.")} == trainable, (
            "no frozen base checkpointed"
        )
        nodes.append({name: saved[f"model.{name}"] for name in trainable})
    assert any(not torch.equal(nodes[0][name], nodes[1][name]) for name in trainable), "the nodes trained apart"
    model = ctx.load_driver_weights()
    expected = AdapterAverage(state_dict_of(model), lora_layers(model), how)(nodes)
    got = load_file(rec["weights"])
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    # Node 0 merged the average itself, on its own base, from the adapters: no merged model crossed,
    # and what it scored is the saved model.
    assert "final/weights_to_score" not in kinds
    assert kinds["final/adapters_to_score"] == kinds["final/node_adapters"]
    plain = build_model(dataclasses.replace(ctx.spec, lora=None))
    plain.load_state_dict(got)
    # node 0 scored it on its own PEFT model computing these weights (the merged tensors swapped in, the
    # adapters scaled by 0: they add exactly 0), on one thread (runtime.setup_threads, 1 CPU): scored here on
    # one thread too, the same kernels on the same batches give the same bits
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scored = score_sets(make_task(ctx.data.task), plain, ctx.eval_sets(val=False), cfg.eval_rows)
    finally:
        torch.set_num_threads(threads)
    assert scored["id_accuracy"] == rec["metrics"]["id_accuracy"] and scored["id_loss"] == rec["metrics"]["id_loss"]


def test_eval_on_nodes_scores_the_average_on_each_nodes_own_held_out_rows(ray_session, tmp_path):
    cfg = tiny_config(bn_recalibrate=False)
    cfg.data.eval_on_nodes, cfg.data.test_size, cfg.optim.epochs = True, 64, 1
    ctx, rec = run_lofi(cfg, tmp_path)
    assert "test" not in ctx.data.eval_sets, "the driver holds no test rows"
    per_node = rec["details"]["average_on_nodes"]
    assert len(per_node) == 2 and per_node[0] != per_node[1], "each node scored its own rows"
    assert rec["metrics"]["id_accuracy"] == pytest.approx(sum(m["id_accuracy"] for m in per_node) / 2)
    assert all("id_accuracy" in n["metrics"] for n in rec["nodes"]) and "shift_accuracy" in rec["metrics"]
    assert rec["comm"]["by_kind"]["setup/eval_sets"] == 2 * payload_nbytes(ctx.data.eval_sets["shift/uci_digits"])


def test_one_average_with_an_outer_step_scores_the_model_it_saves(ray_session, tmp_path, monkeypatch):
    """The star's final average with DiLoCo's outer step: what the nodes are sent to score is the stepped
    model the record saves, not the plain average before the step."""
    from raylowcomm.actors import NodeGroup

    scored, score_weights = [], NodeGroup.score_weights

    def keep_what_is_scored(self, state, *args, **kwargs):
        scored.append(state)
        return score_weights(self, state, *args, **kwargs)

    monkeypatch.setattr(NodeGroup, "score_weights", keep_what_is_scored)
    _, rec = run_lofi(tiny_config(outer_optimizer="nesterov", bn_recalibrate=False), tmp_path)
    saved = load_file(rec["weights"])
    assert len(scored) == 1 and scored[0].keys() == saved.keys()
    assert all(torch.equal(scored[0][k], saved[k]) for k in saved)
