"""How many units each interlocking stage gets: a contiguous partition that minimises the largest
stage's cost, by block count, parameters or measured forward + backward time (aux heads included).
Plain arithmetic over per-unit costs; `splitting` cuts the model where it says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass
class StageCosts:
    """Measured seconds (forward + backward) per unit, and of the aux head that a stage ending
    after unit i carries (``boundaries[i]``, one fewer than units): what a stage costs in
    1-way training is its units plus its head."""

    units: list[float]
    boundaries: list[float]


Balance = str | Sequence[float] | StageCosts


def balanced_sizes(costs: Sequence[float], num_parts: int, boundaries: Sequence[float] | None = None) -> list[int]:
    """Contiguous partition of ``costs`` into ``num_parts`` non-empty parts minimising the
    largest part's total, a part that ends after unit i (not the last) adding ``boundaries[i]``
    (its aux head); among optimal partitions later parts are kept small (the last stage also
    carries the real head)."""
    boundaries = list(boundaries) if boundaries is not None else [0.0] * len(costs)
    units = len(costs)
    if not 1 <= num_parts <= units:
        raise ValueError(f"cannot split {units} units into {num_parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: smallest possible max part cost for the first i units in p parts.
    best = [[inf] * (units + 1) for _ in range(num_parts + 1)]
    start = [[0] * (units + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for p in range(1, num_parts + 1):
        for i in range(p, units + 1):
            head = boundaries[i - 1] if p < num_parts and i < units else 0.0
            for j in range(p - 1, i):  # last part = units j..i-1; larger j wins ties
                value = max(best[p - 1][j], prefix[i] - prefix[j] + head)
                if value <= best[p][i]:
                    best[p][i], start[p][i] = value, j
    sizes, i = [], units
    for p in range(num_parts, 0, -1):
        sizes.append(i - start[p][i])
        i = start[p][i]
    return sizes[::-1]


def unit_costs(units: Sequence[nn.Module], balance: Balance) -> list[float]:
    """The cost of each unit that `balance` names: 1 each ("blocks"), its parameter count ("params"),
    or the given (or measured: `StageCosts`) costs, checked against the units."""
    if balance == "blocks":
        return [1.0] * len(units)
    if balance == "params":
        return [float(sum(p.numel() for p in u.parameters())) for u in units]
    if isinstance(balance, StageCosts):
        balance = balance.units
    if isinstance(balance, str):
        raise ValueError(f"balance must be 'blocks', 'params' or per-unit costs, got {balance!r}")
    if len(balance) != len(units):
        raise ValueError(f"got {len(balance)} unit costs for {len(units)} units")
    return [float(c) for c in balance]


def stage_sizes(costs: list[float], num_stages: int, balance: Balance, sizes: Sequence[int] | None) -> list[int]:
    """Units per stage: the given `sizes` (checked), or balanced by cost (and measured aux heads)."""
    if sizes is None:
        return balanced_sizes(costs, num_stages, balance.boundaries if isinstance(balance, StageCosts) else None)
    if len(sizes) != num_stages or sum(sizes) != len(costs) or min(sizes) < 1:
        raise ValueError(
            f"a split of {len(costs)} units into {num_stages} stages needs {num_stages} sizes >= 1 "
            f"summing to {len(costs)}, got {list(sizes)}"
        )
    return list(sizes)
