"""lo-fi rounds that travel node to node (lofi.exchange: peers), compressed outer gradients with error feedback."""

import contextlib
import math
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import load_file

from raylowcomm.actors import ActorDied, NodeGroup
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import LoraConfig
from raylowcomm.core.averaging import average_state_dicts
from raylowcomm.core.compression import layout_of, make_codec
from raylowcomm.lora import average_delta, lora_layers, plain_key, trainable_state
from raylowcomm.models import state_dict_of
from raylowcomm.strategies.lofi import node_rounds
from raylowcomm.strategies.lofi.node_rounds import NodeRounds
from raylowcomm.strategies.lofi.payload import floats
from tests.strategies.test_lofi import kill_own_worker, run_lofi, tiny_config

ROUND_KINDS = {
    "train/control",
    "train/train_stats",
    "train/outer_gradients",
    "train/round_replies",
    "train/round_args",
    "train/verify_hash",
}
REF = 28  # an ObjectRef crosses as its binary id


def payload_bytes(ctx, codec: str, bn: bool = True) -> int:
    """Parameters in `codec`, BatchNorm statistics (`bn`: they cross) as float32, from the formula alone."""
    model = ctx.load_driver_weights()
    state, params = state_dict_of(model), {k for k, _ in model.named_parameters()}
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
    assert globals_[0].keys() == globals_[1].keys() and all(
        torch.equal(globals_[0][k], globals_[1][k]) for k in globals_[0]
    )
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
    final = {k[len("final/") :] for k in kinds if k.startswith("final/")}
    assert final == {
        "outer_gradients",
        "round_args",
        "round_replies",
        "verify_hash",
        "train_stats",
        "bn_statistics",
        "combined_bn_statistics",
        "node_metrics",
        "eval_metrics",
        "node_info",
    }
    model = payload_nbytes({k: v.detach() for k, v in ctx.load_driver_weights().named_parameters()})
    small = rec["comm"]["by_phase"]["final"] - kinds["final/outer_gradients"]
    assert kinds["final/outer_gradients"] == n * (n - 1) * size and small < model / 4  # BN statistics, metrics
    assert "average_without_bn_recalibration" in rec["details"]
    result = load_file(rec["weights"])
    node0 = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / "node0.safetensors"))
    params = [k for k, _ in ctx.load_driver_weights().named_parameters()]
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
    final = {k[len("final/") :] for k in kinds if k.startswith("final/")}
    assert final == {
        "outer_gradients",
        "round_args",
        "round_replies",
        "verify_hash",
        "train_stats",
        "node_metrics",
        "eval_metrics",
        "node_info",
    }  # no model read back, none sent to be scored
    result = load_file(rec["weights"])
    node0 = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / "node0.safetensors"))
    assert all(torch.equal(result[k], node0[f"model.{k}"]) for k, _ in ctx.load_driver_weights().named_parameters())


U32, U64, TINY = 2.0**-24, 2.0**-53, 2.0**-146
"""float32's and float64's unit roundoff: round to nearest errs by at most u·|x| in the normal range; TINY covers
float32's subnormals, where a rounding errs by at most 2^-150 absolute, for the few roundings of one result."""


@contextlib.contextmanager
def watching_rounds(state_dir, n=2):
    """What the nodes hold around each averaging round of a run, read from storage while the driver waits on
    them (NodeGroup.call returns once every node has answered): after each `train` call every node's checkpoint
    (its weights at the boundary, which the round then averages) and the last round's global model
    (lofi/global.safetensors: the driver's in a star, node 0's with peers); after each round lands
    (`apply_round`, peers) or is loaded (`load_round`, star) every node's checkpoint again."""
    seen = SimpleNamespace(trained=[], landed=[])
    call = NodeGroup.call

    def nodes():
        files = [load_file(str(state_dir / "lofi" / "checkpoints" / f"node{k}.safetensors")) for k in range(n)]
        return [{name[len("model.") :]: v for name, v in f.items() if name.startswith("model.")} for f in files]

    def global_model():
        path = state_dir / "lofi" / "global.safetensors"
        if not path.exists():
            return None
        return {name[len("global.") :]: v for name, v in load_file(str(path)).items() if name.startswith("global.")}

    def watched(group, method, *args, **kwargs):
        out = call(group, method, *args, **kwargs)
        if method == "train":
            seen.trained.append(SimpleNamespace(nodes=nodes(), global_model=global_model()))
        elif method in ("apply_round", "load_round"):
            seen.landed.append(nodes())
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NodeGroup, "call", watched)
        yield seen


