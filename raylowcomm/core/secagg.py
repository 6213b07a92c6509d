"""Secure aggregation of integer codes by pairwise masks (`../shared/TRUST.md`; Bonawitz et al. 2017,
"Practical Secure Aggregation for Federated Learning on User-Held Data"). Plain numpy, no Ray.

What it is for: summable codes, every node quantised on the same grid, so the nodes' integer codes
add exactly. The driver receives only masked payloads, each uniformly random on its own, whose sum is
the nodes' code sum: the driver learns the sum and nothing about any one node's codes.

The protocol, for a run (a name) and nodes with integer ids:
1. Keys: each node makes an X25519 key pair (`SecAggNode`); the driver gathers the public keys into a
   `Roster` and hands it to every node. Each node derives, for each peer, the pair key
   HKDF-SHA256(X25519(own private, peer public), salt = the run, info = the pair's ids and public
   keys), and per round the round key HKDF-SHA256(pair key, info = the run, the pair, the round). A
   pair key needs a private key: the driver holds public keys and payloads only, and no function here
   takes two public keys. A node refuses to be pickled, so its keys do not travel by accident.
2. Masks: the mask of pair (i, j) in round r is the ChaCha20 keystream under the round key (nonce: a
   zero counter, r as 8 little-endian bytes, b"mask") read as little-endian unsigned W-bit integers,
   one per entry. Node i adds +mask for each peer j > i and -mask for each j < i, modulo 2^W, to its
   shifted codes u = q + 2^(b-1) (q in [-2^(b-1), 2^(b-1))). Each pair's masks cancel in the sum.
3. Width: W = the smallest of 8, 16, 32, 64 that is at least b + ceil(log2 N), N the roster's size.
   Each u is in [0, 2^b - 1], so a sum of at most N of them is at most N(2^b - 1) < 2^(b+ceil(log2 N))
   <= 2^W: the sum mod 2^W is the exact sum (no sign bit is needed: the codes are shifted, hence
   TRUST's "+1" is not). The signed sum is that minus n * 2^(b-1), n the nodes in the sum. The masks
   are uniform over the whole W-bit word, so every byte on the wire is uniform; a packing to exactly
   b + ceil(log2 N) bits (modulus 2^that) would also be exact and is a later wire optimisation.
4. Sum (`SecureSum`): the driver adds the payloads modulo 2^W.
5. Dropouts (SecAgg's recovery, with round keys in place of Shamir shares): when node d masked but
   its payload never arrived, the driver closes the round (`SecureSum.close`: the survivors are the
   nodes whose payloads arrived; nothing is accepted after) and sends the survivor set to every
   survivor; each reveals its round keys with the lost nodes only (`SecAggNode.reveal`), never with
   another survivor, and the driver removes those pair masks: the result is exactly the survivors'
   code sum. This reveals the masks between survivors and d for this round only (round keys, not
   pair keys: d's masks in other rounds stay secret, so it can rejoin the next round). It does not
   reveal d's codes: d's payload never arrived, and d's payload arriving late must be refused for
   that round, since with its pair masks known it would unmask to d's codes (`close` refuses it).

Threat covered: an honest-but-curious driver, and nodes that follow the protocol but pool what they
see. With pairwise masks over all pairs, the driver with any coalition of nodes learns only the sum
of the other nodes' codes, provided at least two honest nodes are in the sum. Refused: fewer than 3
nodes in a roster or in a sum, since with 2 the sum and one's own codes give the other's.

Not covered: a malicious driver. It could swap public keys (no authentication of keys here), or
claim a live node lost and obtain its round keys while holding its payload; a node answers one
survivor set per round (a second, different one is refused), but only SecAgg's double masking (a
self-mask with Shamir-shared seeds) closes that attack, not built here. Nor integrity: a node may send
any in-range codes, a wrong revealed key spoils the sum, and robust rules that need each update do
not compose with this (norm clipping before quantising does). Nor differential privacy: the sum is
released as is. Masking two different code vectors under the same round reveals their difference, so
a node masks one vector per round (repeating the same codes returns the same bytes, for a resend).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MIN_NODES = 3  # with 2, the sum and one's own codes reveal the other's
WIDTHS = (8, 16, 32, 64)  # storage words: numpy's unsigned dtypes, whose adds wrap modulo 2^W
_CHACHA_BLOCKS = 2**32  # ChaCha20's 32-bit block counter: at most 2^32 blocks of 64 bytes a stream


def _too_few(count: int, what: str) -> None:
    if count < MIN_NODES:
        raise ValueError(
            f"secure aggregation needs at least {MIN_NODES} nodes, {what} has {count}: with 2, the sum "
            "and one node's own codes reveal the other's"
        )


@dataclass(frozen=True)
class CodeSpec:
    """The shared grid: codes of `bits` bits (signed, in [-2^(b-1), 2^(b-1))) summed over at most
    `nodes` nodes; `width` is W (see the module's docstring), the modulus 2^W."""

    bits: int
    nodes: int

    def __post_init__(self) -> None:
        if self.bits < 1:
            raise ValueError(f"codes need at least 1 bit, got {self.bits}")
        _too_few(self.nodes, "the code spec")
        if self.needed_bits > WIDTHS[-1]:
            raise ValueError(f"a sum of {self.nodes} codes of {self.bits} bits needs {self.needed_bits} > 64 bits")

    @property
    def needed_bits(self) -> int:
        return self.bits + math.ceil(math.log2(self.nodes))

    @property
    def width(self) -> int:
        return next(w for w in WIDTHS if w >= self.needed_bits)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(f"<u{self.width // 8}")

    @property
    def offset(self) -> int:
        return 2 ** (self.bits - 1)


@dataclass(frozen=True)
class Roster:
    """What the driver gathers and hands out: the run's name and each node's raw X25519 public key."""

    run: str
    publics: Mapping[int, bytes]

    def __post_init__(self) -> None:
        _too_few(len(self.publics), "the roster")
        if any(len(key) != 32 for key in self.publics.values()):
            raise ValueError("X25519 public keys are 32 bytes")
        if len(set(self.publics.values())) != len(self.publics):
            raise ValueError("two nodes share a public key")


@dataclass(frozen=True)
class MaskedPayload:
    """One node's masked codes for one round: `data` is (u + its pair masks) mod 2^W, little-endian."""

    run: str
    round: int
    node: int
    spec: CodeSpec
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Reveal:
    """A survivor's round keys with the round's lost nodes (lost node → 32-byte round key)."""

    run: str
    round: int
    node: int
    keys: Mapping[int, bytes]


def _hkdf(key: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(key)


def _run_salt(run: str) -> bytes:
    return b"raylowcomm/secagg/v1/run=" + run.encode()


def round_key(pair_key: bytes, run: str, pair: tuple[int, int], round_: int) -> bytes:
    """The pair's key for one round: revealing it exposes that round's mask of the pair only."""
    info = f"round key|pair={min(pair)},{max(pair)}|round={round_}".encode()
    return _hkdf(pair_key, _run_salt(run), info)


def pair_mask(key: bytes, round_: int, count: int, width: int) -> np.ndarray:
    """`count` unsigned `width`-bit integers from ChaCha20 under `key`, the round in the nonce."""
    if not 0 <= round_ < 2**64:
        raise ValueError(f"a round is an integer in [0, 2^64), got {round_}")
    size = count * width // 8
    if size > _CHACHA_BLOCKS * 64:
        raise ValueError(f"{size} bytes of masks exceed one ChaCha20 stream")
    nonce = (0).to_bytes(4, "little") + round_.to_bytes(8, "little") + b"mask"
    stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(size))
    return np.frombuffer(stream, dtype=np.dtype(f"<u{width // 8}"))


def _sign(node: int, peer: int) -> int:
    return 1 if peer > node else -1


def _apply(total: np.ndarray, mask: np.ndarray, sign: int) -> None:
    if sign > 0:
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)


