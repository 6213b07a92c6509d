"""Interlocking backprop on Ray: stage actors apply exactly the n-way reference update, the
driver only ever handles refs and small dicts, and full runs report bytes, heads and weights."""

import copy
import itertools

import pytest
import ray
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn import Linear
from transformers import LlamaConfig, LlamaForCausalLM

from raylowcomm.actors import DriverFetches
from raylowcomm.catalog import TaskSpec
from raylowcomm.common.batches import Source, batch_at, num_examples
from raylowcomm.common.ledger import Ledger
from raylowcomm.config import ConfigError, OptimConfig
from raylowcomm.core.interlock.heads import resnet_aux_heads
from raylowcomm.core.interlock.routing import (
    InterlockStage,
    build_stages,
    message_plan,
    reference_gradients,
    run_pipeline,
)
from raylowcomm.core.interlock.splitting import split_timm_resnet
from raylowcomm.data import PreparedData
from raylowcomm.models import ModelSpec, place
from raylowcomm.runner import prepare
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.interlocking import Interlocking, train_interlocked
from raylowcomm.strategies.interlocking.stage import StageActor, StageWorker
from raylowcomm.tasks import CausalLM, ImageClassification, make_task
from tests.core.test_interlock import NUM_CLASSES, tiny_resnet

LR = 0.1


@pytest.fixture(scope="module")
def three_actors(ray_session):
    """Three stage processes, reloaded per case (process start-up dominates small tests); a
    third of a CPU each, so the full runs below still find CPUs while these are alive."""
    actors = [StageActor.options(num_cpus=1 / 3).remote(1, 0) for _ in range(3)]
    yield actors
    for a in actors:
        ray.kill(a)


def test_message_plan_matches_routing():
    # farthest n = 3, K = 4: stage 3 sends head 3 early; stage 2 sends head 2 early and relays 3.
    assert message_plan(4, 3, "farthest") == [[set(), set()], [set(), {2}, set()], [{2}, {3}], [{3}]]
    assert all(not any(m) for plan in message_plan(4, 1, "sum") for m in plan)
    # farthest n = K is end-to-end: only the final head's gradient travels, relayed by every stage.
    assert message_plan(3, 3, "farthest") == [[set(), set()], [set(), {2}], [{2}]]


LAYOUTS = {None: None, "channels_last": ModelSpec("timm", memory_format="channels_last")}


@pytest.mark.parametrize(
    "n,rule,layout",
    [(n, rule, None) for n in (1, 2, 3) for rule in ("farthest", "sum")]
    + [(2, "farthest", "channels_last"), (3, "sum", "channels_last")],
)
def test_ray_stages_apply_reference_update(three_actors, n, rule, layout):
    """K = 3 actors, 2 micro-batches, one SGD step: every stage's and aux head's new weights
    equal w - lr * (gradient of its n-way objective on the whole batch, one autograd graph), the
    stages' convolutions in torch's layout or in channels_last (`layout`, the model's spec)."""
    K, M = 3, 2
    g = torch.Generator().manual_seed(3)
    split = {
        "pixels": torch.randint(0, 256, (8, 16, 16), dtype=torch.uint8, generator=g),
        "labels": torch.randint(0, NUM_CLASSES, (8,), generator=g),
    }
    source = Source("image", split, {}, batch_size=8, seed=0, image_size=16)
    batch = batch_at(split, 0, 8, 0)
    x, y = ImageClassification(16).inputs(batch).double(), batch["labels"]
    model = tiny_resnet().double().eval()  # eval BN: micro-batches see the same statistics as the batch
    modules = split_timm_resnet(model, K)
    heads = [h.double().eval() for h in resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))]
    optim = OptimConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.0)
    actors = three_actors
    ray.get(
        [
            a.load.remote(
                k,
                K,
                n,
                rule,
                (modules[k], heads[k] if k < K - 1 else None),
                "cross_entropy",
                optim,
                M,
                source if k == 0 else None,
                spec=LAYOUTS[layout],
            )
            for k, a in enumerate(actors)
        ]
    )
    fetch = DriverFetches(Ledger())
    run = train_interlocked(actors, K, n, rule, M, steps=1, fetch=fetch)
    assert run["batches"] == 1 and fetch.tensors == 0, "the driver must only read small dicts"
    got = ray.get([a.state.remote() for a in actors])

    want_stages, want_heads = reference_gradients(modules, heads, (x, y), n, rule)
    for k in range(K):
        params = dict(modules[k].named_parameters())
        for name, grad in want_stages[k].items():
            want = params[name].detach() - LR * grad
            assert torch.allclose(got[k][0][name], want, rtol=1e-9, atol=1e-12), f"stage {k} {name}"
    for j in range(K - 1):
        params = dict(heads[j].named_parameters())
        for name, grad in want_heads[j].items():
            assert torch.allclose(got[j][1][name], params[name].detach() - LR * grad, rtol=1e-9, atol=1e-12), (
                f"head {j}"
            )
    assert any(not torch.equal(got[0][0][name], p) for name, p in modules[0].named_parameters())

    if rule == "farthest" and n == K:  # end-to-end backprop of the unsplit model's loss
        e2e = copy.deepcopy(model)
        F.cross_entropy(e2e(x), y).backward()
        stepped = {name: p.detach() - LR * p.grad for name, p in e2e.named_parameters()}
        name_of = {id(p): name for name, p in model.named_parameters()}
        for k in range(K):
            for name, p in modules[k].named_parameters():
                assert torch.allclose(got[k][0][name], stepped[name_of[id(p)]], rtol=1e-9, atol=1e-12)

    # What the driver gets back from a forward is a ref to a ref: never tensor bytes.
    h_ref, _ = actors[0].forward.remote(1, 0)
    inner = ray.get(h_ref)
    assert isinstance(inner, ray.ObjectRef)
    h, targets = ray.get(inner)  # (test only) it does hold the activation, in stage 0's store
    assert h.shape[0] == 4 and torch.equal(targets, batch_at(split, 1, 8, 0)["labels"][:4])


