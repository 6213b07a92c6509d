"""lo-fi's quorum and membership options (`QuorumOptions`, a group of `LofiConfig`'s fields): rounds that
land on a quorum, sync by time, nodes that join and leave, and what quorum rounds cannot run with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.checks import check_kills, check_kills_restarted
from raylowcomm.core.membership import JoinEvent, LeaveEvent, ScheduleError, check_schedule
from raylowcomm.strategies.lofi.config import on_quorum
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.option_groups import CodecOptions, OptionGroup, RoundOptions
from raylowcomm.strategies.lofi.payload import final_is_own


@dataclass(frozen=True)
class QuorumOptions(OptionGroup):
    """Quorum rounds and membership: how many payloads land a round and how long it waits, what a late
    payload weighs, whether a waiting node trains on, sync by steps or time, the joins and leaves."""

    quorum: int | float | None
    grace_s: float
    staleness: float
    keep_training: bool
    sync: Literal["steps", "time"]
    sync_every_s: float | None
    join: list[JoinEvent]
    leave: list[LeaveEvent]

    def check(self, cfg: RunConfig, exchange: type[Exchange], rounds: RoundOptions, codec: CodecOptions) -> None:
        quorum_rounds = on_quorum(self, cfg.nodes.elastic)
        if not quorum_rounds:  # lockstep rounds wait for every node: a kill no restart meets would end the run
            check_kills_restarted(
                cfg, per_node=True, why="lockstep rounds wait for every node (lofi.quorum lets the others go on)"
            )
        elif not exchange.nodes_keep_rounds:
            field, value = next(
                (
                    (f"lofi.{name}", getattr(self, name))
                    for name in ("quorum", "sync", "join", "leave")
                    if getattr(self, name) not in (None, "steps", [])
                ),
                ("nodes.count", cfg.nodes.count_as_given()),
            )
            raise ConfigError(field, value, "quorum rounds are peer rounds: set lofi.exchange: peers (or a compress)")
        else:
            self._check_quorum_rounds(cfg, rounds, codec)
        if self.keep_training and not quorum_rounds and not rounds.overlap:
            raise ConfigError(
                "lofi.keep_training",
                self.keep_training,
                "a node keeps what it trains while its payload waits for a quorum round or its round is in "
                "flight: set lofi.quorum (or lofi.sync: time) or lofi.overlap, or false",
            )
        if self.keep_training and rounds.overlap and exchange.nodes_keep_rounds:
            if cfg.model.lora is not None:
                raise ConfigError(
                    "lofi.keep_training",
                    self.keep_training,
                    "with model.lora a landed round restarts the adapters it merged, "
                    "which leaves nothing of the node's own to keep: set lofi.keep_training: false",
                )
            if rounds.mix:
                raise ConfigError(
                    "lofi.mix",
                    rounds.mix,
                    "with lofi.keep_training a landed round keeps all the node trained while it was in flight: "
                    "set lofi.mix: 0",
                )

    def _check_quorum_rounds(self, cfg: RunConfig, rounds: RoundOptions, codec: CodecOptions) -> None:
        """The quorum's size, how long a round waits and what a late payload weighs, the membership,
        how rounds come, and the options quorum rounds cannot run with."""
        q, n = self.quorum, cfg.nodes.most
        whole = isinstance(q, int) and not isinstance(q, bool)
        if q is not None and not ((whole and 1 <= q <= n) or (isinstance(q, float) and 0 < q <= 1)):
            raise ConfigError(
                "lofi.quorum", q, f"a node count in 1..{n} (nodes.count), a fraction in (0, 1], or null for lockstep"
            )
        if cfg.nodes.elastic:
            for name, value in (("data.node_files", cfg.data.node_files), ("nodes.hosts", cfg.nodes.hosts)):
                if value is not None:
                    raise ConfigError(
                        "nodes.count",
                        cfg.nodes.count_as_given(),
                        f"a range's nodes start wherever the cluster holds them, with a shard cut from one "
                        f"training set: not offered with {name}; give one number",
                    )
        if self.grace_s < 0:
            raise ConfigError("lofi.grace_s", self.grace_s, "must be >= 0 seconds")
        if self.staleness < 0:
            raise ConfigError("lofi.staleness", self.staleness, "must be >= 0 (0: a late payload counts fully)")
        self.check_membership(cfg, None)
        timed = self.sync == "time"
        if timed and not (self.sync_every_s and self.sync_every_s > 0):
            raise ConfigError(
                "lofi.sync_every_s", self.sync_every_s, "sync: time needs the seconds between payloads (> 0)"
            )
        self._check_refused(cfg, rounds, codec)

    def _check_refused(self, cfg: RunConfig, rounds: RoundOptions, codec: CodecOptions) -> None:
        """What quorum rounds cannot run with: rounds by steps and by time at once (or neither), a
        warm-up by time, adapters, fragments or overlap, a final round encoded apart, a curve, a budget."""
        timed = self.sync == "time"
        refused = (
            (
                "lofi.average_every",
                rounds.average_every,
                (rounds.average_every is None) != timed,
                "sync: time replaces average_every: set one of them"
                if timed
                else "quorum rounds need rounds: set lofi.average_every (or lofi.sync: time)",
            ),
            (
                "lofi.warmup_steps",
                rounds.warmup_steps,
                timed and rounds.warmup_steps > 0,
                "a warm-up counts steps: with sync: time set it to 0",
            ),
            ("model.lora", "set", cfg.model.lora is not None, "not offered with quorum rounds yet: remove lofi.quorum"),
            (
                "lofi.fragments",
                rounds.fragments,
                rounds.fragments > 1,
                "quorum rounds sync the whole model: set lofi.fragments: 1",
            ),
            (
                "lofi.overlap",
                rounds.overlap,
                rounds.overlap > 0,
                "a quorum round lands between segments: set lofi.overlap: 0",
            ),
            (
                "lofi.final_round",
                codec.final_round,
                final_is_own(codec),
                "a quorum round may merge a late payload with the last ones, so every payload is encoded "
                "alike: set lofi.final_round: compressed and lofi.final_residual: true",
            ),
            (
                "eval_every",
                cfg.eval_every,
                cfg.eval_every > 0,
                "a curve from snapshots needs lockstep nodes: set eval_every: 0",
            ),
            (
                "optim.budget_s",
                cfg.optim.budget_s,
                cfg.optim.budget_s is not None,
                "quorum rounds run a budget of node-steps: remove optim.budget_s",
            ),
        )
        for name, value, bad, fix in refused:
            if bad:
                raise ConfigError(name, value, fix)

    def check_membership(self, cfg: RunConfig, steps: int | None) -> None:
        """join and leave against the first nodes and, once known, the run's steps per node."""
        for i, ev in enumerate(self.leave):
            if ev.how != "remove":
                raise ConfigError(
                    f"lofi.leave[{i}].how",
                    ev.how,
                    "a node leaves quorum rounds by `remove`; a crash is churn.kill (with nodes.max_restarts: 0 it "
                    "does not come back): set how: remove",
                )
        if self.join and cfg.data.node_files is not None:
            raise ConfigError(
                "lofi.join",
                [ev.step for ev in self.join],
                "a joiner's shard is cut from one shared training set: not offered with data.node_files; "
                "remove lofi.join",
            )
        try:
            check_schedule(cfg.nodes.count, self.leave, self.join, steps)
        except ScheduleError as err:
            raise ConfigError(f"lofi.{err.field}", err.value, err.allowed) from None

    def check_loaded(self, cfg: RunConfig, steps: int | None) -> None:
        """The membership against the run's steps per node (None: not known before the nodes start), and
        churn.kill against them and the steps at which nodes leave."""
        if steps is not None:
            self.check_membership(cfg, steps)
        check_kills(cfg, steps, {ev.node: ev.step for ev in self.leave}, "lofi.leave")
