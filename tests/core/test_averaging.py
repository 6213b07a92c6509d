import timm
import torch
from torch import nn

from raylowcomm import assets
from raylowcomm.core.averaging import (
    OuterNesterov,
    StreamingAverage,
    average_state_dicts,
    combine_bn_statistics,
    greedy_soup,
    measure_bn_statistics,
)


def _real_states(k=3):
    """k perturbed copies of the real EfficientNet-Lite0 ImageNet weights."""
    from safetensors.torch import load_file

    base = load_file(str(assets.require("efficientnet_lite0")))
    gen = torch.Generator().manual_seed(0)
    return [
        {
            n: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
            for n, v in base.items()
        }
        for _ in range(k)
    ]


def test_uniform_average_is_exact_on_real_state_dicts():
    states = _real_states()
    avg = average_state_dicts(states)
    for name in states[0]:
        if states[0][name].is_floating_point():
            # the float64 sum in node order, one division, one rounding: StreamingAverage's arithmetic, so the
            # same bits (a pairwise float64 mean could round to the neighbouring float32 near a tie)
            total = states[0][name].double()
            for s in states[1:]:
                total = total + s[name].double()
            assert torch.equal(avg[name], (total / len(states)).float()), name
        else:
            assert torch.equal(avg[name], states[0][name])


def test_weighted_average_follows_weights():
    states = _real_states(2)
    avg = average_state_dicts(states, weights=[3.0, 1.0])
    name = "conv_stem.weight"
    torch.testing.assert_close(avg[name], (0.75 * states[0][name].double() + 0.25 * states[1][name].double()).float())


def test_streaming_result_with_extra_does_not_change_the_sum():
    a, b, c = _real_states(3)
    avg = StreamingAverage()
    avg.add(a)
    avg.add(b)
    with_c = avg.result(extra=c)
    # the same float64 sums in the same order ((a + b) + c, then one division): the same bits
    assert torch.equal(with_c["conv_stem.weight"], average_state_dicts([a, b, c])["conv_stem.weight"])
    assert torch.equal(avg.result()["conv_stem.weight"], average_state_dicts([a, b])["conv_stem.weight"])


def test_greedy_soup_skips_a_model_that_hurts():
    good = {"w": torch.tensor([1.0])}
    also_good = {"w": torch.tensor([1.2])}
    bad = {"w": torch.tensor([-5.0])}
    score = lambda s: -abs(s["w"].item() - 1.1)  # noqa: E731 — best at 1.1
    soup, kept, best = greedy_soup([lambda: good, lambda: also_good, lambda: bad], score)
    assert kept == [0, 1]
    assert soup["w"].item() == 1.1 or abs(soup["w"].item() - 1.1) < 1e-6
    assert abs(best - 0.0) < 1e-6


def _forward(model, batch):
    return model(batch)


def test_bn_statistics_across_nodes_equal_one_pass_in_one_process():
    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", num_classes=10)
    batches = [torch.randn(8, 3, 16, 16) * (1 + i) + i for i in range(6)]
    one_pass, count = measure_bn_statistics(model, batches, _forward)
    assert count == 6
    node_a = measure_bn_statistics(model, batches[:2], _forward)
    node_b = measure_bn_statistics(model, batches[2:], _forward)
    combined = combine_bn_statistics([node_a, node_b])
    assert combined.keys() == one_pass.keys()
    # Every batch's own statistics are the same bits in both (train-mode BN normalises with the batch's own,
    # so what a layer sees does not depend on the running statistics). What differs is how they are averaged:
    # one pass keeps a cumulative mean r ← (1 − 1/n)·r + (1/n)·s_n over 6 batches, each update within
    # 4u·(|r| + |s_n|) ≤ 8u·M of exact (u = 2^-24, M = max_n |s_n|, |r| ≤ M), so ≤ 48u·M; the nodes' means over 2
    # and 4 batches (≤ 16u·M, 32u·M), combined by batch count in float64 and rounded once (≤ (16·2 + 32·4)/6·u·M
    # + u·M < 28u·M). The two differ by less than 76u·M < 2^-17·M.
    per_batch = [measure_bn_statistics(model, [b], _forward)[0] for b in batches]
    for k in one_pass:
        if k.endswith("num_batches_tracked"):
            assert torch.equal(combined[k], one_pass[k])
            continue
        most = torch.stack([s[k].double().abs() for s in per_batch]).amax(0)
        assert ((combined[k].double() - one_pass[k].double()).abs() <= 2.0**-17 * most).all(), k
    # the statistics really changed from the ImageNet-free init (not a vacuous comparison)
    assert any(v.abs().sum() > 0 for k, v in one_pass.items() if k.endswith("running_mean"))


def test_bn_measurement_leaves_weights_and_momentum_alone():
    model = timm.create_model("test_efficientnet", num_classes=10)
    before = {k: v.clone() for k, v in model.named_parameters()}
    momenta = [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    measure_bn_statistics(model, [torch.randn(4, 3, 16, 16)], _forward)
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    assert momenta == [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def test_outer_nesterov_matches_its_formula_and_reduces_to_averaging():
    init = {"w": torch.tensor([1.0, 2.0]), "running_mean": torch.tensor([0.0])}
    avg1 = {"w": torch.tensor([0.5, 1.0]), "running_mean": torch.tensor([3.0])}
    plain = OuterNesterov(init, {"w"}, lr=1.0, momentum=0.0)
    torch.testing.assert_close(plain.step(avg1)["w"], avg1["w"])
    outer = OuterNesterov(init, {"w"}, lr=0.7, momentum=0.9)
    out = outer.step(avg1)
    delta = init["w"] - avg1["w"]
    buf = delta
    torch.testing.assert_close(out["w"], init["w"] - 0.7 * (delta + 0.9 * buf))
    assert out["running_mean"].item() == 3.0


def test_outer_nesterov_from_the_averaged_delta_is_the_step_from_the_average():
    """Peer rounds step from Δ̄ = θ_global − mean θ_k: over two rounds, the same bits as `step` on the
    average wherever Δ̄ is what `step` computes itself (here exactly representable values)."""
    init = {"w": torch.tensor([1.0, 2.0]), "running_mean": torch.tensor([0.5])}
    averages = [
        {"w": torch.tensor([0.5, 1.0]), "running_mean": torch.tensor([3.0])},
        {"w": torch.tensor([0.25, 1.5]), "running_mean": torch.tensor([2.0])},
    ]
    by_average = OuterNesterov(init, {"w"}, lr=0.7, momentum=0.9)
    by_delta = OuterNesterov(init, {"w"}, lr=0.7, momentum=0.9)
    for avg in averages:
        delta = {k: (by_delta.state[k] - v).to(torch.float64) for k, v in avg.items()}
        a, b = by_average.step(avg), by_delta.step_delta(delta)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(by_average.buf["w"], by_delta.buf["w"])
    assert not torch.equal(by_delta.state["w"], init["w"])