@pytest.mark.parametrize("rule,layout", [("farthest", None), ("sum", None), ("farthest", "channels_last")])
def test_ray_stages_that_overlap_batches_equal_the_pipeline_in_process(three_actors, rule, layout):
    """K = 3, n = 2, 2 batches a stage, 3 batches: the actors' weights equal `run_pipeline`'s, which a
    core test checks against the gradients of the weights each forward ran with; the driver still
    reads only small dicts, and each stage that waits for messages stashed its weights. In
    channels_last (`layout`) the actors' fused momentum steps walk weights and gradients laid out alike."""
    K, M, n, steps = 3, 2, 2, 3
    g = torch.Generator().manual_seed(5)
    split = {
        "pixels": torch.randint(0, 256, (24, 16, 16), dtype=torch.uint8, generator=g),
        "labels": torch.randint(0, NUM_CLASSES, (24,), generator=g),
    }
    source = Source("image", split, {}, batch_size=8, seed=0, image_size=16)
    modules = split_timm_resnet(tiny_resnet().double().eval(), K)
    heads = [h.double().eval() for h in resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))]
    optim = OptimConfig(name="sgd", lr=LR, momentum=0.9, weight_decay=0.0)
    payloads = [(modules[k], heads[k] if k < K - 1 else None) for k in range(K)]
    ray.get(
        [
            a.load.remote(
                k, K, n, rule, payloads[k], "cross_entropy", optim, M, source if k == 0 else None, spec=LAYOUTS[layout]
            )
            for k, a in enumerate(three_actors)
        ]
    )
    fetch = DriverFetches(Ledger())
    run = train_interlocked(three_actors, K, n, rule, M, steps=steps, fetch=fetch, stage_batches=2)
    assert run["batches"] == steps and fetch.tensors == 0
    got = ray.get([a.state.remote() for a in three_actors])
    infos = ray.get([a.info.remote() for a in three_actors])

    task = ImageClassification(16)
    batches = [
        [(task.inputs(mb).double(), mb["labels"]) for mb in (source.micro_batch(b, i, M) for i in range(M))]
        for b in range(steps)
    ]
    momentum = lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)  # noqa: E731
    stages = build_stages(modules, heads, n, rule, optimizer_factory=momentum, micro_batches_per_step=M)
    run_pipeline(stages, batches, stage_batches=2)
    for k, stage in enumerate(stages):
        # float64, the same calls in the same order in another process: at most a few roundings of
        # 2^-53 relative apart (the actor's thread count may order a reduction otherwise)
        for name, p in stage.module.named_parameters():
            assert torch.allclose(got[k][0][name], p.detach(), rtol=1e-9, atol=1e-12), f"stage {k} {name}"
        assert (infos[k]["stashes"] > 0) == bool(stage.needs_from_downstream()) and infos[k]["steps"] == steps