def peer_round(global_model: dict, nodes: list[dict], weights: list[float]) -> dict:
    """An uncompressed peer round as every node computes it (payload.DeltaCodec with codec none, then the plain
    outer step): Δ_k = θ_g − θ_k in float64, rounded to float32 where node k sends it; Δ̄ = Σ_k w_k·Δ_k / Σ_k w_k
    accumulated in float64 in node order; θ_g − Δ̄ in float64, rounded once. Only elementwise IEEE operations,
    each its own kernel (nothing fused), so every CPU gets these bits: a run must match them exactly."""
    total, out = math.fsum(weights), {}
    for k, g in global_model.items():
        sent = [(g.double() - node[k].double()).to(g.dtype).double() for node in nodes]
        acc = sent[0] * weights[0]
        for d, w in zip(sent[1:], weights[1:]):
            acc = acc + d * w
        out[k] = (g.double() - acc / total).to(g.dtype)
    return out


def star_vs_peer_bound(global_model: dict, nodes: list[dict]) -> dict:
    """Per element, how far one uncompressed peer round (b) may land from the star's average (a) of the same
    two equally weighted float32 nodes θ_k, from the global model θ_g. With m = mean_k θ_k, d_k = θ_g − θ_k
    (exact reals), u = 2^-24, ε = 2^-53: the star rounds the float64 mean once, |a − m| ≤ (u + 2ε)|m|; node k
    sends D_k = fl32(fl64(d_k)), |D_k − d_k| ≤ (u + 2ε)|d_k|; their float64 mean Δ̄ errs by at most
    E = (u + 4ε)·mean_k|d_k|, and b = fl32(fl64(θ_g − Δ̄)) has |b − m| ≤ (u + 2ε)(|m| + E) + E. So
    |a − b| ≤ (2u + 4ε)|m| + (1 + u + 2ε)(u + 4ε)·mean_k|d_k| < 2^-22·(|m| + mean_k|d_k|), plus TINY."""
    out = {}
    for k, g in global_model.items():
        m = sum(node[k].double() for node in nodes) / len(nodes)
        d = sum((g.double() - node[k].double()).abs() for node in nodes) / len(nodes)
        out[k] = 2.0**-22 * (m.abs() + d) + TINY
    return out


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


