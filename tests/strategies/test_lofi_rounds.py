"""lo-fi rounds that travel node to node (lofi.exchange: peers), compressed outer gradients with error feedback."""

import math
import threading
import time

import psutil
import pytest
import ray
import torch
from safetensors.torch import load_file

from raylowcomm.actors import ActorDied
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import LoraConfig
from raylowcomm.core.compression import layout_of, make_codec
from raylowcomm.lora import trainable_state
from raylowcomm.models import state_dict_of
from raylowcomm.strategies.lofi import rounds
from raylowcomm.strategies.lofi.rounds import PeerRounds, floats
from tests.strategies.test_lofi import run_lofi, tiny_config

ROUND_KINDS = {"train/control", "train/train_stats", "train/outer_gradients", "train/round_replies", "train/round_args",
               "train/verify_hash"}
REF = 28  # an ObjectRef crosses as its binary id


def payload_bytes(ctx, codec: str, bn: bool = True) -> int:
    """Parameters in `codec`, BatchNorm statistics (`bn`: they cross) as float32, from the formula alone."""
    state, params = state_dict_of(ctx.model), {k for k, _ in ctx.model.named_parameters()}
    buffers = {k: v for k, v in floats(state).items() if k not in params and bn}
    packed = make_codec(codec).payload_nbytes(layout_of({k: state[k] for k in params}))
    return packed + make_codec("none").payload_nbytes(layout_of(buffers))


def round_files(state_dir, n=2):
    return [load_file(str(state_dir / "lofi" / "checkpoints" / f"node{k}_round.safetensors")) for k in range(n)]


def test_int4_rounds_leave_every_node_identical_and_the_ledger_books_packed_bytes(ray_session, tmp_path):
    cfg = tiny_config(average_every=8, compress="int4", bn_recalibrate=False)
    ctx, rec = run_lofi(cfg, tmp_path)
    n, rounds = 2, len(rec["details"]["averaging_steps"]) - 1
    assert rec["details"]["exchange"] == "peers" and rounds == 3
    kinds = rec["comm"]["by_kind"]
    # during training only payloads between the nodes, refs, control and hashes crossed; no weights
    assert {k for k in kinds if k.startswith("train/")} <= ROUND_KINDS
    size = payload_bytes(ctx, "int4")
    assert size < payload_bytes(ctx, "none") / 5
    assert kinds["train/outer_gradients"] == rounds * n * (n - 1) * size
    # the small messages of each round are booked as they cross: each node's reply (its ref and payload size)
    # and what every node is sent (the round, the N refs, the weights), sized as the actor layer sizes them
    replies = rounds * n * (REF + payload_nbytes(size))
    args = sum(n * (payload_nbytes(r) + n * REF + payload_nbytes([1.0] * n)) for r in range(1, rounds + 1))
    assert kinds["train/round_replies"] == replies and kinds["train/round_args"] == args
    rounds_total = rec["comm"]["by_phase"]["train"] - kinds["train/control"] - kinds["train/train_stats"]
    assert rounds_total == rounds * n * (n - 1) * size + replies + args + kinds["train/verify_hash"]
    # the final average is one more round, each payload to each peer; the nodes hold the result, the driver
    # reads none of it
    assert kinds["final/outer_gradients"] == n * (n - 1) * size
    assert kinds["train/verify_hash"] > 0  # every round was hash-checked (a mismatch raises)
    fetched = rec["details"]["driver_fetched"]["train"]
    assert fetched["tensors"] == 0 and fetched["bytes"] == replies < 100 * rounds * n
    # every node's round file holds the same global model, bit for bit, and its own nonzero residual
    files = round_files(tmp_path / "state")
    globals_ = [{k: v for k, v in f.items() if k.startswith("global.")} for f in files]
    assert globals_[0].keys() == globals_[1].keys() and all(torch.equal(globals_[0][k], globals_[1][k])
                                                            for k in globals_[0])
    residual = [f["residual.conv_stem.weight"] for f in files]
    assert residual[0].dtype == torch.float64 and residual[0].abs().sum() > 0
    assert not torch.equal(residual[0], residual[1])
    # the nodes' own models stay sound: BatchNorm statistics cross uncompressed, so no variance turns negative
    assert all(math.isfinite(node["metrics"]["id_loss"]) for node in rec["nodes"])
    assert rec["metrics"]["id_accuracy"] > 0.2


