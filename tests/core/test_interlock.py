"""Interlocking backprop: splits compose to the model, stage runners reproduce the n-way
gradients of one autograd graph for every n and both rules, messages stay within n - 1 hops."""

import copy
import itertools

import pytest
import timm
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from raylowcomm.core.interlock.heads import (
    PositionSubsetHead,
    SampledLogits,
    causal_lm_loss,
    decoder_aux_heads,
    resnet_aux_heads,
)
from raylowcomm.core.interlock.routing import (
    InterlockStage,
    build_stages,
    message_plan,
    reference_gradients,
    run_interlocked_batch,
    run_pipeline,
    update_heads,
    upstream_heads,
)
from raylowcomm.core.interlock.schedule import batch_calls
from raylowcomm.core.interlock.splitting import (
    balanced_sizes,
    split_hf_decoder,
    split_timm_cnn,
    split_timm_resnet,
    timm_cnn_units,
)

NUM_CLASSES = 5


def tiny_resnet(seed: int = 0, **kwargs) -> torch.nn.Module:
    """timm's test_resnet (BasicBlock and Bottleneck) with random BN affine/stats, so no
    gradient is trivially zero (timm zero-inits each block's last BN)."""
    torch.manual_seed(seed)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=NUM_CLASSES, **kwargs)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            torch.nn.init.uniform_(m.bias, -0.2, 0.2)
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model


def image_batch(n: int = 4, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, NUM_CLASSES, (n,), generator=g)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def token_batch(n: int = 2, length: int = 12, seed: int = 1):
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, -3:] = -100  # right padding
    return ids, labels


def accumulated_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def assert_grads_equal(got: dict, want: dict, what: str, rtol=1e-6, atol=1e-9) -> None:
    assert got.keys() == want.keys(), what
    assert any(g.abs().sum() > 0 for g in want.values()), f"{what}: reference gradient is all zero"
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=rtol, atol=atol), (
            f"{what} {name}: max diff {(got[name] - want[name]).abs().max():.3e}"
        )


def check_messages(trace, stages, n: int) -> None:
    """Every head in a message is at most n - 1 hops from the receiving stage, and each stage
    sends upstream exactly the heads an earlier stage uses."""
    sent: dict[tuple[int, int], set[int]] = {}
    for m in trace.grad_messages:
        assert all(j - (m.src - 1) <= n - 1 for j in m.heads), m
        assert m.nbytes > 0
        sent.setdefault((m.mb_id, m.src), set()).update(m.heads)
    for (_, src), heads in sent.items():
        assert heads == stages[src].sends_upstream()
    for k, stage in enumerate(stages):
        if stage.sends_upstream():
            assert any(src == k for _, src in sent), f"stage {k} never sent"


def no_step_optimizer(params):
    return torch.optim.SGD(params, lr=0.0)


# ----------------------------------------------------------------------------- routing


def test_routing_tables():
    K = 4
    assert [update_heads(k, K, 1, "farthest") for k in range(K)] == [{0}, {1}, {2}, {3}]
    assert [update_heads(k, K, 2, "farthest") for k in range(K)] == [{1}, {2}, {3}, {3}]
    assert [update_heads(k, K, 4, "farthest") for k in range(K)] == [{3}] * 4
    assert [update_heads(k, K, 3, "sum") for k in range(K)] == [{0, 1, 2}, {1, 2, 3}, {2, 3}, {3}]
    # farthest, n = 3: stage 0 uses head 2, stage 1 head 3 -> stage 1 forwards {2}, stage 2 {2, 3}.
    assert [upstream_heads(k, K, 3, "farthest") for k in range(K)] == [set(), {2}, {2, 3}, {3}]
    assert [upstream_heads(k, K, 2, "sum") for k in range(K)] == [set(), {1}, {2}, {3}]
    assert all(not upstream_heads(k, K, 1, r) for k in range(K) for r in ("farthest", "sum"))
    with pytest.raises(ValueError):
        update_heads(0, K, 5, "farthest")
    with pytest.raises(ValueError):
        update_heads(0, K, 2, "nearest")


