"""Which rows a step trains on: dicts of tensors (`Split`), disjoint shards, each epoch's order and
batch as pure functions of (seed, step), so a resumed node, a DDP rank and an interlocking stage
all draw the same batches without talking to each other."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from raylowcomm.common.seeding import epoch_seed, group_order_seed

Split = dict[str, torch.Tensor]


def num_examples(split: Split) -> int:
    return len(next(iter(split.values())))


def take(split: Split, index: torch.Tensor) -> Split:
    return {k: v[index] for k, v in split.items()}


def shard_indices(n: int, num_shards: int, seed: int) -> list[torch.Tensor]:
    """Disjoint shards that together cover range(n), sizes differing by at most one."""
    if num_shards > n:
        raise ValueError(f"cannot split {n} examples into {num_shards} non-empty shards")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i::num_shards].sort().values for i in range(num_shards)]


@functools.lru_cache(maxsize=8)
def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """A shard's row order in epoch `epoch`, a pure function of (n, seed, epoch); cached, as
    every step of the epoch reads it and drawing it anew each step would cost a permutation of
    the whole shard per step.
    Callers index it and never write to it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))


GROUP_BATCHES = 8
"""optim.group_by_length sorts each run of 8 batches' rows by length: a batch trimmed to its
longest row then carries far less padding (docs/benchmarks.md has the main job's figures), while
the batches stay random in content; sorting the whole epoch would trim a little more but order
the epoch by length."""


def length_grouped_batch(
    mask: torch.Tensor, i: int, batch_size: int, seed: int, epoch: int, group_seed: int
) -> torch.Tensor:
    """Batch `i` of an epoch with rows of similar length together (rows of `mask`, the attention
    mask): the epoch's shuffled rows (`epoch_permutation`) are cut into groups of GROUP_BATCHES
    batches, each group sorted by length and cut into batches, which the group takes in an order
    drawn from `group_seed`. Nodes share `group_seed`, so at each step every DDP rank takes a
    batch of the same length rank in its group (no rank waits long for another's longer batch).
    Only batch i's group is sorted: a step's cost does not grow with the shard."""
    group, place = divmod(i, GROUP_BATCHES)
    span = GROUP_BATCHES * batch_size
    rows = epoch_permutation(len(mask), seed, epoch)[group * span : (group + 1) * span]
    rows = rows[: len(rows) // batch_size * batch_size]
    chunks = rows[mask[rows].sum(1).argsort(descending=True, stable=True)].split(batch_size)
    generator = torch.Generator().manual_seed(group_order_seed(group_seed, epoch, group))
    order = torch.randperm(len(chunks), generator=generator)
    return chunks[int(order[place])]


def eval_batches(split: Split, batch_size: int):
    n = num_examples(split)
    for i in range(0, n, batch_size):
        yield {k: v[i : i + batch_size] for k, v in split.items()}


def steps_per_epoch(shard_size: int, batch_size: int) -> int:
    return shard_size // batch_size


def batch_at(shard: Split, step: int, batch_size: int, seed: int, group_seed: int | None = None) -> Split:
    """The batch of global step `step`: a pure function, so a resumed node sees the same data.
    With `group_seed` (optim.group_by_length) padded rows of similar length are batched together."""
    per_epoch = steps_per_epoch(num_examples(shard), batch_size)
    epoch, i = divmod(step, per_epoch)
    if group_seed is not None and "attention_mask" in shard:
        return take(shard, length_grouped_batch(shard["attention_mask"], i, batch_size, seed, epoch, group_seed))
    return take(shard, epoch_permutation(num_examples(shard), seed, epoch)[i * batch_size : (i + 1) * batch_size])


def group_seed(cfg) -> int | None:
    """The seed every node shares for its length-grouped batches (optim.group_by_length), or None."""
    return cfg.seed if cfg.optim.group_by_length else None


@dataclass
class Source:
    """What an interlocking stage 0 builds micro-batches from: ``kind`` "image" (uint8 pixels -> the net's
    input, labels as targets) or "tokens" (input_ids are inputs and targets)."""

    kind: Literal["image", "tokens"]
    train: dict[str, Tensor] | None
    """None until stage 0 reads it on its own host."""
    eval_sets: dict[str, dict[str, Tensor]]
    batch_size: int
    seed: int
    image_size: int = 32
    eval_batch_size: int = 256
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    """The model's input normalisation (data.prepare_data reads it from the model's config)."""

    def micro_batch(self, step: int, mb: int, micro_batches: int) -> dict[str, Tensor]:
        """Micro-batch `mb` of training batch `step` (batches as every strategy draws them)."""
        size = self.batch_size // micro_batches
        batch = batch_at(self.train, step, self.batch_size, self.seed)
        return {k: v[mb * size : (mb + 1) * size] for k, v in batch.items()}

    def eval_chunk(self, name: str, chunk: int) -> dict[str, Tensor]:
        start = chunk * self.eval_batch_size
        return {k: v[start : start + self.eval_batch_size] for k, v in self.eval_sets[name].items()}