def test_after_peer_rounds_bn_recalibration_and_scoring_send_no_model(ray_session, tmp_path):
    """The final round leaves the average on every node, and only there: its start, the last global model,
    is on the nodes only, so node 0 saves the result and no model crosses in the final phase. The nodes
    measure BatchNorm statistics of what they hold and score it. Since the end recalibrates them, BatchNorm
    statistics never cross in a round: the payloads are weights only."""
    ctx, rec = run_lofi(tiny_config(average_every=8, compress="int4", bn_recalibrate=True), tmp_path)
    kinds, n = rec["comm"]["by_kind"], 2
    size = payload_bytes(ctx, "int4", bn=False)
    assert size < payload_bytes(ctx, "int4") and kinds["train/outer_gradients"] == 3 * n * (n - 1) * size
    assert not any(k.endswith(("running_mean", "running_var")) for k in round_files(tmp_path / "state")[0])
    final = {k[len("final/"):] for k in kinds if k.startswith("final/")}
    assert final == {"outer_gradients", "round_args", "round_replies", "verify_hash", "train_stats",
                     "bn_statistics", "combined_bn_statistics", "node_metrics", "eval_metrics", "node_info"}
    model = payload_nbytes({k: v.detach() for k, v in ctx.model.named_parameters()})
    small = rec["comm"]["by_phase"]["final"] - kinds["final/outer_gradients"]
    assert kinds["final/outer_gradients"] == n * (n - 1) * size and small < model / 4  # BN statistics, metrics
    assert "average_without_bn_recalibration" in rec["details"]
    result = load_file(rec["weights"])
    node0 = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / "node0.safetensors"))
    params = [k for k, _ in ctx.model.named_parameters()]
    # node 0 checkpointed the average at the final round and saved it, with the recalibrated statistics
    assert all(torch.equal(result[k], node0[f"model.{k}"]) for k in params)
    bn = [k for k in result if k.endswith("running_var")]
    assert bn and any(not torch.equal(result[k], node0[f"model.{k}"]) for k in bn)  # recalibrated since


def test_one_compressed_average_is_decoded_on_the_driver_from_the_pretrained_weights(ray_session, tmp_path):
    """Without rounds the final average's start is the pretrained model, which the driver holds: it
    fetches the N payloads the nodes exchanged and decodes them there; its result is the nodes' (hash-checked
    in the run), here the model node 0 checkpointed at the final round, and no model is read back."""
    ctx, rec = run_lofi(tiny_config(compress="int4", bn_recalibrate=False), tmp_path)
    kinds, n, size = rec["comm"]["by_kind"], 2, payload_bytes(ctx, "int4")
    assert rec["details"]["exchange"] == "peers" and rec["comm"]["by_phase"]["train"] == 0
    assert kinds["final/outer_gradients"] == n * (n - 1) * size + n * size
    final = {k[len("final/"):] for k in kinds if k.startswith("final/")}
    assert final == {"outer_gradients", "round_args", "round_replies", "verify_hash", "train_stats", "node_metrics",
                     "eval_metrics", "node_info"}  # no model read back, none sent to be scored
    result = load_file(rec["weights"])
    node0 = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / "node0.safetensors"))
    assert all(torch.equal(result[k], node0[f"model.{k}"]) for k, _ in ctx.model.named_parameters())


