"""Distributed differential privacy for a node's round update (`../shared/TRUST.md`; McMahan et al. 2018,
"Learning Differentially Private Recurrent Language Models", DP-FedAvg; Kairouz et al. 2021, "The
Distributed Discrete Gaussian Mechanism"). Plain torch, numpy and cryptography; opacus for the accounting.

The mechanism, per round and node:
1. Clip: the node's whole Δ (every tensor it sends, one L2 norm over all of them) is scaled down to norm
   at most C (`clip_update`). A node's whole data moves its Δ by at most C, whatever it holds: the
   privacy unit is the node, which covers any one example of it too.
2. Noise: every entry gets Gaussian noise of standard deviation σ·C/√N (`add_noise`), N the nodes in the
   round. The sum of the N noised updates carries noise of standard deviation σ·C, the Gaussian
   mechanism of noise multiplier σ on the sum, whose sensitivity to one node is C.
3. Accounting (`epsilon_of`, `noise_for`): opacus's Rényi-DP accountant over the rounds, each a Gaussian
   mechanism of multiplier σ on the sum at sample rate 1 (every node's Δ is in every round).

The noise is not drawn from torch's or numpy's generators seeded by the run's seed: anyone holding the
config could draw it again and subtract it. It comes from a ChaCha20 keystream (the `cryptography`
package) under a key derived by HKDF-SHA256 from a secret of the node's own (`new_secret`, 32 bytes of
`os.urandom`, never sent) and the send's place (round, step, tensor name): the same secret and place
give the same noise, so a restarted node sends the same bytes again. The keystream's 64-bit words become
uniforms in (0, 1) and then normals by Box–Muller in float64. Floating-point sampling of a Gaussian is
not an exact Gaussian (Mironov 2012, "On Significance of the Least Significant Bits for Differential
Privacy"): the guarantee is the one of the ideal mechanism the float64 draws approximate.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

SECRET_BYTES = 32
"""The size of a node's noise secret (a ChaCha20 key's)."""
_INFO = b"raylowcomm dp noise v1"
_MAX_ENTRIES = 2**35  # ChaCha20's 32-bit block counter: 2^32 blocks of 64 bytes, 8 bytes an entry


def new_secret() -> bytes:
    """A node's noise secret: 32 bytes from the operating system's generator, made on the node, kept there."""
    return os.urandom(SECRET_BYTES)


def update_norm(delta: dict[str, Tensor]) -> float:
    """The L2 norm over every tensor of `delta`, in float64, summed in the names' sorted order (the same
    bits whatever order the dict has)."""
    total = 0.0
    for name in sorted(delta):
        total += float(delta[name].to(torch.float64).square().sum())
    return math.sqrt(total)


def clip_update(delta: dict[str, Tensor], clip: float) -> tuple[dict[str, Tensor], float]:
    """`delta` scaled to L2 norm at most `clip` (one factor for every tensor), and its norm before. An
    update within the bound is returned as it is (the same tensors); one over it, as new tensors."""
    if not clip > 0:
        raise ValueError(f"the clipping bound must be > 0, not {clip}")
    norm = update_norm(delta)
    if norm <= clip:
        return delta, norm
    factor = clip / norm
    return {k: d * factor for k, d in delta.items()}, norm


def _stream_key(secret: bytes, place: tuple[int, ...], name: str) -> bytes:
    """The ChaCha20 key of one tensor's noise: HKDF-SHA256 of the node's secret, bound to the send's place
    (round, step, ...) and the tensor's name, so no two sends of a node share a noise vector."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a noise secret has {SECRET_BYTES} bytes, not {len(secret)}")
    info = _INFO + struct.pack(f"<{len(place)}q", *place) + b"\x00" + name.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def uniforms(key: bytes, count: int) -> np.ndarray:
    """`count` float64 uniforms in (0, 1) from the ChaCha20 keystream under `key` (zero nonce: the key is
    used for this stream only): each the top 53 bits k of a little-endian 64-bit word, as (k + 1/2)/2^53,
    so neither 0 nor 1 comes out (Box–Muller takes a logarithm)."""
    if count > _MAX_ENTRIES:
        raise ValueError(f"one tensor's noise takes at most {_MAX_ENTRIES} entries, not {count}")
    encryptor = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor()
    words = np.frombuffer(encryptor.update(b"\x00" * (8 * count)), dtype="<u8")
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def normals(key: bytes, count: int) -> Tensor:
    """`count` standard normals in float64 from the keystream under `key`, by Box–Muller on pairs of
    uniforms (the first half of the pairs' cosines, then their sines)."""
    pairs = (count + 1) // 2
    u = uniforms(key, 2 * pairs)
    radius = np.sqrt(-2.0 * np.log(u[:pairs]))
    angle = 2.0 * math.pi * u[pairs:]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    return torch.from_numpy(z)


def noise_std(noise_multiplier: float, clip: float, nodes: int) -> float:
    """The standard deviation each node adds to each entry: σ·C/√N, so that the N nodes' sum carries σ·C."""
    return noise_multiplier * clip / math.sqrt(nodes)


def add_noise(delta: dict[str, Tensor], std: float, secret: bytes, place: tuple[int, ...]) -> dict[str, Tensor]:
    """`delta` plus Gaussian noise of standard deviation `std` per entry, drawn in float64 from the
    node's `secret` and the send's `place` (round, step, ...) per tensor name; each tensor keeps its dtype
    and device. Deterministic in (secret, place, name): a resent update is the same bytes."""
    out = {}
    for name, d in delta.items():
        z = normals(_stream_key(secret, place, name), d.numel()).reshape(d.shape)
        out[name] = (d.to(torch.float64).cpu() + std * z).to(d.dtype).to(d.device)
    return out


def privatize(
    delta: dict[str, Tensor], clip: float, noise_multiplier: float, nodes: int, secret: bytes, place: tuple[int, ...]
) -> dict[str, Tensor]:
    """A node's update as it may leave the node: clipped to `clip`, then noised (`add_noise`) with σ·C/√N.
    Its norm before clipping is data the noise does not cover: it is not returned, to be logged nowhere."""
    clipped, _ = clip_update(delta, clip)
    return add_noise(clipped, noise_std(noise_multiplier, clip, nodes), secret, place)


def epsilon_of(noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε after `rounds` Gaussian mechanisms of multiplier σ at (ε, δ)-DP, by opacus's `RDPAccountant` at
    sample rate 1: every node's update is in every round. For quorum rounds, where a node may miss a
    round, rate 1 overstates ε: a conservative bound."""
    if rounds < 1:
        return 0.0
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, 1.0, rounds)]
    with _quiet():
        return float(accountant.get_epsilon(delta=delta))


def noise_for(epsilon: float, rounds: int, delta: float) -> float:
    """The smallest σ (within opacus's search tolerance) whose ε over `rounds` is at most `epsilon`
    (opacus's `get_noise_multiplier`, RDP at sample rate 1: conservative where a node may miss a round);
    ValueError where no σ opacus searches fits."""
    from opacus.accountants.utils import get_noise_multiplier

    with _quiet():
        return float(
            get_noise_multiplier(
                target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=rounds, accountant="rdp"
            )
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """opacus warns where the best Rényi order is the largest it tries: ε is then an upper bound looser than it
    could be (never below the truth). Silenced, so that a refusal stays one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        yield
