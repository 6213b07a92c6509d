"""lo-fi's rounds on a schedule (`lofi.average_every` as a list, `lofi.warmup_steps`) and the final round's own
codec (`lofi.final_round`), the tensors that cross whole (`lofi.dense`): where the rounds come, that every node
lands each one bit-identical, and that the final round flushes what compression held back."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import load_file

from raylowcomm.config import ConfigError
from raylowcomm.core.compression import Payload, layout_of, make_codec
from raylowcomm.models import state_dict_of
from raylowcomm.strategies.lofi.config import LofiConfig, round_boundaries, round_gaps
from raylowcomm.strategies.lofi.merging import WeightAverage
from raylowcomm.strategies.lofi.payload import DeltaCodec, dense_names, floats
from raylowcomm.strategies.lofi.plan import plan_rounds
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.strategies.test_lofi_rounds import payload_bytes, round_files


def boundaries(**lofi) -> list[int]:
    cfg = tiny_config(**lofi)
    return plan_rounds(cfg, cfg.options["lofi"], [300, 300], WeightAverage()).boundaries


def test_a_list_of_equal_gaps_is_the_number():
    """[H, H, H] and H give the same rounds, in steps and in epochs, and the list's last entry repeats."""
    for every in (3, 5, 7):
        assert boundaries(average_every=[every] * 3) == boundaries(average_every=every)
        assert boundaries(average_every=[every]) == boundaries(average_every=every)
    assert boundaries(average_every=[1], average_unit="epochs") == boundaries(average_every=1, average_unit="epochs")


def test_a_warm_up_of_single_steps_then_growing_gaps():
    """Post-local SGD's warm-up (a round after each of the first steps), then H growing: the rounds come at
    the running sums of the gaps, the last gap repeating, and the final round at the run's last step."""
    gaps = round_gaps(LofiConfig(average_every=[2, 4], warmup_steps=3), per_epoch=10)
    assert gaps == [1, 1, 1, 2, 4]
    assert round_boundaries(gaps, 20) == [1, 2, 3, 5, 9, 13, 17, 20]
    assert round_boundaries([4], 12) == [4, 8, 12]  # a round at the last step is the final round itself
    assert round_gaps(LofiConfig(average_every=[1, 2], average_unit="epochs"), per_epoch=9) == [9, 18]


