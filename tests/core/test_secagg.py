"""core.secagg: pairwise masks cancel exactly in the members' sum, a masked payload's bytes look uniform,
nothing that leaves a node carries a pair secret or key, a round masked again among survivors is exact and
fresh, fewer than 3 members are refused, and the wire packs exactly n bits an entry."""

import itertools
import pickle

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from raylowcomm.core.secagg import (
    CodeSpec,
    Roster,
    SecAggNode,
    add_masked,
    pack_bits,
    shifted_codes,
    signed_sum,
    unpack_bits,
)

RUN = "test-roster"
FALSE_ALARM = 1e-6  # the chi-square test's probability of failing on truly uniform bytes


def _group(ids, run=RUN):
    nodes = {i: SecAggNode(i) for i in ids}
    roster = Roster(run, {i: node.public for i, node in nodes.items()})
    for node in nodes.values():
        node.join(roster)
    return nodes, roster


def unmask_sum(payloads, spec, count):
    """Σq of the members' masked payloads: their sum modulo 2^n, less the offsets."""
    return signed_sum(add_masked(payloads, spec, count), spec, count, len(payloads))


def _codes(rng, spec, size):
    return rng.integers(-spec.offset, 2**spec.bits - spec.offset, size=size, dtype=np.int64)


@pytest.mark.parametrize(("n", "bits"), [*itertools.product([3, 4, 8], [2, 4, 8]), (3, 16), (4, 62)])
def test_masks_cancel_in_the_sum(n, bits):
    rng = np.random.default_rng(1000 * n + bits)
    nodes, _ = _group(range(n))
    spec = CodeSpec(bits, n)
    codes = {i: _codes(rng, spec, 201) for i in nodes}
    payloads = [node.mask(codes[i], spec, "round=5", nodes) for i, node in nodes.items()]
    assert all(len(p) == spec.nbytes(201) for p in payloads)
    assert np.array_equal(unmask_sum(payloads, spec, 201), sum(codes.values()))


def test_unsigned_codes_add_up_to_the_width_of_their_sum():
    """Fixed-point magnitudes: 48-bit unsigned words, the largest of each on every node."""
    nodes, _ = _group(range(5))
    spec = CodeSpec(48, 5, signed=False)
    top = np.full(7, 2**48 - 1, dtype=np.int64)
    payloads = [node.mask(top, spec, "scales", nodes) for node in nodes.values()]
    assert spec.needed_bits == 51
    assert unmask_sum(payloads, spec, 7).tolist() == [5 * (2**48 - 1)] * 7


def test_torch_codes_are_accepted():
    nodes, _ = _group(range(3))
    spec = CodeSpec(2, 3)
    payloads = [node.mask(torch.tensor([-2, -1, 0, 1], dtype=torch.int8), spec, "r", nodes) for node in nodes.values()]
    assert unmask_sum(payloads, spec, 4).tolist() == [-6, -3, 0, 3]


