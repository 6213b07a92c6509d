"""What a lo-fi node's calls tell the driver, typed at both ends.

On the wire a report is the plain dict its `wire()` gives, and the driver reads it back with
`from_wire`: the ledger books what really crossed (`round_replies`, `train_stats`), the same bytes as
the plain dicts these replaced, and the record keeps that dict as it was (results.json's
`nodes[k].train`). Between the two ends nothing reads a report by string key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from raylowcomm.core.rounds import SegmentReport


class ResumePoint(NamedTuple):
    """Where a node stands: the rounds it has landed and the step it has trained to."""

    rounds: int
    step: int


@dataclass
class TrainReport:
    """One `train` call of a node: the step it reached and what training it did (`training.train_steps`)."""

    node: int
    step: int
    restored_from: int | None
    """The checkpoint step this node's process restarted from before the call (None: it did not)."""
    snapshot_s: dict[int, float]
    """The call's training seconds at each snapshot step it passed (`eval_every`)."""
    steps: int
    samples: int
    train_s: float
    last_step_s: float
    mean_loss: float | None
    round_wait_s: float | None = None
    """`lofi.overlap`: how long training waited for the round in flight that landed in the call."""
    round_wait_at_stop_s: float | None = None
    """Set by the driver: the wait for the round that landed where a spent budget stopped the nodes."""

    @classmethod
    def of(cls, node: int, step: int, restored_from: int | None, snapshot_s: dict, stats: dict, **waited):
        """From `train_steps`' statistics of the call."""
        return cls(node, step, restored_from, snapshot_s, **stats, **waited)

    def wire(self) -> dict:
        """The dict that crosses and that the record keeps: the waits only where there were some."""
        out = {
            "node": self.node,
            "step": self.step,
            "restored_from": self.restored_from,
            "snapshot_s": self.snapshot_s,
            "steps": self.steps,
            "samples": self.samples,
            "train_s": self.train_s,
            "last_step_s": self.last_step_s,
            "mean_loss": self.mean_loss,
        }
        for name in ("round_wait_s", "round_wait_at_stop_s"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_wire(cls, d: dict) -> TrainReport:
        return cls(**d)


@dataclass
class SegmentResult:
    """One quorum-round segment of a node (`LofiNode.segment`): its training, the global model it started
    from, its payload's size, and how the call's time split."""

    train: TrainReport
    base_round: int
    base_hash: str
    nbytes: int
    token: str | None
    """`lofi.keep_training`: the node's name for this payload (None otherwise)."""
    landed: int
    """The rounds it landed at the segment's start."""
    parts_s: dict[str, float] = field(default_factory=dict)

    def wire(self) -> dict:
        out = {**self.train.wire(), "base_round": self.base_round, "base_hash": self.base_hash, "nbytes": self.nbytes}
        if self.token is not None:
            out["token"] = self.token
        return {**out, "landed": self.landed, "segment_parts_s": self.parts_s}

    @classmethod
    def from_wire(cls, d: dict) -> SegmentResult:
        d = dict(d)
        head = {k: d.pop(k) for k in ("base_round", "base_hash", "nbytes", "landed", "segment_parts_s")}
        token = d.pop("token", None)
        return cls(
            TrainReport.from_wire(d),
            head["base_round"],
            head["base_hash"],
            head["nbytes"],
            token,
            head["landed"],
            head["segment_parts_s"],
        )

    def for_policy(self, record: dict) -> SegmentReport:
        """What quorum rounds' policy decides by; `record`: the wire dict, which the record keeps."""
        t = self.train
        return SegmentReport(t.step, self.base_round, t.samples, t.train_s, self.nbytes, self.token, record)
