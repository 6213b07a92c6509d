"""Byte accounting by phase, from what was really sent.

Every payload that crosses between the driver and an actor, or between actors, is recorded with
the size it has on the wire: tensors by `nbytes`, anything else by its pickled size (Ray's own
serialisation is pickle protocol 5 with tensors' buffers out of band, so the two agree to within
a small header).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass, field

import torch

PHASES = ("setup", "train", "final")


def payload_nbytes(obj) -> int:
    """Bytes an object occupies when sent: tensor data exactly, containers recursively."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(v, torch.Tensor) for v in obj):
        return sum(payload_nbytes(v) for v in obj)
    return len(pickle.dumps(obj, protocol=5))


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
