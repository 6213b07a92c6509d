"""Byte accounting by phase, from what was really sent.

Every payload that crosses between the driver and an actor, or between actors, is recorded with
the size it has on the wire: tensors by `nbytes`, wherever they sit in dicts, lists and tuples,
anything else by its pickled size (Ray's own serialisation is pickle protocol 5, so the two agree
to within a small header a tensor). A tensor is never counted by its pickle: torch pickles a storage
with its memory address as a decimal key, so the same tensor's pickle differs by a byte or two from
one process to the next, and the count would too.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass, field

import torch

PHASES = ("setup", "train", "final")


def payload_nbytes(obj) -> int:
    """Bytes an object occupies when sent: tensor data exactly; a dict, list or tuple holding a tensor
    (at any depth) as the sum of its values' counts; anything else by its pickled size."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if _holds_tensor(obj):
        return sum(payload_nbytes(v) for v in (obj.values() if isinstance(obj, dict) else obj))
    return len(pickle.dumps(obj, protocol=5))


def _holds_tensor(obj) -> bool:
    """Whether a dict, list or tuple holds a tensor in its values, at any depth."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


@dataclass
class Ledger:
    """Totals per phase and per kind of payload (`what`), plus a message count."""

    bytes_by_phase: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: int = 0

    def record(self, phase: str, what: str, nbytes: int, copies: int = 1) -> int:
        """Count `copies` transfers of a payload of `nbytes` (e.g. one object fetched by N nodes)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        total = int(nbytes) * copies
        self.bytes_by_phase[phase] += total
        self.bytes_by_kind[f"{phase}/{what}"] += total
        self.messages += copies
        return total

    def send(self, phase: str, what: str, obj, copies: int = 1) -> int:
        return self.record(phase, what, payload_nbytes(obj), copies)

    def merge(self, other: Ledger) -> None:
        for phase, n in other.bytes_by_phase.items():
            self.bytes_by_phase[phase] += n
        for kind, n in other.bytes_by_kind.items():
            self.bytes_by_kind[kind] += n
        self.messages += other.messages

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_phase.values())

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        """The ledger `to_dict` wrote (a resumed run continues its counts)."""
        return cls(dict(d["by_phase"]), defaultdict(int, d["by_kind"]), d["messages"])

    def to_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "by_phase": dict(self.bytes_by_phase),
            "by_kind": dict(sorted(self.bytes_by_kind.items())),
            "messages": self.messages,
        }
