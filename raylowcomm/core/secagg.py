"""Secure aggregation of integer codes by pairwise masks (`../shared/TRUST.md`; Bonawitz et al. 2017,
"Practical Secure Aggregation for Federated Learning on User-Held Data"). Plain numpy, no Ray.

What it is for: summable codes, every node's codes on one grid, so that they add exactly. Whoever sums a
round (every peer, or the driver) reads only masked payloads, each uniformly random on its own, whose sum is
the nodes' code sum: it learns the sum and nothing about any one node's codes.

The protocol, for a roster (a name and each node's public key):
1. Keys: each node makes an X25519 key pair (`SecAggNode`); the driver gathers the public keys into a
   `Roster` and hands it to every node. Each node derives, for each peer, the pair key
   HKDF-SHA256(X25519(own private, peer public), salt = the roster's name, info = the pair's ids and public
   keys). A pair key needs a private key: the driver holds public keys and payloads only, and no function
   here takes two public keys. A node refuses to be pickled, so its keys do not travel by accident.
2. Masks: a payload is masked for a slot (a label naming the round and the tensor) among a set of members
   (the nodes whose payloads that sum will hold). The mask of pair (i, j) is the ChaCha20 keystream under
   HKDF(pair key, info = the pair, the slot and the members), read as little-endian unsigned integers, one
   per entry. Node i adds +mask for each member j > i and −mask for each j < i, modulo 2^n, to its shifted
   codes u = q + offset (`CodeSpec`). Each pair's masks cancel in the members' sum. A key is used for one
   stream only, so the nonce is constant.
3. Width: n = b + ceil(log2 N) bits, N the most nodes a sum holds. Each u is in [0, 2^b), so a sum of at
   most N of them is below N·2^b <= 2^n: the sum modulo 2^n is the exact sum. Masks are uniform modulo
   2^n, so every payload is uniform over n-bit words; the wire packs exactly n bits an entry (`pack_bits`).
4. Sum (`add_masked`, then `signed_sum`): the members' payloads added modulo 2^n, the offsets taken off.
   Every peer may add them, or the driver may, sending the sum back.
5. A member whose payload is lost: the round is masked again among the others (a different member set is
   a different key for every pair: fresh masks), and no key is revealed. Masking the same codes twice
   under independent masks reveals nothing on its own; but whoever held every first payload would hold
   the first sum, and the second sum taken from it is the lost member's codes. So a round is masked
   again only where nobody holds the lost payload (`lofi.secure` forwards a payload some member holds).
   Masking two different code vectors under the same masks reveals their difference, so a node refuses
   that.

Threat covered: an honest-but-curious driver, and nodes that follow the protocol but pool what they see:
with pairwise masks over all members, any coalition learns only the sum of the other members' codes,
provided at least two members outside it are in the sum. Refused: fewer than 3 members, since with 2 the
sum and one's own codes give the other's. Not covered: a malicious driver (it could swap public keys:
they are not authenticated here), integrity (a node may send any in-range codes), and what the sum itself
reveals (differential privacy's part). docs/privacy.md says this for users.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MIN_NODES = 3  # with 2, the sum and one's own codes reveal the other's
MAX_BITS = 64  # numpy's widest unsigned word, whose adds wrap modulo 2^64
PUBLIC_KEY_NBYTES = 32  # a raw X25519 public key
_CHACHA_BYTES = 2**32 * 64  # ChaCha20's 32-bit block counter: at most 2^32 blocks of 64 bytes a stream
_NONCE = bytes(16)  # every key masks one stream
_CHUNK = 1 << 20  # entries bit-packed at a time (a multiple of 8: each chunk ends on a byte)


def _too_few(count: int, what: str) -> None:
    if count < MIN_NODES:
        raise ValueError(
            f"secure aggregation needs at least {MIN_NODES} nodes, {what} has {count}: with 2, the sum "
            "and one node's own codes reveal the other's"
        )


@dataclass(frozen=True)
class CodeSpec:
    """Codes of `bits` bits summed over at most `nodes` nodes: signed codes in [-2^(b-1), 2^(b-1)), or
    unsigned ones in [0, 2^b) (`signed` false). `needed_bits` is n, the modulus 2^n (the module's step 3)."""

    bits: int
    nodes: int
    signed: bool = True

    def __post_init__(self) -> None:
        if self.bits < 1:
            raise ValueError(f"codes need at least 1 bit, got {self.bits}")
        _too_few(self.nodes, "the code spec")
        if self.needed_bits > MAX_BITS:
            raise ValueError(f"a sum of {self.nodes} codes of {self.bits} bits needs {self.needed_bits} > 64 bits")

    @property
    def needed_bits(self) -> int:
        return self.bits + math.ceil(math.log2(self.nodes))

    @property
    def dtype(self) -> np.dtype:
        """The unsigned word that holds n bits."""
        return np.dtype(f"<u{next(w for w in (8, 16, 32, 64) if w >= self.needed_bits) // 8}")

    @property
    def offset(self) -> int:
        return 2 ** (self.bits - 1) if self.signed else 0

    def nbytes(self, count: int) -> int:
        """Bytes of `count` masked entries on the wire: n bits each."""
        return (count * self.needed_bits + 7) // 8

    def reduce(self, words: np.ndarray) -> np.ndarray:
        """Words modulo 2^n, in place."""
        if self.needed_bits < MAX_BITS:
            np.bitwise_and(words, self.dtype.type((1 << self.needed_bits) - 1), out=words)
        return words


def pack_bits(words: np.ndarray, n: int) -> bytes:
    """The low `n` bits of each unsigned word, little-endian, back to back: ceil(count·n / 8) bytes."""
    flat = np.ascontiguousarray(words).reshape(-1)
    size = flat.dtype.itemsize
    if n == 8 * size:
        return flat.astype(flat.dtype.newbyteorder("<"), copy=False).tobytes()
    if n == 4:  # int2 codes summed over 3 or 4 nodes: two to a byte, the first in the low nibble
        nibbles = np.zeros(flat.size + flat.size % 2, dtype=np.uint8)
        nibbles[: flat.size] = flat
        return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    out = []
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK].astype(f"<u{size}").view(np.uint8).reshape(-1, size)
        bits = np.unpackbits(chunk, axis=1, bitorder="little")[:, :n]
        out.append(np.packbits(bits.reshape(-1), bitorder="little").tobytes())
    return b"".join(out)