# CI's time: the smallest exchange lands the star's model bit for bit, and int4 rounds keep every node identical, in
# CI
@pytest.mark.heavy
def test_uncompressed_peer_rounds_give_the_driver_stars_model_within_float_tolerance(ray_session, tmp_path):
    """Each round, as it happened in both runs, from what the nodes held at its boundary: a peer round lands
    exactly on θ_g − mean_k fl32(θ_g − θ_k) on every node (the arithmetic of `peer_round`, bit for bit), a star
    round on mean_k θ_k; from the same nodes (the first round: nothing crossed before it) the two differ by
    float32 rounding alone, within a bound derived from the arithmetic (`star_vs_peer_bound`). Rounds after the
    first start from models that differ by that rounding, carried through SGD: no bound compares those, so
    each run is checked against its own nodes."""
    with watching_rounds(tmp_path / "star" / "state") as star_rounds:
        _, star = run_lofi(tiny_config(average_every=8, bn_recalibrate=False), tmp_path / "star")
    with watching_rounds(tmp_path / "peers" / "state") as peer_rounds:
        ctx, peers = run_lofi(tiny_config(average_every=8, bn_recalibrate=False, exchange="peers"), tmp_path / "peers")
    assert star["details"]["exchange"] == "driver" and peers["details"]["exchange"] == "peers"
    # N = 2: a star moves 2·N models a round, peers N·(N−1) float32 Δs (integer counters stay home)
    star_bytes = star["comm"]["by_kind"]["train/node_weights"] + star["comm"]["by_kind"]["train/global_weights"]
    assert peers["comm"]["by_kind"]["train/outer_gradients"] == 3 * 2 * payload_bytes(ctx, "none") < star_bytes / 1.99
    weights = [1.0, 1.0]
    assert len(star_rounds.trained) == len(peer_rounds.trained) == 4  # boundaries 8, 16, 24, 32
    assert len(star_rounds.landed) == 3 and len(peer_rounds.landed) == 4  # the final round lands on the nodes

    # peers: every round, every node, bit for bit; the saved model is node 0's after the final round
    g = floats(state_dict_of(ctx.load_driver_weights()))  # every node's global model as it starts: the initial weights
    for r, before in enumerate(peer_rounds.trained, 1):
        g = peer_round(g, [floats(node) for node in before.nodes], weights)
        if r < 4:
            assert_equal(peer_rounds.trained[r].global_model, g, f"round {r}'s global model")
        for k, node in enumerate(peer_rounds.landed[r - 1]):
            assert_equal(floats(node), g, f"node {k}'s model after round {r}")
    peers_saved = load_file(peers["weights"])
    assert_equal(floats(peers_saved), g, "the saved model")

    # star: every round the driver's average of the nodes it collected, loaded by every node
    for r, before in enumerate(star_rounds.trained, 1):
        average = average_state_dicts(before.nodes, weights)
        if r < 4:
            assert_equal(star_rounds.trained[r].global_model, average, f"star round {r}'s average")
            for k, node in enumerate(star_rounds.landed[r - 1]):
                assert_equal(node, average, f"node {k}'s model after star round {r}")
    star_saved = load_file(star["weights"])
    assert_equal(star_saved, average, "the star's saved model")

    # round 1 from the same nodes: the two exchanges' results within the derived bound, not bit for bit
    first = star_rounds.trained[0].nodes
    for k, node in enumerate(first):
        assert_equal(peer_rounds.trained[0].nodes[k], node, f"node {k} before any round")  # nothing crossed yet
    a, b = star_rounds.trained[1].global_model, peer_rounds.trained[1].global_model
    bound = star_vs_peer_bound(floats(state_dict_of(ctx.load_driver_weights())), [floats(node) for node in first])
    assert b.keys() == bound.keys()
    for name in b:
        excess = (b[name].double() - a[name].double()).abs() - bound[name]
        assert excess.max() <= 0, f"{name}: {excess.max().item():.3g} beyond the bound"
    assert any(not torch.equal(a[k], b[k]) for k in b), "Δ rounded to float32 on the node changes some bits"
    ints = [k for k in star_saved if not star_saved[k].is_floating_point()]
    assert ints and all(torch.equal(star_saved[k], peers_saved[k]) for k in ints)  # every node ran the same steps


BN_STATISTICS = (".running_mean", ".running_var", ".num_batches_tracked")


def lora_config(**lofi):
    cfg = tiny_config(average_every=8, bn_recalibrate=False, **lofi)
    cfg.model.lora = LoraConfig(r=4, alpha=8)
    return cfg


@contextlib.contextmanager
def one_thread():
    """A float64 matmul's sum of r products is ordered by the kernel the thread count picks: the nodes run on
    one thread (runtime.setup_threads, nodes.cpus 1), and so does what repeats their merges here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plain(state: dict) -> dict:
    """A PEFT model's state under the plain model's names, without adapters or BatchNorm statistics."""
    return {pk: v for k, v in state.items() if (pk := plain_key(k)) is not None and not pk.endswith(BN_STATISTICS)}


def sent_as_peers(start: dict, node: dict, names) -> dict:
    """A node's tensors as its peers decode them: θ_g − fl32(θ_g − θ_k), in float64 (node_rounds._average)."""
    return {k: start[k].double() - (start[k].double() - node[k].double()).to(start[k].dtype).double() for k in names}


