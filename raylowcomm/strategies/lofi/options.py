"""lo-fi's options as typed groups (`LofiOptions`), built from the flat `LofiConfig` a config loads: the
YAML keys stay flat under `lofi:`, and each group checks its own fields, cross-field checks
included, once (`option_groups`, `quorum_options`), on the topology chosen once (`exchange_for`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylowcomm.config import RunConfig
from raylowcomm.strategies.lofi import dial
from raylowcomm.strategies.lofi.config import NAME, LofiConfig, node_slots, on_quorum
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.merging import merging_for
from raylowcomm.strategies.lofi.option_groups import (
    AverageOptions,
    CodecOptions,
    DialOptions,
    OuterOptions,
    ProbeOptions,
    RoundOptions,
)
from raylowcomm.strategies.lofi.peers import PeerExchange
from raylowcomm.strategies.lofi.privacy import PrivacyOptions
from raylowcomm.strategies.lofi.quorum import QuorumExchange
from raylowcomm.strategies.lofi.quorum_options import QuorumOptions
from raylowcomm.strategies.lofi.robust_options import RobustOptions
from raylowcomm.strategies.lofi.secure_options import SecureOptions
from raylowcomm.strategies.lofi.secure_star import SecureStarExchange
from raylowcomm.strategies.lofi.star import StarExchange

if TYPE_CHECKING:
    from raylowcomm.strategies.base import RunContext


def exchange_for(cfg: RunConfig) -> type[Exchange]:
    """The run's topology, chosen here only: peer rounds where `exchange: peers`, or `auto` with a
    codec, landing on a quorum where `quorum` is set, nodes sync by time, join and leave, or come as
    the cluster holds them (`on_quorum`); secure rounds through the driver where `exchange: driver` with
    `secure`; else the driver's star."""
    opts = cfg.options[NAME]
    if opts.secure and opts.exchange == "driver":
        return SecureStarExchange
    peers = opts.exchange == "peers" or (opts.exchange == "auto" and opts.compress != "none")
    if peers and on_quorum(opts, cfg.nodes.elastic):
        return QuorumExchange
    return PeerExchange if peers else StarExchange


@dataclass(frozen=True)
class LofiOptions:
    """The groups of one `LofiConfig`."""

    rounds: RoundOptions
    codec: CodecOptions
    quorum: QuorumOptions
    outer: OuterOptions
    probe: ProbeOptions
    average: AverageOptions
    robust: RobustOptions
    dial: DialOptions
    privacy: PrivacyOptions
    secure: SecureOptions

    @classmethod
    def of(cls, o: LofiConfig) -> LofiOptions:
        return cls(
            RoundOptions.of(o),
            CodecOptions.of(o),
            QuorumOptions.of(o),
            OuterOptions.of(o),
            ProbeOptions.of(o),
            AverageOptions.of(o),
            RobustOptions.of(o),
            DialOptions.of(o),
            PrivacyOptions.of(o),
            SecureOptions.of(o),
        )

    def validate(self, cfg: RunConfig, exchange: type[Exchange]) -> None:
        """Every group's checks before anything starts (a ConfigError), on the topology `exchange`
        the run was given (`exchange_for`, chosen once). Privacy first: what it refuses beside it is
        refused as privacy's, whatever else a group would say of it; then secure aggregation's, likewise."""
        self.privacy.check(cfg, exchange, self)
        self.secure.check(cfg, exchange, self)
        self.rounds.check(cfg, exchange, timed=self.quorum.sync == "time")
        self.codec.check(self.rounds, self.secure.secure)
        self.codec.check_scale(cfg, exchange, self)
        self.quorum.check(cfg, exchange, self.rounds, self.codec)
        self.outer.check(cfg)
        self.probe.check(cfg, exchange, self.outer)
        self.average.check(cfg, exchange, self.rounds, self.codec)
        self.robust.check(cfg, exchange)
        self.dial.check(cfg)

    def check(self, ctx: RunContext) -> None:
        """The groups against the loaded model and data: the run's length from its smallest shard, where
        the driver knows the shards' sizes (not with data.node_files: only the nodes know theirs). First
        the dial (`dial.resolve`): with `dial: auto` the options it chose replace the run's own, in
        `cfg.options`, and are checked as given ones are; then every later reader sees them."""
        from raylowcomm.training import total_steps

        sizes = ctx.data.train.sizes(node_slots(ctx.cfg, self.quorum))
        smallest = min(sizes) if sizes else None
        self.codec.check_loaded(ctx)  # the dense names given, before the dial sizes payloads by them
        given = ctx.cfg.options[NAME]
        resolved = dial.resolve(ctx, given, smallest)
        groups = self
        if resolved is not given:
            ctx.cfg.options[NAME] = resolved
            groups = LofiOptions.of(resolved)
            groups.validate(ctx.cfg, exchange_for(ctx.cfg))
            groups.codec.check_loaded(ctx)
        groups.rounds.check_loaded(ctx, merging_for(ctx.spec).sync_unit, smallest)
        groups.quorum.check_loaded(ctx.cfg, total_steps(ctx.cfg.optim, smallest) if sizes else None)
        groups.privacy.check_loaded(ctx, ctx.cfg.options[NAME], smallest)
        groups.secure.check_loaded(ctx, ctx.cfg.options[NAME])
