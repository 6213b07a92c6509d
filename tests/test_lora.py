"""LoRA core (raylowcomm.lora) on the real MiniLM and SmolLM2: frozen base, what a node sends,
the exact average of the nodes' adapters against an independent computation, rebuilding on an
actor, averaging rounds, saving."""

import copy
import dataclasses

import pytest
import torch

from raylowcomm import lora
from raylowcomm.config import ConfigError, LoraConfig, ModelConfig, RunConfig, build_dataclass, validate_lora
from raylowcomm.finetune import build_model, load_pretrained
from raylowcomm.models import state_dict_of
from raylowcomm.tasks import PromptClassification
from tests.conftest import trainable_nbytes

A_SUFFIX, B_SUFFIX = ".lora_A.default.weight", ".lora_B.default.weight"
SCALE = 16 / 8  # LoraConfig defaults: alpha / r
MINILM = ModelConfig(name="all-MiniLM-L6-v2", family="hf_classifier", lora=LoraConfig())


def nbytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors on shared CPUs: one thread is several times faster than two fighting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def minilm():
    model, spec, _ = load_pretrained(MINILM, 2, seed=0)
    return model.eval(), spec


def batch(seed, n=4, length=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (n, length), generator=gen)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 2, (n,), generator=gen),
    }


def logits(model, seed=99):
    inputs = {k: v for k, v in batch(seed).items() if k != "labels"}
    with torch.no_grad():
        return model.eval()(**inputs).logits


def perturbed(state, seed, noise=0.05):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def with_state(model, trainable):
    """A copy of `model` (a node) holding these adapters and head."""
    node = copy.deepcopy(model)
    node.load_state_dict(trainable, strict=False)
    return node


@pytest.fixture(scope="module")
def node_states(minilm):
    """What 3 nodes send after learning something of their own: their adapters and head moved by
    seeded noise, then 2 SGD steps on their own random tokens (one working copy, reloaded per node)."""
    model, _ = minilm
    start, work, states = lora.trainable_state(model), copy.deepcopy(model).train(), []
    opt = torch.optim.SGD([p for p in work.parameters() if p.requires_grad], lr=0.1)
    for node in range(3):
        work.load_state_dict(perturbed(start, 1000 + node), strict=False)
        for step in range(2):
            work(**batch(100 * node + step)).loss.backward()
            opt.step()
            opt.zero_grad()
        states.append(lora.trainable_state(work))
    return states


def manual_average(base, states, weights):
    """base + Σ w_k·scale·B_k·A_k, heads averaged, in plain float32 torch, by key names alone."""
    w = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    expected = {}
    for key in (k for k in states[0] if k.endswith(A_SUFFIX)):
        layer = key[: -len(A_SUFFIX)]
        plain = layer.removeprefix("base_model.model.") + ".weight"
        deltas = [SCALE * s[layer + B_SUFFIX] @ s[key] for s in states]
        expected[plain] = base[layer + ".base_layer.weight"] + sum(float(wk) * d for wk, d in zip(w, deltas))
    for key in (k for k in states[0] if ".modules_to_save.default." in k):
        plain = key.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
        expected[plain] = sum(float(wk) * s[key] for wk, s in zip(w, states))
    return expected


def stacked_adapter_model(spec, base, states, weights):
    """The averaged model computed WITHOUT merging: one PEFT model whose rank-N·r adapter stacks the
    nodes' factors (A = [A_1; …; A_N], B = [w_1·B_1 … w_N·B_N], same alpha/r), head averaged."""
    n, cfg = len(states), spec.lora
    wide = build_model(dataclasses.replace(spec, lora=dataclasses.replace(cfg, r=cfg.r * n, alpha=cfg.alpha * n)))
    wide = wide.to(next(v.dtype for v in states[0].values() if v.is_floating_point()))
    w = [x / sum(weights) for x in weights]
    state = {k: v for k, v in base.items() if ".lora_" not in k}
    for key in (k for k in states[0] if k.endswith(A_SUFFIX)):
        layer = key[: -len(A_SUFFIX)]
        state[key] = torch.cat([s[key] for s in states])
        state[layer + B_SUFFIX] = torch.cat([wk * s[layer + B_SUFFIX] for wk, s in zip(w, states)], dim=1)
    for key in (k for k in states[0] if ".modules_to_save.default." in k):
        state[key] = sum(wk * s[key] for wk, s in zip(w, states))
    wide.load_state_dict(state)
    return wide


