"""`lofi.privacy`: distributed differential privacy of lo-fi's peer rounds (`core.privacy`, docs/privacy.md).

Before anything starts (`PrivacyOptions`): the bounds' ranges; the combinations in which something of a
node's own crosses un-noised, or the guarantee on the average would not hold, refused; then, on the
loaded data, the run's rounds counted (every round in which a node's Δ crosses, the final one included)
and σ fixed for them (`PrivacyPlan`): the smallest σ whose ε fits `epsilon`, or the σ given, refused
where its ε would pass `epsilon`. On a node (`NodeNoise`): its round Δ clipped and noised before the
codec, from a secret the node makes at its first start and keeps beside its checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from raylowcomm.common.batches import steps_per_epoch
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core import privacy
from raylowcomm.core.averaging import batchnorm_layers
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.config import PrivacyConfig, fixed_period, round_boundaries, round_gaps
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.option_groups import OptionGroup

if TYPE_CHECKING:
    from raylowcomm.storage import Storage
    from raylowcomm.strategies.base import RunContext

logger = logging.getLogger(__name__)

_PEERS = "needs lockstep peer rounds"


def secret_path(rank: int) -> str:
    """Where node `rank` keeps its noise secret: beside its checkpoint, under the run's lo-fi state (a new
    run starts without it; a resumed or restarted node reads it back)."""
    return f"lofi/checkpoints/node{rank}_noise.secret"


def planned_rounds(cfg: RunConfig, o, smallest_shard: int) -> int:
    """The rounds in which a node's Δ crosses, as `plan.plan_rounds` lays them out: each boundary's round,
    the final one included (one, the final average, without `average_every`)."""
    from raylowcomm.training import total_steps

    steps = total_steps(cfg.optim, smallest_shard)
    gaps = round_gaps(o, steps_per_epoch(smallest_shard, cfg.optim.batch_size))
    if gaps is None:
        return 1
    if fixed_period(o) and o.fragments > 1:
        return len(streaming.schedule(gaps[0], o.fragments, steps)[0])
    return len(round_boundaries(gaps, steps))


@dataclass(frozen=True)
class PrivacyPlan:
    """The run's mechanism: σ (`noise_multiplier`) and C for `nodes` nodes, its accounting at δ."""

    epsilon_target: float
    delta: float
    noise_multiplier: float
    clip: float
    nodes: int
    chosen: bool
    """Whether σ was chosen for `epsilon_target` (else given)."""
    secure: bool = False
    """Whether rounds are masked (`lofi.secure`): peers and driver then read the sum only."""

    def record(self, rounds: int) -> dict:
        """`details.privacy`: ε the accountant gives for σ over `rounds` at δ, the ε that holds against
        whoever reads one node's noised update alone (σ/√N), and which of the two holds against the peers
        and the driver (the first with secure rounds, which show them the sum only)."""
        epsilon = privacy.epsilon_of(self.noise_multiplier, rounds, self.delta)
        return {
            "epsilon": epsilon,
            "epsilon_target": self.epsilon_target,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "rounds": rounds,
            "nodes": self.nodes,
            "unit": "node",
            "epsilon_one_update_seen_alone": self.epsilon_one_update(rounds),
            "epsilon_against_peers_and_driver": epsilon if self.secure else self.epsilon_one_update(rounds),
            "accountant": "opacus RDPAccountant, sample rate 1",
        }

    def epsilon_one_update(self, rounds: int) -> float:
        """ε against a reader of one node's noised updates in the clear, each carrying σ/√N of its C."""
        return privacy.epsilon_of(self.noise_multiplier / math.sqrt(self.nodes), rounds, self.delta)