def lora_merge_bound(base: dict, starts: dict, nodes: list[dict], sent: list[dict], layers, a: dict, b: dict) -> dict:
    """Per plain tensor, how far a peer round's merge (b, of the `sent` states) may land from the star's (a, of the
    nodes' own states), two nodes weighted equally (w_k = 1/2), u = 2^-24. A sent factor x' = θ_g − fl32(θ_g − x)
    is within e_x = 2^-23·|θ_g − x| + 2^-52·|x| + TINY of x (the float32 rounding of the difference and two float64
    roundings). A merged weight is fl32(W0 + scale·Σ_k w_k·B_k·A_k) in float64: the two differ by at most
    scale·Σ_k w_k·(e_B·|A'_k| + |B_k|·e_A) (the products' difference, on absolute values), plus each result's
    float32 rounding, u(1 + 2u)·|result| < 2^-23·|result|, plus float64 rounding of the r-term products and the
    sums, < 2^-48·(|W0| + scale·Σ_k w_k·(|B_k|·|A_k| + |B'_k|·|A'_k|)). A head's mean: Σ_k w_k·e_h plus the two
    float32 roundings. Tensors no node trains are the base in both."""

    def err(k, x):
        return 2.0**-23 * (starts[k].double() - x.double()).abs() + 2.0**-52 * x.double().abs() + TINY

    out, factors = {}, set()
    for layer in layers:
        factors |= {layer.a, layer.b}
        exact = rounding = 0
        for node, s in zip(nodes, sent):
            bm, am = node[layer.b].double().flatten(1), node[layer.a].double().flatten(1)
            bs, as_ = s[layer.b].flatten(1), s[layer.a].flatten(1)
            exact = exact + 0.5 * (
                err(layer.b, node[layer.b]).flatten(1) @ as_.abs() + bm.abs() @ err(layer.a, node[layer.a]).flatten(1)
            )
            rounding = rounding + 0.5 * (bm.abs() @ am.abs() + bs.abs() @ as_.abs())
        exact, rounding = (layer.scale * t.view(layer.shape) for t in (exact, rounding))
        out[layer.plain] = (
            exact
            + 2.0**-48 * (base[layer.plain].double().abs() + rounding)
            + 2.0**-23 * (a[layer.plain].double().abs() + b[layer.plain].double().abs())
            + TINY
        )
    for k in nodes[0].keys() - factors:
        pk = plain_key(k)
        out[pk] = (
            sum(0.5 * err(k, node[k]) for node in nodes)
            + 2.0**-23 * (a[pk].double().abs() + b[pk].double().abs())
            + TINY
        )
    for pk in a.keys() - out.keys():
        out[pk] = torch.zeros_like(a[pk], dtype=torch.float64)
    return out


