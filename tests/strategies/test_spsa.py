"""SPSA on Ray: replicas stay bit-identical from one byte per gradient, through leaves and
joins; config errors surface before any actor; the prompt task scores label words exactly."""

import pytest
import torch
from safetensors.torch import load_file

from raylowcomm.actors import ReplicaMismatch, check_replicas
from raylowcomm.common.hashing import parameter_hash
from raylowcomm.common.ledger import Ledger
from raylowcomm.config import ConfigError
from raylowcomm.core.membership import LeaveEvent
from raylowcomm.core.zo.perturb import trainable_parameters
from raylowcomm.models import state_dict_of
from raylowcomm.runner import prepare
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.spsa import Spsa, SpsaNode
from raylowcomm.tasks import make_task, score_sets


def tiny_config(steps=20, count=2, eval_every=0, **spsa):
    return from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 320, "test_size": 100, "image_size": 16, "shift": "none"},
            "optim": {"lr": 0.01, "batch_size": 16, "max_steps": steps, "epochs": 20},
            "nodes": {"count": count, "cpus": 1},
            "strategies": ["spsa"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "eval_every": eval_every,
            "spsa": spsa,
        }
    )


def final_hashes(rec):
    return {n["node"]: n["final_hash"] for n in rec["nodes"] if n["final_hash"] is not None}


# --- config, no Ray ------------------------------------------------------------------------------


def test_membership_schedule_parses_into_dataclasses():
    cfg = tiny_config(leave=[{"node": 1, "step": 5, "how": "kill"}], join=[{"step": 8}])
    assert cfg.options["spsa"].leave == [LeaveEvent(node=1, step=5, how="kill")]
    assert cfg.options["spsa"].join[0].step == 8


@pytest.mark.parametrize(
    "spsa, field",
    [
        ({"leave": [{"node": 2, "step": 3}]}, "spsa.leave[0].node"),  # no node 2 at step 3
        ({"leave": [{"node": 0, "step": 3}, {"node": 1, "step": 3}]}, "spsa.leave[1]"),  # nobody left
        ({"leave": [{"node": 1, "step": 3}, {"node": 1, "step": 6}]}, "spsa.leave[1].node"),  # left twice
        ({"join": [{"step": 0}]}, "spsa.join[0].step"),
        ({"leave": [{"node": 1, "step": 2, "how": "crash"}]}, "spsa.leave[0].how"),
        ({"codec": "log", "g_min": 10.0, "g_max": 1.0}, "spsa.g_min"),
        ({"codec": "linear", "scale": 0.0}, "spsa.scale"),
        ({"eps": 0.0}, "spsa.eps"),
        ({"samples": 0}, "spsa.samples"),
        ({"verify_every": 0}, "spsa.verify_every"),
        ({"include": ["("]}, "spsa.include[0]"),
        ({"step": "normalised"}, "spsa.samples"),  # one g per node: no spread to divide by
        ({"step": "normalised", "samples": 1, "estimator": "one_sided_batch"}, "spsa.samples"),
        ({"estimator": "three_point"}, "spsa.estimator"),
        ({"step": "adam"}, "spsa.step"),
        ({"density": 0.0}, "spsa.density"),
        ({"density": 1.5}, "spsa.density"),
    ],
)
def test_bad_config_names_the_field(spsa, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(**spsa)
    assert err.value.field_name == field


def test_a_joiner_may_be_scheduled_to_leave():
    tiny_config(join=[{"step": 2}], leave=[{"node": 2, "step": 4}, {"node": 0, "step": 4}])


def test_events_past_the_last_step_fail_before_any_actor(tmp_path):
    ctx = prepare(tiny_config(steps=6, join=[{"step": 6}]), tmp_path)
    with pytest.raises(ConfigError) as err:
        Spsa().run(ctx)  # raises before Ray is touched: no cluster in this test
    assert err.value.field_name == "spsa.join[0].step"


# --- the prompt task -----------------------------------------------------------------------------


def test_prompt_classification_reads_the_last_real_token_whatever_the_padding():
    from transformers import LlamaConfig, LlamaForCausalLM

    from raylowcomm.tasks import PromptClassification

    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=50,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
        )
        .double()
        .eval()
    )
    rows = [[5, 6, 7, 8, 9], [11, 12, 13]]
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    choices = torch.tensor([[3, 4], [3, 4]])
    batch = {"input_ids": ids, "attention_mask": mask, "choice_ids": choices, "labels": torch.tensor([0, 1])}
    task = PromptClassification()
    with torch.no_grad():
        got = task.forward(model, batch)
        # In float64 the padded batch and the unpadded row add the same nonzero terms (a padded key's attention
        # weight is exactly 0, and causal attention keeps pads after the prompt out of it) in another order, and
        # the label words' rows meet the hidden state in an einsum instead of the full head: ~2^-53 relative per
        # operation, so 1e-10 on logits of magnitude < 1 leaves a gain of 10^5. The task rounds its logits to
        # float32 once (u = 2^-24 relative): the bound is their sum.
        for i, r in enumerate(rows):
            full = model(input_ids=torch.tensor([r])).logits[0, -1][choices[i]]
            assert got.dtype == torch.float32
            assert ((got[i].double() - full).abs() <= 2.0**-24 * full.abs() + 1e-10).all(), i
        expected = torch.nn.functional.cross_entropy(got, batch["labels"])
        assert torch.equal(task.loss(model, batch), expected)  # the same forward and cross-entropy again