def unpack_bits(data: bytes, n: int, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` words of `n` bits as `pack_bits` packed them, as unsigned `dtype`."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if len(data) != (count * n + 7) // 8:
        raise ValueError(f"{len(data)} bytes do not hold {count} words of {n} bits")
    if n == 8 * dtype.itemsize:
        return np.frombuffer(data, dtype=dtype).copy()
    raw, out = np.frombuffer(data, dtype=np.uint8), []
    if n == 4 and dtype.itemsize == 1:
        words = np.empty(2 * raw.size, dtype=dtype)
        words[0::2], words[1::2] = raw & 15, raw >> 4
        return words[:count]
    for start in range(0, count, _CHUNK):
        size = min(_CHUNK, count - start)
        first = start * n // 8  # a chunk starts on a byte: _CHUNK is a multiple of 8
        bits = np.unpackbits(raw[first : first + (size * n + 7) // 8], bitorder="little")[: size * n]
        words = np.zeros((size, 8 * dtype.itemsize), dtype=np.uint8)
        words[:, :n] = bits.reshape(size, n)
        out.append(np.packbits(words, axis=1, bitorder="little").reshape(-1).view(dtype))
    return np.concatenate(out) if out else np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class Roster:
    """What the driver gathers and hands out: the roster's name (fresh for each roster) and each node's raw
    X25519 public key."""

    run: str
    publics: Mapping[int, bytes]

    def __post_init__(self) -> None:
        _too_few(len(self.publics), "the roster")
        if any(len(key) != PUBLIC_KEY_NBYTES for key in self.publics.values()):
            raise ValueError("X25519 public keys are 32 bytes")
        if len(set(self.publics.values())) != len(self.publics):
            raise ValueError("two nodes share a public key")


def _hkdf(key: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(key)


def _salt(run: str) -> bytes:
    return b"raylowcomm/secagg/v2/roster=" + run.encode()


def pair_mask(key: bytes, count: int, spec: CodeSpec) -> np.ndarray:
    """`count` words of the spec's width from ChaCha20 under `key` (not yet reduced modulo 2^n)."""
    size = count * spec.dtype.itemsize
    if size > _CHACHA_BYTES:
        raise ValueError(f"{size} bytes of masks exceed one ChaCha20 stream")
    stream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor().update(bytes(size))
    return np.frombuffer(stream, dtype=spec.dtype)


def shifted_codes(codes, spec: CodeSpec) -> np.ndarray:
    """Codes on the spec's grid as unsigned words u = q + offset, flat; a code off the grid is refused (it
    would overflow the width and spoil every node's sum)."""
    array = np.asarray(codes)
    if array.dtype.kind not in "iu":
        raise ValueError(f"codes must be integers, got {array.dtype}")
    array = array.astype(np.int64).reshape(-1)
    if array.size and (array.min() < -spec.offset or array.max() >= 2**spec.bits - spec.offset):
        raise ValueError(f"codes outside [{-spec.offset}, {2**spec.bits - spec.offset}) for {spec.bits} bits")
    return (array + spec.offset).astype(spec.dtype)


@dataclass(eq=False)
class SecAggNode:
    """A node's side: its X25519 key pair, its pair keys once it has a roster, and what it masked in each
    (slot, members), so that it never masks two different code vectors under the same masks."""

    node: int
    _private: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _run: str | None = field(default=None, repr=False)
    _pair_keys: dict[int, bytes] = field(default_factory=dict, repr=False)
    _masked: dict[tuple, bytes] = field(default_factory=dict, repr=False)

    def __reduce__(self):
        raise TypeError("a SecAggNode holds a private key and pair keys: it stays on its node")

    @property
    def public(self) -> bytes:
        """The raw 32-byte public key: the only thing of this object the driver receives."""
        return self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def roster(self) -> str | None:
        """The name of the roster this node joined (None: none yet)."""
        return self._run

    def join(self, roster: Roster) -> None:
        """Derive a pair key with every other node of the roster (which must carry this node's key)."""
        if roster.publics.get(self.node) != self.public:
            raise ValueError(f"the roster {roster.run!r} does not carry node {self.node}'s public key")
        salt, keys = _salt(roster.run), {}
        for peer, public in roster.publics.items():
            if peer == self.node:
                continue
            secret = self._private.exchange(X25519PublicKey.from_public_bytes(public))
            lo, hi = sorted((self.node, peer))
            info = f"pair key|pair={lo},{hi}|".encode() + roster.publics[lo] + roster.publics[hi]
            keys[peer] = _hkdf(secret, salt, info)
        self._run, self._pair_keys, self._masked = roster.run, keys, {}

    def _mask_key(self, peer: int, slot: str, members: tuple[int, ...]) -> bytes:
        lo, hi = sorted((self.node, peer))
        fields = ("mask", f"{lo},{hi}", slot, ",".join(map(str, members)))
        info = "|".join(f"{len(f)}:{f}" for f in fields).encode()  # length-prefixed: no two tuples read alike
        return _hkdf(self._pair_keys[peer], _salt(self._run), info)

    def forget(self, prefix: str) -> None:
        """Forget what was masked in the slots that start with `prefix` (a landed round's: never masked again)."""
        self._masked = {key: digest for key, digest in self._masked.items() if not key[0].startswith(prefix)}

    def mask(self, codes, spec: CodeSpec, slot: str, members: Iterable[int]) -> bytes:
        """This node's codes masked for `slot` among `members` (itself among them), packed n bits an entry;
        a second, different code vector for the same slot and members is refused."""
        members = tuple(sorted(set(members)))
        _too_few(len(members), "the round's members")
        if self.node not in members or any(m != self.node and m not in self._pair_keys for m in members):
            raise ValueError(f"node {self.node} holds no pair key with every member of {list(members)}: join a roster")
        if len(members) > spec.nodes:
            raise ValueError(f"the spec's width covers {spec.nodes} nodes, the round has {len(members)}")
        words = shifted_codes(codes, spec)
        digest = hashlib.sha256(repr(spec).encode() + words.tobytes()).digest()
        if self._masked.setdefault((slot, members), digest) != digest:
            raise ValueError(f"{slot} was masked already with other codes: the difference would leak")
        for peer in members:
            if peer == self.node:
                continue
            mask = pair_mask(self._mask_key(peer, slot, members), words.size, spec)
            (np.add if peer > self.node else np.subtract)(words, mask, out=words)
        return pack_bits(spec.reduce(words), spec.needed_bits)


def add_masked(payloads: Sequence[bytes], spec: CodeSpec, count: int) -> bytes:
    """The members' payloads added modulo 2^n, packed as each was: their masks cancel only when every
    member's payload of one (slot, members) is here, and then this is Σu, the members' shifted codes'
    sum, no secret of any one member. Whoever adds them (every peer, or the driver for all) learns it."""
    _too_few(len(payloads), "the sum")
    if len(payloads) > spec.nodes:
        raise ValueError(f"the spec's width covers {spec.nodes} nodes, the sum has {len(payloads)}")
    total = np.zeros(count, dtype=spec.dtype)
    for data in payloads:
        np.add(total, unpack_bits(data, spec.needed_bits, count, spec.dtype), out=total)
    return pack_bits(spec.reduce(total), spec.needed_bits)


def signed_sum(total: bytes, spec: CodeSpec, count: int, members: int) -> np.ndarray:
    """Σ q as int64 from `add_masked`'s sum of `members` payloads: Σu less each member's offset."""
    words = unpack_bits(total, spec.needed_bits, count, spec.dtype)
    if spec.dtype.itemsize == 8:  # u64 sums may pass int64's range; the offset brings them back
        return (words - np.uint64(members * spec.offset)).view(np.int64)
    return words.astype(np.int64) - members * spec.offset
