"""Nodes load the model themselves (model.source) and weights in bf16 (model.dtype): a driver that
cannot load the weights still runs; every node starts bit-identical, new head included; only a
recipe of a few KB crosses in setup; bf16 replicas stay identical step after step."""

import pytest
import ray
import torch
import transformers
from safetensors.torch import load_file

from raylowcomm.actors import Node, count_tensors
from raylowcomm.common.hashing import parameter_hash
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import ConfigError
from raylowcomm.finetune import ModelRecipe, on_meta
from raylowcomm.models import state_dict_of
from raylowcomm.runner import prepare
from raylowcomm.strategies import Spsa, from_dict

MINILM = {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"}
TEXT = {"name": "rotten_tomatoes", "train_size": 96, "test_size": 16, "max_length": 24, "shift": "none"}


def text_config(strategies=("spsa",), model=None, **spsa):
    return from_dict(
        {
            "model": {**MINILM, **(model or {})},
            "data": TEXT,
            "optim": {"batch_size": 8, "lr": 1e-3},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": list(strategies),
            "log_every": 1000,
            "checkpoint_every": 100,
            "spsa": {"steps": 20, "verify_every": 1, **spsa},
        }
    )


@pytest.fixture
def driver_cannot_load(monkeypatch):
    """This process (the driver) can read config and tokenizer only: loading weights fails here.
    Node actors are other processes, which can."""

    def refuse(*args, **kwargs):
        raise AssertionError("the driver loaded the model's weights")

    for auto in (transformers.AutoModelForSequenceClassification, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("safetensors.torch.load_file", refuse)


# --- no actors ---------------------------------------------------------------------------------------


def test_the_driver_plans_on_the_meta_device_and_falls_back_where_a_host_cannot_read(tmp_path, monkeypatch):
    ctx = prepare(text_config(model={"lora": {"r": 4}, "dtype": "bf16"}), tmp_path)
    assert on_meta(ctx.architecture) and ctx.recipe is not None, "no weight on the driver"
    assert count_tensors(ctx.recipe) == 0 and payload_nbytes(ctx.recipe) < 4096
    base = {p.dtype for p in ctx.architecture.parameters() if not p.requires_grad}
    trained = {p.dtype for p in ctx.architecture.parameters() if p.requires_grad}
    assert base == {torch.bfloat16} and trained == {torch.float32}, "a bf16 base under fp32 adapters and head"
    monkeypatch.setattr("raylowcomm.strategies.base.hosts_without", lambda check: ["10.77.0.2"])
    what, weights = ctx.initial_model()  # auto, and one host cannot read the weights: the driver sends them
    assert what == "initial_weights" and ctx.held.source == "driver"
    assert weights.keys() == set(ctx.architecture.state_dict()) and not on_meta(ctx.load_driver_weights())


def test_who_must_hold_the_weights_and_what_bf16_cannot_train_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.source.*interlocking splits"):
        from_dict(
            {
                "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False, "source": "nodes"},
                "strategies": ["interlocking"],
            }
        )
    with pytest.raises(ConfigError, match="model.dtype.*lofi.*needs fp32"):
        from_dict({"model": {**MINILM, "dtype": "bf16"}, "strategies": ["spsa", "lofi"]})
    tiny = {"name": "test_efficientnet", "family": "timm", "pretrained": False, "source": "nodes"}
    with pytest.raises(ConfigError, match="model.source.*one compressed average is decoded on the driver"):
        from_dict({"model": tiny, "strategies": ["lofi"], "lofi": {"compress": "int4"}})
    # after peer rounds the nodes hold the average (node 0 saves it), the outer step included: no driver weights
    from_dict(
        {
            "model": tiny,
            "strategies": ["lofi"],
            "lofi": {"compress": "int4", "average_every": 8, "outer_optimizer": "nesterov"},
        }
    )
    merged = text_config(model={"lora": {"r": 4}, "merge": True})  # auto: the driver merges, so it loads
    assert not on_meta(prepare(merged, tmp_path).architecture)


def test_a_hugging_face_model_from_scratch_is_its_config_with_the_overrides_drawn_from_the_seed(tmp_path):
    """pretrained: false draws the architecture (with config_overrides) from the run's seed: the driver
    and a node's recipe hold the same bits, another seed other bits; the overrides are refused with
    the pretrained weights or naming a field the config does not have."""
    small = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}

    def cfg(seed=0, **model):
        return from_dict(
            {
                "model": {"name": "SmolLM2-135M", "family": "hf_causal_lm", "pretrained": False, **model},
                "data": {"name": "hamlet", "max_length": 16, "train_size": 8, "test_size": 4},
                "optim": {"batch_size": 4},
                "strategies": ["interlocking"],
                "seed": seed,
            }
        )

    ctx = prepare(cfg(config_overrides=small), tmp_path)
    model = ctx.load_driver_weights()
    assert {k: getattr(model.config, k) for k in small} == small and len(model.model.layers) == 2
    named = lambda m: list(m.state_dict().items())  # noqa: E731
    on_node = ModelRecipe(ctx.cfg.model, None, ctx.cfg.seed).load()
    assert parameter_hash(named(on_node)) == parameter_hash(named(model))
    other = prepare(cfg(seed=1, config_overrides=small), tmp_path / "other").load_driver_weights()
    assert parameter_hash(named(other)) != parameter_hash(named(model))
    with pytest.raises(ConfigError, match="model.config_overrides.*model.pretrained: false"):
        cfg(config_overrides=small, pretrained=True)
    with pytest.raises(ConfigError, match="model.config_overrides.no_such_field.*not a field of LlamaConfig"):
        prepare(cfg(config_overrides={"no_such_field": 1}), tmp_path / "bad")


# --- Ray ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_node_starts_bit_identical_new_head_included(ray_session, tmp_path):
    """Two nodes load MiniLM with a new classification head from the recipe; a third gets the
    driver's loaded weights through the object store: one hash, the driver's own."""
    ctx = prepare(text_config(), tmp_path)
    recipe = ModelRecipe(ctx.cfg.model, 2, ctx.cfg.seed)
    assert recipe == ctx.recipe
    driver = parameter_hash(list(ctx.load_driver_weights().named_parameters()))  # loads here, for the comparison
    actor = ray.remote(num_cpus=0.5)(Node)
    nodes = [actor.remote(k, ctx.cfg, ctx.spec, ctx.data.task, recipe) for k in range(2)]
    nodes.append(actor.remote(2, ctx.cfg, ctx.spec, ctx.data.task, state_dict_of(ctx.load_driver_weights())))
    try:
        hashes = ray.get([n.hash.remote() for n in nodes])
    finally:
        for n in nodes:
            ray.kill(n)
    assert hashes == [driver] * 3
    head = ctx.load_driver_weights().classifier.weight
    assert head.abs().sum() > 0 and not torch.equal(head, torch.zeros_like(head)), "a drawn head, not zeros"


@pytest.mark.slow
def test_bf16_lora_spsa_trains_on_nodes_the_driver_cannot_load_for(ray_session, tmp_path, driver_cannot_load):
    """SPSA on r=4 adapters over a bf16 MiniLM base, 20 steps, the driver never loading a weight:
    the replicas' hashes agree after every step, setup carries a recipe and no weight tensor, and
    the adapter saved is fp32."""
    ctx = prepare(text_config(model={"lora": {"r": 4, "alpha": 8}, "dtype": "bf16"}), tmp_path)
    rec = Spsa().run(ctx).to_dict()
    assert "error" not in rec and on_meta(ctx.architecture)
    verified = rec["details"]["verified"]
    assert [v["step"] for v in verified if v["step"] > 0] == list(range(1, 21))
    assert all(v["nodes"] == [0, 1] for v in verified), "every check saw both replicas agree"
    assert len({v["hash"] for v in verified}) >= 20, "the adapters moved every step"
    setup = {k: v for k, v in rec["comm"]["by_kind"].items() if k.startswith("setup/")}
    assert setup.keys() == {"setup/model_recipe", "setup/data_recipe", "setup/eval_sets"}
    assert setup["setup/model_recipe"] == 2 * payload_nbytes(ctx.recipe) < 4096
    weight_bytes = sum(p.numel() * p.element_size() for p in ctx.architecture.parameters())
    assert rec["comm"]["by_phase"]["setup"] < weight_bytes / 10, "no weight crossed in setup"
    adapter = load_file(str(tmp_path / "spsa" / "adapter" / "adapter_model.safetensors"))
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}