# --- Ray -----------------------------------------------------------------------------------------


def test_two_nodes_stay_bit_identical_and_send_one_byte_per_gradient(ray_session, tmp_path):
    steps, samples = 20, 2
    ctx = prepare(tiny_config(steps=steps, verify_every=1, samples=samples), tmp_path)
    rec = Spsa().run(ctx).to_dict()
    det = rec["details"]
    assert [v["step"] for v in det["verified"]] == list(range(1, steps + 1))
    assert all(v["nodes"] == [0, 1] for v in det["verified"])
    assert len({v["hash"] for v in det["verified"]}) == steps, "the weights must change every step"
    hashes = final_hashes(rec)
    assert set(hashes) == {0, 1} and len(set(hashes.values())) == 1
    # 2 nodes × 2 samples × 1 byte published, each relayed to the one other node
    by_kind = rec["comm"]["by_kind"]
    assert by_kind["train/projected_grads"] == by_kind["train/projected_grads_relay"] == 2 * samples * 1 * steps
    assert det["codec_bytes"] == 1 and det["payload_bytes_per_step"] == 2 * samples
    # inline messages: up, codes + a float32 loss; down, the other node's codes; plus Ray's framing,
    # all far below the ~250 B one ObjectRef would cost
    assert 2 * (samples + 4) + 2 * samples < det["wire_bytes_per_step"] < 64
    assert 0 < det["control_wire_bytes_per_step"] < 256, "step numbers and publisher lists, measured too"
    assert by_kind["train/train_loss"] == 2 * 4 * steps and by_kind["setup/model_recipe"] > 0
    train_kinds = {k for k in by_kind if k.startswith("train/")}
    assert train_kinds == {
        "train/projected_grads",
        "train/projected_grads_relay",
        "train/train_loss",
        "train/control",
        "train/verify_hash",
    }, "no weights may move while training"
    assert "id_accuracy" in det["step0_metrics"] and "id_accuracy" in rec["metrics"]
    assert rec["samples_seen"] == 2 * steps * 16 and rec["peak_rss_bytes"] > 0
    # each node says what its process held before its model loaded: a part of its peak (the scale benchmark's split)
    assert all(0 < node["rss_before_model_bytes"] < node["peak_rss_bytes"] for node in rec["nodes"])
    # the saved weights are the replicas' weights, saved and scored by a node where they are: no model crosses
    # at the end, only what the driver fetches (the metrics, each node's info and hash), each fetch booked
    model = ctx.load_driver_weights()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    final = {k: v for k, v in by_kind.items() if k.startswith("final/")}
    assert set(final) == {"final/eval_metrics", "final/node_info", "final/final_hash"}, final
    assert sum(final.values()) == rec["comm"]["by_phase"]["final"] < min(4096, model_bytes // 100)
    assert final["final/final_hash"] >= 2 * 64, "two nodes' hex digests came back"
    saved = load_file(rec["weights"])
    assert rec["weights"].endswith("spsa/model.safetensors") and saved.keys() == model.state_dict().keys()
    model.load_state_dict(saved)
    assert parameter_hash(list(model.named_parameters())) == hashes[0]
    # the node's scores are the driver's of the saved file, exactly: the same computation on the same weights
    # (on the node's one thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scored = score_sets(make_task(ctx.data.task), model, ctx.eval_sets(val=False), ctx.cfg.eval_rows)
    finally:
        torch.set_num_threads(threads)
    assert scored == rec["metrics"]


# CI's time: the one-sided leave-and-join test runs the same path in CI; core/test_zo_estimators replays every
# estimator
@pytest.mark.heavy
def test_nodes_leave_and_join_from_checkpoint_plus_log(ray_session, tmp_path):
    """Node 1 crashes at 5, node 2 joins at 9 (checkpoint of step 8 + log), node 0 is removed at
    14, node 3 joins at 17 (checkpoint of 16 + log): each joiner's hash equals the running
    node's on arrival, and the survivors end bit-identical."""
    cfg = tiny_config(
        steps=22,
        verify_every=3,
        codec="float32",
        perturbation="gaussian",
        leave=[{"node": 1, "step": 5, "how": "kill"}, {"node": 0, "step": 14}],
        join=[{"step": 9}, {"step": 17}],
    )
    ctx = prepare(cfg, tmp_path)
    initial = parameter_hash(list(ctx.load_driver_weights().named_parameters()))
    rec = Spsa().run(ctx).to_dict()
    nodes = {n["node"]: n for n in rec["nodes"]}
    assert (nodes[1]["left_step"], nodes[1]["left_how"]) == (5, "died")
    assert (nodes[0]["left_step"], nodes[0]["left_how"]) == (14, "remove")
    assert (nodes[2]["joined_step"], nodes[2]["joined_from_checkpoint_step"]) == (9, 8)
    assert (nodes[3]["joined_step"], nodes[3]["joined_from_checkpoint_step"]) == (17, 16)
    verified = {(v["step"], tuple(v["nodes"])) for v in rec["details"]["verified"]}
    assert {(9, (0, 2)), (17, (2, 3)), (22, (2, 3))} <= verified
    hashes = final_hashes(rec)
    assert set(hashes) == {2, 3} and len(set(hashes.values())) == 1 and initial not in hashes.values()
    by_kind = rec["comm"]["by_kind"]
    assert by_kind["train/join_checkpoint"] > 0 and by_kind["train/join_log"] > 0
    # float32: 4 bytes per gradient; each publisher's payload is relayed to every other running node
    running = [2 if s < 5 else 1 if s < 9 else 2 if s < 14 else 1 if s < 17 else 2 for s in range(22)]
    assert by_kind["train/projected_grads"] == sum(4 * n for n in running)
    assert by_kind["train/projected_grads_relay"] == sum(4 * n * (n - 1) for n in running)
    assert rec["samples_seen"] == sum(running) * 16 and rec["details"]["shard_slots"] == 4
    # goodput: each node booked for its own time in the run, its calls' waits within it; the dead node's
    # last step is lost, untimed
    g = rec["goodput"]
    accounts = {a["node"]: a for a in g["nodes"]}
    assert [accounts[k]["joins"] for k in range(4)] == [0, 0, 1, 1] and g["joins"] == 2
    assert accounts[1]["lost_s"] is None and accounts[0]["lost_s"] == accounts[2]["lost_s"] == 0.0
    assert (
        accounts[1]["reserved_s"] < accounts[0]["reserved_s"] and accounts[3]["reserved_s"] < accounts[2]["reserved_s"]
    )
    for a in accounts.values():
        assert 0 < a["useful_s"] and a["useful_s"] + a["idle_at_barriers_s"] <= a["reserved_s"]
    assert g["useful_node_s"] == sum(a["useful_s"] for a in g["nodes"]) and 0 < g["goodput"] < 1
    model = ctx.load_driver_weights()
    model.load_state_dict(load_file(rec["weights"]))
    assert parameter_hash(list(model.named_parameters())) == hashes[2]


@pytest.mark.heavy  # about 30 s on 4 actors: the 2-node leave-and-join test above runs in CI
def test_four_nodes_stay_bit_identical_over_20_steps_through_a_leave_and_a_join(ray_session, tmp_path):
    """N = 4, the scale at which the benchmark measures SPSA's steps to target: node 1 leaves at step 7
    and a fifth node joins at 12 (checkpoint of step 12 + log); every node running at the end holds
    the bits the others do, and the model saved from them."""
    cfg = tiny_config(steps=20, count=4, verify_every=5, leave=[{"node": 1, "step": 7}], join=[{"step": 12}])
    cfg.nodes.cpus = 0.5
    ctx = prepare(cfg, tmp_path)
    rec = Spsa().run(ctx).to_dict()
    nodes = {n["node"]: n for n in rec["nodes"]}
    assert nodes[1]["left_step"] == 7 and nodes[4]["joined_step"] == 12
    verified = {(v["step"], tuple(v["nodes"])) for v in rec["details"]["verified"]}
    assert {(5, (0, 1, 2, 3)), (20, (0, 2, 3, 4))} <= verified
    hashes = final_hashes(rec)
    assert set(hashes) == {0, 2, 3, 4} and len(set(hashes.values())) == 1
    model = ctx.load_driver_weights()
    model.load_state_dict(load_file(rec["weights"]))
    assert parameter_hash(list(model.named_parameters())) == hashes[0]


def test_progress_every_step_and_a_learning_curve_every_eval_every_steps(ray_session, tmp_path):
    steps, every = 7, 3
    ctx = prepare(tiny_config(steps=steps, eval_every=every, verify_every=100), tmp_path)
    reports = []
    ctx = ctx.for_strategy(reports.append)
    rec = Spsa().run(ctx).to_dict()
    assert [r["step"] for r in reports] == list(range(1, steps + 1))
    assert all(0 < r["train_loss"] < 10 for r in reports)
    assert [("id_accuracy" in r) for r in reports] == [s in (3, 6) for s in range(1, steps + 1)]
    curve = rec["curve"]
    assert [p["step"] for p in curve] == [3, 6, 7]
    assert [p["samples"] for p in curve] == [2 * 16 * s for s in (3, 6, 7)]
    for key in ("wall_s", "bytes", "samples"):
        assert all(a[key] <= b[key] for a, b in zip(curve, curve[1:])), key
    assert curve[0]["bytes"] >= rec["comm"]["by_phase"]["setup"], "all setup bytes were sent before the first point"
    assert curve[-1]["wall_s"] == round(rec["train_s"], 3) and curve[-1]["bytes"] == rec["comm"]["total_bytes"]
    assert {k: curve[-1][k] for k in rec["metrics"]} == rec["metrics"]
    assert set(curve[0]) == {"step", "wall_s", "samples", "bytes", "forwards", *rec["metrics"]}
    assert [p["forwards"] for p in curve] == [2 * 2 * s for s in (3, 6, 7)], "two_point: 2 forwards per sample"
    assert rec["details"]["forwards"] == 2 * 2 * steps and rec["details"]["forwards_per_node_step"] == 2
    assert rec["comm"]["by_kind"]["setup/eval_sets"] > 0, "the evaluating node fetched the test set: counted"


@pytest.mark.slow
@pytest.mark.parametrize("density", [pytest.param(1.0, marks=pytest.mark.heavy), 1 / 256])  # dense: the heavy tier
def test_one_sided_batch_with_the_normalised_step_keeps_replicas_identical_through_a_leave_and_a_join(
    ray_session, tmp_path, density
):
    """The FZOO-style estimator and the step normalised from the decoded bytes, dense and sparse:
    2 nodes, node 1 removed at step 5, node 2 joins at step 9 from the checkpoint of step 8 plus the
    log; hashes equal at every step for 22 steps, one byte per perturbation, samples + 1 forwards
    per node-step; with density 1/256 the ~100 perturbations moved only a part of the weights."""
    steps, samples = 22, 3
    cfg = tiny_config(
        steps=steps,
        eval_every=10,
        verify_every=1,
        samples=samples,
        estimator="one_sided_batch",
        step="normalised",
        lr=1e-3,
        density=density,
        leave=[{"node": 1, "step": 5}],
        join=[{"step": 9}],
    )
    ctx = prepare(cfg, tmp_path)
    initial = parameter_hash(list(ctx.load_driver_weights().named_parameters()))
    before = {n: p.detach().clone() for n, p in trainable_parameters(ctx.load_driver_weights())}
    rec = Spsa().run(ctx).to_dict()
    det, nodes = rec["details"], {n["node"]: n for n in rec["nodes"]}
    assert (nodes[1]["left_step"], nodes[1]["left_how"]) == (5, "remove")
    assert (nodes[2]["joined_step"], nodes[2]["joined_from_checkpoint_step"]) == (9, 8)
    verified = {(v["step"], tuple(v["nodes"])) for v in det["verified"]}
    assert {(4, (0, 1)), (9, (0, 2)), (22, (0, 2))} <= verified
    assert all(len(v["nodes"]) >= 1 for v in det["verified"]) and len(det["verified"]) >= steps
    assert len({v["hash"] for v in det["verified"] if v["step"] > 0} - {initial}) >= steps - 1, "weights move"
    hashes = final_hashes(rec)
    assert set(hashes) == {0, 2} and len(set(hashes.values())) == 1 and initial not in hashes.values()
    running = [2 if s < 5 else 1 if s < 9 else 2 for s in range(steps)]
    assert rec["comm"]["by_kind"]["train/projected_grads"] == sum(samples * n for n in running)
    assert det["estimator"] == "one_sided_batch" and det["step_rule"] == "normalised"
    assert det["forwards_per_node_step"] == samples + 1 and det["forwards"] == (samples + 1) * sum(running)
    assert [(p["step"], p["forwards"]) for p in rec["curve"]] == [
        (s, (samples + 1) * sum(running[:s])) for s in (10, 20, 22)
    ]
    assert nodes[0]["forwards"] == (samples + 1) * steps and nodes[2]["forwards"] == (samples + 1) * (steps - 9)
    final = load_file(rec["weights"])
    moved = sum(int((final[n] != b).sum()) for n, b in before.items()) / sum(b.numel() for b in before.values())
    perturbations = samples * sum(running)
    if density == 1.0:
        assert moved > 0.9
    else:  # each weight is in a given perturbation's mask with probability 1/256
        assert abs(moved - (1 - (1 - density) ** perturbations)) < 0.05 and det["density"] == density


def test_a_diverged_replica_stops_the_run_naming_step_and_nodes(ray_session, tmp_path):
    ctx = prepare(tiny_config(steps=4), tmp_path)
    state = {k: v.clone() for k, v in ctx.load_driver_weights().state_dict().items()}

    bad = {k: v.clone() for k, v in state.items()}
    name = next(k for k, v in bad.items() if v.is_floating_point())
    bad[name].view(-1)[0] = torch.nextafter(bad[name].view(-1)[0], torch.tensor(1e9))  # one ulp
    nodes = {
        k: SpsaNode.remote(
            k, ctx.spec, ctx.data.task, ctx.data.train, 3, ctx.cfg, Spsa.opts(ctx.cfg), ctx.storage, weights=w
        )
        for k, w in ((0, state), (1, state), (2, bad))
    }
    with pytest.raises(ReplicaMismatch, match=r"after step 7: nodes \[0, 1\] hash \w+; nodes \[2\]"):
        check_replicas(nodes, 7, Ledger())
    del nodes[2]
    assert len(check_replicas(nodes, 7, Ledger())) == 64


# CI's time: replicas and a joiner through leaves and joins (the one-sided test), SPSA on LoRA adapters
# (test_model_source) run in CI
@pytest.mark.heavy
def test_spsa_on_lora_adapters_keeps_replicas_identical_and_a_joiner_matches(ray_session, tmp_path):
    """Real MiniLM with r=4 adapters: only adapters and head are perturbed and replayed; 2 nodes
    stay bit-identical for 20 steps; a node joining at step 10 from the (adapters-only) checkpoint
    of step 8 plus the log matches them; the frozen base never changes."""
    from tests.conftest import trainable_nbytes

    cfg = from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier", "lora": {"r": 4, "alpha": 8}},
            "data": {"name": "rotten_tomatoes", "train_size": 96, "test_size": 16, "max_length": 24, "shift": "none"},
            "optim": {"batch_size": 8, "lr": 1e-3},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["spsa"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "spsa": {"steps": 20, "verify_every": 1, "join": [{"step": 10}]},
        }
    )
    ctx = prepare(cfg, tmp_path)
    initial = state_dict_of(ctx.load_driver_weights())
    rec = Spsa().run(ctx).to_dict()
    verified = rec["details"]["verified"]
    assert len(verified) >= 20 and verified[-1]["nodes"] == [0, 1, 2]
    assert len({v["hash"] for v in verified if v["step"] > 0}) >= 19, "the adapters must change every step"
    joiner = rec["nodes"][2]
    assert joiner["joined_from_checkpoint_step"] == 8 and joiner["final_hash"] == rec["nodes"][0]["final_hash"]
    assert rec["comm"]["by_kind"]["train/join_checkpoint"] < 1.1 * trainable_nbytes(ctx.load_driver_weights())
    trainable = {k for k, p in ctx.load_driver_weights().named_parameters() if p.requires_grad}
    driver = trainable_parameters(ctx.load_driver_weights())
    assert {name for name, _ in driver} == trainable, "SPSA perturbs adapters and head only"
    final = load_file(rec["weights"])  # the adapters and head: the base is the pretrained model's
    assert final.keys() == trainable and any(not torch.equal(final[k], initial[k]) for k in trainable)
    assert (tmp_path / "spsa" / "adapter" / "adapter_model.safetensors").exists()
