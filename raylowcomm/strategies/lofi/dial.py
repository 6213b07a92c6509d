"""`lofi.dial: auto`: the codec, period, dense tensors, block and final round chosen for the run by the
measured rule (`RULES`, the decision table of docs/strategies/lofi.md), from what is known before any
actor starts: the model's kind, the run's steps a node, its nodes. Settings the user gave win. The
choice's bytes are checked against `lofi.dial_bytes` of DDP's and stepped down where they exceed it.
With the dial off or on, an explicit setting on the wrong side of the measured frontier for the run's
length is said in one warning line (`dial_frontier.FRONTIER`). Figures: docs/measurements/lofi.md.
With `compress_scale: shared` (and `secure`) the dial keeps to codes that add, and counts masked bytes."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from raylowcomm.core.averaging import batchnorm_layers
from raylowcomm.core.compression import NoCompression, layout_of
from raylowcomm.core.summable import SUMMABLE
from raylowcomm.strategies.lofi.config import LofiConfig, round_boundaries, round_gaps
from raylowcomm.strategies.lofi.dial_frontier import period_of, warn_off_frontier
from raylowcomm.strategies.lofi.payload import DeltaCodec, crossing, dense_names
from raylowcomm.strategies.lofi.peers import nodes_hold_result

logger = logging.getLogger(__name__)

DOC = "docs/measurements/lofi.md"
NEAR = 1.25
"""A run within this factor of a row's measured length counts as measured."""
CHEAPER = {"none": "int8", "int8": "int4", "int4": "int2", "int2": "sign"}
"""The next cheaper codec a step down takes."""
MIN_TOPK = 0.005
"""top-k's fraction a step down halves no lower than this (below it each offset takes 2 bytes)."""


@dataclass(frozen=True)
class Row:
    """One row of the decision table: the runs it covers (a model `kind`, a length in `unit` up to
    `upto`, from the row before it), the length it was measured at, what it sets, and where."""

    name: str
    kind: str
    unit: str
    measured: float
    upto: float
    settings: dict
    measurement: str
    halfway: bool = False
    """average_every: half the run's steps (one round halfway)."""


RULES = (
    Row(
        "a BatchNorm vision model, short",
        "batchnorm",
        "steps",
        62,
        90,
        {"average_every": 8, "compress": "int2", "compress_block": 128, "dense": ["head", "vectors"]},
        f"{DOC}#ternary-rounds-every-8-steps-compress-int2-2026-12-06",
    ),
    Row(
        "a BatchNorm vision model, longer",
        "batchnorm",
        "steps",
        125,
        math.inf,
        {"average_every": 6, "compress": "topk", "topk_fraction": 0.03},
        f"{DOC}#the-dial-measured-python--m-benchmarksdial",
    ),
    Row(
        "a language model, 1 epoch",
        "language",
        "epochs",
        1,
        1.5,
        {"compress": "int4"},
        f"{DOC}#at-125-steps-and-on-minilm-one-round-halfway-2026-12-05",
        halfway=True,
    ),
    Row(
        "a language model, 2 epochs or more",
        "language",
        "epochs",
        2,
        math.inf,
        {"average_every": None, "compress": "int4"},
        f"{DOC}#the-dial-measured-python--m-benchmarksdial",
    ),
    Row(
        "LoRA adapters",
        "lora",
        "epochs",
        1,
        math.inf,
        {"average_every": None, "compress": "int4"},
        f"{DOC}#adapters-rounds-with-lora",
    ),
)
"""Every row's peer rounds end in the run's codec (`final_round: compressed`, the default)."""


@dataclass(frozen=True)
class Run:
    """What the rule reads of a run: its model's kind, its length, its nodes."""

    kind: str
    """lora, batchnorm, language, or other (a model without BatchNorm that is not a language model)."""
    steps: int
    per_epoch: int
    nodes: int
    family: str

    @property
    def epochs(self) -> float:
        return self.steps / self.per_epoch