def test_uncompressed_peer_rounds_give_the_driver_stars_model_within_float_tolerance(ray_session, tmp_path):
    """Not bit for bit: θ_g − mean_k(θ_g − θ_k) rounds differently from mean_k θ_k (Δ is rounded to float32
    on the node), so the runs differ by float32 rounding carried through 3 rounds and 32 SGD steps: below
    1e-4 absolute + 1e-4 relative (measured: 1.2e-5 on weights, 1.9e-5 relative on BN statistics)."""
    _, star = run_lofi(tiny_config(average_every=8, bn_recalibrate=False), tmp_path / "star")
    ctx, peers = run_lofi(tiny_config(average_every=8, bn_recalibrate=False, exchange="peers"), tmp_path / "peers")
    assert star["details"]["exchange"] == "driver" and peers["details"]["exchange"] == "peers"
    # N = 2: a star moves 2·N models a round, peers N·(N−1) float32 Δs (integer counters stay home)
    star_bytes = star["comm"]["by_kind"]["train/node_weights"] + star["comm"]["by_kind"]["train/global_weights"]
    assert peers["comm"]["by_kind"]["train/outer_gradients"] == 3 * 2 * payload_bytes(ctx, "none") < star_bytes / 1.99
    a, b = load_file(star["weights"]), load_file(peers["weights"])
    for name in a:
        if a[name].is_floating_point():
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())


BN_STATISTICS = (".running_mean", ".running_var", ".num_batches_tracked")


def lora_config(**lofi):
    cfg = tiny_config(average_every=8, bn_recalibrate=False, **lofi)
    cfg.model.lora = LoraConfig(r=4, alpha=8)
    return cfg


def test_lora_peer_rounds_send_adapters_and_merge_what_the_drivers_rounds_merge(ray_session, tmp_path):
    """With adapters, uncompressed peer rounds exchange the adapters' and head's Δ only; every node decodes
    each peer's, merges the exact average scale·Σ_k w_k·B_k·A_k into its base and restarts its adapters, as
    the driver's rounds do: the two runs' weights agree to float32 rounding (Δ is rounded on the node). The
    driver holds no base, so node 0 saves the result; BatchNorm statistics (not averaged without
    recalibration) are each run's own and left out."""
    _, star = run_lofi(lora_config(), tmp_path / "star")
    ctx, peers = run_lofi(lora_config(exchange="peers"), tmp_path / "peers")
    assert star["details"]["exchange"] == "driver" and peers["details"]["exchange"] == "peers"
    kinds = peers["comm"]["by_kind"]
    adapters = make_codec("none").payload_nbytes(layout_of(trainable_state(ctx.model)))
    assert kinds["train/outer_gradients"] == 3 * 2 * adapters
    assert adapters < payload_nbytes(state_dict_of(ctx.model)) / 5
    assert {k for k in kinds if k.startswith("train/")} <= ROUND_KINDS
    assert peers["details"]["driver_fetched"]["train"]["tensors"] == 0
    assert peers["comm"]["by_phase"]["final"] < 3 * adapters  # the final round's payloads; no model crossed
    a, b = load_file(star["weights"]), load_file(peers["weights"])
    assert a.keys() == b.keys() and not any(".lora_" in k for k in b)
    for name in a:
        if not name.endswith(BN_STATISTICS):
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(a[k], b[k]) for k in a if not k.endswith(BN_STATISTICS))


def test_compressed_lora_rounds_in_fragments_leave_the_nodes_identical_and_drop_restarted_residuals(ray_session,
                                                                                                   tmp_path):
    """int4, two fragments, a step of overlap: each fragment's layers merge and restart alone (a layer's B
    and A in one fragment), the nodes' global models and bases hash equal every round (the run checks),
    and what a merge restarted keeps no residual: after the final round only the head's is left."""
    ctx, rec = run_lofi(lora_config(compress="int4", fragments=2, overlap=1), tmp_path)
    assert rec["details"]["exchange"] == "peers" and rec["comm"]["by_kind"]["train/verify_hash"] > 0
    files = round_files(tmp_path / "state")
    assert all(torch.equal(files[0][k], files[1][k]) for k in files[0] if k.startswith("global."))
    residuals = {k for k in files[0] if k.startswith("residual.")}
    assert residuals and not any(".lora_" in k for k in residuals)
    assert math.isfinite(rec["metrics"]["id_loss"])


