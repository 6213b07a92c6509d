"""Estimators and step rules of zeroth-order steps: the one-sided batch estimator against hand-written
references, forward-pass counts, the normalised step from decoded bytes, and that replicas and a
joiner replaying the log stay bit-identical under both."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from raylowcomm.common.hashing import parameter_hash
from raylowcomm.core.zo.codec import codec_for
from raylowcomm.core.zo.estimators import (
    ESTIMATORS,
    STEP_RULES,
    check_step_rule,
    forwards_per_step,
    measured_loss,
    projected_grads,
    rule_updates,
    spread,
)
from raylowcomm.core.zo.perturb import (
    CHUNK,
    KINDS,
    apply_step_,
    apply_update_,
    iter_z,
    one_sided_losses,
    spsa_losses,
    trainable_parameters,
)
from raylowcomm.core.zo.replay import ReplayLog, Replica, SeedSchedule, step_seeds
from tests.core.test_zo import convex_problem, mse

torch.set_num_threads(1)


def linear(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Linear(6, 1).to(dtype)


def data(n=32, seed=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 1, generator=g, dtype=dtype)


# ------------------------------------------------------------------------------ the one-sided estimator


@pytest.mark.parametrize("kind", KINDS)
def test_one_sided_batch_equals_a_hand_written_reference_on_a_linear_model(kind):
    """g_s = (L(θ+εz_s) − L(θ))/ε with z_s drawn by hand and the losses from functional_call.
    Rademacher: bitwise equal (c·z is exact for z = ±1, so θ + εz rounds the same however it is
    computed); Gaussian: within 1e-12 relative (θ + εz may round differently with a fused add)."""
    model, batch, eps, seeds = linear(), data(), 1e-4, [5, 6, 7, 8]
    params = trainable_parameters(model)
    theta = {n: p.detach().clone() for n, p in params}
    pairs = one_sided_losses(model, params, mse, batch, seeds, eps, kind)
    gs = projected_grads("one_sided_batch", pairs, eps)
    with torch.no_grad():
        base = float(mse(model, batch))
    for seed, g, (_, lb) in zip(seeds, gs, pairs):
        shifted = {n: theta[n] + eps * z for n, z in zip(theta, iter_z(params, seed, kind))}
        with torch.no_grad():
            plus = float(nn.functional.mse_loss(functional_call(model, shifted, (batch[0],)), batch[1]))
        reference = (plus - base) / eps
        assert lb == base
        if kind == "rademacher":
            assert g == reference
        else:
            assert g == pytest.approx(reference, rel=1e-12, abs=1e-12)
    assert all(torch.equal(p, theta[n]) for n, p in params), "θ comes back bitwise"


def test_one_sided_batch_on_a_quadratic_is_the_directional_derivative_plus_its_curvature_term():
    """L(θ) = ½θᵀAθ + bᵀθ: (L(θ+εz) − L(θ))/ε = (Aθ + b)·z + (ε/2)·zᵀAz exactly in real numbers;
    float64 agrees to 1e-8 relative."""

    class Quadratic(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            m = torch.randn(8, 8, generator=g, dtype=torch.float64)
            self.register_buffer("a", m @ m.T + torch.eye(8, dtype=torch.float64))
            self.register_buffer("b", torch.randn(8, generator=g, dtype=torch.float64))
            self.theta = nn.Parameter(torch.randn(8, generator=g, dtype=torch.float64))

        def forward(self):
            return 0.5 * self.theta @ self.a @ self.theta + self.b @ self.theta

    model, eps = Quadratic(), 1e-3
    params = trainable_parameters(model)
    for kind in KINDS:
        gs = projected_grads(
            "one_sided_batch", one_sided_losses(model, params, lambda m, _: m(), None, [1, 2, 3], eps, kind), eps
        )
        for seed, g in zip([1, 2, 3], gs):
            z = next(iter_z(params, seed, kind))
            th = model.theta.detach()
            expected = float((model.a @ th + model.b) @ z + eps / 2 * z @ model.a @ z)
            assert g == pytest.approx(expected, rel=1e-8)


def test_forward_passes_are_counted_as_run():
    model, batch = linear(), data()
    params = trainable_parameters(model)
    calls = []

    def counting(m, b):
        calls.append(1)
        return mse(m, b)

    for estimator, measure in (("two_point", spsa_losses), ("one_sided_batch", one_sided_losses)):
        for samples in (1, 3, 5):
            calls.clear()
            measure(model, params, counting, batch, list(range(samples)))
            assert len(calls) == forwards_per_step(estimator, samples)
    assert [forwards_per_step(e, 4) for e in ESTIMATORS] == [8, 5]
    rep = Replica(linear(), 0, 1, codec_for("log"), eps=1e-3, samples=4, lr=0.01, estimator="one_sided_batch")
    for _ in range(3):
        rep.compute(mse, batch)
        rep.apply([0], b"")
    assert rep.forwards == 3 * 5
    assert sorted(rep.times) == ["forward_base_s", "forward_plus_s", "perturb_s", "replay_s"]
    assert all(t > 0 for t in rep.times.values())


def test_measured_loss_is_the_shared_base_or_the_pairs_mean():
    assert measured_loss("one_sided_batch", [(3.0, 1.5), (2.0, 1.5)]) == 1.5
    assert measured_loss("two_point", [(3.0, 1.0), (2.0, 2.0)]) == 2.0
    assert projected_grads("two_point", [(3.0, 1.0)], 0.5) == [2.0]
    assert projected_grads("one_sided_batch", [(3.0, 1.0)], 0.5) == [4.0]


# ------------------------------------------------------------------------------ step rules


def test_normalised_rule_divides_by_the_sample_spread_of_the_decoded_gs():
    codec = codec_for("log")
    gs = [codec.decode(codec.encode(g)) for g in (0.3, -1.7, 2.2, 0.01, -0.4, 5.0)]
    updates = list(zip(range(100, 106), gs))
    sigma = float(np.std(gs, ddof=1))
    assert spread(gs) == pytest.approx(sigma, rel=1e-14)
    normalised = rule_updates(updates, "normalised")
    assert [s for s, _ in normalised] == list(range(100, 106))
    assert [g for _, g in normalised] == pytest.approx([g / sigma for g in gs], rel=1e-14)
    assert rule_updates(updates, "plain") == updates
    assert rule_updates([(1, 0.5), (2, 0.5)], "normalised") == [(1, 0.0), (2, 0.0)], "no spread: no gradient part"
    assert rule_updates([(1, 0.5), (2, 0.5)], "plain") == [(1, 0.5), (2, 0.5)]


def test_normalised_step_matches_the_formula():
    model = linear(dtype=torch.float32)
    params = trainable_parameters(model)
    theta = [p.detach().double().clone() for _, p in params]
    updates = [(11, 0.7), (12, -1.3), (13, 0.2)]
    apply_step_(params, rule_updates(updates, "normalised"), lr=0.05)
    sigma = float(np.std([g for _, g in updates], ddof=1))
    expected = [t.clone() for t in theta]
    for seed, g in updates:
        expected = [e - 0.05 * g / (3 * sigma) * z.double() for e, z in zip(expected, iter_z(params, seed))]
    # float32 against the float64 formula: each update rounds its coefficient, its product and its sum, so
    # ≤ 2u·|α·z| + u·(|θ| + Σ|α·z|) per update (u = 2^-24), for 3 updates < 2^-21·(|θ| + Σ_m |α_m·z_m|)
    size = [torch.zeros_like(t) for t in theta]
    for seed, g in updates:
        size = [s + abs(0.05 * g / (3 * sigma)) * z.double().abs() for s, z in zip(size, iter_z(params, seed))]
    assert all(
        ((p.double() - e).abs() <= 2.0**-21 * (t.abs() + s)).all()
        for (_, p), e, t, s in zip(params, expected, theta, size)
    )


def test_bad_estimators_and_rules_are_refused():
    with pytest.raises(ValueError, match="samples >= 2"):
        check_step_rule("normalised", samples=1)
    check_step_rule("normalised", samples=2)
    with pytest.raises(ValueError, match="unknown step rule"):
        rule_updates([(1, 0.1)], "adam")
    with pytest.raises(ValueError, match="unknown estimator"):
        forwards_per_step("three_point", 2)
    with pytest.raises(ValueError, match="at least two"):
        spread([1.0])
    with pytest.raises(ValueError, match="samples >= 2"):
        Replica(linear(), 0, 1, codec_for("log"), eps=1e-3, samples=1, lr=0.1, rule="normalised")
    with pytest.raises(ValueError, match="unknown estimator"):
        Replica(linear(), 0, 1, codec_for("log"), eps=1e-3, samples=2, lr=0.1, estimator="one_sided")
    assert STEP_RULES == ("plain", "normalised")


# ------------------------------------------------------------------------------ replicas and replay


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1)).to(dtype)


@pytest.mark.parametrize(
    "estimator, rule, density",
    [(e, r, 1.0) for e in ESTIMATORS for r in STEP_RULES]
    + [("one_sided_batch", "normalised", 0.25), ("two_point", "plain", 0.25)],
)
def test_replicas_stay_identical_over_20_steps_with_a_leave_and_a_join_and_replay_reproduces_them(
    estimator, rule, density
):
    """Three `Replica`s exchange codes for 20 steps; node 2 leaves after step 7; node 3 joins at
    step 12 from a checkpoint of step 10 plus the log. Every running replica hashes equal after
    every step; a fresh model replaying the whole log from step 0 ends equal too; the same run
    under the other step rule ends elsewhere (the rule is applied)."""
    cfg = dict(eps=1e-3, samples=3, lr=0.02, weight_decay=0.1, estimator=estimator, rule=rule, density=density)
    reps = {n: Replica(mlp(), n, 42, codec_for("log"), **cfg) for n in range(3)}
    checkpoint, initial = None, parameter_hash(trainable_parameters(mlp()))
    for step in range(20):
        if step == 8:
            del reps[2]
        if step == 10:
            checkpoint = copy.deepcopy(reps[0].model)
        if step == 12:
            joiner = Replica(checkpoint, 3, 42, codec_for("log"), step=12, **cfg)
            assert joiner.catch_up(10, reps[0].log.to_bytes(10)) == 2
            reps[3] = joiner
        payloads = {n: r.compute(mse, data(dtype=torch.float32, seed=10 + n))[0] for n, r in reps.items()}
        for n, r in reps.items():
            r.apply(sorted(reps), b"".join(payloads[k] for k in sorted(reps) if k != n))
        assert len({parameter_hash(r.params) for r in reps.values()}) == 1, f"step {step}"
    final = parameter_hash(reps[0].params)
    assert final != initial
    fresh = trainable_parameters(mlp())
    log = ReplayLog.from_bytes(reps[3].log.to_bytes())  # the joiner's log holds steps 10.. only
    assert log.steps == list(range(10, 20))
    full = ReplayLog.from_bytes(reps[0].log.to_bytes())
    replay_cfg = dict(schedule=SeedSchedule(42), codec=codec_for("log"), lr=0.02, weight_decay=0.1, density=density)
    assert full.replay_(fresh, 0, 20, rule=rule, **replay_cfg) == 20
    assert parameter_hash(fresh) == final
    other = trainable_parameters(mlp())
    full.replay_(other, 0, 20, rule="plain" if rule == "normalised" else "normalised", **replay_cfg)
    assert parameter_hash(other) != final


def test_one_sided_batch_with_the_normalised_step_reduces_loss_on_a_convex_problem():
    model, batch, params = convex_problem()
    schedule, codec = SeedSchedule(3), codec_for("log")
    with torch.no_grad():
        start = float(mse(model, batch))
    for step in range(150):
        seeds = step_seeds(schedule, step, 0, 4)
        gs = projected_grads("one_sided_batch", one_sided_losses(model, params, mse, batch, seeds), 1e-3)
        decoded = [(s, codec.decode(codec.encode(v))) for s, v in zip(seeds, gs)]
        apply_step_(params, rule_updates(decoded, "normalised"), lr=0.1 * 0.98**step)
    with torch.no_grad():
        final = float(mse(model, batch))
    assert math.isfinite(final) and final < 1e-3 * start


# ------------------------------------------------------------------------------ sparse perturbations


def test_a_sparse_z_is_the_dense_draw_then_a_byte_mask_per_chunk_from_the_same_generator():
    """The stream's definition for density < 1: per CHUNK, the Rademacher words, then one random
    byte per element; z is kept where the byte is below round(256·density)."""
    params = [("a", torch.zeros(3, 41)), ("b", torch.zeros(CHUNK + 77))]
    gen = torch.Generator().manual_seed(9)
    expected = []
    for _, p in params:
        for n in [min(CHUNK, p.numel() - s) for s in range(0, p.numel(), CHUNK)]:
            words = torch.empty((n + 63) // 64, dtype=torch.int64).random_(-(2**63), None, generator=gen)
            bits = (words.view(torch.uint8).unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
            z = bits.view(-1)[:n].float() * 2 - 1
            mask_bytes = torch.empty((n + 7) // 8, dtype=torch.int64).random_(-(2**63), None, generator=gen)
            expected.append(torch.where(mask_bytes.view(torch.uint8)[:n] < 64, z, torch.zeros(())))
    z = torch.cat([t.view(-1) for t in iter_z(params, 9, "rademacher", density=0.25)])
    assert torch.equal(z, torch.cat(expected))
    assert abs(float((z != 0).double().mean()) - 0.25) < 0.01
    dense = torch.cat([t.view(-1) for t in iter_z(params, 9, "rademacher")])
    assert torch.equal(dense, torch.cat([t.view(-1) for t in iter_z(params, 9, "rademacher", density=1.0)]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_sparse_step_moves_only_the_masked_weights_and_the_forward_sees_only_them_shifted(kind):
    model = mlp()
    params = trainable_parameters(model)
    theta = [p.detach().clone() for _, p in params]
    z = list(iter_z(params, 5, kind, density=0.5))
    seen = []

    def loss(m, b):
        seen.append([p.detach().clone() for _, p in params])
        return mse(m, b)

    one_sided_losses(model, params, loss, data(dtype=torch.float32), [5], 1e-2, kind, density=0.5)
    assert all(torch.equal(s, t) for s, t in zip(seen[0], theta)), "L(θ) first"
    assert all(torch.equal(s, torch.add(t, zz, alpha=1e-2)) for s, t, zz in zip(seen[1], theta, z))
    apply_update_(params, 5, 0.1, kind, density=0.5)
    for (_, p), t, zz in zip(params, theta, z):
        assert torch.equal(p[zz == 0], t[zz == 0]) and bool((p[zz != 0] != t[zz != 0]).all())
    assert 0.3 < sum(int((zz != 0).sum()) for zz in z) / sum(zz.numel() for zz in z) < 0.7


def test_bad_densities_are_refused():
    for bad in (0.0, 1 / 512, 1.5):
        with pytest.raises(ValueError, match="density"):
            Replica(linear(), 0, 1, codec_for("log"), eps=1e-3, samples=2, lr=0.1, density=bad)