def run_of(ctx, smallest_shard: int) -> Run:
    """The run's facts from its loaded model and data (`smallest_shard`: the examples of its smallest shard)."""
    from raylowcomm.common.batches import steps_per_epoch
    from raylowcomm.training import total_steps

    cfg, family = ctx.cfg, ctx.spec.family
    if cfg.model.lora is not None:
        kind = "lora"
    elif batchnorm_layers(ctx.architecture):
        kind = "batchnorm"
    else:
        kind = "language" if family.startswith("hf_") else "other"
    steps = total_steps(cfg.optim, smallest_shard)
    return Run(kind, steps, steps_per_epoch(smallest_shard, cfg.optim.batch_size), cfg.nodes.count, family)


def explicit(o: LofiConfig) -> set[str]:
    """The options the user set: those away from their defaults (as `config.applicability` asks)."""
    found = set()
    for f in dataclasses.fields(LofiConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name not in ("dial", "dial_bytes") and getattr(o, f.name) != default:
            found.add(f.name)
    return found


def row_for(run: Run) -> tuple[Row, list[str]]:
    """The table's row for `run` and what about the run was never measured (empty: the row's own run)."""
    kind = {"other": "language"}.get(run.kind, run.kind)
    notes = [] if run.kind != "other" else ["a model without BatchNorm that is not a language model"]
    if kind == "language" and run.family != "hf_classifier":
        notes = notes or [f"a {run.family} model (MiniLM, a classifier, was measured)"]
    rows = [r for r in RULES if r.kind == kind]
    for row in rows:
        length = run.steps if row.unit == "steps" else run.epochs
        if length <= row.upto:
            break
    if abs(math.log(max(length, 1e-9) / row.measured)) > math.log(NEAR):
        notes.append(f"{length:g} {row.unit} a node (measured: {row.measured:g})")
    return row, notes


@dataclass
class Sizes:
    """What a round moves, from the loaded model: the tensors a node sends (`sent`), its parameters'
    names, and the bytes of DDP's gradient all-reduce per step per worker."""

    model: object
    family: str
    sent: dict
    params: set
    gradient_bytes: int

    @classmethod
    def of(cls, ctx) -> Sizes:
        model = ctx.architecture  # names, shapes and dtypes suffice: may be on the meta device
        if ctx.fine_tune.trainable_only():  # a node sends what trains: adapters and head
            sent = {k: p for k, p in model.named_parameters() if p.requires_grad}
        else:
            sent = model.state_dict()
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return cls(model, ctx.spec.family, sent, {k for k, _ in model.named_parameters()}, grads)


def predicted_bytes(o: LofiConfig, run: Run, sizes: Sizes) -> int:
    """The bytes lo-fi's rounds move after setup. Peer rounds (a codec, or exchange: peers): each
    payload's exact size from the codec's layout, N·(N−1) fetches a round and the final one, plus N to
    the driver where it decodes one average itself (`train/` and `final/outer_gradients`). The driver's
    star: 2·N float32 models a round, N at the end. Whole-model lockstep rounds: fragments and quorum
    rounds send what their schedule does."""
    gaps = round_gaps(o, run.per_epoch)
    rounds = len(round_boundaries(gaps, run.steps)) - 1 if gaps else 0
    n = run.nodes
    if o.compress == "none" and o.exchange != "peers":
        whole = NoCompression().payload_nbytes(layout_of(crossing(sizes.sent, o)))
        return (2 * rounds + 1) * n * whole
    codec = DeltaCodec(o, sizes.sent, sizes.params, dense_names(sizes.model, sizes.family, o.dense))
    payload, final = codec.nbytes, sum(c.payload_nbytes(layout) for c, layout in codec.final_parts)
    if o.secure:  # masked codes and magnitudes (`core.secure_codes`)
        names = dict.fromkeys(k for _, layout in codec.parts for k in layout)
        payload, final = (sum(codec.masked_nbytes(names, last, n)) for last in (False, True))
    driver = 0 if nodes_hold_result(o, run.kind == "lora") else n
    return rounds * n * (n - 1) * payload + (n * (n - 1) + driver) * final


def step_down(o: LofiConfig, given: set[str], run: Run) -> tuple[LofiConfig, str] | None:
    """One step cheaper among what the dial chose (not `given`): a period twice as long (for a model
    without BatchNorm, at last one average at the end; a BatchNorm model keeps a round before its end),
    else a cheaper codec; None where nothing the dial chose can go cheaper."""
    period = period_of(o)
    if "average_every" not in given and period is not None:
        if 2 * period < run.steps:
            return dataclasses.replace(o, average_every=2 * period), f"average_every {period} -> {2 * period}"
        if run.kind != "batchnorm":
            return dataclasses.replace(o, average_every=None), "one average at the end"
    if "compress" in given:
        return None
    if o.compress == "topk" and o.topk_fraction / 2 >= MIN_TOPK and "topk_fraction" not in given:
        half = o.topk_fraction / 2
        return dataclasses.replace(o, topk_fraction=half), f"topk_fraction {o.topk_fraction:g} -> {half:g}"
    cheaper = CHEAPER.get(o.compress)
    if cheaper is not None and (o.compress_scale != "shared" or cheaper in SUMMABLE):
        return dataclasses.replace(o, compress=cheaper), f"compress {o.compress} -> {cheaper}"
    return None


def choose(o: LofiConfig, run: Run, sizes: Sizes) -> tuple[LofiConfig, dict]:
    """The resolved options and the record of the choice (`details.dial`): the row's settings where the
    user gave none, stepped down until their bytes fit `dial_bytes` of DDP's."""
    given = explicit(o)
    row, notes = row_for(run)
    settings = dict(row.settings)
    if row.halfway:
        settings["average_every"] = max(run.steps // 2, 1)
    settings["final_round"] = "compressed"
    if o.compress_scale == "shared" and settings.get("compress") not in SUMMABLE:
        settings.update(RULES[0].settings)  # codes that add: the short BatchNorm row's int2
        notes.append(f"compress_scale: shared adds codes, and the row's {row.settings['compress']} are not: its int2")
    chosen = {k: v for k, v in settings.items() if k not in given}
    resolved = dataclasses.replace(o, **chosen)
    ddp = run.nodes * run.steps * sizes.gradient_bytes
    budget, steps_down = o.dial_bytes * ddp, []
    predicted = predicted_bytes(resolved, run, sizes)
    while predicted > budget and (down := step_down(resolved, given, run)) is not None:
        resolved, what = down
        steps_down.append(what)
        predicted = predicted_bytes(resolved, run, sizes)
    final = {k: getattr(resolved, k) for k in chosen}
    reason = f"{row.name} (measured: {row.measurement})"
    if notes:
        reason += f"; outside what was measured: {', '.join(notes)}, so the nearest row"
    if steps_down:
        reason += f"; stepped down to fit dial_bytes {o.dial_bytes:g} of DDP's: {', '.join(steps_down)}"
    if predicted > budget:
        reason += f"; still over dial_bytes {o.dial_bytes:g} of DDP's: nothing the dial chose goes cheaper"
    kept = {k: getattr(o, k) for k in sorted(given & set(settings))}
    if kept:
        reason += f"; kept your {_settings(kept)}"
    record = {"chose": final, "kept": kept, "reason": reason, "predicted_bytes": predicted, "ddp_bytes": ddp}
    return resolved, record


def _settings(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def resolve(ctx, o: LofiConfig, smallest_shard: int | None) -> LofiConfig:
    """The options the run goes on with: with `dial: auto` the choice, logged, its record kept on the
    result (`dial_record`); and a warning for a setting the measurements put on the wrong side. Once
    per config: a config resolved already is returned as it is. Without the shards' sizes (data.node_files)
    nothing is known of the run's length: the options as given."""
    if o.dial_record is not None or smallest_shard is None:
        return o
    run, given = run_of(ctx, smallest_shard), explicit(o)
    if o.dial == "auto":
        resolved, record = choose(o, run, Sizes.of(ctx))
        resolved.dial_record = record
        logger.info(
            "[lofi] dial: auto chose %s because %s; predicted %d bytes after setup, DDP's %d",
            _settings(record["chose"]) or "nothing (every setting given)",
            record["reason"],
            record["predicted_bytes"],
            record["ddp_bytes"],
        )
        o = resolved
    warn_off_frontier(o, given, run)
    return o