def shifted_codes(codes, spec: CodeSpec) -> np.ndarray:
    """Signed codes on the spec's grid as W-bit unsigned u = q + 2^(b-1); a code off the grid is refused
    (it would overflow the width and spoil every node's sum)."""
    array = np.asarray(codes)
    if array.dtype.kind not in "iu":
        raise ValueError(f"codes must be integers, got {array.dtype}")
    array = array.astype(np.int64)
    if array.size and (array.min() < -spec.offset or array.max() >= spec.offset):
        raise ValueError(f"codes outside [-{spec.offset}, {spec.offset}) for {spec.bits} bits")
    return (array + spec.offset).astype(spec.dtype)


@dataclass(eq=False)
class SecAggNode:
    """A node's side: its X25519 key pair for the run, its pair keys once it has the roster, the rounds
    it masked (one code vector a round) and the survivor set it answered each round."""

    run: str
    node: int
    _private: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _pair_keys: dict[int, bytes] = field(default_factory=dict, repr=False)
    _masked: dict[int, bytes] = field(default_factory=dict, repr=False)
    _answered: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)

    def __reduce__(self):
        raise TypeError("a SecAggNode holds a private key and pair keys: it stays on its node")

    @property
    def public(self) -> bytes:
        """The raw 32-byte public key: the only thing of this object the driver receives."""
        return self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def join(self, roster: Roster) -> None:
        """Derive a pair key with every other node of the roster (which must carry this node's key)."""
        if roster.run != self.run or roster.publics.get(self.node) != self.public:
            raise ValueError(f"the roster does not carry node {self.node}'s public key for run {self.run!r}")
        self._pair_keys = {}
        for peer, public in roster.publics.items():
            if peer == self.node:
                continue
            secret = self._private.exchange(X25519PublicKey.from_public_bytes(public))
            lo, hi = sorted((self.node, peer))
            info = f"pair key|pair={lo},{hi}|".encode() + roster.publics[lo] + roster.publics[hi]
            self._pair_keys[peer] = _hkdf(secret, _run_salt(self.run), info)

    def _round_key(self, peer: int, round_: int) -> bytes:
        return round_key(self._pair_keys[peer], self.run, (self.node, peer), round_)

    def mask(self, codes, round_: int, spec: CodeSpec) -> MaskedPayload:
        """This node's payload for the round; a second, different code vector for a round is refused."""
        if len(self._pair_keys) + 1 < MIN_NODES:
            raise ValueError("join a roster of at least 3 nodes before masking")
        shifted = shifted_codes(codes, spec)
        digest = hashlib.sha256(repr((spec, shifted.shape)).encode() + shifted.tobytes()).digest()
        if self._masked.setdefault(round_, digest) != digest:
            raise ValueError(f"round {round_} was masked already with other codes: the difference would leak")
        total = shifted.reshape(-1).copy()
        for peer in sorted(self._pair_keys):
            _apply(
                total, pair_mask(self._round_key(peer, round_), round_, total.size, spec.width), _sign(self.node, peer)
            )
        return MaskedPayload(self.run, round_, self.node, spec, tuple(shifted.shape), total.tobytes())

    def reveal(self, round_: int, survivors: Iterable[int]) -> Reveal:
        """Round keys with the nodes outside `survivors` only; one survivor set a round is answered."""
        survivors = frozenset(survivors)
        if self.node not in survivors:
            raise ValueError(f"node {self.node} is not among the survivors it is asked to reveal for")
        if round_ not in self._masked:
            raise ValueError(f"node {self.node} did not mask round {round_}")
        _too_few(len(survivors), "the survivor set")
        if self._answered.setdefault(round_, survivors) != survivors:
            raise ValueError(f"round {round_} was answered for another survivor set: a second one could unmask")
        lost = sorted(set(self._pair_keys) - survivors)
        return Reveal(self.run, round_, self.node, {d: self._round_key(d, round_) for d in lost})


