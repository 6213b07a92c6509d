"""When each of lo-fi's options can take effect (`config.applicability`): a rule per field of
`LofiConfig`, asked only of the fields a user set away from their defaults. Ranges and the
combinations a topology cannot run are checked by the option groups (`options.LofiOptions`); these
say what an option needs to change anything at all."""

from __future__ import annotations

from raylowcomm.config.applicability import always, needs
from raylowcomm.strategies.lofi.config import on_quorum

_ROUNDS = "set lofi.average_every"
_CODEC = "set lofi.compress (int8, int4, int2, topk, sign)"


def _blockwise(cfg, o) -> bool:
    """Whether any tensor crosses in a blockwise codec: every codec but none, or the dense tensors'."""
    return o.compress != "none" or bool(o.dense and o.dense_codec != "none")


OPTION_RULES = {
    "average_every": always,
    "warmup_steps": always,  # RoundOptions: needs average_every, shorter than the run
    "average_unit": needs(lambda cfg, o: o.average_every is not None, f"counts lofi.average_every's period: {_ROUNDS}"),
    "outer_optimizer": always,
    "outer_lr": needs(
        lambda cfg, o: o.outer_optimizer == "nesterov", "is the outer step's: set lofi.outer_optimizer: nesterov"
    ),
    "outer_momentum": needs(
        lambda cfg, o: o.outer_optimizer == "nesterov", "is the outer step's: set lofi.outer_optimizer: nesterov"
    ),
    "weighting": always,
    "soup": always,
    "bn_recalibrate": always,  # ending.finish_run: only for a model with BatchNorm
    "bn_batches": needs(lambda cfg, o: o.bn_recalibrate, "sizes the BatchNorm recalibration: set bn_recalibrate: true"),
    "lora_average": needs(lambda cfg, o: cfg.model.lora is not None, "averages LoRA adapters: set model.lora"),
    "exchange": always,
    "compress": always,
    "topk_fraction": needs(lambda cfg, o: o.compress == "topk", "is top-k's fraction: set lofi.compress: topk"),
    "dense": always,  # CodecOptions: beside a compress, in peer rounds
    "dense_codec": needs(
        lambda cfg, o: bool(o.dense), "is the codec of lofi.dense's tensors, and none are named: set lofi.dense"
    ),
    "compress_block": needs(_blockwise, f"sizes a blockwise codec's blocks, and nothing crosses in one: {_CODEC}"),
    "compress_scale": always,  # CodecOptions: int8/int4/int2 codecs, lockstep peer rounds that take the mean
    "error_feedback": needs(lambda cfg, o: o.compress != "none", f"keeps what a codec drops: {_CODEC}"),
    "fragments": always,  # RoundOptions: peer rounds every H steps
    "overlap": always,  # RoundOptions: peer rounds every H steps
    "probe_steps": always,
    "final_round": needs(lambda cfg, o: o.compress != "none", f"is a codec's final round: {_CODEC}"),
    "final_residual": needs(
        lambda cfg, o: o.compress != "none" and o.error_feedback,
        f"adds error feedback's residual to the final round: {_CODEC} with lofi.error_feedback: true",
    ),
    "mix": needs(lambda cfg, o: o.overlap > 0, "mixes a fragment that lands while a node trains on: set lofi.overlap"),
    "round_momentum": always,  # RoundOptions: needs whole-model rounds
    "sync": always,
    "sync_every_s": needs(lambda cfg, o: o.sync == "time", "is the period of sync by time: set lofi.sync: time"),
    "quorum": always,
    "grace_s": needs(
        lambda cfg, o: o.quorum is not None,
        "is how long a round waits past its quorum, and every round waits for every node: set lofi.quorum",
    ),
    "staleness": needs(
        lambda cfg, o: on_quorum(o, cfg.nodes.elastic),
        "weighs payloads that missed their round, and rounds are lockstep: set lofi.quorum (or sync: time)",
    ),
    "keep_training": always,  # QuorumOptions: quorum rounds or overlap
    "join": always,
    "join.step": always,
    "leave": always,
    "leave.node": always,
    "leave.step": always,
    "leave.how": always,
    "aggregate": always,  # RobustOptions: peer rounds, not model.lora
    "clip_kappa": needs(lambda cfg, o: o.aggregate == "clip", "is clip's bound: set lofi.aggregate: clip"),
    "trim": needs(
        lambda cfg, o: o.aggregate == "trimmed_mean", "is the trimmed mean's fraction: set lofi.aggregate: trimmed_mean"
    ),
    "on_bad_payload": always,  # RobustOptions: peer rounds, not model.lora
    "bad_norm_factor": needs(
        lambda cfg, o: o.on_bad_payload == "drop" and o.aggregate != "mean",
        "bounds the norm of a payload a robust round keeps: set lofi.on_bad_payload: drop and a lofi.aggregate "
        "other than mean",
    ),
    "bad_cosine_factor": needs(
        lambda cfg, o: o.on_bad_payload == "drop" and o.aggregate != "mean",
        "bounds how far from the others' direction a payload a robust round keeps may point: set "
        "lofi.on_bad_payload: drop and a lofi.aggregate other than mean",
    ),
    "privacy": always,  # PrivacyOptions: lockstep peer rounds, refusing what crosses un-noised
    "privacy.epsilon": always,
    "privacy.delta": always,
    "privacy.clip": always,
    "privacy.noise": always,
    "secure": always,  # SecureOptions: lockstep peer rounds of summable codes, 3 nodes or more
    "dial": always,  # DialOptions: not with data.node_files
    "dial_bytes": needs(
        lambda cfg, o: o.dial == "auto", "is the byte budget of the dial's choice: set lofi.dial: auto"
    ),
}
"""Every lo-fi option's rule, by its name in the `lofi:` section."""
