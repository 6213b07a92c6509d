"""Streaming DiLoCo in lo-fi's peer rounds: fragments synced at staggered steps, exchanges overlapped with training."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from raylowcomm.actors import ActorDied
from raylowcomm.core.compression import layout_of, make_codec
from raylowcomm.models import state_dict_of
from raylowcomm.storage import Storage
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.payload import floats
from raylowcomm.strategies.lofi.round_file import round_path, write_round
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.strategies.test_lofi_rounds import bare_rounds, host_on_storage, payload_bytes, round_files


def fragment_bytes(ctx, fragments: int, codec: str = "int4") -> list[int]:
    """Each fragment's payload from the formula (parameters in `codec`, BatchNorm statistics as float32), the
    fragments cut by the same formula's bytes per tensor."""
    model = ctx.load_driver_weights()
    state, params = floats(state_dict_of(model)), {k for k, _ in model.named_parameters()}
    size = {k: make_codec(codec if k in params else "none").payload_nbytes(layout_of({k: v})) for k, v in state.items()}
    return [sum(size[k] for k in names) for names in streaming.split(size, fragments)]


def test_fragments_are_contiguous_balanced_and_cover_every_tensor_once():
    sizes = {f"t{i}": n for i, n in enumerate([100, 3, 3, 50, 50, 1, 90, 2])}
    for count in range(1, len(sizes) + 1):
        groups = streaming.split(sizes, count)
        assert len(groups) == count and all(groups) and sum(groups, []) == list(sizes)  # in order, each once
    assert streaming.split(sizes, 1) == [list(sizes)]
    halves = [sum(sizes[k] for k in g) for g in streaming.split(sizes, 2)]
    assert halves == [156, 143]  # the cut falls where the running total passes half of 299
    with pytest.raises(ValueError):
        streaming.split(sizes, 9)
    # a module's tensors stay together: a layer's weight, bias and BatchNorm statistics sync at once
    layers = {
        "conv.weight": 90,
        "bn.weight": 4,
        "bn.bias": 4,
        "bn.running_mean": 4,
        "bn.running_var": 4,
        "head.weight": 100,
    }
    assert streaming.split(layers, 2) == [
        ["conv.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
        ["head.weight"],
    ]
    assert streaming.split(layers, 3) == [["conv.weight"], list(layers)[1:5], ["head.weight"]]
    with pytest.raises(ValueError, match="3 modules"):
        streaming.split(layers, 4)


def test_with_lora_fragments_are_counted_in_adapted_layers_and_refused_before_any_actor(tmp_path):
    """Under LoRA a node sends adapters and head: a layer's A and B are one unit, so the tiny model's
    adapted layers plus its head bound lofi.fragments, not its many frozen modules; more is a ConfigError
    at check time, where it used to fail inside the node actors."""
    from raylowcomm.config import ConfigError, LoraConfig
    from raylowcomm.runner import prepare
    from raylowcomm.strategies.lofi import Lofi
    from raylowcomm.strategies.lofi.merging import merging_for

    cfg = tiny_config(average_every=8, compress="int4", bn_recalibrate=False)
    cfg.model.lora = LoraConfig(r=4, alpha=8)
    ctx = prepare(cfg, tmp_path)
    merging = merging_for(ctx.spec)
    sent = [k for k, p in ctx.architecture.named_parameters() if p.requires_grad]
    units = {merging.sync_unit(k) for k in sent}
    assert len(units) < len({k.rsplit(".", 1)[0] for k in ctx.architecture.state_dict()})  # frozen modules not counted
    assert all(".lora_" not in u for u in units)  # A and B of a layer: one unit
    cfg.options["lofi"].fragments = len(units)
    Lofi.check(ctx)
    cfg.options["lofi"].fragments = len(units) + 1
    with pytest.raises(ConfigError, match=f"sends {len(units)} modules"):
        Lofi.check(ctx)


def test_each_fragment_syncs_once_per_h_at_its_staggered_step():
    every, frags, steps = 12, 3, 50
    boundaries, fragments = streaming.schedule(every, frags, steps)
    assert boundaries[-1] == steps and fragments[-1] == streaming.ALL  # the final round: every fragment
    events = list(zip(boundaries[:-1], fragments[:-1]))
    assert all(t % every == (f + 1) * every // frags % every for t, f in events)  # t ≡ (f+1)·H/F (mod H)
    for start in range(0, steps - every, every):  # every window of H steps syncs each fragment once
        assert sorted(f for t, f in events if start < t <= start + every) == list(range(frags))
    # one fragment: a round every H steps, as before fragments
    assert streaming.schedule(8, 1, 32) == ([8, 16, 24, 32], [0, 0, 0, streaming.ALL])
    # a round lands τ steps after it is sent, or at the next boundary if that comes first
    assert streaming.landings([4, 8, 12, 14], 3) == [7, 11, 14]


def test_an_exchange_in_flight_does_not_block_and_its_error_surfaces_where_it_lands():
    release = threading.Event()
    began = time.perf_counter()
    exchange = streaming.InFlightRound(3, 1, lambda: release.wait(30) and {"w": torch.ones(2)})
    assert time.perf_counter() - began < 1.0 and exchange.round == 3 and exchange.fragment == 1
    release.set()
    assert torch.equal(exchange.result()["w"], torch.ones(2))

    def lost():
        raise ActorDied("lofi node 1 died during averaging round 3's exchange")

    with pytest.raises(ActorDied, match="node 1 died"):
        streaming.InFlightRound(3, 0, lost).result()
    restarted = bare_rounds(rank=0, rounds=2)  # restarted since the round began: nothing in flight
    with pytest.raises(ActorDied, match="lofi node 0 died during averaging round 3's exchange"):
        restarted.expect_landing([3, 14])
    restarted.expect_landing([2, 10])  # landed before it died: nothing to wait for


def _global_parts(files):
    return [{k: v for k, v in f.items() if k.startswith("global.")} for f in files]


def _meta(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata()["raylowcomm"]


def test_two_fragments_book_one_fragment_per_sync_and_overlap_keeps_the_bytes_and_the_global_model(
    ray_session, tmp_path
):
    """H = 8, F = 2 over 32 steps: fragment 0 syncs at 4, 12, 20, 28 and fragment 1 at 8, 16, 24, then the final
    round syncs both. Overlap τ = 2 lands each round 2 steps after it is sent: the same payload bytes, another
    model (the delay is real), and every node still holds the same global model after each landing."""
    n = 2
    cfg = dict(average_every=8, compress="int4", fragments=2, bn_recalibrate=False)
    ctx, plain = run_lofi(tiny_config(**cfg), tmp_path / "plain")
    _, flying = run_lofi(tiny_config(**cfg, overlap=2, mix=0.5), tmp_path / "flying")
    assert plain["details"]["averaging_steps"] == [4, 8, 12, 16, 20, 24, 28, 32]
    sizes = fragment_bytes(ctx, 2)
    full = payload_bytes(ctx, "int4")
    assert sum(sizes) == full and max(sizes) < 0.6 * full  # a sync carries about half the model's payload
    kinds = plain["comm"]["by_kind"]
    assert kinds["train/outer_gradients"] == (4 * sizes[0] + 3 * sizes[1]) * n * (n - 1)
    assert kinds["final/outer_gradients"] == n * (n - 1) * full  # the final round: both fragments, to the peers
    assert kinds["train/verify_hash"] == 7 * n * 64  # every sync's global model hash-checked on every node
    for kind in ("outer_gradients", "round_replies", "round_args"):
        assert flying["comm"]["by_kind"][f"train/{kind}"] == kinds[f"train/{kind}"], kind
    # as many hash checks, one of them later: the last round lands during the final call to train
    assert flying["comm"]["by_kind"]["train/verify_hash"] == 6 * n * 64
    assert flying["comm"]["by_kind"]["final/verify_hash"] == kinds["final/verify_hash"] + n * 64
    # each node says how long its training waited for each landing round (the delay the τ steps did not hide)
    waits = [t["round_wait_s"] for node in flying["nodes"] for t in node["train"] if "round_wait_s" in t]
    assert len(waits) == 7 * n and all(w >= 0 for w in waits)
    a, b = load_file(plain["weights"]), load_file(flying["weights"])
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())
    for run in ("plain", "flying"):
        files = round_files(tmp_path / run / "state")
        g0, g1 = _global_parts(files)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
        assert all(f["residual.conv_stem.weight"].abs().sum() > 0 for f in files)
    # the round files say what their last round synced and how it was merged: the final round, every fragment
    assert '"fragment": -1' in _meta(tmp_path / "flying" / "state" / "lofi" / "checkpoints" / "node0_round.safetensors")


def test_overlap_without_fragments_lands_whole_rounds_late_and_keep_training_keeps_the_steps_in_flight(
    ray_session, tmp_path
):
    """τ = 2 with one fragment: every round (the whole model) lands two steps after it is sent, with the bytes
    of τ = 0 (3 rounds of int4 payloads to the peer, by the formula); the nodes' global models agree after
    each landing (checked by the run). Dropping the τ steps (mix 0) and keeping them on top of the landed
    model (`keep_training`) end on other models; a node that keeps them writes the parameters it sent from
    into its round file (for a restart to merge again), one that drops them does not."""
    cfg = dict(average_every=8, compress="int4", bn_recalibrate=False, overlap=2)
    ctx, flying = run_lofi(tiny_config(**cfg), tmp_path / "flying")
    _, kept = run_lofi(tiny_config(**cfg, keep_training=True), tmp_path / "kept")
    for rec in (flying, kept):
        assert rec["comm"]["by_kind"]["train/outer_gradients"] == 3 * 2 * payload_bytes(ctx, "int4")
    a, b = load_file(flying["weights"]), load_file(kept["weights"])
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())
    assert not any(k.startswith("sent.") for f in round_files(tmp_path / "flying" / "state") for k in f)
    params = {k for k, _ in ctx.load_driver_weights().named_parameters()}
    for f in round_files(tmp_path / "kept" / "state"):
        assert {k[len("sent.") :] for k in f if k.startswith("sent.")} == params


def test_keep_on_top_moves_the_parameters_onto_the_landed_model_and_takes_the_rest_as_landed():
    """θ ← G' + (θ − θ_sent) in float64 on parameters, the global value elsewhere. Exact in two cases by
    the arithmetic: θ = θ_sent gives G' bit for bit (G' + 0); G' = θ_sent gives θ bit for bit (the float32
    difference of two values within a factor 2^29 of each other is exact in float64, so the sum is θ
    exactly before its rounding to float32, which keeps it). The values are drawn with magnitudes in [1, 2),
    within a factor 2 of each other, so that condition holds by construction."""
    g = torch.Generator().manual_seed(0)

    def values():
        sign = torch.randint(0, 2, (64,), generator=g) * 2 - 1
        return sign * (1 + torch.rand(64, generator=g))

    mine, sent, landed = ({k: values() for k in ("w", "bn.running_mean")} for _ in range(3))
    params = {"w"}
    same = streaming.keep_on_top(sent, sent, landed, params)
    assert torch.equal(same["w"], landed["w"]) and same["w"].dtype == torch.float32
    back = streaming.keep_on_top(mine, sent, sent, params)
    assert torch.equal(back["w"], mine["w"])
    moved = streaming.keep_on_top(mine, sent, landed, params)
    assert moved["bn.running_mean"] is landed["bn.running_mean"]
    assert not torch.equal(moved["w"], landed["w"]) and not torch.equal(moved["w"], mine["w"])


def test_a_budget_ends_overlapping_rounds_with_the_round_in_flight_landed(ray_session, tmp_path):
    """optim.budget_s with lofi.overlap: with τ = H a round is in flight through every segment, so wherever
    the budget ends (inside a segment, or in the round that sent it) that round lands where the nodes stand
    before the final round: every round begun landed on every node (its wait is in the stats of the call
    it landed in, or of the last call where it landed after it), every node ends on one global model (the
    run's final hash check), and the record stops at its budget."""
    cfg = tiny_config(average_every=4, compress="int8", bn_recalibrate=False, overlap=4)
    cfg.optim.budget_s = 1.0
    _, rec = run_lofi(cfg, tmp_path)
    budget, details = rec["details"]["budget"], rec["details"]
    assert budget["stopped_by"] == "budget" and budget["train_s"] >= 1.0
    assert details["averaging_steps"][-1] == budget["steps"] == max(n["train"][-1]["step"] for n in rec["nodes"])
    begun = len(details["averaging_steps"]) - 1  # every boundary but the final one sent a round
    assert begun >= 1
    for node in rec["nodes"]:  # landed in a call to train, or where the round that sent it spent the budget
        landed = sum(("round_wait_s" in call) + ("round_wait_at_stop_s" in call) for call in node["train"])
        assert landed == begun, node["node"]
    assert {"id_accuracy", "shift_accuracy"} <= rec["metrics"].keys()


def test_a_node_restarted_between_its_round_file_and_its_checkpoint_keeps_its_steps_in_flight_again(tmp_path):
    """keep_training with overlap: a node that died after writing round 2's file, before the checkpoint after
    it, restarts from the checkpoint made where the round landed (round 1) and merges round 2 again from the
    file: the same G' + (θ − θ_sent) as the landing that died, from the parameters the file says it sent."""
    g = torch.Generator().manual_seed(1)
    mine, sent, landed = ({k: torch.randn(8, generator=g) for k in ("w", "b")} for _ in range(3))
    storage, loaded = Storage(tmp_path), {}
    write_round(storage, round_path(0), 2, landed, sent={"w": sent["w"]}, fragment=streaming.ALL, mix=0.0)
    node = host_on_storage(storage, mine, loaded, [], step=10)
    peer = bare_rounds(rank=0, rounds=1)
    peer.node, peer.global_state, peer.outer, peer.params, peer.sent_from = node, {}, None, {"w"}, None
    peer.codec, peer.merging = SimpleNamespace(load_residual=lambda r: None), SimpleNamespace(merges_rounds=False)
    peer._restore_round()
    expected = streaming.keep_on_top(mine, {"w": sent["w"]}, landed, {"w"})
    assert node.rounds == 2 and loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected) and peer.sent_from is None