@pytest.mark.heavy  # CI's time: compressed LoRA rounds in fragments and the LoRA star's exact merge run in CI
def test_lora_peer_rounds_send_adapters_and_merge_what_the_drivers_rounds_merge(ray_session, tmp_path):
    """With adapters, uncompressed peer rounds exchange the adapters' and head's Δ only; every node decodes
    each peer's, merges the exact average scale·Σ_k w_k·B_k·A_k into its base and restarts its adapters, as
    the driver's rounds do. Each round, as it happened in both runs, from what the nodes held at its boundary:
    a peer round's merge is `average_delta` of the nodes' adapters as they crossed (Δ rounded to float32 on
    the node) on the base the nodes held, bit for bit on every node; a star round's is the same merge of the
    nodes' own adapters; from the same nodes (the first round) the two differ within a bound derived from the
    arithmetic (`lora_merge_bound`). The driver holds no base, so node 0 saves the result; BatchNorm statistics
    (not averaged without recalibration) are each node's own and left out."""
    with watching_rounds(tmp_path / "star" / "state") as star_rounds:
        _, star = run_lofi(lora_config(), tmp_path / "star")
    with watching_rounds(tmp_path / "peers" / "state") as peer_rounds:
        ctx, peers = run_lofi(lora_config(exchange="peers"), tmp_path / "peers")
    assert star["details"]["exchange"] == "driver" and peers["details"]["exchange"] == "peers"
    kinds = peers["comm"]["by_kind"]
    adapters = make_codec("none").payload_nbytes(layout_of(trainable_state(ctx.load_driver_weights())))
    assert kinds["train/outer_gradients"] == 3 * 2 * adapters
    assert adapters < payload_nbytes(state_dict_of(ctx.load_driver_weights())) / 5
    assert {k for k in kinds if k.startswith("train/")} <= ROUND_KINDS
    assert peers["details"]["driver_fetched"]["train"]["tensors"] == 0
    assert peers["comm"]["by_phase"]["final"] < 3 * adapters  # the final round's payloads; no model crossed
    a, b = load_file(star["weights"]), load_file(peers["weights"])
    assert a.keys() == b.keys() and not any(".lora_" in k for k in b)
    model = ctx.load_driver_weights()
    trains, layers, weights = set(trainable_state(model)), lora_layers(model), [1.0, 1.0]
    initial = state_dict_of(model)
    assert len(star_rounds.trained) == len(peer_rounds.trained) == 4 and len(peer_rounds.landed) == 4

    # peers: each round's merge on the base and global adapters the nodes held, bit for bit, on every node
    held = initial  # node 0's whole model before the round (its global adapters are its own after a merge)
    for r, before in enumerate(peer_rounds.trained, 1):
        sent = [sent_as_peers(held, node, trains) for node in before.nodes]
        with one_thread():
            merged = average_delta(held, sent, layers, weights)
        merged = {k: v.to(torch.float32) for k, v in plain(merged).items()}
        for k, node in enumerate(peer_rounds.landed[r - 1]):
            assert_equal(plain(node), merged, f"node {k}'s merged model after round {r}")
        if r == 1:
            first_sent, first_merged = sent, merged
        held = peer_rounds.landed[r - 1][0]
    assert_equal(plain(b), merged, "the saved model")

    # star: each round's merge of the nodes' adapters on the driver's last average (the driver holds the base
    # here and merges the final average too, in this process: no thread count to match)
    base = initial
    for r, before in enumerate(star_rounds.trained, 1):
        average = average_delta(base, [{k: n[k] for k in trains} for n in before.nodes], layers, weights)
        if r < 4:
            assert_equal(star_rounds.trained[r].global_model, average, f"star round {r}'s average")
        base = average
    assert_equal(plain(a), plain(average), "the star's saved model")

    # round 1 from the same nodes: the two exchanges' merges within the derived bound, not bit for bit
    first = star_rounds.trained[0].nodes
    for k, node in enumerate(first):
        assert_equal(peer_rounds.trained[0].nodes[k], node, f"node {k} before any round")  # nothing crossed yet
    star_first = plain(star_rounds.trained[1].global_model)
    assert star_first.keys() == first_merged.keys()
    bound = lora_merge_bound(plain(initial), initial, first, first_sent, layers, star_first, first_merged)
    for name, value in first_merged.items():
        excess = (value.double() - star_first[name].double()).abs() - bound[name]
        assert excess.max() <= 0, f"{name}: {excess.max().item():.3g} beyond the bound"
    assert any(not torch.equal(star_first[k], first_merged[k]) for k in first_merged)


def test_compressed_lora_rounds_in_fragments_leave_the_nodes_identical_and_drop_restarted_residuals(
    ray_session, tmp_path
):
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


def bare_rounds(rank: int, rounds: int) -> NodeRounds:
    """A node's side of peer rounds with no model behind it: what a round's bookkeeping reads of its node."""
    peer = NodeRounds.__new__(NodeRounds)
    peer.node, peer.in_flight = SimpleNamespace(rank=rank, rounds=rounds), None
    return peer


