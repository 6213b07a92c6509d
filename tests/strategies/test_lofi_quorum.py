"""Quorum rounds (`lofi.quorum`): on time and with every node in the quorum they are lockstep rounds,
bit for bit; a slow node's payload lands late and every node still ends with the same model; a
preempted node leaves the quorum, restarts and ends identical to the others."""

import os
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import load_file

from raylowcomm.config import ConfigError
from raylowcomm.config.schema import ChurnConfig, KillAt, SlowNode
from raylowcomm.runner import prepare
from raylowcomm.storage import Storage
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.lofi import Lofi, exchange_for, node_rounds
from raylowcomm.strategies.lofi.config import node_slots
from raylowcomm.strategies.lofi.node_rounds import PendingProgress
from raylowcomm.strategies.lofi.quorum import ROUNDS
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.strategies.test_lofi_rounds import bare_rounds, host_on_storage


def rounds_config(**lofi):
    """16 steps a node (one epoch), a round every 8."""
    cfg = tiny_config(average_every=8, compress="int8", bn_recalibrate=False, **lofi)
    cfg.optim.epochs = 1
    return cfg


@pytest.mark.parametrize(
    "lofi, field",
    [
        ({"quorum": 3}, "lofi.quorum"),
        ({"quorum": 0}, "lofi.quorum"),
        ({"quorum": 1.5}, "lofi.quorum"),
        ({"quorum": 1, "grace_s": -1}, "lofi.grace_s"),
        ({"quorum": 1, "fragments": 2}, "lofi.fragments"),
        ({"quorum": 1, "final_round": "exact"}, "lofi.final_round"),
    ],
)
def test_bad_quorum_options_are_refused(lofi, field):
    with pytest.raises(ConfigError) as err:
        rounds_config(**lofi)
    assert err.value.field_name == field


def test_quorum_rounds_are_peer_rounds():
    with pytest.raises(ConfigError) as err:
        tiny_config(average_every=8, quorum=1)  # no codec: the driver's star
    assert err.value.field_name == "lofi.quorum"
    with pytest.raises(ConfigError) as err:
        tiny_config(exchange="driver", sync="time", sync_every_s=1.0)
    assert err.value.field_name == "lofi.sync"


def test_quorum_needs_rounds():
    with pytest.raises(ConfigError) as err:
        tiny_config(compress="int8", quorum=1)
    assert err.value.field_name == "lofi.average_every"