class SecureSum:
    """The driver's side of one round: add payloads, close, apply the survivors' reveals, read the sum."""

    def __init__(self, roster: Roster, spec: CodeSpec, round_: int) -> None:
        if spec.nodes < len(roster.publics):
            raise ValueError(f"the spec's width covers {spec.nodes} nodes, the roster has {len(roster.publics)}")
        self.roster, self.spec, self.round = roster, spec, round_
        self._payloads: dict[int, MaskedPayload] = {}
        self._survivors: frozenset[int] | None = None

    def add(self, payload: MaskedPayload) -> None:
        if self._survivors is not None:
            raise ValueError(
                f"round {self.round} is closed: node {payload.node}'s payload is refused, since the "
                "lost nodes' pair masks may be revealed and would unmask it"
            )
        if (payload.run, payload.round, payload.spec) != (self.roster.run, self.round, self.spec):
            raise ValueError(f"node {payload.node}'s payload is for another run, round or grid")
        if payload.node not in self.roster.publics or payload.node in self._payloads:
            raise ValueError(f"node {payload.node} is not in the roster or sent twice")
        self._payloads[payload.node] = payload

    def close(self) -> frozenset[int]:
        """Freeze the survivors (the nodes whose payloads arrived); returns them, to send to each."""
        if self._survivors is None:
            _too_few(len(self._payloads), "the round's survivors")
            shapes = {p.shape for p in self._payloads.values()}
            if len(shapes) != 1:
                raise ValueError(f"the payloads' shapes differ: {sorted(shapes)}")
            self._survivors = frozenset(self._payloads)
        return self._survivors

    @property
    def lost(self) -> frozenset[int]:
        return frozenset(self.roster.publics) - self.close()

    def total(self, reveals: Iterable[Reveal] = ()) -> np.ndarray:
        """Σ u over the survivors, exact (W-bit unsigned); with lost nodes, needs every survivor's reveal."""
        survivors, lost = self.close(), self.lost
        reveals = {r.node: r for r in reveals if (r.run, r.round) == (self.roster.run, self.round)}
        if lost and (set(reveals) != survivors or any(set(r.keys) != lost for r in reveals.values())):
            raise ValueError(f"nodes {sorted(lost)} are lost: every survivor must reveal its keys with them")
        payloads = [self._payloads[n] for n in sorted(survivors)]
        total = np.zeros(math.prod(payloads[0].shape), dtype=self.spec.dtype)
        for payload in payloads:
            np.add(total, np.frombuffer(payload.data, dtype=self.spec.dtype), out=total)
        for node in sorted(reveals if lost else ()):
            for d, key in sorted(reveals[node].keys.items()):
                _apply(total, pair_mask(key, self.round, total.size, self.spec.width), -_sign(node, d))
        return total.reshape(payloads[0].shape)

    def signed_sum(self, reveals: Iterable[Reveal] = ()) -> np.ndarray:
        """Σ q over the survivors: the total minus (number of survivors) · 2^(b-1), as int64."""
        total = self.total(reveals)
        if self.spec.width == 64:  # u64 sums may pass int64's range; the offset brings them back
            return (total - np.uint64(len(self.close()) * self.spec.offset)).view(np.int64)
        return total.astype(np.int64) - len(self.close()) * self.spec.offset
