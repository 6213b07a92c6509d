"""core.secagg: pairwise masks cancel exactly in the sum, a masked payload's bytes look uniform, the
driver's objects carry no pair secret or key, a lost node's masks are removed from the survivors' sum,
fewer than 3 nodes are refused, and masks depend on the keys, round and codes only."""

import itertools
import pickle

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from raylowcomm.core.secagg import CodeSpec, Roster, SecAggNode, SecureSum, pair_mask, shifted_codes

RUN = "test-run"
FALSE_ALARM = 1e-6  # the chi-square test's probability of failing on truly uniform bytes


def _group(ids):
    nodes = {i: SecAggNode(RUN, i) for i in ids}
    roster = Roster(RUN, {i: node.public for i, node in nodes.items()})
    for node in nodes.values():
        node.join(roster)
    return nodes, roster


def _codes(rng, bits, shape):
    return rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), size=shape, dtype=np.int64)


@pytest.mark.parametrize(("n", "bits"), [*itertools.product([3, 4, 8], [2, 4, 8]), (3, 16), (4, 62)])
def test_masks_cancel_in_the_sum(n, bits):
    rng = np.random.default_rng(1000 * n + bits)
    nodes, roster = _group(range(n))
    spec = CodeSpec(bits, n)
    codes = {i: _codes(rng, bits, (3, 67)) for i in nodes}
    secure = SecureSum(roster, spec, round_=5)
    for i, node in nodes.items():
        secure.add(node.mask(codes[i], 5, spec))
    assert np.array_equal(secure.signed_sum(), sum(codes.values()))
    plain = sum(shifted_codes(c, spec) for c in codes.values())  # wraps mod 2^W like the masked sum
    assert np.array_equal(secure.total(), plain)
    assert secure.total().dtype == spec.dtype


def test_torch_codes_are_accepted():
    nodes, roster = _group(range(3))
    spec = CodeSpec(2, 3)
    codes = {i: torch.tensor([-2, -1, 0, 1], dtype=torch.int8) for i in nodes}
    secure = SecureSum(roster, spec, 0)
    for i, node in nodes.items():
        secure.add(node.mask(codes[i], 0, spec))
    assert secure.signed_sum().tolist() == [-6, -3, 0, 3]


@pytest.mark.parametrize(
    ("bits", "n", "width"), [(2, 3, 8), (4, 4, 8), (8, 8, 16), (9, 8, 16), (16, 3, 32), (8, 512, 32)]
)
def test_width_rule(bits, n, width):
    assert CodeSpec(bits, n).width == width


@pytest.mark.parametrize(("bits", "n"), [(4, 4), (8, 8), (16, 3)])
def test_a_masked_payload_is_uniform_bytes(bits, n):
    """Constant codes (all 0), so any structure in the bytes would come from the masks. Over 2^16
    entries the 256 byte values' counts give a chi-square statistic of 255 degrees of freedom; the bound
    is its (1 - 1e-6) quantile, so truly uniform bytes fail once in a million runs."""
    nodes, roster = _group(range(n))
    spec = CodeSpec(bits, n)
    payload = nodes[1].mask(np.zeros(2**16, dtype=np.int64), 3, spec)
    data = np.frombuffer(payload.data, dtype=np.uint8)
    assert data.size == 2**16 * spec.width // 8
    counts = np.bincount(data, minlength=256)
    expected = data.size / 256
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi2.isf(FALSE_ALARM, df=255)


def test_the_driver_sees_no_pair_secret_or_key():
    nodes, roster = _group(range(4))
    spec = CodeSpec(4, 4)
    payloads = [node.mask(np.zeros(4096, dtype=np.int64), 7, spec) for node in nodes.values()]
    secrets = []
    for i, j in itertools.combinations(nodes, 2):
        peer = nodes[j]._private.public_key()
        secrets += [nodes[i]._private.exchange(peer), nodes[i]._pair_keys[j], nodes[i]._round_key(j, 7)]
        assert nodes[i]._pair_keys[j] == nodes[j]._pair_keys[i]  # both ends derive the same pair key
    secrets += [n._private.private_bytes_raw() for n in nodes.values()]
    blobs = [pickle.dumps(roster), *roster.publics.values(), *(p.data for p in payloads)]
    blobs += [pickle.dumps(p) for p in payloads]
    for blob, secret in itertools.product(blobs, secrets):
        assert secret not in blob
    with pytest.raises(TypeError, match="stays on its node"):
        pickle.dumps(nodes[0])