@dataclass(frozen=True)
class PrivacyOptions(OptionGroup):
    """`lofi.privacy` and what it refuses beside it."""

    privacy: PrivacyConfig | None

    def check(self, cfg: RunConfig, exchange: type[Exchange], groups) -> None:
        """The bounds' ranges, then the combinations refused (`_check_combinations`) on the other groups'
        fields (`groups`: the run's `options.LofiOptions`)."""
        p = self.privacy
        if p is None:
            return
        if p.epsilon is None or not (math.isfinite(p.epsilon) and p.epsilon > 0):
            raise ConfigError("lofi.privacy.epsilon", p.epsilon, "set the ε the run may spend, a finite number > 0")
        if not 0 < p.delta < 1:
            raise ConfigError("lofi.privacy.delta", p.delta, "must be in (0, 1): well below 1 / the number of nodes")
        if not (math.isfinite(p.clip) and p.clip > 0):
            raise ConfigError("lofi.privacy.clip", p.clip, "must be a finite number > 0: the bound on a node's Δ norm")
        if p.noise is not None and not (math.isfinite(p.noise) and p.noise > 0):
            raise ConfigError("lofi.privacy.noise", p.noise, "must be a finite number > 0, or null to fit epsilon")
        parts = (groups.rounds, groups.quorum, groups.probe, groups.average, groups.robust)
        _check_combinations(cfg, exchange, SimpleNamespace(**{k: v for g in parts for k, v in vars(g).items()}))

    def check_loaded(self, ctx: RunContext, o, smallest_shard: int | None) -> None:
        """On the loaded model and data: no BatchNorm statistics recomputed per node; the run's rounds
        counted and σ fixed for them (`o.privacy_plan`), logged in one line."""
        p = self.privacy
        if p is None:
            return
        if o.bn_recalibrate and batchnorm_layers(ctx.architecture):
            raise ConfigError(
                "lofi.bn_recalibrate",
                True,
                "with lofi.privacy each node's BatchNorm statistics of its own shard would reach the driver "
                "un-noised: set lofi.bn_recalibrate: false",
            )
        if smallest_shard is None:
            raise ConfigError(
                "data.node_files",
                ctx.cfg.data.node_files,
                "lofi.privacy counts the run's rounds before it starts, from its shards' sizes, which with "
                "data.node_files only the nodes know: remove lofi.privacy or data.node_files",
            )
        rounds = planned_rounds(ctx.cfg, o, smallest_shard)
        o.privacy_plan = plan = dataclasses.replace(plan_for(p, rounds, ctx.cfg.nodes.count), secure=o.secure)
        logger.info(
            "[lofi] privacy: ε=%.4g at δ=%g over %d rounds (target %g): σ=%.4g (%s), C=%g, node noise σ·C/√N=%.4g "
            "a coordinate; one node's update seen alone: ε=%.4g",
            plan.record(rounds)["epsilon"],
            p.delta,
            rounds,
            p.epsilon,
            plan.noise_multiplier,
            "chosen for the target" if plan.chosen else "given",
            p.clip,
            privacy.noise_std(plan.noise_multiplier, p.clip, plan.nodes),
            plan.epsilon_one_update(rounds),
        )


def plan_for(p: PrivacyConfig, rounds: int, nodes: int) -> PrivacyPlan:
    """σ for `rounds` rounds: the smallest that fits ε (noise null), or the one given, refused where its ε
    passes the target, naming the σ that would fit."""
    try:
        fits = privacy.noise_for(p.epsilon, rounds, p.delta)
    except ValueError:
        raise ConfigError(
            "lofi.privacy.epsilon",
            p.epsilon,
            f"no noise multiplier fits ε {p.epsilon:g} at δ {p.delta:g} over {rounds} rounds: raise epsilon or "
            "lofi.average_every (fewer rounds)",
        ) from None
    if p.noise is None:
        return PrivacyPlan(p.epsilon, p.delta, fits, p.clip, nodes, chosen=True)
    spent = privacy.epsilon_of(p.noise, rounds, p.delta)
    if spent > p.epsilon:
        raise ConfigError(
            "lofi.privacy.noise",
            p.noise,
            f"spends ε {spent:.4g} over the run's {rounds} rounds, more than lofi.privacy.epsilon {p.epsilon:g}: "
            f"set noise to at least {fits:.4g} (or null), or fewer rounds (lofi.average_every)",
        )
    return PrivacyPlan(p.epsilon, p.delta, p.noise, p.clip, nodes, chosen=False)