@pytest.mark.parametrize(
    "lofi, field",
    [
        ({"average_every": [4, 0]}, "lofi.average_every"),
        ({"average_every": []}, "lofi.average_every"),
        ({"warmup_steps": 2}, "lofi.warmup_steps"),
        ({"average_every": 4, "warmup_steps": -1}, "lofi.warmup_steps"),
        ({"average_every": [2, 4], "compress": "int4", "fragments": 2}, "lofi.fragments"),
        ({"average_every": 4, "warmup_steps": 2, "compress": "int4", "overlap": 1}, "lofi.overlap"),
        ({"average_every": 4, "probe_steps": 4, "outer_optimizer": "nesterov"}, "lofi.probe_steps"),
        ({"probe_steps": -1}, "lofi.probe_steps"),
    ],
)
def test_a_schedule_it_cannot_run_is_refused_naming_the_field(lofi, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(**lofi)
    assert err.value.field_name == field


@pytest.mark.parametrize("final_round", ["int8", "exact"])
def test_the_final_round_flushes_the_residual_through_its_own_codec(final_round):
    """With error feedback a round sends Δ + r and keeps what its codec dropped, exactly (d + r' == x, see
    core.compression). The final round encodes Δ + r in its own codec: the payload is that codec's size, and
    what is left is at most its rounding, u·|x| (float32, u = 2^-24) or half an int8 step of the tensor's
    largest |x| (bf16 scale rounded up: ×(1 + 2^-7)), where top-k rounds left most of Δ behind."""
    torch.manual_seed(0)
    state = {"a.weight": torch.randn(64, 33), "b.weight": torch.randn(300)}
    opts = LofiConfig(compress="topk", topk_fraction=0.05, final_round=final_round)
    codec = DeltaCodec(opts, state, set(state))
    first = {k: torch.randn_like(v).double() for k, v in state.items()}  # float32 values: exact in both
    codec.encode(first)
    kept = {k: r.clone() for k, r in codec.residual().items()}
    assert all(r.abs().max() > 0 for r in kept.values())
    last = {k: torch.randn_like(v).double() for k, v in state.items()}
    payload = codec.encode(last, final=True)
    flush = make_codec("none" if final_round == "exact" else final_round)
    assert payload.nbytes == flush.payload_nbytes(layout_of(state))
    decoded = {k: v for k, v in flush.decode(payload, layout_of(state), dtype=torch.float64).items()}
    after = codec.residual()
    for k, x in ((k, last[k] + kept[k]) for k in state):
        assert torch.equal(decoded[k] + after[k], x)  # nothing lost: what did not cross is the residual
        bound = 2.0**-24 * x.abs() if final_round == "exact" else x.abs().max() / 254 * (1 + 2.0**-7)
        assert (after[k].abs() <= bound).all()
    # every node and the driver decode the final round with the final codec: the average is what was sent
    mean = codec.average([payload, payload], [1.0, 1.0], final=True)
    assert all(torch.equal(mean[k], decoded[k]) for k in state)


def test_a_final_round_without_the_residual_sends_the_last_delta_alone():
    """lofi.final_residual: false: the final payload is the final codec's encoding of the last Δ alone, and
    the residual the run built up is left as it was (dropped), as an exact average of the models would."""
    torch.manual_seed(1)
    state = {"w": torch.randn(40, 25)}
    opts = LofiConfig(compress="int4", final_round="exact", final_residual=False)
    codec = DeltaCodec(opts, state, set(state))
    codec.encode({"w": torch.randn_like(state["w"]).double()})
    kept = codec.residual()["w"].clone()
    last = {"w": torch.randn_like(state["w"]).double()}
    payload = codec.encode(last, final=True)
    decoded = make_codec("none").decode(payload, layout_of(state), dtype=torch.float64)["w"]
    assert torch.equal(decoded, last["w"])  # float32 values: the float32 payload holds them exactly
    assert torch.equal(codec.residual()["w"], kept)


def test_scheduled_rounds_land_bit_identical_and_the_final_round_crosses_in_its_codec(ray_session, tmp_path):
    """A warm-up of two single-step rounds, then gaps of 3 and 5 steps, int4 rounds and an int8 final round:
    the rounds come where the schedule says, every round's global model hashes the same on every node (a
    mismatch raises ReplicaMismatch), the round files agree bit for bit, and the ledger books each round's
    int4 payloads and the final round's int8 ones at their packed size."""
    cfg = tiny_config(average_every=[3, 5], warmup_steps=2, compress="int4", final_round="int8", bn_recalibrate=False)
    ctx, rec = run_lofi(cfg, tmp_path)
    n, steps = 2, rec["details"]["steps_per_node"]
    want, t = [1, 2, 5], 5
    while t + 5 < steps:
        t += 5
        want.append(t)
    assert rec["details"]["averaging_steps"] == [*want, steps]
    kinds, rounds = rec["comm"]["by_kind"], len(want)
    assert kinds["train/outer_gradients"] == rounds * n * (n - 1) * payload_bytes(ctx, "int4")
    assert kinds["final/outer_gradients"] == n * (n - 1) * payload_bytes(ctx, "int8")
    assert kinds["train/verify_hash"] > 0 and kinds["final/verify_hash"] > 0
    files = round_files(tmp_path / "state")
    globals_ = [{k: v for k, v in f.items() if k.startswith("global.")} for f in files]
    assert globals_[0].keys() == globals_[1].keys()
    assert all(torch.equal(globals_[0][k], globals_[1][k]) for k in globals_[0])
    saved = load_file(rec["weights"])  # node 0's model after the final round: the global model itself
    assert all(torch.equal(saved[k[len("global.") :]], v) for k, v in globals_[0].items())


def test_a_probe_starts_every_node_from_one_averaged_head(ray_session, tmp_path, monkeypatch):
    """lofi.probe_steps (LP-FT): each node trains its head alone, the driver averages the heads and every node
    starts from that one head, also as the global model of peer rounds (a node starting from another would
    fail the first round's hash check). Only heads cross for it: one per node up, the average to each node."""
    from raylowcomm.actors import NodeGroup
    from raylowcomm.strategies.lofi.probe import head_names

    put, shared = NodeGroup.put, []

    def watched(group, obj, phase, what, copies=1):
        if what == "shared_head":
            shared.append(obj)
        return put(group, obj, phase, what, copies=copies)

    monkeypatch.setattr(NodeGroup, "put", watched)
    cfg = tiny_config(average_every=8, compress="int4", probe_steps=3, bn_recalibrate=False)
    ctx, rec = run_lofi(cfg, tmp_path)
    model = ctx.load_driver_weights()
    [average] = shared  # the probed heads' average, sent once: it moved away from the random head
    assert average.keys() == set(head_names(model, "timm"))
    assert any(not torch.equal(v, dict(model.named_parameters())[k].detach()) for k, v in average.items())
    names = head_names(model, "timm")
    assert names and all(n.startswith(model.pretrained_cfg["classifier"]) for n in names)
    head = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in names)
    kinds = rec["comm"]["by_kind"]
    assert kinds["setup/probe_heads"] == 2 * head and kinds["setup/shared_head"] == 2 * head
    assert kinds["train/verify_hash"] > 0  # every round hash-checked: the nodes' global models agreed
    assert "probe" in rec["details"]["phases_s"]


@pytest.mark.parametrize("momentum", ["keep", "reset"])
def test_round_momentum_reset_starts_every_node_afresh_at_each_round(ray_session, tmp_path, momentum):
    """The checkpoint a node writes when the final round lands (what a restart resumes from) holds SGD's
    momentum buffers under keep, none under reset; the replicas agree either way (hash-checked)."""
    cfg = tiny_config(average_every=8, compress="int8", bn_recalibrate=False, round_momentum=momentum)
    run_lofi(cfg, tmp_path)
    tensors = load_file(str(tmp_path / "state" / "lofi" / "checkpoints" / "node0.safetensors"))
    buffers = [k for k in tensors if k.startswith("optim.") and k.endswith("momentum_buffer")]
    assert bool(buffers) == (momentum == "keep")