@pytest.mark.slow
def test_spsa_on_bf16_weights_keeps_replicas_bit_identical(ray_session, tmp_path):
    """Full SPSA on bf16 weights (MeZO's low-precision setting): 20 steps, every replica's hash
    equal after each; the result is bf16."""
    cfg = from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False, "dtype": "bf16"},
            "data": {"name": "mnist", "train_size": 320, "test_size": 100, "image_size": 16, "shift": "none"},
            "optim": {"lr": 0.01, "batch_size": 16},
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["spsa"],
            "log_every": 1000,
            "checkpoint_every": 100,
            "spsa": {"steps": 20, "verify_every": 1, "eps": 0.01},
        }
    )
    ctx = prepare(cfg, tmp_path)
    rec = Spsa().run(ctx).to_dict()
    verified = rec["details"]["verified"]
    assert [v["step"] for v in verified if v["step"] > 0] == list(range(1, 21))
    assert all(v["nodes"] == [0, 1] for v in verified)
    assert len({v["hash"] for v in verified}) > 10, "bf16 steps still move the weights"
    saved = load_file(rec["weights"])
    assert {v.dtype for k, v in saved.items() if v.is_floating_point()} == {torch.bfloat16}


@pytest.mark.slow
def test_lofi_lora_average_is_merged_and_saved_on_a_node_when_the_driver_holds_no_base(
    ray_session, tmp_path, driver_cannot_load
):
    """lo-fi with adapters on a bf16 base, the driver never loading a weight: node 0 merges the exact
    average on its base and writes model.safetensors itself; the driver only relays adapters."""
    from raylowcomm.strategies import Lofi

    cfg = text_config(["lofi"], model={"lora": {"r": 4, "alpha": 8}, "dtype": "bf16"})
    cfg.data.train_size, cfg.optim.max_steps = 32, 2
    ctx = prepare(cfg, tmp_path)
    rec = Lofi().run(ctx).to_dict()
    assert "error" not in rec and on_meta(ctx.architecture)
    kinds = rec["comm"]["by_kind"]
    assert kinds["final/adapters_to_save"] == kinds["final/adapters_to_score"] == kinds["final/node_adapters"]
    saved = load_file(rec["weights"])
    plain = {k for k, _ in ctx.architecture.state_dict().items() if ".lora_" not in k and "original_module" not in k}
    assert len(saved) == len(plain) and saved["classifier.weight"].dtype == torch.float32
    assert saved["bert.encoder.layer.0.attention.self.query.weight"].dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.heavy  # CI has DDP over LoRA adapters (test_ddp) and bf16 bases under SPSA and lo-fi (above)