def host_on_storage(storage, weights: dict, loaded: dict, saves: list, step: int) -> SimpleNamespace:
    """A node for `bare_rounds` with its files in `storage`: it has landed round 1, trained to `step` and
    checkpointed there; its model holds `weights`, what a round loads into it goes into `loaded`, the steps
    it checkpoints at into `saves`."""
    return SimpleNamespace(
        rank=0,
        rounds=1,
        step=step,
        saved_step=step,
        storage=storage,
        weights=lambda: dict(weights),
        load_global=lambda state, rounds: loaded.update(state),
        save_state=saves.append,
        log=lambda msg: None,
    )


def test_a_payload_lost_with_its_node_mid_exchange_names_the_node_and_the_round(monkeypatch):
    """A node restarted between send_delta and apply_round holds no payload; a peer finds the payload's owner
    dead. Either way the round ends with ActorDied naming the node and the round, not a TypeError."""
    restarted = bare_rounds(rank=0, rounds=2)
    restarted.payload = None
    with pytest.raises(ActorDied, match=r"lofi node 0 died during averaging round 3's exchange.*--resume"):
        restarted.apply_round(3, [[None], [None]], [1.0, 1.0])

    def owner_died(ref):
        raise ray.exceptions.OwnerDiedError("00" * 28, "", "")

    monkeypatch.setattr(node_rounds.ray, "get", owner_died)
    peer = bare_rounds(rank=1, rounds=2)
    peer.payload = {}
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
            pid = kill_own_worker("LofiNode.train")
            if pid is not None:
                killed.append(pid)
                return
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fragments, adapters, scale",
    [
        pytest.param(1, False, "node", marks=pytest.mark.heavy),
        pytest.param(2, False, "node", marks=pytest.mark.heavy),
        pytest.param(2, False, "shared", marks=pytest.mark.heavy),  # summable codes: residuals settled per round
        (2, True, "node"),
    ],
)
def test_a_killed_node_resumes_with_its_residual_and_ends_equal_to_an_uninterrupted_run(
    ray_session, tmp_path, fragments, adapters, scale
):
    """Whole rounds, or two fragments (Streaming DiLoCo): residuals, momentum and global model, per fragment;
    with LoRA adapters also the base each round merged into."""
    cfg = tiny_config(
        average_every=8,
        compress="int4",
        compress_scale=scale,
        bn_recalibrate=False,
        fragments=fragments,
        **({} if adapters else {"outer_optimizer": "nesterov"}),
    )
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


# CI's time: a node's restart from its checkpoint and BN recalibration after peer rounds each run in CI
@pytest.mark.heavy
def test_node_0_restarted_between_bn_recalibration_and_its_save_saves_the_combined_statistics(
    ray_session, tmp_path, monkeypatch
):
    """Node 0 killed once the combined BatchNorm statistics are loaded, before it scores and saves the average:
    restarted, it restores the average from its round file and the combined statistics from storage, so the
    saved model equals an uninterrupted run's, statistics included."""
    from raylowcomm.strategies.lofi import final as final_phase

    cfg = tiny_config(average_every=8, compress="int4", bn_recalibrate=True)
    _, clean = run_lofi(cfg, tmp_path / "clean")
    recalibrate, killed = final_phase.recalibrate_bn, []

    def recalibrate_then_kill_node_0(group, final, batches):
        recalibrate(group, final, batches)
        killed.append(ray.get(group[0].info.remote())["pid"])
        ray.kill(group[0])  # the next call (scoring) finds it dead and restarts it

    monkeypatch.setattr(final_phase, "recalibrate_bn", recalibrate_then_kill_node_0)
    _, rec = run_lofi(cfg, tmp_path / "killed")
    assert killed and rec["nodes"][0]["pid"] != killed[0], "node 0 was not restarted after the recalibration"
    a, b = load_file(clean["weights"]), load_file(rec["weights"])
    bn = [k for k in a if k.endswith(("running_mean", "running_var"))]
    assert bn and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rec["metrics"] == clean["metrics"]