def test_dense_names_the_head_the_vectors_or_patterns_and_refuses_a_pattern_that_matches_nothing():
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=10)
    params = dict(model.named_parameters())
    assert dense_names(model, "timm", ["head"]) == {"classifier.weight", "classifier.bias"}
    assert dense_names(model, "timm", ["vectors"]) == {n for n, p in params.items() if p.dim() == 1}
    assert dense_names(model, "timm", ["conv_stem.*", "head"]) == {
        "conv_stem.weight",
        "classifier.weight",
        "classifier.bias",
    }
    with pytest.raises(ValueError, match="'stem.*' matches no parameter"):
        dense_names(model, "timm", ["stem.*"])


def test_dense_tensors_cross_whole_in_their_codec_and_the_rest_in_compress():
    """lofi.dense: the named tensors' Δ + r is int8 over every entry (nothing left but half a step of the
    tensor's largest |x|, bf16 scale rounded up: ×(1 + 2^-7)), the others' top-k; the payload is the two
    codecs' sizes, and the average every node decodes is the decoded payload, part by part."""
    torch.manual_seed(2)
    state = {
        "body.weight": torch.randn(64, 33),
        "classifier.weight": torch.randn(10, 40),
        "classifier.bias": torch.randn(10),
    }
    opts = LofiConfig(compress="topk", topk_fraction=0.05, dense=["head"])
    head = {"classifier.weight", "classifier.bias"}
    codec = DeltaCodec(opts, state, set(state), head)
    delta = {k: torch.randn_like(v).double() for k, v in state.items()}
    payload = codec.encode(delta)
    body, whole = layout_of({"body.weight": state["body.weight"]}), layout_of({k: state[k] for k in head})
    topk, int8 = make_codec("topk", topk_fraction=0.05), make_codec("int8")
    assert payload.nbytes == topk.payload_nbytes(body) + int8.payload_nbytes(whole)
    residual = codec.residual()
    for k in head:
        assert (residual[k].abs() <= delta[k].abs().max() / 254 * (1 + 2.0**-7)).all()
    assert int((residual["body.weight"] == delta["body.weight"]).sum()) == 64 * 33 - round(0.05 * 64 * 33)
    mean = codec.average([payload, payload], [1.0, 3.0])
    decoded = {
        **topk.decode(Payload({k: payload[k] for k in body}), body, dtype=torch.float64),
        **int8.decode(Payload({k: payload[k] for k in whole}), whole, dtype=torch.float64),
    }
    assert all(torch.equal(mean[k], decoded[k]) for k in state)


@pytest.mark.parametrize("lofi", [{"dense": ["head"]}, {"dense": ["head"], "exchange": "peers"}])
def test_dense_without_compressed_peer_rounds_is_refused(lofi):
    with pytest.raises(ConfigError) as err:
        tiny_config(average_every=4, **lofi)
    assert err.value.field_name == "lofi.dense"


def test_a_dense_pattern_matching_no_parameter_is_refused_before_any_actor(tmp_path):
    from raylowcomm.runner import prepare

    cfg = tiny_config(average_every=4, compress="topk", dense=["head", "fc.*"])
    with pytest.raises(ConfigError, match="'fc.\\*' matches no parameter") as err:
        prepare(cfg, tmp_path)
    assert err.value.field_name == "lofi.dense"


def test_rounds_with_a_dense_head_land_bit_identical_and_book_both_codecs(ray_session, tmp_path):
    """Top-k rounds with the head and every 1-D parameter whole in int8: every node lands every round with
    the same global model (a mismatch raises ReplicaMismatch; the round files agree bit for bit), and each
    round's payloads are booked at the two codecs' packed sizes."""
    cfg = tiny_config(
        average_every=4, compress="topk", topk_fraction=0.05, dense=["head", "vectors"], bn_recalibrate=False
    )
    ctx, rec = run_lofi(cfg, tmp_path)
    model = ctx.load_driver_weights()
    params = dict(model.named_parameters())
    whole = {n for n, p in params.items() if p.dim() == 1} | {"classifier.weight"}
    state = state_dict_of(model)
    packed = make_codec("topk", topk_fraction=0.05).payload_nbytes(
        layout_of({k: state[k] for k in params if k not in whole})
    )
    packed += make_codec("int8").payload_nbytes(layout_of({k: state[k] for k in whole}))
    packed += make_codec("none").payload_nbytes(layout_of({k: v for k, v in floats(state).items() if k not in params}))
    n, rounds = 2, len(rec["details"]["averaging_steps"]) - 1
    assert rec["comm"]["by_kind"]["train/outer_gradients"] == rounds * n * (n - 1) * packed
    files = round_files(tmp_path / "state")
    globals_ = [{k: v for k, v in f.items() if k.startswith("global.")} for f in files]
    assert globals_[0].keys() == globals_[1].keys()
    assert all(torch.equal(globals_[0][k], globals_[1][k]) for k in globals_[0])