def test_balanced_sizes():
    assert balanced_sizes([1, 1, 1, 1], 3) == [2, 1, 1]
    assert balanced_sizes([10, 1, 1, 1], 2) == [1, 3]
    assert balanced_sizes([1, 1, 1, 1, 1, 5], 2) == [5, 1]
    assert balanced_sizes([3, 3, 3], 3) == [1, 1, 1]
    with pytest.raises(ValueError):
        balanced_sizes([1, 1], 3)


# ----------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5])
def test_resnet_split_composes_to_model(num_stages):
    model = tiny_resnet().eval()
    x, _ = image_batch()
    stages = split_timm_resnet(model, num_stages)
    assert len(stages) == num_stages
    h = x
    with torch.no_grad():
        for s in stages:
            h = s(h)
        assert torch.equal(h, model(x))  # the model's own modules, the same ops in the same order: the same bits


@pytest.mark.parametrize("balance", ["blocks", "params", [1, 1, 1, 1, 1, 1, 1, 1, 6]])
def test_resnet_split_inside_layers(balance):
    model = tiny_resnet(layers=(2, 2, 2, 2)).eval()  # stem + 8 blocks
    x, _ = image_batch()
    for num_stages in (4, 9):
        stages = split_timm_resnet(model, num_stages, balance)
        h = x
        with torch.no_grad():
            for s in stages:
                h = s(h)
            assert torch.equal(h, model(x))  # the model's own modules, the same ops in the same order
        own = {id(p) for s in stages for p in s.parameters()}
        assert own == {id(p) for p in model.parameters()}  # every parameter in exactly one stage
        assert sum(len(list(s.parameters())) for s in stages) == len(list(model.parameters()))
    with pytest.raises(ValueError):
        split_timm_resnet(model, 10)


def test_efficientnet_split_composes_to_model_and_gets_aux_heads():
    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=NUM_CLASSES).eval()
    x, _ = image_batch()
    units = timm_cnn_units(model)
    for num_stages in (1, 2, 3, units):
        stages = split_timm_cnn(model, num_stages)
        heads = resnet_aux_heads(stages, NUM_CLASSES, (8,))
        h = x
        with torch.no_grad():
            for k, s in enumerate(stages):
                h = s(h)
                if k < num_stages - 1:  # every aux head fits its stage's output
                    assert heads[k].eval()(h).shape == (len(x), NUM_CLASSES)
            assert torch.equal(h, model(x))  # the model's own modules, the same ops in the same order
        assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    with pytest.raises(ValueError):
        split_timm_cnn(model, units + 1)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_decoder_split_composes_to_model(num_stages):
    model = tiny_llama().eval()
    ids, _ = token_batch()
    stages = split_hf_decoder(model, num_stages)
    assert [len(s.layers) for s in stages] == balanced_sizes([1] * 4, num_stages)
    h = ids
    with torch.no_grad():
        for s in stages:
            h = s(h)
        assert torch.equal(h, model(ids).logits)  # the model's own modules, the same ops in the same order


def test_decoder_split_refuses_tied_embeddings():
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied"):
        split_hf_decoder(model, 2)


# ----------------------------------------------------------------------------- gradients


@pytest.fixture
def rmsnorm_in_its_own_dtype(monkeypatch):
    """LlamaRMSNorm computes in float32 even for a float64 model: in its own dtype, for exact comparisons."""
    from transformers.models.llama import modeling_llama

    def in_its_own_dtype(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", in_its_own_dtype)


def interlocked_vs_reference(stages_modules, heads, batch, n, rule, loss_fn, **tol):
    K = len(stages_modules)
    stages = build_stages(stages_modules, heads, n, rule, loss_fn=loss_fn, optimizer_factory=no_step_optimizer)
    trace = run_interlocked_batch(stages, [batch], step=False)
    want_stages, want_heads = reference_gradients(stages_modules, heads, batch, n, rule, loss_fn)
    for k in range(K):
        assert_grads_equal(accumulated_grads(stages_modules[k]), want_stages[k], f"K={K} n={n} {rule} stage {k}", **tol)
    for j in range(K - 1):
        assert_grads_equal(accumulated_grads(heads[j]), want_heads[j], f"K={K} n={n} {rule} head {j}", **tol)
    check_messages(trace, stages, n)
    return trace


RESNET_CASES = [(K, n, rule) for K in (3, 4) for n in range(1, K + 1) for rule in ("farthest", "sum")]


@pytest.mark.parametrize("num_stages,n,rule", RESNET_CASES)
def test_resnet_stage_gradients_match_reference(num_stages, n, rule):
    model = tiny_resnet().double().train()
    modules = split_timm_resnet(model, num_stages)
    heads = [h.double().train() for h in resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))]
    trace = interlocked_vs_reference(modules, heads, image_batch(dtype=torch.float64), n, rule, F.cross_entropy)
    assert len(trace.losses) == num_stages
    if n == 1:
        assert trace.grad_messages == []