def tiny_cfg(**interlocking):
    return from_dict(
        {
            "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 256, "test_size": 200, "image_size": 16},
            # one evaluation chunk per set, so the driver's reads of the stages' evaluation reports
            # stay a small share of these tiny activations (the byte assertions below)
            "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": 1, "eval_batch_size": 256},
            "nodes": {"cpus": 1},
            "strategies": ["interlocking"],
            "interlocking": {"stages": 2, "micro_batches": 2, "aux_widths": [8], "balance": "blocks", **interlocking},
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_resnet_run_counts_bytes_and_scores_every_head(ray_session, tmp_path, n):
    cfg = tiny_cfg(n=n, rule="farthest")
    cfg.eval_every = 5  # curve evaluations must not change what training sends
    ctx = prepare(cfg, tmp_path)
    rec = Interlocking().run(ctx).to_dict()
    d, kinds = rec["details"], rec["comm"]["by_kind"]
    steps = 256 // 16
    assert d["batches"] == steps and rec["samples_seen"] == steps * 16

    # Activation bytes are exactly (stage 0 output per micro-batch) x micro-batches x steps.
    probe = split_timm_resnet(copy.deepcopy(ctx.load_driver_weights()), 2)[0]
    x = ImageClassification(16).inputs(batch_at(ctx.data.train.load_all(), 0, 8, cfg.seed))
    h_bytes = probe(x).nbytes
    assert kinds["train/activations"] == steps * 2 * h_bytes
    assert kinds["train/targets"] == steps * 16 * 8
    assert kinds.get("train/gradients", 0) == (steps * 2 * h_bytes if n == 2 else 0)

    assert d["driver_fetched"]["train"]["tensors"] == 0 and d["driver_fetched"]["eval"]["tensors"] == 0
    assert d["driver_fetched"]["train"]["bytes"] < 0.05 * kinds["train/activations"]
    assert set(d["heads"]["test"]) == {"head0_aux", "head1_final"}
    assert all(0 < b <= 1 for b in d["busy_fraction"]) and d["step_time_s"] > 0
    # goodput: a stage's busy time is useful, the rest of the training phase it waited (the pipeline's bubble)
    g, busy = rec["goodput"], [node["busy_s"] for node in rec["nodes"]]
    assert [a["useful_s"] for a in g["nodes"]] == busy and g["useful_node_s"] == sum(busy)
    assert all(a["idle_at_barriers_s"] == a["reserved_s"] - a["useful_s"] for a in g["nodes"])
    assert g["goodput"] == sum(busy) / g["reserved_node_s"] and 0 < g["goodput"] <= 1
    assert {"id_accuracy", "id_loss", "shift_accuracy"} <= rec["metrics"].keys()

    # The saved model is the stages' weights reassembled: scored as they scored it (in their layout, models.place,
    # on their one thread, nodes.cpus, in chunks of eval_rows), it scores what the final head scored, bit for bit
    model = copy.deepcopy(ctx.load_driver_weights())
    model.load_state_dict(load_file(rec["weights"]))
    assert not torch.equal(next(model.parameters()), next(ctx.load_driver_weights().parameters()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scored = make_task(ctx.data.task).evaluate(
            place(model, ctx.spec, "cpu"), ctx.data.eval_sets["test"], cfg.eval_rows
        )
    finally:
        torch.set_num_threads(threads)
    assert scored == {"accuracy": rec["metrics"]["id_accuracy"], "loss": rec["metrics"]["id_loss"]}
    assert d["heads"]["test"]["head1_final"]["accuracy"] == rec["metrics"]["id_accuracy"]

    curve = rec["curve"]
    assert [p["step"] for p in curve] == [5, 10, 15, 16] and curve[-1]["id_accuracy"] == rec["metrics"]["id_accuracy"]
    assert [p["samples"] for p in curve] == [5 * 16, 10 * 16, 15 * 16, 16 * 16]
    train_per_batch = (kinds["train/activations"] + kinds["train/targets"] + kinds.get("train/gradients", 0)) / steps
    setup = rec["comm"]["by_phase"]["setup"]
    for p in curve[:-1]:  # by then: setup + that many batches' messages + the driver's reads of the stage reports
        assert setup + p["step"] * train_per_batch <= p["bytes"] <= setup + p["step"] * train_per_batch * 1.05


class InMemory:
    """Training rows already in memory, in place of data.TrainSource (a random-vocabulary model)."""

    def __init__(self, split):
        self.split = split

    def load(self, node: int, count: int):
        return self.split

    def sizes(self, count: int) -> list[int]:
        return [num_examples(self.split)]


@pytest.mark.slow
def test_decoder_run_unties_embeddings(ray_session, tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = from_dict(
        {
            "model": {"family": "hf_causal_lm"},
            "data": {"name": "hamlet", "max_length": 12},
            "optim": {"name": "adamw", "lr": 1e-2, "batch_size": 8, "epochs": 2},
            "nodes": {"cpus": 1},
            "strategies": ["interlocking"],
            "interlocking": {"stages": 2, "n": 2, "rule": "sum", "micro_batches": 2},
        }
    )
    g = torch.Generator().manual_seed(1)
    train, test = ({"input_ids": torch.randint(0, 64, (n, 12), generator=g)} for n in (64, 16))
    data = PreparedData({"test": test}, None, InMemory(train), TaskSpec("causal_lm"), None)
    ctx = RunContext(cfg, model, ModelSpec("hf_causal_lm", hf_config=config), data, tmp_path)
    rec = Interlocking().run(ctx).to_dict()
    d = rec["details"]
    assert d["lm_head_untied"] and model.lm_head.weight is model.model.embed_tokens.weight  # driver weights untouched
    assert {"id_loss", "id_perplexity"} <= rec["metrics"].keys()
    assert (
        rec["comm"]["by_kind"]["train/gradients"] == rec["comm"]["by_kind"]["train/activations"]
    )  # sum, n=2: dL_1/dx_1
    saved = load_file(rec["weights"])
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    untied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    untied.load_state_dict(saved)
    # the chain of the two stages is the model's own modules in its own order, each stage actor on one thread
    # (runtime.setup_threads, 1 CPU): scored here on one thread too, the same kernels give the same bits
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert CausalLM().evaluate(untied, test, 256)["loss"] == rec["metrics"]["id_loss"]
    finally:
        torch.set_num_threads(threads)
    assert d["heads"]["test"]["head0_aux"]["loss"] < 2 * rec["metrics"]["id_loss"]


def test_validation_names_the_field():
    with pytest.raises(ConfigError) as err:
        tiny_cfg(stages=2, n=3)
    assert err.value.field_name == "interlocking.n"
    with pytest.raises(ConfigError) as err:
        tiny_cfg(micro_batches=3)
    assert err.value.field_name == "interlocking.micro_batches"
    for positions in (0.5, 0.0):  # a subset of token positions is a decoder's; and a fraction in (0, 1]
        with pytest.raises(ConfigError) as err:
            tiny_cfg(aux_positions=positions)
        assert err.value.field_name == "interlocking.aux_positions"
    with pytest.raises(ConfigError) as err:
        from_dict(
            {"model": {"name": "test_vit", "family": "timm", "pretrained": False}, "strategies": ["interlocking"]}
        )
    assert err.value.field_name == "model.name"
    with pytest.raises(ConfigError) as err:
        from_dict(
            {
                "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"},
                "data": {"name": "rotten_tomatoes"},
                "strategies": ["interlocking"],
            }
        )
    assert err.value.field_name == "model.family"


def test_stage_worker_times_each_call_kind_for_the_schedule_model():
    """K = 2, n = 2, 2 micro-batches, driven by hand; a clock that ticks once per reading makes
    every timed piece exactly 1: the forward and backward lists get one entry per call, the
    optimizer step its own entry (once per batch, in the call that completes the batch)."""
    torch.manual_seed(0)
    stages = [Linear(4, 4), Linear(4, 3)]
    workers = []
    for k, module in enumerate(stages):
        stage = InterlockStage(
            k,
            2,
            2,
            "farthest",
            module,
            Linear(4, 3) if k == 0 else None,
            F.cross_entropy,
            lambda params: torch.optim.SGD(params, lr=0.1),
            micro_batches_per_step=2,
        )
        workers.append(StageWorker(stage, 2, k == 1, None))
        ticks = itertools.count()
        workers[-1].clock = lambda ticks=ticks: next(ticks)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    for mb in range(2):
        h, _ = workers[0].forward(0, mb, x, y)
        _, early = workers[1].forward(0, mb, h, y)
        assert workers[0].backward(0, mb, early) == {}
    assert [w.steps_done for w in workers] == [1, 1]
    assert {k: v for k, v in workers[0].call_s.items() if v} == {"forward": [1, 1], "backward": [1, 1], "step": [1]}
    assert {k: v for k, v in workers[1].call_s.items() if v} == {"forward": [1, 1], "step": [1]}
    assert workers[1].timing()["median_call_s"]["backward"] is None
