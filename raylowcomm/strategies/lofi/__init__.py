"""lo-fi (Wortsman et al. 2022): every node fine-tunes its own copy on its own shard with no
communication; the driver averages the weights once at the end (or every `average_every`).

Curve without communicating: at every `eval_every` step a node snapshots its weights in storage.
After training the driver averages snapshot s across nodes and scores it (plain or
by-examples average: no BN recalibration, soup or outer step); the point's time is the slowest
node's training time at s plus the measured time of the final collection, its bytes those sent
by s plus one collection. Fetching the snapshots is measurement, outside the run's ledger.

Where the nodes meet, the averaging topology, is one object chosen once (`options.exchange_for`): the
driver's star (`star`) or rounds that travel node to node, compressed (`peers`, with the node's side
in `node_rounds`). The loop below trains to each boundary and asks the exchange for the round;
`final` scores, recalibrates and saves the average the exchange ends with; `start_nodes` starts the
node actors (and later the joiners).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from raylowcomm.actors import NodeGroup
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import RunConfig
from raylowcomm.execution.placement import node_bundle
from raylowcomm.strategies.base import RunContext, RunRecord, Strategy
from raylowcomm.strategies.lofi.applicability import OPTION_RULES
from raylowcomm.strategies.lofi.config import NAME, LofiConfig, node_slots
from raylowcomm.strategies.lofi.ending import finish_run
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.lockstep import LockstepRounds
from raylowcomm.strategies.lofi.merging import merging_for
from raylowcomm.strategies.lofi.node import LofiNode
from raylowcomm.strategies.lofi.options import LofiOptions, exchange_for
from raylowcomm.strategies.lofi.plan import plan_rounds
from raylowcomm.strategies.lofi.probe import shared_head

logger = logging.getLogger(__name__)


class Lofi(Strategy[LofiConfig]):
    name: ClassVar[str] = NAME
    runs_by_default: ClassVar[bool] = True
    elastic_nodes: ClassVar[bool] = True  # on quorum rounds, which a range selects
    Config: ClassVar[type] = LofiConfig
    option_rules: ClassVar[dict] = OPTION_RULES

    @staticmethod
    def table_rows(record: dict, metric: str) -> list[list[str]]:
        """The average as scored before BatchNorm recalibration, where it was recalibrated."""
        bn = record.get("details", {}).get("average_without_bn_recalibration")
        if not bn:
            return []
        shift = f"{bn[f'shift_{metric}']:.4f}" if f"shift_{metric}" in bn else "-"
        return [["  avg w/o BN recal", f"{bn[f'id_{metric}']:.4f}", shift]]

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """Joiners (lofi.join) may be alive beside the first nodes: a slot for each. Nodes past a range's min
        (`nodes.count: [min, max]`) are not reserved: each starts where and when the cluster holds it."""
        return [node_bundle(cfg)] * (cfg.nodes.count + len(Lofi.opts(cfg).join))

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None:
        """What starts from, or merges into, weights the driver holds (the topology's to say); one final
        average of adapters is merged and saved on node 0, where the base is."""
        o = Lofi.opts(cfg)
        return exchange_for(cfg).driver_weights(cfg, o)

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        """Each group of the options checks itself (`options.LofiOptions`), on the topology chosen once."""
        LofiOptions.of(Lofi.opts(cfg)).validate(cfg, exchange_for(cfg))

    @staticmethod
    def check(ctx: RunContext) -> None:
        """Each group of the options against the loaded model and data."""
        LofiOptions.of(Lofi.opts(ctx.cfg)).check(ctx)

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, n = ctx.cfg, self.opts(ctx.cfg), ctx.cfg.nodes.count
        clock, ledger, slots = TrainClock(), Ledger(), node_slots(cfg, opts)
        ctx.fresh_state(self.name)
        (what, start), watch = ctx.initial_model(), Stopwatch()
        initial = start if what == "initial_weights" else None  # None: the nodes load the weights, not the driver
        exchange = exchange_for(cfg)(ctx, opts, initial)
        with NodeGroup(LofiNode, cfg, ledger, restarts=cfg.restarts, bundles=self.bundles(cfg)) as group:
            with watch("start"):
                launch = start_nodes(ctx, group, opts, exchange, slots, what, start)
            sizes = ctx.data.train.sizes(slots) or group.call("examples", phase="setup", what="shard_sizes")
            plan = plan_rounds(
                cfg, opts, sizes, merging_for(ctx.spec).node_average(initial, ctx.architecture, opts.lora_average)
            )
            if opts.probe_steps and not ctx.resume:
                with watch("probe"):
                    shared_head(group, opts.probe_steps, plan.weights)
            ctx.live.expect(n, plan.steps)
            bounds = plan.boundaries if plan.averaging else [plan.steps]
            logger.info(
                "[lofi] %d nodes x %s steps, averaging at steps %s",
                n,
                plan.steps
                if cfg.optim.budget_s is None
                else f"{cfg.optim.budget_s:g} s of training (at most {plan.steps})",
                bounds if len(bounds) <= 12 else f"{bounds[:6]} ... {bounds[-1]}",
            )
            first = exchange.resume(ctx, group, plan) if ctx.resume else 0
            if first:
                logger.info("[lofi] resuming after averaging round %d (exchange: %s)", first, exchange.name)
            with watch("train"):
                if exchange.paced:
                    trained = exchange.train(ctx, group, plan, launch)
                else:
                    trained = LockstepRounds(ctx, group, plan, exchange, start).run(first)
            return finish_run(self.name, opts, ctx, group, plan, exchange, trained, clock, watch)


def start_nodes(
    ctx: RunContext, group: NodeGroup, opts: LofiConfig, exchange: Exchange, slots: int, what: str, start
) -> Callable[..., Callable[[], None] | None]:
    """The first `nodes.count` node actors, started and ready: each fetches the start (`what`: the initial
    weights, or the recipe the nodes load them by), the evaluation sets and how to read its shard (not the
    data). Returns `launch`, which starts node k the same way later (a joiner, or a node past a range's min)."""
    cfg, n, ledger = ctx.cfg, ctx.cfg.nodes.count, group.ledger
    weights_ref = group.put(start, "setup", what, copies=n)
    group.share_eval_sets(ctx.eval_sets(), keys=list(range(n)))
    # how to read the data, not the data
    recipe = group.put(ctx.data.train, "setup", "data_recipe", copies=n)

    def book_fetches() -> None:
        ledger.send("train", what, start)
        ledger.send("train", "data_recipe", ctx.data.train)

    def launch(k: int, placed: bool = True):
        """Node k's actor; a joiner's fetch of the start and the recipe is booked as it starts.
        Unplaced (past a range's min), it waits for the cluster to hold it: the booking is
        returned, for the caller to make once the actor has started."""
        if k >= n and placed:
            book_fetches()
        (group.start if placed else group.start_unplaced)(
            k,
            k,
            ctx.spec,
            ctx.data.task,
            weights_ref,
            recipe,
            cfg,
            ctx.storage,
            ctx.live.poster(k),
            rounds=opts if exchange.nodes_keep_rounds else None,
            round_momentum=opts.round_momentum,
            slots=slots,
        )
        return None if placed else book_fetches

    for k in range(n):
        launch(k)
    group.ready()
    return launch