@pytest.mark.parametrize("n,rule", [(n, r) for n in (1, 2, 3) for r in ("farthest", "sum")])
def test_decoder_stage_gradients_match_reference(n, rule, rmsnorm_in_its_own_dtype):
    model = tiny_llama().double().train()
    modules = split_hf_decoder(model, 3)
    heads = [h.double() for h in decoder_aux_heads(model, 3, init_from_lm_head=(rule == "sum"))]
    # float64 throughout: the sum rule adds the heads' gradients in another order than the reference, which
    # float64 rounds at 2^-53 relative per addition; the float64 tolerances of assert_grads_equal apply
    interlocked_vs_reference(modules, heads, token_batch(), n, rule, causal_lm_loss)


def test_micro_batches_accumulate_to_full_batch_gradient():
    model = tiny_resnet().double().eval()  # eval BN: micro-batch statistics do not matter
    modules = split_timm_resnet(model, 3)
    heads = [h.double().eval() for h in resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))]
    x, y = image_batch(n=6, dtype=torch.float64)
    for rule in ("farthest", "sum"):
        stages = build_stages(modules, heads, 2, rule, optimizer_factory=no_step_optimizer, micro_batches_per_step=3)
        run_interlocked_batch(stages, [(x[i : i + 2], y[i : i + 2]) for i in (0, 2, 4)], step=False)
        assert all(s.ready_to_step for s in stages)
        want_stages, want_heads = reference_gradients(modules, heads, (x, y), 2, rule)
        for k in range(3):
            assert_grads_equal(accumulated_grads(modules[k]), want_stages[k], f"{rule} stage {k}")
        for j in range(2):
            assert_grads_equal(accumulated_grads(heads[j]), want_heads[j], f"{rule} head {j}")
        for s in stages:
            s.step()  # clears the gradients for the next rule
        assert all(p.grad is None for m in modules for p in m.parameters())


@pytest.mark.parametrize("num_stages", [3, 4])
def test_farthest_full_width_is_end_to_end_backprop(num_stages):
    model = tiny_resnet().train()
    x, y = image_batch()
    F.cross_entropy(model(x), y).backward()
    e2e = {name: p.grad for name, p in model.named_parameters()}

    split_model = copy.deepcopy(model)
    split_model.zero_grad(set_to_none=True)
    name_of = {id(p): name for name, p in split_model.named_parameters()}
    modules = split_timm_resnet(split_model, num_stages)
    heads = resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))
    stages = build_stages(modules, heads, num_stages, "farthest", optimizer_factory=no_step_optimizer)
    run_interlocked_batch(stages, [(x, y)], step=False)
    checked = 0
    for m in modules:
        for p in m.parameters():
            want = e2e[name_of[id(p)]]
            # one loss, backpropagated through the same modules in the same order: the same bits
            assert torch.equal(p.grad, want), name_of[id(p)]
            checked += 1
    assert checked == len(e2e)


# ----------------------------------------------------------------------------- messages


def test_local_learning_sends_nothing():
    model = tiny_resnet()
    modules = split_timm_resnet(model, 4)
    stages = build_stages(modules, resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8)), 1, "sum")
    assert all(not s.sends_upstream() and not s.needs_from_downstream() for s in stages)
    x, y = image_batch()
    h = x
    for s in stages:
        h = s.forward(0, h, y)
        assert s.backward(0, {}) == {}  # complete right after its own forward
        assert s.ready_to_step


