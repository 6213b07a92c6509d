"""SPSA's nodes' own step, callable outside their actors: which batch node k draws at a step
(`node_batch`), how many steps a run plans (`planned_steps`), and one step of N nodes with a single
replica standing for all of them (`step_as_nodes`: the replicas are bit-identical). The node actor
and the driver use the first two; `python -m benchmarks.zo` runs SPSA in one process with all three,
so its weights are those of a real run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raylowcomm.common.batches import batch_at, group_seed
from raylowcomm.common.seeding import node_seed
from raylowcomm.config import RunConfig
from raylowcomm.core.zo.replay import Replica
from raylowcomm.strategies.spsa.config import SpsaConfig
from raylowcomm.training import autocast, total_steps


def node_batch(shard: dict, step: int, cfg: RunConfig, node: int) -> dict:
    """Node ``node``'s training batch at ``step``, drawn from its own ``shard`` with its own seed."""
    return batch_at(shard, step, cfg.optim.batch_size, node_seed(cfg.seed, node), group_seed(cfg))


def planned_steps(cfg: RunConfig, opts: SpsaConfig, sizes: Sequence[int] | None) -> int | None:
    """The run's steps: spsa.steps, else optim's epochs over the smallest shard (``sizes``, one per
    slot); None where only the nodes know their shards' sizes (node files)."""
    return opts.steps or (total_steps(cfg.optim, min(sizes)) if sizes else None)


def step_as_nodes(replica: Replica, loss: Callable, shards: Sequence[dict], cfg: RunConfig, step: int) -> None:
    """Step ``step`` of ``len(shards)`` nodes on one replica: node k's codes on its batch of
    ``shards[k]``, node 0's last (its codes are the replica's own), then every node's codes applied in
    node order, as each node of the run applies them."""
    others = []
    with autocast(cfg.optim.precision, "cpu"):
        for k in [*range(1, len(shards)), 0]:
            replica.node = k
            codes, _ = replica.compute(loss, node_batch(shards[k], step, cfg, k))
            others += [codes] if k else []
    replica.apply(list(range(len(shards))), b"".join(others))
