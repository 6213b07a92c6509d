"""One digest of a model's exact bits: replicas that must agree bitwise (SPSA's replicas, lo-fi's nodes
after a peer round) compare it instead of their weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def parameter_hash(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of names, dtypes, shapes and exact bytes, in order: equal iff replicas agree bitwise."""
    h = hashlib.sha256()
    for name, p in params:
        t = p.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(p.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()