def plain_model(spec, state):
    model = build_model(dataclasses.replace(spec, lora=None)).to(
        next(v.dtype for v in state.values() if v.is_floating_point())
    )
    model.load_state_dict(state)
    return model


U32 = 2.0**-24  # float32's unit roundoff (round to nearest): |fl(x) − x| ≤ u·|x| in the normal range


def merge_error_bound(base, states, weights, r, layers_of=A_SUFFIX):
    """Per plain key, how far a float32 merge (manual_average, or PEFT's merge_and_unload: B·A as a float32
    matmul of r terms, times scale, times w_k, summed over N nodes, added to W0) may be from average_delta's
    (float64, rounded once). With T = Σ_k w_k·scale·|B_k|·|A_k| (float64, on absolute values): the matmul errs
    by γ_r·|B||A| ≤ (r + 1)u·|B||A|, the scale, the weight and the N additions by one u each on terms ≤ T,
    adding W0 by u·(|W0| + T); average_delta rounds once, u·(|W0| + T). In all ≤ u·((r + N + 5)·T + 2|W0|).
    A head's mean: N + 3 roundings of terms ≤ Σ_k w_k·|h_k|."""
    w = [x / sum(weights) for x in weights]
    n, out = len(states), {}
    for key in (k for k in states[0] if k.endswith(A_SUFFIX)):
        layer = key[: -len(A_SUFFIX)]
        plain = layer.removeprefix("base_model.model.") + ".weight"
        w0 = base[layer + ".base_layer.weight"].double()
        t = sum(
            wk * SCALE * (s[layer + B_SUFFIX].double().flatten(1).abs() @ s[key].double().flatten(1).abs())
            for wk, s in zip(w, states)
        ).view(w0.shape)
        out[plain] = U32 * ((r + n + 5) * t + 2 * w0.abs()) + 2.0**-146
    for key in (k for k in states[0] if ".modules_to_save.default." in k):
        plain = key.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
        out[plain] = U32 * (n + 3) * sum(wk * s[key].double().abs() for wk, s in zip(w, states)) + 2.0**-146
    return out


def assert_within(got, want, bound, what=""):
    for key, value in want.items():
        excess = (got[key].double() - value.double()).abs() - bound[key]
        assert excess.max() <= 0, f"{what}{key}: {excess.max().item():.3g} beyond the bound"


def plain_keys(spec):
    with torch.device("meta"):
        return build_model(dataclasses.replace(spec, lora=None)).state_dict().keys()


# --- frozen base, small payload, same start everywhere ------------------------------------------


def test_base_frozen_adapters_and_head_trainable(minilm):
    model, _ = minilm
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(A_SUFFIX in n or B_SUFFIX in n or ".modules_to_save.default." in n for n in trainable)
    assert {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    } <= trainable
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert (
        any(".base_layer." in n for n in frozen) and "base_model.model.bert.embeddings.word_embeddings.weight" in frozen
    )
    assert len(lora.lora_layers(model)) == 12  # query and value (peft's BERT default) in 6 layers
    with model.disable_adapter():  # B = 0 at the start: the adapted model is exactly its base
        base_logits = logits(model)
    assert torch.equal(logits(model), base_logits)


