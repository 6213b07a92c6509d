"""What SPSA's driver counts across a run (`DriverCounts`), kept in storage at every checkpoint so
that a resumed run continues them, and the goodput of its nodes from those counts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from raylowcomm.common.goodput import NodeAccount, goodput

DRIVER_STATE = "spsa/driver.json"
"""In storage: the driver's counts at the last checkpoint (what `--resume` continues from)."""


@dataclass
class DriverCounts:
    """What the driver has counted so far: kept in DRIVER_STATE at every checkpoint beside the step, the
    running nodes, the ledger and the nodes' records, so that a resumed run continues them."""

    samples: int = 0
    forwards: int = 0
    curve: list = field(default_factory=list)
    verified: list = field(default_factory=list)
    per_step: dict = field(default_factory=lambda: {"payload": [], "wire": [], "control": [], "wall": []})
    step0: dict = field(default_factory=dict)
    ckpt_step: int = 0
    ckpt_size: int = 0
    node_s: dict = field(default_factory=dict)
    """Per node (its id as a string, as JSON keeps it): seconds on steps whose codes every replica applied
    (`useful_s`) and seconds waiting for the slowest node's codes or replay (`idle_s`), as the driver times
    each node's calls."""

    @classmethod
    def restored(cls, state: dict) -> DriverCounts:
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})  # older states: fewer counts

    def book_node_time(self, pubs: list[int], computing: dict[int, float], replaying: dict[int, float]) -> None:
        """A published step is useful on every node that computed it (every replica applies its codes) and on
        every node that replayed it; the rest of each call's wait, to the slowest node's, is idle."""
        for calls, nodes in ((computing, pubs), (replaying, [k for k in pubs if k in replaying])):
            slowest = max((calls[k] for k in nodes), default=0.0)
            for k in nodes:
                account = self.node_s.setdefault(str(k), {"useful_s": 0.0, "idle_s": 0.0})
                account["useful_s"] += calls[k]
                account["idle_s"] += slowest - calls[k]

    def goodput(self, records: dict[int, dict], train_s: float) -> dict:
        """Each node's account (`node_s`) over its time in the run (``records``: the driver's, per node):
        from its join to its leave or death, or the whole training phase. A node that died loses the step
        it was computing, not timed."""
        accounts = []
        for k, r in sorted(records.items()):
            times = self.node_s.get(str(k), {"useful_s": 0.0, "idle_s": 0.0})
            whole = r["joined_step"] == 0 and r["left_step"] is None
            accounts.append(
                NodeAccount(
                    k,
                    times["useful_s"],
                    times["idle_s"],
                    None if r["left_how"] == "died" else 0.0,
                    joins=int(r["joined_step"] > 0),
                    reserved_s=None if whole else r.get("left_at_s", train_s) - r.get("joined_at_s", 0.0),
                )
            )
        return goodput(accounts, train_s)
