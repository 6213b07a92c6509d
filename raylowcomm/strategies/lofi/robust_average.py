"""Robust peer and quorum rounds (`lofi.aggregate`, `lofi.on_bad_payload`): how a node combines its peers'
payloads with a rule of `core.robust` instead of the plain mean, drops a payload it cannot combine, and
what it keeps of each round for the run's record.

Every node combines the same decoded payloads in the same order with the same rule and weights
(`robust_round`: exact by construction), so replicas stay bit-identical and the global-hash checks
still hold. Node 0 writes each round's rows to `RECORD` in storage as it combines it (a few numbers a
node, and kept across its restarts); the driver reads the file once, at the end (`robust_details`).

A node whose Δ is not finite cannot be encoded (the codecs refuse it): with `on_bad_payload: drop` it
sends `marker()` instead, which every node leaves out of the round as not finite."""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch

from raylowcomm.core.compression import Payload
from raylowcomm.core.robust import NodeDiagnostics, make_rule, robust_round
from raylowcomm.storage import Storage

logger = logging.getLogger(__name__)

NOT_FINITE = "\x00not_finite"
"""The one key of the marker payload a node sends for a Δ that is not finite."""
RECORD = "lofi/robust_rounds.json"
"""Node 0's rows of every round it combined, by round."""


def is_robust(opts) -> bool:
    """Whether rounds go through `robust_round`; else the plain mean (`average_decoded`), bit for bit."""
    return opts.aggregate != "mean" or opts.on_bad_payload == "drop"


def screen_factor(opts) -> float | None:
    """`robust_round`'s screening: none with `fail`; with `drop` the non-finite payloads, and with a
    robust rule also those past `bad_norm_factor` × the round's median norm."""
    if opts.on_bad_payload != "drop":
        return None
    return opts.bad_norm_factor if opts.aggregate != "mean" else math.inf


def cosine_factor(opts) -> float | None:
    """`robust_round`'s cosine screen: `bad_cosine_factor` with `drop` and a robust rule, else none."""
    if opts.on_bad_payload != "drop" or opts.aggregate == "mean":
        return None
    return opts.bad_cosine_factor


def marker() -> Payload:
    """What a node sends for a Δ that is not finite, with `on_bad_payload: drop`: no tensor of it."""
    return Payload({NOT_FINITE: torch.zeros(0, dtype=torch.uint8)})


def _row(at: int, d: NodeDiagnostics | None) -> dict:
    """A node's part in a round, for the record (JSON: a non-finite norm is a string)."""
    if d is None:
        return {"at": at, "norm": "nan", "cosine": None, "scale": 1.0, "trimmed": 0.0, "dropped": "not finite"}
    return {
        "at": at,
        "norm": d.norm if math.isfinite(d.norm) else str(d.norm),
        "cosine": d.cosine,
        "scale": d.scale,
        "trimmed": d.trimmed,
        "dropped": d.dropped.reason if d.dropped else None,
    }


class RobustAverage:
    """A node's (or, for lo-fi's one average, the driver's) robust rounds: the rule, the screening, and
    node 0's record of every round it combined. `host`: the node (its rank and storage), None on the driver."""

    def __init__(self, opts, host=None):
        self.rule = make_rule(opts.aggregate, opts.clip_kappa, opts.trim)
        self.factor, self.unlike = screen_factor(opts), cosine_factor(opts)
        self.host = host
        self.label = "driver" if host is None else f"lofi node {host.rank}"
        self.record: dict[int, list[dict]] | None = None

    def sendable(self, delta: dict) -> bool:
        """Whether Δ can be encoded; with `drop` a non-finite Δ is not, and is said in the node's log."""
        if self.factor is None or all(bool(torch.isfinite(v).all()) for v in delta.values()):
            return True
        round_ = self.host.rounds + 1 if self.host is not None else "final"
        logger.warning(
            "[%s] round %s: its Δ is not finite, sends no update (lofi.on_bad_payload: drop)", self.label, round_
        )
        return False

    def average(self, parts, payloads: list[Payload], weights: list[float], round_: int | None) -> dict:
        """Δ̄ of the round by the rule (float64), the marked and screened payloads left out."""
        sent = [k for k, p in enumerate(payloads) if NOT_FINITE not in p]
        if not sent:
            raise ValueError(f"round {round_}: every node's Δ was not finite (lofi.on_bad_payload: drop)")
        result = robust_round(
            parts,
            [payloads[k] for k in sent],
            [weights[k] for k in sent],
            self.rule,
            screen_factor=self.factor,
            diagnose=True,
            cosine_factor=self.unlike,
        )
        rows = dict(zip(sent, result.nodes))
        dropped = [k for k in range(len(payloads)) if k not in rows or rows[k].dropped]
        for k in dropped:
            why = rows[k].dropped.reason if k in rows else "not finite"
            logger.warning("[%s] round %s: payload %d of the round dropped (%s)", self.label, round_, k, why)
        if self.host is not None and self.host.rank == 0 and round_ is not None:
            self._keep(round_, [_row(k, rows.get(k)) for k in range(len(payloads))])
        return result.delta

    def _keep(self, round_: int, rows: list[dict]) -> None:
        """The round's rows into `RECORD` (node 0), read first where a restarted node 0 left one."""
        storage: Storage = self.host.storage
        if self.record is None:
            self.record = {int(r): v for r, v in storage.read_json(RECORD).items()} if storage.exists(RECORD) else {}
        self.record[round_] = rows
        storage.write_json(RECORD, {str(r): v for r, v in sorted(self.record.items())})


def robust_details(storage: Storage, opts, members: list[list[int]] | None = None) -> dict:
    """The record's `robust_rounds` (each round's rows, by node) and `dropped_payloads` (per node, how
    many of its payloads rounds left out), from node 0's `RECORD`; nothing for a mean run. `members`:
    each round's nodes in its order (quorum rounds); else a round's k-th payload is node k's."""
    if not is_robust(opts):
        return {}
    stored = storage.read_json(RECORD) if storage.exists(RECORD) else {}
    rounds, dropped = [], Counter()
    for r, rows in sorted((int(r), v) for r, v in stored.items()):
        nodes = members[r - 1] if members is not None and r <= len(members) else list(range(len(rows)))
        named = [{"node": nodes[row.pop("at")], **row} for row in rows]
        dropped.update(row["node"] for row in named if row["dropped"])
        rounds.append({"round": r, "nodes": named})
    count = 1 + max((row["node"] for x in rounds for row in x["nodes"]), default=-1)
    return {"robust_rounds": rounds, "dropped_payloads": [dropped[k] for k in range(count)]}