def test_early_send_before_downstream_and_bad_message():
    """farthest n = 2: stage 1 sends dL_1/dx right after its forward, then waits for head 2."""
    model = tiny_resnet()
    modules = split_timm_resnet(model, 3)
    stages = build_stages(modules, resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8)), 2, "farthest")
    assert [s.needs_from_downstream() for s in stages] == [{1}, {2}, set()]
    assert [s.sends_upstream() for s in stages] == [set(), {1}, {2}]
    x, y = image_batch()
    h0 = stages[0].forward(0, x, y)
    h1 = stages[1].forward(0, h0, y)
    early = stages[1].backward(0, {})
    assert early.keys() == {1} and early[1].shape == h0.shape
    assert not stages[1].ready_to_step  # still waits for head 2
    assert stages[0].backward(0, {}) == {}
    stages[0].backward(0, early)
    assert stages[0].ready_to_step
    stages[2].forward(0, h1, y)
    late = stages[2].backward(0, {})
    assert late.keys() == {2}
    with pytest.raises(ValueError):
        stages[1].backward(0, {1: late[2]})  # head 1 is local, never received
    assert stages[1].backward(0, late) == {}
    assert stages[1].ready_to_step


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("n,rule", [(1, "sum"), (2, "farthest"), (3, "sum")])
def test_training_reduces_loss(n, rule):
    model = tiny_resnet().train()
    modules = split_timm_resnet(model, 3)
    heads = resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))
    opt = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    stages = build_stages(modules, heads, n, rule, optimizer_factory=opt, micro_batches_per_step=2)
    x, y = image_batch(n=8)
    micro = [(x[:4], y[:4]), (x[4:], y[4:])]
    first = run_interlocked_batch(stages, micro).losses
    for _ in range(15):
        last = run_interlocked_batch(stages, micro).losses
    assert last[-1] < 0.5 * first[-1], (first, last)
    assert all(b < a for a, b in zip(first, last)), (first, last)


def test_decoder_training_reduces_loss():
    model = tiny_llama().train()
    modules = split_hf_decoder(model, 2)
    heads = decoder_aux_heads(model, 2)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    stages = build_stages(modules, heads, 2, "sum", loss_fn=causal_lm_loss, optimizer_factory=opt)
    batch = token_batch()
    first = run_interlocked_batch(stages, [batch]).losses
    for _ in range(10):
        last = run_interlocked_batch(stages, [batch]).losses
    assert last[-1] < 0.7 * first[-1], (first, last)


def test_stage_is_a_plain_object_for_actors():
    """The runner exchanges only plain tensors: h forward, {head: tensor} backward."""
    model = tiny_resnet()
    modules = split_timm_resnet(model, 2)
    stages = build_stages(modules, resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8)), 2, "farthest")
    x, y = image_batch()
    h = stages[0].forward(7, x, y)
    assert isinstance(h, torch.Tensor) and not h.requires_grad and h.grad_fn is None
    stages[1].forward(7, h, y)
    msg = stages[1].backward(7, {})
    assert isinstance(stages[1], InterlockStage)
    assert msg.keys() == {1} and msg[1].grad_fn is None and not msg[1].requires_grad
    assert stages[0].backward(7, msg) == {}
    assert stages[1].pop_losses().keys() == {7}


def test_balanced_sizes_count_the_aux_head_each_stage_carries():
    assert balanced_sizes([1, 1, 1, 1], 2) == [2, 2]
    # a stage ending after unit 1 would carry a head costing 5: the best split avoids that boundary
    assert balanced_sizes([1, 1, 1, 1], 2, [0, 5, 0]) == [3, 1]
    assert balanced_sizes([1, 1, 1, 1], 2, [5, 0, 5]) == [2, 2]


def test_measured_costs_time_every_unit_and_boundary_head_and_a_fixed_split_is_kept():
    from raylowcomm.core.interlock.splitting import StageCosts, measure_balance

    model = tiny_resnet()
    units = timm_cnn_units(model)
    costs = measure_balance(model, "timm", torch.randn(4, 3, 16, 16), NUM_CLASSES, (8,), cpus=1, repeats=1)
    assert isinstance(costs, StageCosts) and len(costs.units) == units and len(costs.boundaries) == units - 1
    assert all(c > 0 for c in costs.units + costs.boundaries)
    stages = split_timm_cnn(model, 2, costs)
    assert sum(len(s) for s in stages) == units + 1  # every unit, plus the model's own head
    fixed = split_timm_cnn(model, 2, "blocks", sizes=[1, units - 1])
    assert len(fixed[0]) == 1 and len(fixed[1]) == units
    with pytest.raises(ValueError, match="sizes"):
        split_timm_cnn(model, 2, "blocks", sizes=[1, 1])


