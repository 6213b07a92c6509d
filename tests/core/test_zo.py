"""SPSA with shared randomness: exact restore, replay identity, codecs, and that it learns."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from raylowcomm.common.hashing import parameter_hash
from raylowcomm.core.zo.codec import codec_for
from raylowcomm.core.zo.perturb import (
    CHUNK,
    KINDS,
    apply_step_,
    apply_update_,
    decay_mask,
    iter_z,
    spsa_losses,
    spsa_projected_grad,
    spsa_projected_grads,
    trainable_parameters,
)
from raylowcomm.core.zo.replay import ReplayLog, Replica, SeedSchedule, step_seeds

torch.set_num_threads(1)


def mlp(seed=0, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(dropout), nn.Linear(7, 1)).to(dtype)


class Wide(nn.Module):
    """Many parameters: odd sizes, one tensor spanning several CHUNKs, a norm, an embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(50, 13)
        self.big = nn.Linear(13, CHUNK // 5 + 3)  # > 2·CHUNK elements in the weight
        self.norm = nn.LayerNorm(CHUNK // 5 + 3)
        self.head = nn.Linear(CHUNK // 5 + 3, 1)

    def forward(self, idx):
        return self.head(torch.tanh(self.norm(self.big(self.emb(idx))))).mean()


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def convex_problem():
    """A linear model at zero and a noiseless linear target: (model, batch, its trainable parameters)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 10, generator=g)
    batch = (x, x @ torch.randn(10, 1, generator=g))
    model = nn.Linear(10, 1)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
    return model, batch, trainable_parameters(model)


def batch_for(dtype=torch.float32, n=16, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=dtype), torch.randn(n, 1, generator=g, dtype=dtype)


def bits(params):
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}
    return [p.detach().clone().view(as_int[p.dtype]) for _, p in params]


# ------------------------------------------------------------------------------ seeds, params


def test_seed_schedule_is_stable_and_distinct():
    s = SeedSchedule(0)
    assert s.seed(1, 2, 3) == 3415856098436945430  # fixed forever: every node/version must agree
    seeds = {s.seed(st, n, k) for st in range(20) for n in range(4) for k in range(3)}
    assert len(seeds) == 20 * 4 * 3
    assert all(0 <= x < 2**63 for x in seeds)
    assert s.seed(0, 1, 2) != s.seed(0, 2, 1)
    assert SeedSchedule(1).seed(1, 2, 3) != s.seed(1, 2, 3)


def test_trainable_parameters_order_subset_and_decay_mask():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    names = [n for n, _ in trainable_parameters(model)]
    assert names == [n for n, _ in model.named_parameters()]
    subset = trainable_parameters(model, include=["^2\\.", "0.bias"])
    assert [n for n, _ in subset] == ["0.bias", "2.weight", "2.bias"]
    with pytest.raises(ValueError):
        trainable_parameters(model, include=["nothing"])
    assert decay_mask(trainable_parameters(model)) == [True, False, False, False, True, False]
    named = [
        ("encoder.ln_f.weight", torch.zeros(3, 3)),
        ("bn1.weight", torch.zeros(2, 2)),
        ("blk.rmsnorm.scale", torch.zeros(2, 2)),
        ("kiln.weight", torch.zeros(2, 2)),
    ]
    assert decay_mask(named) == [False, False, False, True]


# ------------------------------------------------------------------------------ perturbations


def test_rademacher_is_exactly_pm1_balanced_and_unpacks_the_drawn_bits():
    params = [("a", torch.zeros(700_001)), ("b", torch.zeros(300_000))]
    z = torch.cat([t.view(-1) for t in iter_z(params, 5, "rademacher")])
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    assert abs(float((z > 0).double().mean()) - 0.5) < 0.005
    per_bit = z[: 64 * (z.numel() // 64)].view(-1, 64).mean(0)  # every bit of a word is used
    assert per_bit.abs().max() < 0.06
    first = next(iter_z([("w", torch.zeros(64))], 12345, "rademacher"))
    gen = torch.Generator().manual_seed(12345)
    word = torch.empty(1, dtype=torch.int64).random_(-(2**63), None, generator=gen)
    expected = [1.0 if (word.item() >> k) & 1 else -1.0 for k in range(64)]
    assert first.tolist() == expected


def test_gaussian_moments():
    z = next(iter_z([("w", torch.zeros(1_000_000))], 9, "gaussian"))
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_z_and_one_stream_across_parameters(kind):
    params = [("a", torch.zeros(3, 40)), ("b", torch.zeros(3, 40)), ("c", torch.zeros(CHUNK + 10))]
    z1, z2, z3 = (list(iter_z(params, s, kind)) for s in (1, 1, 2))
    assert all(torch.equal(a, b) for a, b in zip(z1, z2))
    assert not any(torch.equal(a, b) for a, b in zip(z1, z3))
    assert not torch.equal(z1[0], z1[1])  # not one generator restarted per parameter
    assert [z.shape for z in z1] == [p.shape for _, p in params]


@pytest.mark.parametrize("kind", KINDS)
def test_z_is_one_fresh_draw_per_chunk_of_each_parameter(kind):
    """The stream's definition, whatever buffers the draws reuse: per CHUNK, in order, what
    torch.randn would give, or the bits of freshly drawn int64 words."""
    params = [("a", torch.zeros(3, 41)), ("b", torch.zeros(2 * CHUNK + 77)), ("c", torch.zeros(5))]
    gen = torch.Generator().manual_seed(9)
    expected = []
    for _, p in params:
        for n in [min(CHUNK, p.numel() - s) for s in range(0, p.numel(), CHUNK)]:
            if kind == "gaussian":
                expected.append(torch.randn(n, generator=gen))
            else:
                words = torch.empty((n + 63) // 64, dtype=torch.int64).random_(-(2**63), None, generator=gen)
                bits = (words.view(torch.uint8).unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
                expected.append(bits.view(-1)[:n].float() * 2 - 1)
    z = torch.cat([t.view(-1) for t in iter_z(params, 9, kind)])
    assert torch.equal(z, torch.cat(expected))


@pytest.mark.parametrize("kind", KINDS)
def test_update_regenerates_the_same_z(kind):
    params = [("a", torch.zeros(3, 40)), ("c", torch.zeros(CHUNK + 10))]
    apply_update_(params, 77, -1.0, kind)  # θ = 0 − (−1)·z = z
    assert all(torch.equal(p, z) for (_, p), z in zip(params, iter_z(params, 77, kind)))


# ------------------------------------------------------------------------------ SPSA


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", [mlp, lambda: Wide()], ids=["mlp", "wide"])
def test_perturb_and_restore_is_bitwise_exact(kind, build):
    model = build()
    params = trainable_parameters(model)
    batch = batch_for() if isinstance(model, nn.Sequential) else torch.arange(8)
    loss_fn = mse if isinstance(model, nn.Sequential) else (lambda m, idx: m(idx))
    before, h = bits(params), parameter_hash(params)
    gs = spsa_projected_grads(model, params, loss_fn, batch, [3, 4, 5], eps=1e-3, kind=kind)
    assert all(g != 0 and math.isfinite(g) for g in gs)
    assert all(torch.equal(a, b) for a, b in zip(before, bits(params)))
    assert parameter_hash(params) == h


def test_arithmetic_restore_would_not_be_exact():
    """Why θ is parked rather than walked back: MeZO's +ε, −2ε, +ε walk changes float32 weights."""
    params = trainable_parameters(Wide())
    before = bits(params)
    for alpha in (1e-3, -2e-3, 1e-3):
        apply_update_(params, 3, -alpha, "gaussian")
    assert not all(torch.equal(a, b) for a, b in zip(before, bits(params)))


@pytest.mark.parametrize("kind", KINDS)
def test_forwards_see_theta_plus_then_minus_eps_z_and_theta_keeps_its_storage(kind):
    """θ + εz exactly; θ − εz up to a rounding (θ + εz mirrored through θ, no second draw)."""
    model = Wide()
    params = trainable_parameters(model)
    theta = [p.detach().clone() for _, p in params]
    storage = [p.data_ptr() for _, p in params]
    seen = []

    def loss(m, idx):
        seen.append([p.detach().clone() for _, p in params])
        return m(idx)

    spare = [torch.empty_like(p) for _, p in params]
    spsa_losses(model, params, loss, torch.arange(8), [3, 4], eps=2e-3, kind=kind, spare=spare)
    for i, seed in enumerate([3, 4]):
        z = list(iter_z(params, seed, kind))
        plus, minus = seen[2 * i : 2 * i + 2]
        assert all(torch.equal(g, torch.add(t, zz, alpha=2e-3)) for g, t, zz in zip(plus, theta, z))
        # θ − εz as the mirror of a = fl(θ + εz) through θ (lerp, weight 2), against fl(θ − fl(εz)): a errs by at
        # most u·(|θ| + 2ε|z|) (the product and the sum), the mirror adds a rounding of θ − a and of its result,
        # the reference one of εz and one of its result; u = 2^-24: in all < 4u·(|θ| + 2ε|z|) = 2^-22·(…)
        assert all(
            ((g.double() - (t - 2e-3 * zz).double()).abs() <= 2.0**-22 * (t.abs() + 4e-3 * zz.abs())).all()
            for g, t, zz in zip(minus, theta, z)
        )
    assert [p.data_ptr() for _, p in params] == storage  # parked and swapped back, not copied
    assert all(torch.equal(p, t) for (_, p), t in zip(params, theta))


def test_restores_modes_and_weights_even_if_the_loss_fails():
    model = mlp(dropout=0.5)
    model.train()
    model[3].eval()
    params = trainable_parameters(model)
    before = bits(params)

    def boom(m, b):
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError):
        spsa_projected_grad(model, params, boom, batch_for(), 1)
    assert all(torch.equal(a, b) for a, b in zip(before, bits(params)))
    g1 = spsa_projected_grad(model, params, mse, batch_for(), 1)
    g2 = spsa_projected_grad(model, params, mse, batch_for(), 1)
    assert g1 == g2  # eval mode inside: dropout off, so the estimate is deterministic
    assert [m.training for m in model.modules()] == [True, True, True, True, False]


@pytest.mark.parametrize("kind", KINDS)
def test_projected_gradient_matches_autograd_directional_derivative(kind):
    model = mlp(dtype=torch.float64)
    params = trainable_parameters(model)
    batch = batch_for(torch.float64)
    for seed in (11, 12, 13):
        g = spsa_projected_grad(model, params, mse, batch, seed, eps=1e-5, kind=kind)
        model.zero_grad()
        mse(model, batch).backward()
        exact = sum(float((p.grad * z).sum()) for (_, p), z in zip(params, iter_z(params, seed, kind)))
        assert g == pytest.approx(exact, rel=1e-6, abs=1e-9)


# ------------------------------------------------------------------------------ codecs


_rng = np.random.default_rng(0)
VALUES = (
    [0.0, 1e-12, -1e-12, 4e-4, 6e-4, -7e-4, 1e-3, -1e-3, 0.0123, -0.5, 1.0, 3.7, -42.0, 999.0, 1e3, 1e4]
    + _rng.normal(0, 1, 2000).tolist()
    + (_rng.choice([-1, 1], 2000) * 10 ** _rng.uniform(-6, 6, 2000)).tolist()
    + [-1e30]  # last: overflows float32
)


def test_log_codec_error_bounds():
    c = codec_for("log", g_min=1e-3, g_max=1e3)
    assert c.nbytes == 1 and c.max_rel_error == pytest.approx(0.0564, abs=1e-4)
    assert c.levels[-1] == pytest.approx(1e3, rel=1e-12)
    assert c.decode(c.encode(0.0)) == 0.0
    for g in VALUES:
        code = c.encode(g)
        assert 0 <= code <= 255
        d = c.decode(code)
        assert d == 0.0 or math.copysign(1, d) == math.copysign(1, g)
        if abs(g) > 1e3:
            assert d == math.copysign(c.levels[-1], g)
        elif abs(g) >= 1e-3:
            assert abs(d - g) <= c.max_rel_error * abs(g) * (1 + 1e-9)
        else:
            assert abs(d - g) <= 0.5e-3 * (1 + 1e-9)
    assert len({c.encode(g) for g in VALUES}) > 200  # the byte is actually used


def test_linear_codec_error_bounds():
    c = codec_for("linear", scale=0.01)
    for g in VALUES:
        code = c.encode(g)
        assert 1 <= code <= 255
        d = c.decode(code)
        if abs(g) <= 1.275:
            assert abs(d - g) <= c.max_abs_error * (1 + 1e-9)
        else:
            assert d == pytest.approx(math.copysign(1.27, g))


def test_float32_codec_is_float32_rounding_and_rejects_non_finite():
    c = codec_for("float32")
    assert c.nbytes == 4
    for g in VALUES[:-1]:
        assert c.decode(c.encode(g)) == float(np.float32(g))
    for codec in (c, codec_for("log"), codec_for("linear")):
        for bad in (math.nan, math.inf):
            with pytest.raises(ValueError):
                codec.encode(bad)
    with pytest.raises(ValueError):
        c.encode(1e40)


@pytest.mark.parametrize("name", ["log", "linear", "float32"])
def test_codec_bytes_round_trip(name):
    c = codec_for(name)
    gs = VALUES[:-1]
    data = c.to_bytes(gs)
    assert isinstance(data, bytes) and len(data) == len(gs) * c.nbytes
    assert c.from_bytes(data) == [c.decode(c.encode(g)) for g in gs]


# ------------------------------------------------------------------------------ replay


def apply_step_cfg(kind="rademacher"):
    return dict(lr=0.02, weight_decay=0.1, kind=kind)


def test_apply_step_matches_formula():
    model = mlp()
    params = trainable_parameters(model)
    theta = [p.detach().double().clone() for _, p in params]
    updates = [(101, 0.7), (102, -1.3), (103, 0.2)]
    apply_step_(params, updates, lr=0.05, weight_decay=0.1)
    mask = decay_mask(params)
    expected = [0.05 * 0.1 * t * d for t, d in zip(theta, mask)]
    for seed, g in updates:
        expected = [e + 0.05 * g / 3 * z.double() for e, z in zip(expected, iter_z(params, seed))]
    # float32 against the float64 formula: the decay rounds its factor and its product (2u·|θ|), each update
    # its coefficient α = lr·g/M, its product and its sum (2u·|α·z| + u·|θ'|, |θ'| ≤ |θ| + Σ|α·z|); with
    # u = 2^-24 and 3 updates, in all ≤ 5u·(|θ| + Σ_m |α_m·z_m|) < 2^-21·(…)
    size = [0.05 * 0.1 * t.abs() for t in theta]
    for seed, g in updates:
        size = [s + abs(0.05 * g / 3) * z.double().abs() for s, z in zip(size, iter_z(params, seed))]
    for t, e, s, (_, p) in zip(theta, expected, size, params):
        assert ((p.double() - (t - e)).abs() <= 2.0**-21 * (t.abs() + s)).all()
    with pytest.raises(ValueError):
        apply_step_(params, [], lr=0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_one_pass_step_is_bitwise_one_pass_per_update(kind):
    """apply_step_ applies every update chunk by chunk; the bits must be those of decay, then
    one whole pass per update."""
    fused, passes = trainable_parameters(Wide()), trainable_parameters(Wide())
    updates = [(101, 0.7), (102, -1.3), (103, 0.2)]
    apply_step_(fused, updates, lr=0.05, weight_decay=0.1, kind=kind)
    with torch.no_grad():
        for (_, p), d in zip(passes, decay_mask(passes)):
            if d:
                p.mul_(1 - 0.05 * 0.1)
    for seed, g in updates:
        apply_update_(passes, seed, 0.05 * g / 3, kind)
    assert parameter_hash(fused) == parameter_hash(passes)


def run_nodes(nodes=2, samples=2, steps=6, codec=None, kind="rademacher", checkpoint_at=None):
    """Simulated run: each node estimates on its own shard, all apply the shared log."""
    codec = codec or codec_for("log")
    schedule = SeedSchedule(42)
    replicas = [mlp() for _ in range(nodes)]
    params = [trainable_parameters(m) for m in replicas]
    shards = [batch_for(seed=10 + n) for n in range(nodes)]
    log, checkpoint = ReplayLog(), None
    for step in range(steps):
        if step == checkpoint_at:
            checkpoint = copy.deepcopy(replicas[0])
        for n in range(nodes):
            seeds = step_seeds(schedule, step, n, samples)
            gs = spsa_projected_grads(replicas[n], params[n], mse, shards[n], seeds, kind=kind)
            for s, code in enumerate(codec.unpack(codec.to_bytes(gs))):  # what crosses the store
                log.append(step, n, s, code)
        for p in params:
            apply_step_(p, log.step_updates(step, schedule, codec), **apply_step_cfg(kind))
    return replicas, log, schedule, codec, checkpoint


@pytest.mark.parametrize("kind", KINDS)
def test_replicas_stay_identical_and_replay_reproduces_them(kind):
    replicas, log, schedule, codec, checkpoint = run_nodes(kind=kind, checkpoint_at=3)
    hashes = {parameter_hash(trainable_parameters(m)) for m in replicas}
    assert len(hashes) == 1
    final = hashes.pop()
    assert final != parameter_hash(trainable_parameters(mlp()))
    assert len(log) == 6 * 2 * 2

    received = ReplayLog.from_bytes(log.to_bytes())
    fresh = trainable_parameters(mlp())
    cfg = dict(schedule=schedule, codec=codec, **apply_step_cfg(kind))
    assert received.replay_(fresh, 0, 6, **cfg) == 6
    assert parameter_hash(fresh) == final

    joiner = trainable_parameters(checkpoint)  # checkpoint taken before step 3
    assert received.replay_(joiner, 3, 10, **cfg) == 3
    assert parameter_hash(joiner) == final

    skipped = trainable_parameters(mlp())
    received.replay_(skipped, 1, 6, **cfg)
    assert parameter_hash(skipped) != final


def test_replay_order_is_independent_of_arrival_order_and_duplicates_are_refused():
    _, log, schedule, codec, _ = run_nodes(steps=3)
    rows = np.frombuffer(log.to_bytes(), dtype=ReplayLog._DTYPE)[::-1]
    shuffled = ReplayLog()
    for step, node, sample, code in rows.tolist():
        shuffled.append(step, node, sample, code)
    assert shuffled.to_bytes() == log.to_bytes()
    a, b = trainable_parameters(mlp()), trainable_parameters(mlp())
    cfg = dict(schedule=schedule, codec=codec, **apply_step_cfg())
    log.replay_(a, 0, 3, **cfg)
    shuffled.replay_(b, 0, 3, **cfg)
    assert parameter_hash(a) == parameter_hash(b)
    with pytest.raises(ValueError):
        shuffled.append(*rows[0].tolist())


# ------------------------------------------------------------------------------ learning


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec_name", ["log", "float32"])
def test_spsa_reduces_loss_on_a_convex_problem(kind, codec_name):
    model, batch, params = convex_problem()
    schedule, codec = SeedSchedule(3), codec_for(codec_name)
    with torch.no_grad():
        start = float(mse(model, batch))
    for step in range(60):
        seeds = step_seeds(schedule, step, 0, 4)
        gs = spsa_projected_grads(model, params, mse, batch, seeds, kind=kind)
        decoded = [(s, codec.decode(codec.encode(v))) for s, v in zip(seeds, gs)]
        apply_step_(params, decoded, lr=0.05, kind=kind)
    with torch.no_grad():
        assert float(mse(model, batch)) < 0.02 * start


# ------------------------------------------------------------------------------ Replica


@pytest.mark.parametrize("kind", KINDS)
def test_replicas_exchanging_codes_match_the_reference_and_time_their_parts(kind):
    """Two `Replica`s publishing and applying each other's codes end bit-identical to the
    functions run by hand (`run_nodes`), and account each part of their steps."""
    reps = [Replica(mlp(), n, 42, codec_for("log"), eps=1e-3, samples=2, **apply_step_cfg(kind)) for n in range(2)]
    for _ in range(6):
        payloads = [r.compute(mse, batch_for(seed=10 + r.node))[0] for r in reps]
        for r in reps:
            r.apply([0, 1], payloads[1 - r.node])
    reference = run_nodes(kind=kind)[0][0]
    assert {parameter_hash(r.params) for r in reps} == {parameter_hash(trainable_parameters(reference))}
    assert all(t > 0 for r in reps for t in r.times.values())
    assert sorted(reps[0].times) == ["forward_minus_s", "forward_plus_s", "perturb_s", "replay_s"]
