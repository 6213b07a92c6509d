"""lo-fi's options (`LofiConfig`, flat under `lofi:` in a config) as typed groups, each checking its own
fields once: how rounds come and travel (`RoundOptions`), what they compress (`CodecOptions`), the
outer step (`OuterOptions`), the probe before the nodes split (`ProbeOptions`), how the final
average is made (`AverageOptions`) and whether the measured rule chooses for the run (`DialOptions`);
quorum rounds and membership are `quorum_options.QuorumOptions`.

A group's `check` takes the run's config, the exchange chosen once for it (`exchange_for`) and the
groups whose fields its cross-field checks read; `check_loaded` (where a group has one) checks it
against the loaded model and data. `options.LofiOptions` builds the groups and asks each in turn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.compression import CODECS
from raylowcomm.strategies.lofi.config import MAX_COMPRESS_BLOCK, fixed_period, round_gaps
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.payload import dense_names
from raylowcomm.strategies.lofi.scale_options import shared_scale_clashes

if TYPE_CHECKING:
    from raylowcomm.strategies.base import RunContext


class OptionGroup:
    """A group of `LofiConfig`'s fields: a dataclass whose fields are named as the config's."""

    @classmethod
    def of(cls, o):
        """The group's fields read from the flat `LofiConfig`."""
        return cls(**{f.name: getattr(o, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class RoundOptions(OptionGroup):
    """When rounds come and how they travel: their period and warm-up, the topology asked for, Streaming
    DiLoCo's fragments, overlap and mix, the optimizer state at a landing, the nodes' weights."""

    average_every: int | list[int] | None
    warmup_steps: int
    average_unit: Literal["steps", "epochs"]
    exchange: Literal["auto", "driver", "peers"]
    fragments: int
    overlap: int
    mix: float
    round_momentum: Literal["keep", "reset"]
    weighting: Literal["uniform", "examples"]

    def check(self, cfg: RunConfig, exchange: type[Exchange], timed: bool) -> None:
        """`timed`: nodes sync by time (`lofi.sync: time`), rounds without `average_every`."""
        every = self.average_every if isinstance(self.average_every, list) else [self.average_every]
        if self.average_every is not None and (not every or any(h <= 0 for h in every)):
            raise ConfigError(
                "lofi.average_every",
                self.average_every,
                "must be > 0 (a list: each entry), or null for one average at the end",
            )
        if self.warmup_steps < 0:
            raise ConfigError("lofi.warmup_steps", self.warmup_steps, "must be a number of steps >= 0")
        if self.warmup_steps and self.average_every is None:
            raise ConfigError(
                "lofi.warmup_steps",
                self.warmup_steps,
                "a warm-up of rounds needs rounds after it: set lofi.average_every (or warmup_steps: 0)",
            )
        self._check_streaming(exchange.nodes_keep_rounds)
        adapters = cfg.model.lora is not None
        if exchange.nodes_keep_rounds and adapters and self.overlap and self.mix:
            raise ConfigError(
                "lofi.mix",
                self.mix,
                "with model.lora a landed round restarts the adapters it merged, "
                "which leaves nothing of the node's own to mix: set lofi.mix: 0",
            )
        if self.round_momentum == "reset" and (self.fragments > 1 or not (self.average_every is not None or timed)):
            raise ConfigError(
                "lofi.round_momentum",
                self.round_momentum,
                "resets the optimizer state when a whole model lands: it needs rounds (lofi.average_every "
                "or sync: time) and lofi.fragments: 1",
            )
        if cfg.optim.budget_s is not None and self.fragments > 1:
            raise ConfigError(
                "optim.budget_s",
                cfg.optim.budget_s,
                "a budget ends lo-fi where its time does, with one final round of the whole model: not with "
                "lofi.fragments > 1; remove the budget or set fragments: 1",
            )
        if adapters and self.average_every is not None and cfg.eval_every:
            raise ConfigError(
                "eval_every",
                cfg.eval_every,
                "a curve with model.lora and lofi.average_every is not offered: set eval_every: 0",
            )

    def _check_streaming(self, peers: bool) -> None:
        """fragments, overlap and mix: in range, and with what they need (`peers`: peer rounds, every H steps)."""
        if self.fragments < 1:
            raise ConfigError("lofi.fragments", self.fragments, "must be >= 1 (1: the whole model every round)")
        if self.overlap < 0:
            raise ConfigError("lofi.overlap", self.overlap, "must be a number of steps >= 0")
        if not 0 <= self.mix <= 1:
            raise ConfigError("lofi.mix", self.mix, "must be in [0, 1]")
        in_use = (("lofi.fragments", self.fragments, self.fragments > 1), ("lofi.overlap", self.overlap, self.overlap))
        for field, value, on in in_use:
            if not on:
                continue
            if not peers:
                raise ConfigError(
                    field,
                    value,
                    "needs peer rounds: set lofi.compress (int8, int4, int2, topk, sign) or lofi.exchange: peers",
                )
            if self.average_every is None or self.average_unit != "steps":
                raise ConfigError(
                    field, value, "needs rounds every H steps: set lofi.average_every and lofi.average_unit: steps"
                )
        if (self.fragments > 1 or self.overlap) and not fixed_period(self):
            field, value = ("lofi.fragments", self.fragments) if self.fragments > 1 else ("lofi.overlap", self.overlap)
            raise ConfigError(
                field, value, "needs one period: set lofi.average_every to a number and lofi.warmup_steps to 0"
            )
        if self.fragments > 1 and self.average_every % self.fragments:
            raise ConfigError(
                "lofi.fragments", self.fragments, f"must divide lofi.average_every ({self.average_every})"
            )
        gap = self.average_every // self.fragments if fixed_period(self) and self.average_every else 0
        if self.overlap and self.overlap > gap:
            raise ConfigError(
                "lofi.overlap",
                self.overlap,
                f"must be at most average_every/fragments ({gap}): one round in flight at a time",
            )

    def check_loaded(self, ctx: RunContext, sync_unit, smallest_shard: int | None) -> None:
        """Against the loaded model (its units of what crosses, `sync_unit`) and, where known, the run's
        length (the steps of its smallest shard)."""
        self._check_fragments_fit(ctx, sync_unit)
        if smallest_shard is not None:
            self._check_run_length(ctx.cfg, smallest_shard)

    def _check_fragments_fit(self, ctx: RunContext, sync_unit) -> None:
        """More fragments than units of what crosses (`sync_unit` of the floating-point tensors a node
        sends: modules, or under LoRA adapted layers and the head) cannot be cut."""
        model = ctx.architecture
        if ctx.fine_tune.trainable_only():  # a node sends what trains (adapters and head); names only: may be meta
            sent = [k for k, p in model.named_parameters() if p.requires_grad]
        else:
            sent = [k for k, v in model.state_dict().items() if v.is_floating_point()]
        count = len({sync_unit(k) for k in sent})
        if self.fragments > count:
            raise ConfigError(
                "lofi.fragments",
                self.fragments,
                f"the model sends {count} modules with floating-point tensors to cut into fragments: "
                f"set at most {count}",
            )

    def _check_run_length(self, cfg: RunConfig, smallest_shard: int) -> None:
        """average_every and warmup_steps against the run's length: a period longer than the run never
        comes round, and the run would train as plain lo-fi, one average at its end, while the config
        asks for rounds; a warm-up as long as the run leaves no step to `average_every`."""
        from raylowcomm.common.batches import steps_per_epoch
        from raylowcomm.training import total_steps

        if self.average_every is None:
            return
        steps = total_steps(cfg.optim, smallest_shard)
        per_epoch = steps_per_epoch(smallest_shard, cfg.optim.batch_size)
        if self.warmup_steps and self.warmup_steps >= steps and cfg.optim.budget_s is None:
            raise ConfigError(
                "lofi.warmup_steps",
                self.warmup_steps,
                f"the run takes {steps} steps per node, so a warm-up of {self.warmup_steps} rounds every step "
                f"would last it all and lofi.average_every would never take over: set warmup_steps below "
                f"{steps}, or 0",
            )
        every = round_gaps(self, per_epoch)[0]
        if every <= steps:
            return
        listed = isinstance(self.average_every, list)
        first, which = (self.average_every[0], " (its first round)") if listed else (self.average_every, "")
        run = f"the run takes {steps} steps per node"
        end = "no round would come before its end (one average there, as plain lo-fi)"
        if self.average_unit == "steps":
            raise ConfigError(
                "lofi.average_every",
                self.average_every,
                f"{every} steps{which} is longer than the run: {run}, so {end}: set lofi.average_every to at "
                f"most {steps}, or null for one average at the end",
            )
        epochs = steps / per_epoch
        in_steps = f"at most {steps} with lofi.average_unit: steps"
        fix = f"at most {steps // per_epoch} (epochs)" if epochs >= 1 else in_steps
        raise ConfigError(
            "lofi.average_every",
            self.average_every,
            f"{first} epoch{'s' * (first != 1)} ({every} steps){which} is longer than the run: "
            f"{run} ({epochs:g} epoch{'s' * (epochs != 1)} of {per_epoch} steps), so {end}: set "
            f"lofi.average_every to {fix}, or null for one average at the end",
        )


@dataclass(frozen=True)
class CodecOptions(OptionGroup):
    """What peer rounds send: the codec of the outer gradients, the tensors that cross whole, error
    feedback, and the final round's encoding."""

    compress: Literal["none", "int8", "int4", "int2", "topk", "sign"]
    topk_fraction: float
    compress_block: int
    compress_scale: Literal["node", "shared"]
    dense: list[str]
    dense_codec: Literal["none", "int8", "int4", "int2"]
    error_feedback: bool
    final_round: Literal["compressed", "int8", "exact"]
    final_residual: bool

    def check(self, rounds: RoundOptions, secure: bool = False) -> None:
        """`secure`: lofi.secure, whose masked codes may travel through the driver (`exchange: driver`)."""
        if self.compress not in CODECS:
            raise ConfigError("lofi.compress", self.compress, f"choose one of {', '.join(CODECS)}")
        star = rounds.exchange == "driver" and not secure
        if star and self.compress != "none":
            raise ConfigError(
                "lofi.exchange",
                rounds.exchange,
                "compressed outer gradients travel between the nodes (or, masked, through the driver with "
                "lofi.secure): set lofi.exchange: peers (or auto)",
            )
        if not 0 < self.topk_fraction <= 1:
            raise ConfigError("lofi.topk_fraction", self.topk_fraction, "must be in (0, 1]")
        if not 1 <= self.compress_block <= MAX_COMPRESS_BLOCK:
            raise ConfigError("lofi.compress_block", self.compress_block, f"must be in [1, {MAX_COMPRESS_BLOCK}]")
        if self.dense and (self.compress == "none" or star):
            raise ConfigError(
                "lofi.dense",
                self.dense,
                "names tensors that cross whole beside compressed ones: set lofi.compress (peer rounds), or dense: []",
            )

    def check_scale(self, cfg: RunConfig, exchange: type[Exchange], groups) -> None:
        """`compress_scale: shared` against the run's other options (`groups`: `LofiOptions`): the first clash."""
        for clash in shared_scale_clashes(self, cfg, exchange, groups) if self.compress_scale == "shared" else []:
            raise ConfigError("lofi.compress_scale", self.compress_scale, clash)

    def check_loaded(self, ctx: RunContext) -> None:
        """`dense` names tensors of the loaded model."""
        try:
            dense_names(ctx.architecture, ctx.spec.family, self.dense)
        except ValueError as err:
            fix = f"{err}: name its tensors by pattern (`classifier.*`)"
            raise ConfigError("lofi.dense", self.dense, fix) from None


@dataclass(frozen=True)
class OuterOptions(OptionGroup):
    """DiLoCo's outer step on the averaged update."""

    outer_optimizer: Literal["none", "nesterov"]
    outer_lr: float
    outer_momentum: float

    def check(self, cfg: RunConfig) -> None:
        if not 0 < self.outer_lr:
            raise ConfigError("lofi.outer_lr", self.outer_lr, "must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("lofi.outer_momentum", self.outer_momentum, "must be in [0, 1)")
        if cfg.model.lora is not None and self.outer_optimizer != "none":
            raise ConfigError(
                "lofi.outer_optimizer", self.outer_optimizer, "not offered with model.lora: set it to none"
            )


@dataclass(frozen=True)
class ProbeOptions(OptionGroup):
    """LP-FT's probe: the new head trained alone, and averaged, before the nodes split."""

    probe_steps: int

    def check(self, cfg: RunConfig, exchange: type[Exchange], outer: OuterOptions) -> None:
        if self.probe_steps < 0:
            raise ConfigError("lofi.probe_steps", self.probe_steps, "must be a number of steps >= 0")
        if self.probe_steps and (cfg.model.lora is not None or cfg.model.family == "hf_causal_lm"):
            raise ConfigError(
                "lofi.probe_steps",
                self.probe_steps,
                "a probe trains a new classifier head with every other weight frozen: not offered with "
                "model.lora or a causal LM; set it to 0",
            )
        if self.probe_steps and outer.outer_optimizer != "none" and not exchange.nodes_keep_rounds:
            raise ConfigError(
                "lofi.probe_steps",
                self.probe_steps,
                "the driver's outer step starts from the pretrained head, not the probed one: with "
                "lofi.outer_optimizer use peer rounds (lofi.exchange: peers), or set probe_steps to 0",
            )


@dataclass(frozen=True)
class AverageOptions(OptionGroup):
    """How the final average is made: a uniform or greedy soup, LoRA adapters' average, BatchNorm's
    recalibration."""

    soup: Literal["uniform", "greedy"]
    lora_average: Literal["delta", "factors"]
    bn_recalibrate: bool
    bn_batches: int | None

    def check(self, cfg: RunConfig, exchange: type[Exchange], rounds: RoundOptions, codec: CodecOptions) -> None:
        if self.soup == "greedy" and (cfg.data.val_size == 0 or cfg.data.eval_on_nodes):
            raise ConfigError(
                "lofi.soup",
                self.soup,
                "a greedy soup needs a held-out split on the driver: "
                "set data.val_size > 0 (not with data.eval_on_nodes)",
            )
        if self.soup == "greedy" and exchange.nodes_keep_rounds:
            coded = codec.compress != "none"
            field, value = ("lofi.compress", codec.compress) if coded else ("lofi.exchange", rounds.exchange)
            raise ConfigError(field, value, "a greedy soup needs every node's full model: set lofi.soup: uniform")
        if self.soup == "greedy" and cfg.model.lora is not None:
            raise ConfigError("lofi.soup", self.soup, "not offered with model.lora: set it to uniform")
        if self.bn_batches is not None and self.bn_batches <= 0:
            raise ConfigError("lofi.bn_batches", self.bn_batches, "must be > 0, or null for a full pass")


@dataclass(frozen=True)
class DialOptions(OptionGroup):
    """`dial: auto`: the measured rule chooses the rounds' settings for the run (`dial.resolve`, against
    the loaded model and data), within `dial_bytes` of DDP's bytes."""

    dial: Literal["auto", "off"]
    dial_bytes: float

    def check(self, cfg: RunConfig) -> None:
        if not 0 < self.dial_bytes:
            raise ConfigError("lofi.dial_bytes", self.dial_bytes, "must be > 0: a fraction of DDP's bytes")
        if self.dial == "auto" and cfg.data.node_files is not None:
            raise ConfigError(
                "lofi.dial",
                self.dial,
                "chooses by the run's steps a node, which with data.node_files only the nodes know: set the "
                "lo-fi options yourself (docs/strategies/lofi.md), or dial: off",
            )
