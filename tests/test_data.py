import torch

from raylowcomm.data import batch_order, shard_indices
from raylowcomm.training import batch_at


def test_shards_are_disjoint_and_complete():
    for n, k in [(10, 3), (4000, 2), (101, 7)]:
        shards = shard_indices(n, k, seed=3)
        joined = torch.cat(shards)
        assert len(joined) == n
        assert torch.equal(joined.sort().values, torch.arange(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shards_depend_on_seed_only():
    assert all(torch.equal(a, b) for a, b in zip(shard_indices(50, 2, 1), shard_indices(50, 2, 1)))
    assert not all(torch.equal(a, b) for a, b in zip(shard_indices(50, 2, 1), shard_indices(50, 2, 2)))


def test_batch_at_is_a_pure_function_of_step():
    shard = {"x": torch.arange(20)}
    epoch0 = torch.cat([b for b in batch_order(20, 5, seed=1, epoch=0)])
    assert torch.equal(epoch0.sort().values, torch.arange(20))
    assert torch.equal(batch_at(shard, 6, 5, seed=1)["x"], batch_at(shard, 6, 5, seed=1)["x"])
    assert not torch.equal(batch_at(shard, 0, 5, seed=1)["x"], batch_at(shard, 4, 5, seed=1)["x"])