def test_trainable_state_is_small_and_counts_what_ddp_reduces(minilm):
    model, _ = minilm
    sent, full = lora.trainable_state(model), state_dict_of(model)
    adapters = 12 * 8 * (384 + 384) * 4
    head = (384 * 2 + 2) * 4
    print(
        f"\nMiniLM r=8: full state {nbytes(full):,} B, LoRA state {nbytes(sent):,} B "
        f"({nbytes(sent) / nbytes(full):.2%})"
    )
    assert nbytes(sent) == trainable_nbytes(model) == adapters + head
    assert nbytes(sent) <= 0.03 * nbytes(full)
    assert all(v.device.type == "cpu" and v.is_contiguous() for v in sent.values())
    node = copy.deepcopy(model).train()
    node(**batch(7)).loss.backward()  # only these gradients exist, so only these are all-reduced
    assert (
        sum(p.grad.numel() * p.grad.element_size() for p in node.parameters() if p.grad is not None) == adapters + head
    )
    before = lora.trainable_state(node)
    name, param = next((n, p) for n, p in node.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param.add_(1.0)
    assert torch.equal(before[name], lora.trainable_state(model)[name])  # a copy: later steps do not change it


def test_same_seed_same_start_and_actor_rebuild_is_exact(minilm, node_states):
    model, spec = minilm
    again, _, _ = load_pretrained(MINILM, 2, seed=0)
    other, _, _ = load_pretrained(MINILM, 2, seed=1)
    ours, theirs = lora.trainable_state(model), lora.trainable_state(again)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # head and A drawn from the seed
    first_a = lora.lora_layers(model)[0].a
    assert not torch.equal(ours[first_a], lora.trainable_state(other)[first_a])
    trained = with_state(model, node_states[0])
    rebuilt = build_model(spec)  # what an actor does with the spec and the shipped state dict
    rebuilt.load_state_dict(state_dict_of(trained))
    want, got = state_dict_of(trained), state_dict_of(rebuilt)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(".lora_B." in k and want[k].abs().sum() > 0 for k in want)  # adapters really trained
    assert torch.equal(logits(trained), logits(rebuilt))
    assert {n for n, p in rebuilt.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }


# --- averaging ---------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[1, 1], [1, 2, 3]])
def test_average_delta_is_the_exact_average(minilm, node_states, weights):
    model, spec = minilm
    base, states, layers = state_dict_of(model), node_states[: len(weights)], lora.lora_layers(model)
    merged = lora.average_delta(base, states, layers, weights)
    assert merged.keys() == plain_keys(spec)
    expected = manual_average(base, states, weights)
    assert len(expected) == 12 + 2
    assert_within(merged, expected, merge_error_bound(base, states, weights, r=8))
    moved = max((merged[layer.plain] - base[layer.base]).abs().max().item() for layer in layers)
    assert moved > 1e-2  # the adapters changed the weights far more than the tolerance
    untouched = "bert.encoder.layer.0.attention.self.key.weight"
    assert torch.equal(merged[untouched], base["base_model.model." + untouched])
    # the merged model computes what the nodes' averaged adapters compute unmerged: both in float64 (merged
    # without a float32 rounding), where the two orders of W0·x + scale·Σ_k w_k·B_k·(A_k·x) differ by float64
    # rounding alone, ~2^-53 relative per operation: 1e-9 on logits of magnitude < 1 leaves a factor of
    # 10^5 for the 6 layers to amplify it (observed: 2e-16; the float32 models differ by 1e-7)
    base64 = {k: v.double() for k, v in base.items()}
    states64 = [{k: v.double() for k, v in state.items()} for state in states]
    merged64 = lora.average_delta(base64, states64, layers, weights)
    torch.testing.assert_close(
        logits(plain_model(spec, merged64)),
        logits(stacked_adapter_model(spec, base64, states64, weights)),
        atol=1e-9,
        rtol=0,
    )


def test_a_node_computes_the_merged_average_in_place_and_is_put_back(minilm, node_states):
    """What a node scores the average with instead of a second model: its own PEFT model computing the
    merged weights (swapped in, adapters scaled to 0) gives the plain merged model's logits, and after the
    block every tensor and the adapters are its own again."""
    model, spec = minilm
    node = with_state(model, node_states[0])
    before, own = {k: v.clone() for k, v in node.state_dict().items()}, logits(node)
    merged = lora.average_delta(state_dict_of(node), node_states, lora.lora_layers(node))
    with lora.computing(node, merged) as same:
        assert same is node
        inside = logits(node)
    # the merged tensors are the plain model's, and the adapters add exactly 0 (scaled by 0): the same bits
    assert torch.equal(inside, logits(plain_model(spec, merged)))
    assert (inside - own).abs().max() > 1e-3  # the average, not the node's own model
    assert torch.equal(logits(node), own)
    assert all(torch.equal(v, before[k]) for k, v in node.state_dict().items())
    with pytest.raises(KeyError, match="none of"):  # a state without the head: refused before anything moves
        with lora.computing(node, {k: v for k, v in merged.items() if not k.startswith("classifier.")}):
            pass
    assert torch.equal(logits(node), own)


def test_single_node_average_is_peft_merge(minilm, node_states):
    model, _ = minilm
    merged = lora.average_delta(state_dict_of(model), node_states[:1], lora.lora_layers(model))
    reference = with_state(model, node_states[0]).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    bound = merge_error_bound(state_dict_of(model), node_states[:1], [1], r=8)  # PEFT merges in float32
    assert_within(merged, {k: v for k, v in reference.items() if k in bound}, bound)
    assert all(torch.equal(merged[k], reference[k]) for k in reference if k not in bound)  # untouched: the base


def test_factor_average_differs_unless_the_factors_agree(minilm, node_states):
    model, _ = minilm
    base, layers, states = state_dict_of(model), lora.lora_layers(model), node_states
    exact = lora.average_delta(base, states, layers)
    fedavg = lora.average_delta(base, [lora.average_factors(states)], layers)
    for layer in layers:
        change = (exact[layer.plain] - base[layer.base]).norm()
        gap = (exact[layer.plain] - fedavg[layer.plain]).norm()
        assert gap > 0.1 * change, layer.plain  # mean(B)·mean(A) ≠ mean(B·A)
    head = "classifier.weight"
    assert torch.equal(exact[head], fedavg[head])  # heads are averaged plainly either way: the same _mean
    same = [states[0]] * 3
    agree_exact = lora.average_delta(base, same, layers)
    agree_fedavg = lora.average_delta(base, [lora.average_factors(same)], layers)
    # three equal factors average, in float64 within 3·2^-53 relative, to a value that rounds back to the
    # factor itself; the two merges then differ only in float64 (Σ_k ⅓·B·A against B·A), so each rounds to
    # float32 at most one rounding apart: |a − b| ≤ u·(|a| + |b|)
    for key in agree_exact:
        a, b = agree_exact[key].double(), agree_fedavg[key].double()
        assert ((a - b).abs() <= U32 * (a.abs() + b.abs()) + 2.0**-146).all(), key


def test_averaging_rejects_mismatched_inputs(minilm):
    model, _ = minilm
    state = lora.trainable_state(model)
    with pytest.raises(ValueError, match="weight"):
        lora.average_factors([state, state], weights=[1.0])
    with pytest.raises(ValueError, match="keys"):
        lora.average_factors([state, {k: v for k, v in list(state.items())[1:]}])


# --- rounds ------------------------------------------------------------------------------------


def test_merge_and_reset_restarts_from_the_exact_average(minilm, node_states):
    model, spec = minilm
    base, layers = state_dict_of(model), lora.lora_layers(model)
    merged = lora.average_delta(base, node_states[:2], layers)
    nodes = [with_state(model, state) for state in node_states[:2]]
    for node in nodes:
        lora.merge_and_reset(node, merged, seed=7)
    first, second = state_dict_of(nodes[0]), state_dict_of(nodes[1])
    assert all(torch.equal(first[k], second[k]) for k in first)  # replicas identical again
    assert all(not first[layer.b].any() for layer in layers)
    assert all(torch.equal(first[layer.base], merged[layer.plain]) for layer in layers)
    assert torch.equal(logits(nodes[0]), logits(plain_model(spec, merged)))  # B = 0: the adapters add exactly 0
    # round 2 averages from the plain merged base
    states = [perturbed(lora.trainable_state(node), 10 + k) for k, node in enumerate(nodes)]
    round2 = lora.average_delta(merged, states, layers)
    manual = manual_average(first, states, [1, 1])
    assert_within(round2, manual, merge_error_bound(first, states, [1, 1], r=8))
    assert all(torch.equal(round2[k], merged[k]) for k in merged if k not in manual)  # untouched: round 1's
    lora.merge_and_reset(nodes[1], merged, seed=8)  # another round's seed: other adapters
    assert not torch.equal(state_dict_of(nodes[1])[layers[0].a], first[layers[0].a])
    with pytest.raises(ValueError, match="merged state"):
        lora.merge_and_reset(nodes[0], {k: v for k, v in list(merged.items())[1:]}, seed=7)


# --- saving ------------------------------------------------------------------------------------


def test_save_adapter_and_merged(minilm, node_states, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    model, spec = minilm
    node = with_state(model, node_states[0])
    adapter_dir = lora.save_lora(node, spec, tmp_path / "adapter", merge=False)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter_dir.iterdir()}
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size < 0.03 * 90_000_000
    pretrained = lora.average_delta(state_dict_of(model), [lora.trainable_state(model)], lora.lora_layers(model))
    reloaded = PeftModel.from_pretrained(plain_model(spec, pretrained), str(adapter_dir))
    assert torch.equal(logits(reloaded), logits(node))  # the same weights in the same modules: the same bits
    merged_dir = lora.save_lora(state_dict_of(node), spec, tmp_path / "merged", merge=True)
    # the merged model is PEFT's merge of the node, bit for bit (that PEFT's merge is the node's model, to
    # float32 rounding, test_single_node_average_is_peft_merge bounds)
    saved = AutoModelForSequenceClassification.from_pretrained(str(merged_dir)).state_dict()
    peft_merged = copy.deepcopy(node).merge_and_unload().state_dict()
    assert saved.keys() == peft_merged.keys() and all(torch.equal(saved[k], peft_merged[k]) for k in saved)
    average = lora.average_delta(
        state_dict_of(model), [lora.trainable_state(node), lora.trainable_state(model)], lora.lora_layers(model)
    )
    avg_dir = lora.save_lora(average, spec, tmp_path / "average", merge=True)
    assert torch.equal(  # the same weights, saved and read back: the same bits
        logits(AutoModelForSequenceClassification.from_pretrained(str(avg_dir))), logits(plain_model(spec, average))
    )
    with pytest.raises(ValueError, match="merge=True"):
        lora.save_lora(average, spec, tmp_path / "nope", merge=False)


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("r", 0), ("alpha", -1.0), ("dropout", 1.0), ("target_modules", [])])
def test_validate_lora_names_the_field(field, value):
    cfg = RunConfig(model=ModelConfig(lora=dataclasses.replace(LoraConfig(), **{field: value})))
    with pytest.raises(ConfigError) as err:
        validate_lora(cfg)
    assert err.value.field_name == f"model.lora.{field}"


