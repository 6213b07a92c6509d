"""Distributed DP's core (`core.privacy`): clipping a node's whole Δ, the ChaCha20 Gaussian noise keyed
by the node's secret and the send's place, and opacus's accounting. No Ray."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.accountants import RDPAccountant

from raylowcomm.core import privacy

SECRET = bytes(range(32))


def test_a_delta_within_the_bound_is_returned_untouched():
    delta = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64)}
    clipped, norm = privacy.clip_update(delta, 5.0)
    assert norm == 5.0 and clipped is delta
    clipped, _ = privacy.clip_update(delta, 7.5)
    assert all(clipped[k] is delta[k] for k in delta)


def test_a_delta_over_the_bound_is_scaled_to_it_by_one_factor():
    delta = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64)}
    clipped, norm = privacy.clip_update(delta, 1.0)
    assert norm == 5.0
    assert all(torch.equal(clipped[k], delta[k] * (1.0 / 5.0)) for k in delta)  # the one factor C/‖Δ‖, exact
    assert privacy.update_norm(clipped) == pytest.approx(1.0, abs=1e-15)
    assert torch.equal(delta["a"], torch.tensor([3.0, 0.0], dtype=torch.float64))  # the caller's is left as it is


def test_the_norm_is_the_same_bits_whatever_the_dicts_order():
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(97, generator=gen, dtype=torch.float64) * 10**i for i in range(6)}
    backwards = dict(reversed(list(tensors.items())))
    assert privacy.update_norm(tensors) == privacy.update_norm(backwards)
    assert privacy.clip_update(tensors, 1.0)[0]["t3"].equal(privacy.clip_update(backwards, 1.0)[0]["t3"])


def test_clipping_refuses_a_bound_that_is_not_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        privacy.clip_update({"a": torch.ones(2)}, 0.0)


def zeros(n: int = 1000) -> dict:
    return {"w": torch.zeros(n, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}


def test_noise_is_the_same_for_the_same_secret_place_and_tensor():
    one = privacy.add_noise(zeros(), 1.0, SECRET, (1, 8, 0))
    again = privacy.add_noise(zeros(), 1.0, bytes(SECRET), (1, 8, 0))
    assert all(torch.equal(one[k], again[k]) for k in one)
    assert one["w"].abs().sum() > 0


@pytest.mark.parametrize(
    "secret, place",
    [(SECRET, (2, 8, 0)), (SECRET, (1, 9, 0)), (SECRET, (1, 8, 1)), (bytes(32), (1, 8, 0))],
    ids=["round", "step", "final", "secret"],
)
def test_noise_differs_across_rounds_steps_final_and_secrets(secret, place):
    base = privacy.add_noise(zeros(), 1.0, SECRET, (1, 8, 0))["w"]
    other = privacy.add_noise(zeros(), 1.0, secret, place)["w"]
    assert not torch.equal(base, other)
    assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1]) < 0.2  # independent draws, not shifted ones


def test_noise_differs_across_tensors_of_one_send():
    same = {"x": torch.zeros(500, dtype=torch.float64), "y": torch.zeros(500, dtype=torch.float64)}
    out = privacy.add_noise(same, 1.0, SECRET, (1, 8, 0))
    assert not torch.equal(out["x"], out["y"])


def test_noise_does_not_come_from_torchs_seeded_generator():
    torch.manual_seed(0)
    first = privacy.add_noise(zeros(), 1.0, SECRET, (1, 8, 0))["w"]
    torch.manual_seed(1)
    assert torch.equal(first, privacy.add_noise(zeros(), 1.0, SECRET, (1, 8, 0))["w"])
    assert not torch.equal(first, torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64))


def test_a_secret_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        privacy.add_noise(zeros(), 1.0, b"short", (1, 8, 0))


def test_noise_std_is_sigma_c_over_root_n_within_the_sampling_bound():
    """n draws of std s: the sample variance S² has (n−1)S²/s² ~ χ²(n−1), so S²/s² has mean 1 and standard
    deviation √(2/(n−1)); S/s − 1 ≈ (S²/s² − 1)/2 has standard deviation 1/√(2(n−1)). The mean has standard
    deviation s/√n; the share within one s, p = 0.6827 ± √(p(1−p)/n). Each is held to 6 of its deviations."""
    n, sigma, clip, nodes = 400_000, 1.3, 0.5, 4
    std = privacy.noise_std(sigma, clip, nodes)
    assert std == sigma * clip / 2
    delta = {"w": torch.full((n,), 10.0, dtype=torch.float64)}  # norm 10·√n, clipped to 0.5 first
    out = privacy.privatize(delta, clip, sigma, nodes, SECRET, (3, 24, 0))
    clipped = torch.full((n,), clip / math.sqrt(n), dtype=torch.float64)
    z = out["w"] - clipped
    assert abs(z.std().item() / std - 1) < 6 / math.sqrt(2 * (n - 1))
    assert abs(z.mean().item()) < 6 * std / math.sqrt(n)
    p = 0.6826894921370859
    assert abs((z.abs() < std).double().mean().item() - p) < 6 * math.sqrt(p * (1 - p) / n)


def test_noise_keeps_each_tensors_dtype():
    out = privacy.add_noise({"h": torch.zeros(4, dtype=torch.float32)}, 1.0, SECRET, (1, 1, 0))
    assert out["h"].dtype == torch.float32 and out["h"].abs().sum() > 0


def test_uniforms_stay_inside_the_open_interval():
    u = privacy.uniforms(bytes(32), 100_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


@pytest.mark.parametrize("sigma, rounds, delta", [(1.0, 1, 1e-5), (0.8, 20, 1e-5), (2.5, 300, 1e-6)])
def test_epsilon_is_opacus_rdp_accountants_for_the_same_sigma_and_rounds(sigma, rounds, delta):
    accountant = RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    assert privacy.epsilon_of(sigma, rounds, delta) == accountant.get_epsilon(delta=delta)


def test_more_rounds_or_less_noise_spend_more():
    assert privacy.epsilon_of(1.0, 10, 1e-5) < privacy.epsilon_of(1.0, 20, 1e-5)
    assert privacy.epsilon_of(2.0, 10, 1e-5) < privacy.epsilon_of(1.0, 10, 1e-5)


@pytest.mark.parametrize("epsilon, rounds", [(8.0, 10), (1.0, 3), (3.0, 200)])
def test_the_sigma_chosen_for_a_target_spends_at_most_it(epsilon, rounds):
    sigma = privacy.noise_for(epsilon, rounds, 1e-5)
    spent = privacy.epsilon_of(sigma, rounds, 1e-5)
    assert epsilon - 0.02 <= spent <= epsilon
    assert privacy.epsilon_of(0.97 * sigma, rounds, 1e-5) > spent  # not needlessly much noise either