@pytest.mark.parametrize(("ids", "lost"), [((0, 1, 2, 3), {2}), ((0, 3, 5, 9, 11, 20), {0, 11})])
def test_dropout_recovery_gives_the_survivors_sum(ids, lost):
    rng = np.random.default_rng(len(ids))
    nodes, roster = _group(ids)
    spec = CodeSpec(4, len(ids))
    codes = {i: _codes(rng, 4, 1000) for i in ids}
    payloads = {i: nodes[i].mask(codes[i], 2, spec) for i in ids}  # every node masked
    secure = SecureSum(roster, spec, 2)
    for i in ids:
        if i not in lost:
            secure.add(payloads[i])
    survivors = secure.close()
    assert secure.lost == lost
    with pytest.raises(ValueError, match="every survivor must reveal"):
        secure.total()
    reveals = [nodes[s].reveal(2, survivors) for s in sorted(survivors)]
    for reveal in reveals:  # keys with the lost nodes only, never between survivors
        assert set(reveal.keys) == lost
        blob = pickle.dumps(reveal)
        for other in survivors - {reveal.node}:
            assert nodes[reveal.node]._round_key(other, 2) not in blob
            assert nodes[reveal.node]._pair_keys[other] not in blob
    expected = sum(codes[s] for s in survivors)
    assert np.array_equal(secure.signed_sum(reveals), expected)
    with pytest.raises(ValueError, match="is closed"):  # a lost node reappearing is refused this round
        secure.add(payloads[min(lost)])
    with pytest.raises(ValueError, match="another survivor set"):
        nodes[min(survivors)].reveal(2, set(ids) - {max(survivors)})


def test_fewer_than_three_nodes_are_refused():
    nodes = {i: SecAggNode(RUN, i) for i in range(3)}
    with pytest.raises(ValueError, match="at least 3 nodes.*reveal the other's"):
        Roster(RUN, {i: nodes[i].public for i in range(2)})
    with pytest.raises(ValueError, match="at least 3 nodes"):
        CodeSpec(4, 2)
    roster = Roster(RUN, {i: node.public for i, node in nodes.items()})
    for node in nodes.values():
        node.join(roster)
    spec = CodeSpec(4, 3)
    secure = SecureSum(roster, spec, 0)
    for i in (0, 1):
        secure.add(nodes[i].mask(np.zeros(8, dtype=np.int64), 0, spec))
    with pytest.raises(ValueError, match="at least 3 nodes"):
        secure.close()
    with pytest.raises(ValueError, match="at least 3 nodes"):
        nodes[0].reveal(0, {0, 1})


def test_masks_are_deterministic_per_keys_round_and_codes():
    rng = np.random.default_rng(0)
    nodes, _ = _group(range(3))
    spec = CodeSpec(8, 3)
    codes = _codes(rng, 8, 512)
    first = nodes[0].mask(codes, 4, spec)
    assert nodes[0].mask(codes.copy(), 4, spec).data == first.data  # a resend is the same bytes
    other_round = nodes[0].mask(codes, 5, spec)
    assert other_round.data != first.data
    with pytest.raises(ValueError, match="masked already with other codes"):
        nodes[0].mask(codes + (codes < 127), 4, spec)
    key = bytes(range(32))
    assert np.array_equal(pair_mask(key, 1, 64, 16), pair_mask(key, 1, 64, 16))
    assert not np.array_equal(pair_mask(key, 1, 64, 16), pair_mask(key, 2, 64, 16))


def test_off_grid_codes_and_a_foreign_roster_are_refused():
    nodes, roster = _group(range(3))
    with pytest.raises(ValueError, match="outside"):
        nodes[0].mask(np.array([2]), 0, CodeSpec(2, 3))
    with pytest.raises(ValueError, match="integers"):
        nodes[0].mask(np.array([0.5]), 0, CodeSpec(2, 3))
    stranger = SecAggNode(RUN, 0)
    with pytest.raises(ValueError, match="does not carry node 0"):
        stranger.join(roster)