def test_a_payload_lost_with_its_node_mid_exchange_names_the_node_and_the_round(monkeypatch):
    """A node restarted between send_delta and apply_round holds no payload; a peer finds the payload's owner
    dead. Either way the round ends with ActorDied naming the node and the round, not a TypeError."""
    restarted = PeerRounds()
    restarted.rank, restarted.rounds, restarted.payload = 0, 2, None
    with pytest.raises(ActorDied, match=r"lofi node 0 died during averaging round 3's exchange.*--resume"):
        restarted.apply_round(3, [[None], [None]], [1.0, 1.0])

    def owner_died(ref):
        raise ray.exceptions.OwnerDiedError("00" * 28, "", "")

    monkeypatch.setattr(rounds.ray, "get", owner_died)
    peer = PeerRounds()
    peer.rank, peer.rounds, peer.payload = 1, 2, {}
    with pytest.raises(ActorDied, match=r"lofi node 0 died during averaging round 3's exchange"):
        peer.apply_round(3, [[None], [None]], [1.0, 1.0])


def _kill_a_node_after_the_first_round(state_dir, killed: list):
    """Kills one node's training process once both nodes have written their first round file: one of this
    test session's own Ray workers (its descendants), never another run's on the machine."""
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            ready = all(f is not None for f in round_files(state_dir))
        except Exception:
            ready = False
        if ready:
            for proc in psutil.Process().children(recursive=True):
                try:
                    cmdline = proc.cmdline()
                except psutil.Error:
                    continue
                if any("LofiNode.train" in part for part in cmdline):
                    proc.kill()
                    killed.append(proc.pid)
                    return
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("fragments, adapters", [(1, False), (2, False), (2, True)])
def test_a_killed_node_resumes_with_its_residual_and_ends_equal_to_an_uninterrupted_run(ray_session, tmp_path,
                                                                                        fragments, adapters):
    """Whole rounds, or two fragments (Streaming DiLoCo): residuals, momentum and global model, per fragment;
    with LoRA adapters also the base each round merged into."""
    cfg = tiny_config(average_every=8, compress="int4", bn_recalibrate=False, fragments=fragments,
                      **({} if adapters else {"outer_optimizer": "nesterov"}))
    cfg.model.lora = LoraConfig(r=4, alpha=8) if adapters else None
    _, clean = run_lofi(cfg, tmp_path / "clean")
    killed: list = []
    killer = threading.Thread(target=_kill_a_node_after_the_first_round, args=(tmp_path / "killed" / "state", killed))
    killer.start()
    _, rec = run_lofi(cfg, tmp_path / "killed")
    killer.join()
    assert killed, "no node was killed"
    restored = [t for n in rec["nodes"] for t in n["train"] if t["restored_from"] is not None]
    assert restored and restored[0]["restored_from"] >= 8 // fragments, "the node did not resume past the first round"
    a, b = load_file(clean["weights"]), load_file(rec["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(round_files(tmp_path / "clean" / "state"), round_files(tmp_path / "killed" / "state")):
        assert all(torch.equal(x[k], y[k]) for k in x)  # residuals, momentum and global model alike


@pytest.mark.slow
def test_node_0_restarted_between_bn_recalibration_and_its_save_saves_the_combined_statistics(ray_session, tmp_path,
                                                                                             monkeypatch):
    """Node 0 killed once the combined BatchNorm statistics are loaded, before it scores and saves the average:
    restarted, it restores the average from its round file and the combined statistics from storage, so the
    saved model equals an uninterrupted run's, statistics included."""
    from raylowcomm.strategies.lofi import Lofi

    cfg = tiny_config(average_every=8, compress="int4", bn_recalibrate=True)
    _, clean = run_lofi(cfg, tmp_path / "clean")
    recalibrate, killed = Lofi._recalibrate_bn, []

    def recalibrate_then_kill_node_0(group, average, batches, held):
        recalibrate(group, average, batches, held)
        killed.append(ray.get(group[0].info.remote())["pid"])
        ray.kill(group[0])  # the next call (scoring) finds it dead and restarts it

    monkeypatch.setattr(Lofi, "_recalibrate_bn", staticmethod(recalibrate_then_kill_node_0))
    _, rec = run_lofi(cfg, tmp_path / "killed")
    assert killed and rec["nodes"][0]["pid"] != killed[0], "node 0 was not restarted after the recalibration"
    a, b = load_file(clean["weights"]), load_file(rec["weights"])
    bn = [k for k in a if k.endswith(("running_mean", "running_var"))]
    assert bn and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rec["metrics"] == clean["metrics"]
