"""Every seed a run derives, in one place: a node's data order and dropout, per-step seeds that
make a resumed node repeat exactly what an uninterrupted one would have done."""

from __future__ import annotations


def node_seed(run_seed: int, node: int) -> int:
    """The seed of node / DDP rank / SPSA slot `node`: its batch order and its perturbations."""
    return run_seed * 1000 + node


def step_seed(seed: int, step: int) -> int:
    """Seeds torch before step `step` (dropout), so a node resumed at that step draws the same."""
    return seed * 1_000_003 + step


def epoch_seed(seed: int, epoch: int) -> int:
    """The permutation of a shard in epoch `epoch`."""
    return seed * 100_003 + epoch


def group_order_seed(run_seed: int, epoch: int, group: int) -> int:
    """The order in which every node takes the length-sorted batches of group `group` in epoch
    `epoch` (optim.group_by_length): the run's seed, not the node's, so nodes share it."""
    return epoch_seed(run_seed, epoch) * 1_009 + group
