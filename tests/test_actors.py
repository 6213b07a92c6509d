"""The actor layer: a strategy that fails mid-run releases every actor and the next strategy of
the run starts; one model scores the same through every strategy's evaluation path."""

import re
import threading
import time

import psutil
import pytest
import ray
import torch

from raylowcomm.actors import DriverFetches, Node
from raylowcomm.common.batches import Source
from raylowcomm.common.ledger import Ledger
from raylowcomm.core.interlock.splitting import split_hf_decoder, split_timm_cnn
from raylowcomm.models import channels_last, state_dict_of
from raylowcomm.runner import prepare, run
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.interlocking import evaluate_chained, final_head_metrics
from raylowcomm.strategies.interlocking.stage import StageActor
from raylowcomm.strategies.lofi import LofiNode
from raylowcomm.strategies.spsa import Spsa, SpsaNode
from raylowcomm.tasks import CausalLM, make_task, score_sets

ACTOR_CLASS = {"lofi": "LofiNode", "spsa": "SpsaNode", "interlocking": "StageActor"}


def small_config(strategies, **top):
    return from_dict(
        {
            "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "max_steps": 3},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": strategies,
            "log_every": 1000,
            "spsa": {"verify_every": 100},
            "interlocking": {"stages": 2, "micro_batches": 2, "aux_widths": [8]},
            **top,
        }
    )