def test_config_reads_lora_from_yaml_mapping():
    cfg = build_dataclass(
        ModelConfig, {"family": "hf_classifier", "lora": {"r": 4, "target_modules": ["query"]}, "merge": True}, "model"
    )
    assert cfg.lora == LoraConfig(r=4, target_modules=["query"]) and cfg.merge
    validate_lora(RunConfig(model=cfg))
    assert build_dataclass(ModelConfig, {"lora": {}}, "model").lora == LoraConfig()
    with pytest.raises(ConfigError, match="model.lora"):  # the union hides which key: see the report
        build_dataclass(ModelConfig, {"lora": {"rank": 4}}, "model")
    with pytest.raises(ConfigError) as err:
        validate_lora(RunConfig(model=ModelConfig(merge=True)))
    assert err.value.field_name == "model.merge"


def test_unknown_target_module_is_a_config_error(minilm):
    _, spec = minilm
    with pytest.raises(ConfigError) as err:
        build_model(dataclasses.replace(spec, lora=LoraConfig(target_modules=["no_such_layer"])))
    assert err.value.field_name == "model.lora.target_modules"


# --- other architectures -----------------------------------------------------------------------


def test_smollm2_two_nodes_exact_and_small():
    model, spec, _ = load_pretrained(
        ModelConfig(name="SmolLM2-135M", family="hf_causal_lm", lora=LoraConfig()), None, seed=0
    )
    base, layers = state_dict_of(model), lora.lora_layers(model)
    sent = lora.trainable_state(model)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"\nSmolLM2-135M r=8: full state {nbytes(base):,} B ({unique:,} B without the tied copy), "
        f"LoRA state {nbytes(sent):,} B ({nbytes(sent) / unique:.2%})"
    )
    assert nbytes(sent) == 30 * 8 * ((576 + 576) + (576 + 192)) * 4  # q_proj and v_proj (GQA: 192 outputs); no head
    assert nbytes(sent) <= 0.03 * unique
    states = [perturbed(sent, k) for k in range(2)]
    merged = lora.average_delta(base, states, layers)
    assert_within(merged, manual_average(base, states, [1, 1]), merge_error_bound(base, states, [1, 1], r=8))
    assert merged.keys() == plain_keys(spec)

    # The prompt task reads the adapted LM's hidden states and label-word rows: at B = 0 it scores
    # what the plain model scores, and its loss trains the adapters only.
    plain, _, _ = load_pretrained(ModelConfig(name="SmolLM2-135M", family="hf_causal_lm"), None, seed=0)
    task, g = PromptClassification(), torch.Generator().manual_seed(0)
    prompts = {
        "input_ids": torch.randint(1, 1000, (2, 8), generator=g),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "choice_ids": torch.tensor([[7, 9], [7, 9]]),
        "labels": torch.tensor([0, 1]),
    }
    # the same base weights in the same modules, and at B = 0 the adapters add exactly 0: the same bits
    assert torch.equal(task.forward(model, prompts), task.forward(plain, prompts))
    task.loss(model, prompts).backward()
    grads = {k for k, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert (
        grads
        and grads <= {k for k, p in model.named_parameters() if p.requires_grad}
        and all("lora_" in k for k in grads)
    )


def test_timm_convolutions_merge_like_peft():
    model, spec, _ = load_pretrained(
        ModelConfig(name="efficientnet_lite0", family="timm", lora=LoraConfig()), 10, seed=0
    )
    layers = lora.lora_layers(model)
    assert any(len(layer.shape) == 4 and layer.shape[2:] == (3, 3) for layer in layers)  # a 3×3 conv (conv_stem)
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {
        "base_model.model.classifier.modules_to_save.default.weight"
    }
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    merged = lora.average_delta(state_dict_of(model), [lora.trainable_state(model)], layers)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    r = model.peft_config["default"].r
    bound = merge_error_bound(state_dict_of(model), [lora.trainable_state(model)], [1], r=r)
    assert_within(merged, {k: v for k, v in reference.items() if k in bound}, bound)
    assert all(torch.equal(merged[k], reference[k]) for k in reference if k not in bound)  # untouched: the base
    # the merged plain model computes what the PEFT model computes: in float64 (merged without a float32
    # rounding) the two differ by float64 rounding alone, ~2^-53 relative per operation; 1e-9 leaves 10^5
    x = torch.randn(2, 3, 32, 32, generator=gen)
    model64 = copy.deepcopy(model).double().eval()
    merged64 = lora.average_delta(state_dict_of(model64), [lora.trainable_state(model64)], layers)
    with torch.no_grad():
        torch.testing.assert_close(
            plain_model(spec, merged64).eval()(x.double()), model64(x.double()), atol=1e-9, rtol=0
        )


def test_an_adapter_only_checkpoint_restores_the_trained_model_and_optimizer_on_the_pretrained_base(minilm, tmp_path):
    """What a lo-fi node or DDP rank under LoRA writes (trainable_only) and reads back after a
    restart: the pretrained base plus the checkpoint is the trained model, moments included."""
    from raylowcomm.storage import Storage
    from raylowcomm.training import load_checkpoint, make_optimizer, save_checkpoint

    model, _ = minilm
    optim_cfg = build_dataclass(RunConfig, {"optim": {"name": "adamw", "lr": 1e-2}}, "").optim
    trained = copy.deepcopy(model).train()
    optimizer = make_optimizer(optim_cfg, trained)
    for seed in range(2):
        trained(**batch(seed)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    size = save_checkpoint(Storage(tmp_path), "node.safetensors", trained, optimizer, 2, trainable_only=True)
    assert size < 0.05 * nbytes(state_dict_of(model)), "the frozen base is not written"

    restored = copy.deepcopy(model).train()
    restored_optimizer = make_optimizer(optim_cfg, restored)
    assert load_checkpoint(Storage(tmp_path), "node.safetensors", restored, restored_optimizer)["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), restored.state_dict().values()))
    moments, restored_moments = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    assert moments.keys() == restored_moments.keys()
    assert all(torch.equal(moments[i][k], restored_moments[i][k]) for i in moments for k in ("exp_avg", "exp_avg_sq"))
    for net, opt in ((trained, optimizer), (restored, restored_optimizer)):
        torch.manual_seed(5)  # the same dropout masks
        net(**batch(5)).loss.backward()
        opt.step()
    after, restored_after = lora.trainable_state(trained), lora.trainable_state(restored)
    assert all(torch.equal(after[k], restored_after[k]) for k in after), "the next step is the uninterrupted one"