# ----------------------------------------------------------------------------- aux heads on a subset of positions


def test_the_position_subset_loss_is_the_full_loss_in_expectation():
    """Every subset of 2 of the 4 positions, each equally likely: the weighted subset loss averages to the
    loss over every position (the -100 label counted nowhere)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5), generator=generator)
    labels[1, -1] = -100
    full = causal_lm_loss(logits, labels)
    subsets = [torch.tensor(s) for s in itertools.combinations(range(4), 2)]
    estimates = [causal_lm_loss(SampledLogits(logits[:, s], s, 4), labels) for s in subsets]
    mean = sum(estimates) / len(estimates)
    # float64: each estimate is a sum of 4 terms, one product and one quotient, the mean 6 more sums and
    # a quotient, the full loss 8 terms and a quotient: fewer than 32 roundings of 2^-53 relative each
    bound = 32 * 2**-53 * max(abs(full), *(abs(e) for e in estimates))
    assert abs(mean - full) <= bound and any(abs(e - full) > 1e3 * bound for e in estimates)


def test_a_subset_head_reads_its_seeded_positions_while_training_and_every_position_when_scoring():
    head = PositionSubsetHead(torch.nn.Linear(4, 9), 0.25, seed=3)
    h = torch.randn(2, 9, 4)
    first, second = head(h), head(h)
    assert isinstance(first, SampledLogits) and first.of == 8 and len(first.positions) == 2
    assert first.logits.shape == (2, 2, 9) and not torch.equal(first.positions, second.positions)  # afresh per call
    head.draws = 0
    assert torch.equal(head(h).positions, first.positions)  # the draws are the seed's
    head.eval()
    assert torch.equal(head(h), head.head(h))


@pytest.mark.parametrize("n,rule", [(1, "farthest"), (2, "farthest"), (2, "sum")])
def test_subset_heads_send_the_reference_gradients_across_stages(n, rule, rmsnorm_in_its_own_dtype):
    model = tiny_llama().double().train()
    modules = split_hf_decoder(model, 3)
    heads = [PositionSubsetHead(h.double(), 0.5, seed=k) for k, h in enumerate(decoder_aux_heads(model, 3))]
    batch = token_batch()
    stages = build_stages(modules, heads, n, rule, loss_fn=causal_lm_loss, optimizer_factory=no_step_optimizer)
    trace = run_interlocked_batch(stages, [batch], step=False)
    for head in heads:
        head.draws = 0  # the reference reads the same positions
    want_stages, want_heads = reference_gradients(modules, heads, batch, n, rule, causal_lm_loss)
    for k in range(3):
        assert_grads_equal(accumulated_grads(modules[k]), want_stages[k], f"n={n} {rule} stage {k}")
    for j in range(2):
        assert_grads_equal(accumulated_grads(heads[j]), want_heads[j], f"n={n} {rule} head {j}")
    check_messages(trace, stages, n)


# ----------------------------------------------------------------------------- stages that overlap batches


def overlap_case(num_stages: int, n: int, rule: str, lr: float):
    """Float64 stages (eval BN: a micro-batch sees the batch's statistics) with plain SGD, and 4
    batches of 2 micro-batches."""
    model = tiny_resnet().double().eval()
    modules = split_timm_resnet(model, num_stages)
    heads = [h.double().eval() for h in resnet_aux_heads(modules, NUM_CLASSES, widths=(8, 8))]
    batches = []
    for b in range(4):
        x, y = image_batch(n=4, dtype=torch.float64, seed=10 + b)
        batches.append([(x[:2], y[:2]), (x[2:], y[2:])])
    sgd = lambda params: torch.optim.SGD(params, lr=lr)  # noqa: E731
    return modules, heads, batches, sgd


def stage_weights(stage) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.params + stage.head_params]


@pytest.mark.parametrize("n,rule", [(1, "sum"), (2, "farthest"), (2, "sum"), (3, "farthest")])
def test_one_batch_per_stage_is_the_batch_by_batch_order_bit_for_bit(n, rule):
    """stage_batches = 1 runs each batch's calls in turn and steps in place, never stashing."""
    modules, heads, batches, _ = overlap_case(3, n, rule, lr=0.1)
    momentum = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    pipelined = build_stages(
        copy.deepcopy(modules), copy.deepcopy(heads), n, rule, optimizer_factory=momentum, micro_batches_per_step=2
    )
    run_pipeline(pipelined, batches, stage_batches=1)
    stages = build_stages(modules, heads, n, rule, optimizer_factory=momentum, micro_batches_per_step=2)
    plan = message_plan(3, n, rule)
    for b, micro in enumerate(batches):
        out = {}
        for call in batch_calls(plan, 2):
            stage, mb_id = stages[call.stage], 2 * b + call.mb
            if call.kind == "forward":
                x, y = micro[call.mb] if call.stage == 0 else out[call.source][0]
                out[call] = ((stage.forward(mb_id, x, y), y), stage.backward(mb_id, {}))
            else:
                out[call] = (None, stage.backward(mb_id, out[call.source][1]))
        for stage in stages:
            assert stage.ready_to_step
            stage.step()
    for got, want in zip(pipelined, stages):
        assert got.stashes == 0
        assert all(torch.equal(a, b) for a, b in zip(stage_weights(got), stage_weights(want)))


@pytest.mark.parametrize("stage_batches", [2, 3])
@pytest.mark.parametrize("n,rule", [(1, "sum"), (2, "farthest"), (2, "sum"), (3, "farthest")])
def test_a_stage_that_runs_ahead_applies_the_gradient_of_the_weights_its_forward_ran_with(n, rule, stage_batches):
    """A stage that waits for messages from downstream runs batch b's forwards after its step of
    batch b - stage_batches (stage_batches - 1 steps stale); the others after batch b - 1's. Each
    update must be the n-way gradient of one autograd graph through the versions of every stage
    and head that batch's forwards ran with (`reference_gradients`), applied to the latest weights."""
    lr, K = 0.1, 3
    modules, heads, batches, sgd = overlap_case(K, n, rule, lr)
    stages = build_stages(
        copy.deepcopy(modules), copy.deepcopy(heads), n, rule, optimizer_factory=sgd, micro_batches_per_step=2
    )
    run_pipeline(stages, batches, stage_batches)

    versions = [[(modules[k], heads[k] if k < K - 1 else None)] for k in range(K)]  # [stage][steps applied]
    for b, micro in enumerate(batches):
        used = [
            versions[k][max(0, b - stage_batches + 1) if stages[k].needs_from_downstream() else b] for k in range(K)
        ]
        batch = (torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
        want_stages, want_heads = reference_gradients([m for m, _ in used], [h for _, h in used[:-1]], batch, n, rule)
        for k in range(K):
            module, head = (copy.deepcopy(m) if m is not None else None for m in versions[k][b])
            with torch.no_grad():
                for name, p in module.named_parameters():
                    p -= lr * want_stages[k][name]
                for name, p in head.named_parameters() if head is not None else ():
                    p -= lr * want_heads[k][name]
            versions[k].append((module, head))
    for k, stage in enumerate(stages):
        module, head = versions[k][-1]
        want = [p.detach() for p in module.parameters()] + ([p.detach() for p in head.parameters()] if head else [])
        # float64: the two computations add the same terms in other orders, a few roundings of 2^-53
        # relative each over 4 steps, far inside 1e-9 relative
        for got, w in zip(stage_weights(stage), want, strict=True):
            assert torch.allclose(got, w, rtol=1e-9, atol=1e-12), f"stage {k}"
        waits = bool(stage.needs_from_downstream())
        assert (stage.stashes > 0) == waits, (k, stage.stashes)
    stale = build_stages(
        copy.deepcopy(modules), copy.deepcopy(heads), n, rule, optimizer_factory=sgd, micro_batches_per_step=2
    )
    run_pipeline(stale, batches, 1)
    if n > 1:  # running ahead changes the updates: the check above is not of the batch-by-batch order
        assert not all(torch.equal(a, b) for a, b in zip(stage_weights(stale[0]), stage_weights(stages[0])))