@pytest.mark.parametrize(("bits", "n", "needed", "word"), [(2, 3, 4, 1), (2, 4, 4, 1), (2, 5, 5, 1), (8, 4, 10, 2)])
def test_the_width_is_the_bits_of_the_sum(bits, n, needed, word):
    spec = CodeSpec(bits, n)
    assert (spec.needed_bits, spec.dtype.itemsize) == (needed, word)
    assert spec.nbytes(1000) == -(-1000 * needed // 8)


@pytest.mark.parametrize(("n", "count"), [(1, 9), (3, 17), (4, 1000), (4, 999), (7, 3), (10, 2**20 + 5), (51, 64)])
def test_bit_packing_round_trips(n, count):
    rng = np.random.default_rng(n)
    dtype = np.dtype(f"<u{next(w for w in (8, 16, 32, 64) if w >= n) // 8}")
    words = rng.integers(0, 2**n, size=count, dtype=np.uint64).astype(dtype)
    data = pack_bits(words, n)
    assert len(data) == -(-count * n // 8)
    assert np.array_equal(unpack_bits(data, n, count, dtype), words)


@pytest.mark.parametrize(("bits", "n"), [(2, 4), (4, 4), (6, 8), (16, 3)])
def test_a_masked_payload_is_uniform_bytes(bits, n):
    """Constant codes (all 0), so any structure in the bytes would come from the masks. n-bit words packed
    back to back are uniform bytes when the words are uniform; over 2^16 bytes the 256 values' counts give
    a chi-square statistic of 255 degrees of freedom, whose (1 - 1e-6) quantile is the bound: truly
    uniform bytes fail once in a million runs."""
    nodes, _ = _group(range(n))
    spec = CodeSpec(bits, n)
    count = 2**19 // spec.needed_bits  # about 2^16 bytes
    data = np.frombuffer(nodes[1].mask(np.zeros(count, dtype=np.int64), spec, "r", nodes), dtype=np.uint8)
    counts = np.bincount(data, minlength=256)
    expected = data.size / 256
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi2.isf(FALSE_ALARM, df=255)


def test_nothing_that_leaves_a_node_carries_a_pair_secret_or_key():
    nodes, roster = _group(range(4))
    spec = CodeSpec(4, 4)
    payloads = [node.mask(np.zeros(4096, dtype=np.int64), spec, "r", nodes) for node in nodes.values()]
    secrets = []
    for i, j in itertools.combinations(nodes, 2):
        peer = nodes[j]._private.public_key()
        secrets += [nodes[i]._private.exchange(peer), nodes[i]._pair_keys[j], nodes[i]._mask_key(j, "r", (0, 1, 2, 3))]
        assert nodes[i]._pair_keys[j] == nodes[j]._pair_keys[i]  # both ends derive the same pair key
    secrets += [n._private.private_bytes_raw() for n in nodes.values()]
    for blob, secret in itertools.product([pickle.dumps(roster), *roster.publics.values(), *payloads], secrets):
        assert secret not in blob
    with pytest.raises(TypeError, match="stays on its node"):
        pickle.dumps(nodes[0])


def test_a_round_masked_again_among_survivors_is_their_exact_sum_under_fresh_masks():
    """Node 2 masked and was lost: the other three mask the same codes again among themselves. Their sum is
    exact and every pair's mask is new (the members are part of the key)."""
    rng = np.random.default_rng(7)
    nodes, _ = _group(range(4))
    spec = CodeSpec(2, 4)
    codes = {i: _codes(rng, spec, 500) for i in nodes}
    first = {i: nodes[i].mask(codes[i], spec, "round=3", range(4)) for i in nodes}
    survivors = (0, 1, 3)
    again = {i: nodes[i].mask(codes[i], spec, "round=3", survivors) for i in survivors}
    assert np.array_equal(unmask_sum(list(again.values()), spec, 500), sum(codes[i] for i in survivors))
    assert all(again[i] != first[i] for i in survivors)


def test_fewer_than_three_members_are_refused():
    nodes = {i: SecAggNode(i) for i in range(3)}
    with pytest.raises(ValueError, match="at least 3 nodes.*reveal the other's"):
        Roster(RUN, {i: nodes[i].public for i in range(2)})
    with pytest.raises(ValueError, match="at least 3 nodes"):
        CodeSpec(4, 2)
    nodes, _ = _group(range(3))
    spec = CodeSpec(4, 3)
    with pytest.raises(ValueError, match="at least 3 nodes"):
        nodes[0].mask(np.zeros(8, dtype=np.int64), spec, "r", (0, 1))
    payloads = [nodes[i].mask(np.zeros(8, dtype=np.int64), spec, "r", range(3)) for i in range(2)]
    with pytest.raises(ValueError, match="at least 3 nodes"):
        unmask_sum(payloads, spec, 8)


def test_masks_are_deterministic_per_roster_slot_members_and_codes():
    rng = np.random.default_rng(0)
    nodes, _ = _group(range(3))
    spec = CodeSpec(8, 3)
    codes = _codes(rng, spec, 512)
    first = nodes[0].mask(codes, spec, "round=4", range(3))
    assert nodes[0].mask(codes.copy(), spec, "round=4", range(3)) == first  # a resend is the same bytes
    assert nodes[0].mask(codes, spec, "round=5", range(3)) != first
    with pytest.raises(ValueError, match="masked already with other codes"):
        nodes[0].mask(codes + (codes < 127), spec, "round=4", range(3))
    roster = Roster("another roster", {i: node.public for i, node in nodes.items()})
    for node in nodes.values():  # the same key pairs in a roster of another name: other pair keys, other masks
        node.join(roster)
    assert nodes[0].mask(codes, spec, "round=4", range(3)) != first
    nodes[0].forget("round=4")  # a landed round's record of what was masked goes
    assert nodes[0].mask(codes + (codes < 127), spec, "round=4", range(3))


def test_off_grid_codes_a_stranger_and_a_foreign_roster_are_refused():
    nodes, roster = _group(range(3))
    with pytest.raises(ValueError, match="outside"):
        nodes[0].mask(np.array([2]), CodeSpec(2, 3), "r", range(3))
    with pytest.raises(ValueError, match="integers"):
        nodes[0].mask(np.array([0.5]), CodeSpec(2, 3), "r", range(3))
    with pytest.raises(ValueError, match="no pair key with every member"):
        nodes[0].mask(np.array([0]), CodeSpec(2, 4), "r", range(4))
    with pytest.raises(ValueError, match="does not carry node 0"):
        SecAggNode(0).join(roster)
    assert shifted_codes(np.array([-2, 1]), CodeSpec(2, 3)).tolist() == [0, 3]
