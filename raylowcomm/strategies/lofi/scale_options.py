"""`lofi.compress_scale: shared` (`core.summable`) against the rest of a run's options: the options it
cannot run with, each named with why and the fix (`CodecOptions.check_scale` refuses the first)."""

from __future__ import annotations

from raylowcomm.config import RunConfig
from raylowcomm.core.summable import SUMMABLE
from raylowcomm.strategies.lofi.exchange import Exchange

_OR_NODE = "or lofi.compress_scale: node"


def shared_scale_clashes(codec, cfg: RunConfig, exchange: type[Exchange], groups) -> list[str]:
    """Why shared scales cannot run with the options given, one line each (none: they can). `codec`: the
    `CodecOptions`; `groups`: the `LofiOptions` whose quorum and robust groups are read."""
    clashes = []
    chosen_later = groups.dial.dial == "auto" and codec.compress == "none"  # the dial picks codes that add
    if codec.compress not in SUMMABLE and not chosen_later:
        clashes.append(
            f"lofi.compress: {codec.compress} sends no codes that add on a shared grid: set lofi.compress to "
            f"int8, int4 or int2, {_OR_NODE}"
        )
    if codec.dense and codec.dense_codec not in SUMMABLE:
        clashes.append(
            f"lofi.dense_codec: {codec.dense_codec} sends lofi.dense's tensors as floats, not codes that add: set "
            f"dense_codec to int8, int4 or int2, {_OR_NODE}"
        )
    if codec.final_round == "exact":
        clashes.append(
            f"lofi.final_round: exact sends float32 Δ, not codes that add: set final_round: compressed or int8, "
            f"{_OR_NODE}"
        )
    if exchange.paced:
        clashes.append(
            "quorum rounds (lofi.quorum, sync: time, join, leave or elastic nodes) can merge a payload in a later "
            "round, and a node's residual needs the shared scales of the round it was sent for: use lockstep peer "
            f"rounds, {_OR_NODE}"
        )
    if cfg.model.lora is not None:
        clashes.append(f"model.lora merges each node's adapters apart, not their sum: {_OR_NODE[3:]} with model.lora")
    if groups.robust.aggregate != "mean":
        clashes.append(
            f"lofi.aggregate: {groups.robust.aggregate} reads each node's Δ, not the round's sum: set "
            f"lofi.aggregate: mean, {_OR_NODE}"
        )
    if groups.robust.on_bad_payload == "drop":
        clashes.append(
            "lofi.on_bad_payload: drop screens each node's Δ, not the round's sum: set on_bad_payload: fail, "
            + _OR_NODE
        )
    return clashes