def test_quorum_of_every_node_on_time_is_lockstep_bit_for_bit(ray_session, tmp_path):
    _, lockstep = run_lofi(rounds_config(), tmp_path / "lockstep")
    _, quorum = run_lofi(rounds_config(quorum=2), tmp_path / "quorum")
    assert quorum["details"]["exchange"] == "quorum"
    assert quorum["details"]["round_sizes"] == [2, 2] and quorum["details"]["late_payloads"] == 0
    a, b = load_file(lockstep["weights"]), load_file(quorum["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert quorum["metrics"] == lockstep["metrics"]
    # the same payloads cross, once per receiving peer
    for kind in ("train/outer_gradients", "final/outer_gradients"):
        assert quorum["comm"]["by_kind"][kind] == lockstep["comm"]["by_kind"][kind], kind


@pytest.mark.slow
def test_rounds_land_without_the_slow_node_and_its_payload_lands_late(ray_session, tmp_path):
    cfg = rounds_config(quorum=1)
    cfg.churn = ChurnConfig(slow=[SlowNode(node=1, factor=20)])
    _, rec = run_lofi(cfg, tmp_path)
    details = rec["details"]
    assert 1 in details["round_sizes"], "every round waited for the slow node"
    assert details["late_payloads"] >= 1 and min(details["late_staleness"]) >= 1
    fast, slow = (sum(t["steps"] for t in n["train"]) for n in rec["nodes"])
    assert fast + slow == 2 * 16 and fast > slow  # the budget of node-steps, the fast node taking the slow one's share
    assert rec["goodput"]["late_payloads"] == details["late_payloads"]
    assert 0 < rec["goodput"]["goodput"] <= 1
    # finish checked every node's global model hash after the final round: they ended identical


@pytest.mark.slow
def test_a_preempted_node_leaves_the_quorum_and_rejoins_identical(ray_session, tmp_path):
    cfg = rounds_config(quorum=1)
    cfg.churn = ChurnConfig(kill=[KillAt(node=1, at_step=11)])
    _, rec = run_lofi(cfg, tmp_path)
    assert [e["kind"] for e in rec["details"]["churn"]] == ["kill"]
    assert rec["details"]["restarts"] == {1: 1} and rec["goodput"]["restarts"] == 1
    assert rec["goodput"]["nodes"][1]["lost_s"] > 0  # the preempted segment, lost with the node
    assert sum(t["steps"] for n in rec["nodes"] for t in n["train"]) == 2 * 16


@pytest.mark.slow
def test_time_sync_merges_each_payload_by_the_examples_it_trained_on(ray_session, tmp_path):
    cfg = tiny_config(compress="int8", bn_recalibrate=False, sync="time", sync_every_s=0.3)
    cfg.churn = ChurnConfig(slow=[SlowNode(node=1, factor=4)])
    _, rec = run_lofi(cfg, tmp_path)
    log = rec["details"]["round_log"]
    for number, payloads in enumerate(log, 1):
        for p in payloads:
            missed = number - 1 - p["base"]
            assert p["weight"] == (p["samples"] * (1 + missed) ** -0.5 if missed else p["samples"])
    segments = [[t["steps"] for t in n["train"]] for n in rec["nodes"]]
    assert sum(map(sum, segments)) == 2 * 32  # the budget of node-steps
    assert sum(segments[0]) > sum(segments[1])  # the fast node was never held back to the slow one's pace
    assert {p["samples"] for payloads in log for p in payloads} != {16 * 8}  # segments end by time, not by steps


@pytest.mark.slow
def test_a_node_joins_and_another_leaves_mid_run_and_the_remaining_end_identical(ray_session, tmp_path):
    cfg = tiny_config(
        average_every=4, compress="int8", bn_recalibrate=False, join=[{"step": 5}], leave=[{"node": 0, "step": 8}]
    )
    # 3 shards of 170 rows: 10 steps an epoch, 20 a node, a budget of 2 x 20 node-steps; node 1 runs slow, so
    # that the joiner's start (a new process loading the model) comes before the budget is spent
    cfg.churn = ChurnConfig(slow=[SlowNode(node=1, factor=20)])
    ctx, rec = run_lofi(cfg, tmp_path)
    details = rec["details"]
    assert details["exchange"] == "quorum" and details["steps_per_node"] == 20
    assert [j["node"] for j in details["joined"]] == [2] and details["left"] == [{"node": 0, "step": 8}]
    assert [n["node"] for n in rec["nodes"]] == [1, 2]  # the nodes in the run at its end
    joiner = rec["nodes"][1]["train"]
    assert joiner[0]["base_round"] >= 1  # it joined from a landed round's global model, not the start
    assert sum(p["node"] == 0 for r in details["round_log"] for p in r) == 2  # the leaver's payloads all merged
    assert rec["samples_seen"] == 2 * 20 * cfg.optim.batch_size  # the budget: steps x nodes.count, the leaver's too
    assert rec["goodput"]["joins"] == 1
    stay = [rec["goodput"]["nodes"][k]["reserved_s"] for k in range(3)]
    assert stay[0] < stay[1] and stay[2] < stay[1]  # the leaver and the joiner were in the run for less of it
    # the nodes that remain hold one global model, bit for bit, at the last round
    files = [ctx.storage.load_tensors(f"lofi/checkpoints/node{k}_round.safetensors") for k in (1, 2)]
    (a, meta_a), (b, meta_b) = files
    assert meta_a["round"] == meta_b["round"] == len(details["round_log"])
    globals_ = [{k: v for k, v in t.items() if k.startswith("global.")} for t in (a, b)]
    assert globals_[0].keys() == globals_[1].keys() and all(
        torch.equal(globals_[0][k], globals_[1][k]) for k in a if k.startswith("global.")
    )


def test_membership_schedules_are_checked():
    for lofi, field in [
        ({"leave": [{"node": 5, "step": 3}]}, "lofi.leave[0].node"),
        ({"leave": [{"node": 0, "step": 3, "how": "kill"}]}, "lofi.leave[0].how"),
        ({"join": [{"step": 0}]}, "lofi.join[0].step"),
        ({"leave": [{"node": 0, "step": 3}, {"node": 1, "step": 3}]}, "lofi.leave[1]"),
    ]:
        with pytest.raises(ConfigError) as err:
            rounds_config(**lofi)
        assert err.value.field_name == field
    with pytest.raises(ConfigError) as err:
        tiny_config(average_every=8, join=[{"step": 2}])  # no codec: the driver's star
    assert err.value.field_name == "lofi.join"


def test_time_sync_options_are_checked():
    with pytest.raises(ConfigError) as err:
        tiny_config(compress="int8", sync="time")
    assert err.value.field_name == "lofi.sync_every_s"
    with pytest.raises(ConfigError) as err:
        tiny_config(compress="int8", sync="time", sync_every_s=1.0, average_every=8)
    assert err.value.field_name == "lofi.average_every"


def elastic_config(count, strategies=("lofi",), **lofi) -> dict:
    return {
        "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 512, "test_size": 200, "image_size": 16},
        "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 2},
        "nodes": {"count": count, "cpus": 1},
        "strategies": list(strategies),
        "checkpoint_every": 4,
        "log_every": 1000,
        "lofi": {"average_every": 4, "compress": "int8", "bn_recalibrate": False, **lofi},
    }


def test_a_range_of_nodes_reads_and_is_refused_where_it_cannot_run():
    cfg = from_dict(elastic_config([2, 4]))
    assert (cfg.nodes.count, cfg.nodes.most, cfg.nodes.elastic) == (2, 4, True)
    assert cfg.to_dict()["nodes"]["count"] == [2, 4]  # the run's config.yaml says what the user wrote
    assert Lofi.bundles(cfg) == [{"CPU": 1.0}] * 2  # the nodes past the min are not reserved
    assert node_slots(cfg, Lofi.opts(cfg)) == 4 and exchange_for(cfg).name == "quorum"  # a range selects quorum
    for count in ([3, 2], [0, 2], [2], [2, 3.5]):
        with pytest.raises(ConfigError) as err:
            from_dict(elastic_config(count))
        assert err.value.field_name.startswith("nodes.count")  # [2, 3.5]: nodes.count[1]
    for raw in (
        elastic_config([2, 3], strategies=("lofi", "ddp")),  # a fixed number of workers
        elastic_config([2, 3], compress="none"),  # the driver's star: no quorum rounds
        {**elastic_config([2, 3]), "nodes": {"count": [2, 3], "cpus": 1, "hosts": ["a", "b", "c"]}},
    ):
        with pytest.raises(ConfigError) as err:
            from_dict(raw)
        assert err.value.field_name == "nodes.count"


@ray.remote
class CpuHolder:
    """Holds its CPUs until `path` exists, then exits: the cluster grows under a running run."""

    def hold_until(self, path: str) -> None:
        while not os.path.exists(path):
            time.sleep(0.05)
        ray.actor.exit_actor()


@pytest.mark.slow
def test_a_range_takes_a_node_once_the_cluster_holds_it_and_every_node_ends_identical(ray_session, tmp_path):
    """nodes.count [2, 3] on a cluster that holds 2 nodes: the run starts with them; once round 1 lands the
    cluster frees a CPU, the third starts, joins from a landed round's global model, and ends identical."""
    cfg = from_dict(elastic_config([2, 3]))
    # 3 shards of 170 rows: 10 steps an epoch, 20 a node, a budget of 3 x 20 node-steps; node 1 runs slow,
    # so that the third node's start (a new process loading the model) comes before the budget is spent
    cfg.churn = ChurnConfig(slow=[SlowNode(node=1, factor=20)])
    ctx = prepare(cfg, tmp_path)
    spare = ray.available_resources()["CPU"] - 2.5  # two nodes fit beside it, a third does not
    holder = CpuHolder.options(num_cpus=spare).remote()
    ray.get(holder.__ray_ready__.remote())
    holder.hold_until.remote(ctx.storage.uri_of(ROUNDS))  # the first round's log frees the CPUs
    rec = Lofi().run(ctx).to_dict()
    details = rec["details"]
    assert details["exchange"] == "quorum" and details["steps_per_node"] == 20
    assert [(j["node"], j["by"]) for j in details["joined"]] == [(2, "cluster")]
    assert [n["node"] for n in rec["nodes"]] == [0, 1, 2]
    assert rec["nodes"][2]["train"][0]["base_round"] >= 1  # it joined from a landed round, not the start
    assert rec["samples_seen"] == 3 * 20 * cfg.optim.batch_size  # the budget: steps x the range's max
    assert rec["comm"]["by_kind"]["train/data_recipe"] > 0 and rec["goodput"]["joins"] == 1
    files = [ctx.storage.load_tensors(f"lofi/checkpoints/node{k}_round.safetensors") for k in range(3)]
    assert {meta["round"] for _, meta in files} == {len(details["round_log"])}
    first = files[0][0]
    for tensors, _ in files[1:]:
        assert all(torch.equal(first[k], tensors[k]) for k in first if k.startswith("global."))


def test_a_node_that_trains_on_lands_onto_the_new_global_model_with_its_unmerged_progress_on_top():
    """Whole numbers in float32, so every sum below is exact."""
    g0, g1 = {"w": torch.tensor([10.0, 20.0])}, {"w": torch.tensor([7.0, 30.0])}
    progress = PendingProgress()
    t1 = progress.sent({"w": torch.tensor([12.0, 21.0])}, g0)  # Δ1 moved it by (2, 1) from the global model
    t2 = progress.sent({"w": torch.tensor([15.0, 21.0])}, g0)  # then Δ2 by (3, 0), from where it sent Δ1
    # a round merges Δ1 only; it trained on by (1, 4) since sending Δ2: that and Δ2 stay on top of g1
    moved = progress.rebase({"w": torch.tensor([16.0, 25.0])}, g0, g1, merged=[t1])
    assert torch.equal(moved["w"], torch.tensor([7.0 + 3 + 1, 30.0 + 0 + 4]))
    assert torch.equal(progress.base["w"], torch.tensor([10.0, 30.0]))  # Δ3 is measured from g1 + Δ2
    # a round merges Δ2: the model is the newest global model plus what it trained since
    g2 = {"w": torch.tensor([1.0, 2.0])}
    moved = progress.rebase({"w": torch.tensor([11.0, 31.0])}, g1, g2, merged=[t2, "an earlier process's"])
    assert torch.equal(moved["w"], torch.tensor([2.0, 3.0])) and progress.base is None and not progress.unmerged


@pytest.mark.slow
def test_a_node_that_keeps_training_never_waits_for_the_slow_node_and_ends_on_the_global_model(ray_session, tmp_path):
    cfg = rounds_config(quorum=2, keep_training=True)
    cfg.churn = ChurnConfig(slow=[SlowNode(node=1, factor=20)])
    ctx, rec = run_lofi(cfg, tmp_path)
    details = rec["details"]
    # the fast node sent a second payload while its first waited for the slow node's: one round holds both
    assert any(sum(p["node"] == 0 for p in r) == 2 for r in details["round_log"])
    assert sum(t["steps"] for n in rec["nodes"] for t in n["train"]) == 2 * 16  # the budget of node-steps
    # every payload merged, every node's model is the global model: the saved result is its round file's
    tensors, meta = ctx.storage.load_tensors("lofi/checkpoints/node0_round.safetensors")
    assert meta["round"] == len(details["round_log"])
    saved = load_file(rec["weights"])
    globals_ = {k.removeprefix("global."): v for k, v in tensors.items() if k.startswith("global.")}
    assert globals_ and all(torch.equal(saved[k], v) for k, v in globals_.items())


def test_keep_training_needs_quorum_rounds_or_rounds_in_flight_and_mixes_nothing():
    with pytest.raises(ConfigError) as err:
        tiny_config(average_every=8, compress="int8", keep_training=True)
    assert err.value.field_name == "lofi.keep_training"
    tiny_config(average_every=8, compress="int8", keep_training=True, overlap=2)
    with pytest.raises(ConfigError) as err:
        tiny_config(average_every=8, compress="int8", keep_training=True, overlap=2, mix=0.5)
    assert err.value.field_name == "lofi.mix"


def test_a_landing_at_a_segments_start_keeps_that_checkpoint_and_a_restart_merges_the_round_again(
    tmp_path, monkeypatch
):
    """Quorum rounds land at the start of a node's segment, right after the checkpoint its last segment
    ended with (step 16): the node writes its round file and no second checkpoint. A process restored from
    that checkpoint (round 1) and the round file (round 2) merges round 2 again and holds the model the
    landing gave the live node, bit for bit."""
    storage, saves, loaded = Storage(tmp_path), [], {}
    start, mine = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 1.5])}

    def node_side():
        peer = bare_rounds(rank=0, rounds=1)
        peer.node = host_on_storage(storage, mine, loaded, saves, step=16)
        peer.global_state, peer.outer, peer.pending, peer.payload, peer.sent_from = dict(start), None, None, None, None
        peer.merging = SimpleNamespace(merges_rounds=False)
        peer.codec = SimpleNamespace(
            average=lambda payloads, weights, *_, **__: {"w": torch.tensor([0.25, 0.25], dtype=torch.float64)},
            residual=dict,
            load_residual=lambda residual: None,
        )
        return peer

    monkeypatch.setattr(node_rounds.ray, "get", lambda ref: ref)
    live = node_side()
    assert live.catch_up([(2, [["payload 0"], ["payload 1"]], [1.0, 1.0])]) == 1
    landed = dict(loaded)
    assert saves == [] and live.node.rounds == 2 and torch.equal(landed["w"], torch.tensor([0.75, 1.75]))
    loaded.clear()
    restarted = node_side()
    restarted._restore_round()
    assert saves == [16] and restarted.node.rounds == 2 and torch.equal(loaded["w"], landed["w"])