def actor_processes(cls: str) -> list[int]:
    """Live Ray worker processes of an actor class (Ray titles them ray::<Class>[.<method>]), of this test
    session's own Ray only: descendants of the test process, which started Ray (driver → raylet → worker),
    so another run on the machine is never counted, let alone killed."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd, status = " ".join(proc.cmdline()), proc.status()
        except psutil.Error:  # exited meanwhile
            continue
        if f"ray::{cls}" in cmd and status != psutil.STATUS_ZOMBIE:  # a zombie has exited: its parent reaps it late
            found.append(proc.pid)
    return found


def wait_until_gone(cls: str, timeout: float = 30.0) -> list[int]:
    deadline = time.time() + timeout
    while actor_processes(cls) and time.time() < deadline:
        time.sleep(0.2)
    return actor_processes(cls)


def live_groups() -> dict[str, dict]:
    """Placement groups not removed (an earlier test's removal may still be under way: wait a little)."""
    deadline = time.time() + 10
    while True:
        live = {k: v for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
        if not live or time.time() > deadline:
            return live
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "failing, following",
    [
        ("lofi", "spsa"),
        pytest.param("spsa", "interlocking", marks=pytest.mark.heavy),
        pytest.param("interlocking", "lofi", marks=pytest.mark.heavy),
    ],
)  # every strategy's actors are a NodeGroup's: one pair in CI (interlocking failing mid-run: the dead stage's test)
def test_a_strategy_failing_mid_run_releases_its_actors_and_the_next_one_runs(
    ray_session, tmp_path, failing, following
):
    cpus = ray.available_resources().get("CPU", 0)
    # reports from the strategy's own thread; the live view's thread reports too, and its failure is only logged
    seen = {}

    def progress(name, metrics):
        if threading.current_thread() is threading.main_thread():
            seen[name] = seen.get(name, 0) + 1
        if name == failing:
            assert actor_processes(ACTOR_CLASS[failing]), "the failure must come while the strategy's actors are alive"
            raise RuntimeError(f"injected failure in {name} at step {metrics['step']}")

    records = run(small_config([failing, following]), tmp_path, progress=progress)
    assert records[0]["strategy"] == failing and "injected failure" in records[0].get("error", ""), records[0]
    assert records[1]["strategy"] == following and "error" not in records[1] and "id_accuracy" in records[1]["metrics"]
    assert seen[failing] == 1 and seen[following] >= 1
    assert wait_until_gone(ACTOR_CLASS[failing]) == [], f"{failing}'s actors outlived its failure"
    assert live_groups() == {}, "a placement group outlived its run"
    deadline = (
        time.time() + 30
    )  # an earlier test's killed actors may still be freeing theirs: at least as many as before
    while ray.available_resources().get("CPU", 0) < cpus and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= cpus, "every CPU the run took is free again"


@pytest.mark.slow
def test_ctrl_c_mid_run_releases_the_actors(ray_session, tmp_path):
    def progress(name, metrics):
        raise KeyboardInterrupt  # what Ctrl-C raises in the driver

    with pytest.raises(KeyboardInterrupt):
        run(small_config(["lofi", "spsa"]), tmp_path, progress=progress)
    assert wait_until_gone("LofiNode") == [] and live_groups() == {}


def test_every_evaluation_path_scores_a_model_the_same(ray_session, tmp_path):
    """The driver (lo-fi's average), a lo-fi node, an SPSA node, a DDP worker's Node and the
    interlocking chain of one stage all score one model through tasks: identical metrics, each path
    computing as the others do. oneDNN picks a convolution's kernel, and so its rounding, by the
    thread count and the memory format (on an AVX2-only CPU contiguous and channels_last scores
    differed in the 9th digit; one thread and two differ on a 5-row batch's 1x1 convolution), so
    every path here runs nodes.cpus threads, as `runtime.setup_threads` gives every node process
    (the driver's scoring in this process, once the DDP worker's Node has set them), in the layout
    SPSA's nodes always keep (model.memory_format contiguous)."""
    cfg = small_config(["lofi"])
    cfg.model.memory_format = "contiguous"
    ctx = prepare(cfg, tmp_path)
    assert not channels_last(ctx.spec, "cpu"), "every path computes in torch's contiguous layout"
    sets = ctx.eval_sets(val=False)
    weights = state_dict_of(ctx.load_driver_weights().eval())
    threads = torch.get_num_threads()
    try:
        node = Node(0, cfg, ctx.spec, ctx.data.task, weights)  # what a DDP worker runs, on a node's threads
        expected = score_sets(make_task(ctx.data.task), ctx.load_driver_weights(), sets, cfg.eval_rows)
        assert node.evaluate([sets]) == expected
    finally:
        torch.set_num_threads(threads)
    assert {
        "id_accuracy",
        "id_loss",
        "shift_accuracy",
        "shift_loss",
        "shift/uci_digits_accuracy",
        "shift/uci_digits_loss",
    } == expected.keys()
    sets_ref = ray.put(sets)

    lofi = LofiNode.remote(0, ctx.spec, ctx.data.task, weights, ctx.data.train, cfg, ctx.storage)
    spsa = SpsaNode.remote(
        1, ctx.spec, ctx.data.task, ctx.data.train, 2, cfg, Spsa.opts(cfg), ctx.storage, weights=weights
    )
    try:
        assert ray.get(lofi.evaluate.remote([sets_ref])) == expected
        assert ray.get(spsa.evaluate.remote([sets_ref])) == expected
    finally:
        ray.kill(lofi)
        ray.kill(spsa)

    stage = StageActor.remote(cfg.nodes.cpus, 0)
    try:
        [module] = split_timm_cnn(ctx.load_driver_weights(), 1)
        source = Source(
            "image", ctx.data.train.load_all(), sets, cfg.optim.batch_size, cfg.seed, cfg.data.image_size, cfg.eval_rows
        )
        load = (0, 1, 1, "farthest", (module, None), "cross_entropy", cfg.optim, 1, source)
        ray.get(stage.load.remote(*load, spec=ctx.spec))  # placed as the strategy places a stage's layers
        per_set, sent = evaluate_chained([stage], sets, cfg.eval_rows, DriverFetches(Ledger()), "cross_entropy")
    finally:
        ray.kill(stage)
    assert sent == 0 and final_head_metrics(per_set) == expected


def test_the_chain_of_one_decoder_stage_scores_what_the_causal_lm_scores(ray_session):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    train, test = {"input_ids": torch.randint(0, 64, (32, 12))}, {"input_ids": torch.randint(0, 64, (20, 12))}
    # The one stage is the model's own modules in its own order, and the stage actor runs one thread
    # (runtime.setup_threads, 1 CPU): scored here on one thread too, the same kernels on the same batches
    # give the same bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = CausalLM().evaluate(model, test, 8)
    finally:
        torch.set_num_threads(threads)
    stage = StageActor.remote(1, 0)
    try:
        [module] = split_hf_decoder(model, 1)
        source = Source("tokens", train, {"test": test}, 8, 0, eval_batch_size=8)
        ray.get(stage.load.remote(0, 1, 1, "farthest", (module, None), "causal_lm", from_dict({}).optim, 1, source))
        per_set, _ = evaluate_chained([stage], {"test": test}, 8, DriverFetches(Ledger()), "causal_lm")
    finally:
        ray.kill(stage)
    assert per_set["test"][0]["loss"] == expected["loss"]
    assert per_set["test"][0]["perplexity"] == expected["perplexity"]


@pytest.mark.parametrize(
    "change, field, says",
    [
        ({"nodes": {"count": 8, "cpus": 1}}, "nodes.count", "needing 8 CPU in all"),
        ({"nodes": {"count": 2, "cpus": 16}}, "nodes.cpus", "16 each"),
        ({"nodes": {"count": 2, "cpus": 1, "gpus": 1}}, "nodes.gpus", "has no GPU on any node"),
        (
            {"nodes": {"count": 2, "cpus": 1, "resources": {"trainer": 1}}},
            "nodes.resources.trainer",
            "has no trainer on any node",
        ),
        (
            {
                "strategies": ["interlocking"],
                "interlocking": {"stages": 6, "micro_batches": 2, "aux_widths": [8]},
                "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            },  # 6 units: 6 stages split
            "interlocking.stages",
            "6 actors",
        ),
    ],
)
def test_a_run_the_local_cluster_can_never_hold_stops_before_any_actor(ray_session, tmp_path, change, field, says):
    from raylowcomm.config import ConfigError

    raw = {
        "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
        "optim": {"batch_size": 16, "max_steps": 2},
        "strategies": ["lofi"],
        **change,
    }
    with pytest.raises(ConfigError) as err:
        run(from_dict(raw), tmp_path)  # the session's Ray has 4 CPUs, no GPU
    assert err.value.field_name == field and says in str(err.value) and "add nodes" in str(err.value)
    assert not (tmp_path / "results.json").exists()


def test_a_joined_cluster_without_any_gpu_says_so_before_any_actor(ray_session, tmp_path, monkeypatch):
    """On a joined cluster (RAY_ADDRESS) a shortage is waited for, but a GPU run where no node has a GPU stops."""
    from raylowcomm.config import ConfigError

    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    raw = {
        "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
        "optim": {"batch_size": 16, "max_steps": 2},
        "strategies": ["lofi"],
        "nodes": {"count": 2, "cpus": 1, "gpus": 1},
    }
    with pytest.raises(ConfigError, match="has no GPU on any node") as err:
        run(from_dict(raw), tmp_path)
    assert err.value.field_name == "nodes.gpus"


@pytest.mark.slow
def test_a_dead_interlocking_stage_stops_its_run_naming_the_stage_and_the_next_one_runs(ray_session, tmp_path):
    killed = []

    def progress(name, metrics):
        if name == "interlocking" and not killed:
            pid = actor_processes("StageActor")[-1]
            psutil.Process(pid).kill()
            killed.append(pid)

    cfg = small_config(["interlocking", "lofi"])
    cfg.optim.max_steps = 8
    records = run(cfg, tmp_path, progress=progress)
    assert killed
    assert re.search(
        r"ActorDied: interlocking stage [01] \(of 2\) died: each stage holds layers no other has", records[0]["error"]
    ), records[0]
    assert "error" not in records[1] and "id_accuracy" in records[1]["metrics"]
    assert wait_until_gone("StageActor") == []