def test_ddp_lora_on_a_bf16_base_keeps_both_ranks_identical_over_8_steps(ray_session, tmp_path):
    """DDP over adapters on a bf16 MiniLM base, each rank loading the base itself: 8 steps of
    all-reduced fp32 adapter gradients leave both ranks with one parameter hash."""
    from raylowcomm.strategies import Ddp

    cfg = text_config(["ddp"], model={"lora": {"r": 4, "alpha": 8}, "dtype": "bf16"})
    cfg.data.train_size, cfg.optim.batch_size, cfg.optim.max_steps = 32, 2, 8
    ctx = prepare(cfg, tmp_path)
    rec = Ddp().run(ctx).to_dict()
    assert "error" not in rec and rec["details"]["steps_per_worker"] == 8
    hashes = [w["final_hash"] for w in rec["nodes"]]
    assert len(hashes) == 2 and len(set(hashes)) == 1
    assert hashes[0] != parameter_hash(list(ctx.load_driver_weights().named_parameters())), "the adapters trained"
    assert rec["comm"]["by_kind"]["setup/model_recipe"] == 2 * payload_nbytes(ctx.recipe)


def test_a_model_at_a_storage_uri_is_copied_by_whoever_loads_it(tmp_path, monkeypatch):
    """model.path as a storage URI: the driver copies config and tokenizer only (it plans on the meta
    device), a node copies the weights too, once into its cache, and loads the same weights as the folder;
    a URI holding nothing is a one-line error naming model.path."""
    from raylowcomm import models

    folder = tmp_path / "minilm"
    models.load_base(models.ModelConfig(**MINILM), 2, 0)[0].save_pretrained(folder)
    models.load_base(models.ModelConfig(**MINILM), 2, 0)[2].save_pretrained(folder)
    monkeypatch.setattr(models, "MODEL_CACHE", tmp_path / "cache")
    uri = f"file://{folder}"
    cfg = models.ModelConfig(family="hf_classifier", path=uri)
    meta, _, _ = models.load_base(cfg, 2, 0, meta=True)
    copied = {p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    assert on_meta(meta) and "config.json" in copied and not {n for n in copied if n.endswith(".safetensors")}
    assert models.weights_readable(cfg) and not models.weights_readable(models.ModelConfig(path=f"{uri}-gone"))
    model, _, _ = models.load_base(cfg, 2, 0)
    local, _, _ = models.load_base(models.ModelConfig(family="hf_classifier", path=str(folder)), 2, 0)
    assert parameter_hash(list(model.named_parameters())) == parameter_hash(list(local.named_parameters()))
    with pytest.raises(ConfigError, match="model.path.*nothing is at this URI"):
        models.load_base(models.ModelConfig(family="hf_classifier", path=f"{uri}-gone"), 2, 0)