_REFUSED = (
    ("lofi.soup", lambda c, o: o.soup == "greedy", "a greedy soup scores each node's own model", "uniform"),
    ("lofi.probe_steps", lambda c, o: o.probe_steps > 0, "the probe sends each node's head to the driver", "0"),
    ("model.lora", lambda c, o: c.model.lora is not None, "rounds that merge adapters are not covered yet", "null"),
    ("eval_every", lambda c, o: c.eval_every > 0, "the curve fetches each node's own snapshots", "0"),
    (
        "lofi.weighting",
        lambda c, o: o.weighting != "uniform",
        "unequal weights leave one node's share of the average less noise than σ·C",
        "uniform",
    ),
    (
        "lofi.aggregate",
        lambda c, o: o.aggregate != "mean",
        "a robust rule's result is not the noised sum the accountant covers",
        "mean",
    ),
    (
        "lofi.on_bad_payload",
        lambda c, o: o.on_bad_payload != "fail",
        "a round that drops a node's payload keeps less noise than σ·C",
        "fail",
    ),
)
"""(field, whether the run has it, why privacy cannot hold with it, the value that can)."""


def _check_combinations(cfg: RunConfig, exchange: type[Exchange], o) -> None:
    """One line for the first combination in which a node's own state crosses un-noised, or the average
    would carry less noise than σ·C: the driver's star, quorum rounds, and `_REFUSED`'s."""
    if not exchange.nodes_keep_rounds:
        raise ConfigError(
            "lofi.exchange",
            o.exchange,
            f"lofi.privacy {_PEERS}: the driver's star gathers each node's whole weights un-noised; set "
            "lofi.exchange: peers (or a lofi.compress)",
        )
    if exchange.paced:
        field, value = _quorum_field(cfg, o)
        raise ConfigError(
            field,
            value,
            f"lofi.privacy {_PEERS}: quorum rounds land on fewer than every node's noise, and a node may send "
            "more payloads than rounds; set lofi.quorum: null, sync: steps, no join or leave, a fixed nodes.count",
        )
    for field, present, why, fix in _REFUSED:
        if present(cfg, o):
            value = value_of(cfg, o, field)
            raise ConfigError(field, value, f"not with lofi.privacy: {why}; set {field}: {fix}, or remove lofi.privacy")


def _quorum_field(cfg: RunConfig, o) -> tuple[str, object]:
    """The field that puts the rounds on a quorum (`config.on_quorum`)."""
    causes = (("quorum", o.quorum is not None), ("sync", o.sync == "time"), ("join", o.join), ("leave", o.leave))
    for field, on in causes:
        if on:
            return f"lofi.{field}", getattr(o, field)
    return "nodes.count", cfg.nodes.count


def value_of(cfg: RunConfig, o, field: str):
    """The value of `field` (`lofi.<name>`, `<section>.<name>` or a top-level name) in the run's config."""
    section, name = field.split(".") if "." in field else (None, field)
    if section == "lofi":
        return getattr(o, name)
    return getattr(getattr(cfg, section), name) if section else getattr(cfg, name)


class NodeNoise:
    """A node's side: its secret (made at its first start, kept in storage beside its checkpoint, never
    sent) and the run's σ and C; `apply` clips and noises a round's Δ. Refuses to be pickled, so the
    secret does not travel by accident."""

    def __init__(self, plan: PrivacyPlan | None, storage: Storage, rank: int):
        if plan is None:
            raise RuntimeError("lofi.privacy has no σ for the run: `Lofi.check` plans it before the nodes start")
        self.plan = plan
        path = secret_path(rank)
        if storage.exists(path):
            self._secret = storage.read_bytes(path)
        else:
            self._secret = privacy.new_secret()
            storage.write_bytes(path, self._secret)

    def __reduce__(self):
        raise TypeError("a node's noise secret stays on the node")

    def apply(self, delta: dict, place: tuple[int, ...]) -> dict:
        """Δ clipped to C and noised with σ·C/√N per entry, drawn for `place` (round, step, final)."""
        p = self.plan
        return privacy.privatize(delta, p.clip, p.noise_multiplier, p.nodes, self._secret, place)
