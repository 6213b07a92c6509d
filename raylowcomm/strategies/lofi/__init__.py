"""lo-fi (Wortsman et al. 2022): every node fine-tunes its own copy on its own shard with no
communication; the driver averages the weights once at the end (or every `average_every`).

Curve without communicating: at every `eval_every` step a node snapshots its weights in storage.
After training the driver averages snapshot s across nodes and scores it (plain or
by-examples average: no BN recalibration, soup or outer step); the point's time is the slowest
node's training time at s plus the measured time of the final collection, its bytes those sent
by s plus one collection. Fetching the snapshots is measurement, outside the run's ledger.

Where the nodes meet, the averaging topology, is one object chosen once (`exchange_for`): the
driver's star (`star`) or rounds that travel node to node, compressed (`peers`, with the node's side
in `node_rounds`). The loop below trains to each boundary and asks the exchange for the round;
`final` scores, recalibrates and saves the average the exchange ends with.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

from raylowcomm.actors import NodeGroup
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.checks import check_kills, check_kills_restarted
from raylowcomm.core.averaging import batchnorm_layers
from raylowcomm.core.compression import CODECS
from raylowcomm.execution.placement import node_bundle
from raylowcomm.strategies.base import RunContext, RunRecord, Strategy, budget_details, finish_record
from raylowcomm.strategies.lofi import final as final_phase
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.applicability import OPTION_RULES
from raylowcomm.strategies.lofi.config import MAX_COMPRESS_BLOCK, LofiConfig, node_slots, on_quorum
from raylowcomm.strategies.lofi.exchange import Exchange
from raylowcomm.strategies.lofi.merging import merging_for
from raylowcomm.strategies.lofi.node import LofiNode
from raylowcomm.strategies.lofi.payload import dense_names
from raylowcomm.strategies.lofi.peers import PeerExchange
from raylowcomm.strategies.lofi.plan import Plan, plan_rounds
from raylowcomm.strategies.lofi.probe import shared_head
from raylowcomm.strategies.lofi.quorum import QuorumExchange, check_membership
from raylowcomm.strategies.lofi.star import StarExchange
from raylowcomm.tasks import make_task, mean_metrics

logger = logging.getLogger(__name__)


def lockstep_accounts(group: NodeGroup, calls: list[list[dict]]) -> list[NodeAccount]:
    """Each node's goodput account in lockstep rounds: its training is useful (every round merges it), and
    in each call it waits for the slowest node; what a node lost before a restart is not timed."""
    return [
        NodeAccount(
            key,
            useful_s=sum(call[k]["train_s"] for call in calls),
            idle_at_barriers_s=sum(max(s["train_s"] for s in call) - call[k]["train_s"] for call in calls),
            lost_s=None,
            restarts=group.restarted.get(key, 0),
        )
        for k, key in enumerate(group.keys())
    ]


def exchange_for(cfg: RunConfig) -> type[Exchange]:
    """The run's topology, chosen here only: peer rounds where `exchange: peers`, or `auto` with a
    codec, landing on a quorum where `quorum` is set, nodes sync by time, join and leave, or come as
    the cluster holds them (`on_quorum`); else the driver's star."""
    opts = Lofi.opts(cfg)
    peers = opts.exchange == "peers" or (opts.exchange == "auto" and opts.compress != "none")
    if peers and on_quorum(opts, cfg.nodes.elastic):
        return QuorumExchange
    return PeerExchange if peers else StarExchange


class Lofi(Strategy[LofiConfig]):
    name: ClassVar[str] = "lofi"
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
        o = Lofi.opts(cfg)
        Lofi._validate_schedule(o)
        if o.soup == "greedy" and (cfg.data.val_size == 0 or cfg.data.eval_on_nodes):
            raise ConfigError(
                "lofi.soup",
                o.soup,
                "a greedy soup needs a held-out split on the driver: "
                "set data.val_size > 0 (not with data.eval_on_nodes)",
            )
        if not 0 < o.outer_lr:
            raise ConfigError("lofi.outer_lr", o.outer_lr, "must be > 0")
        if not 0 <= o.outer_momentum < 1:
            raise ConfigError("lofi.outer_momentum", o.outer_momentum, "must be in [0, 1)")
        if o.bn_batches is not None and o.bn_batches <= 0:
            raise ConfigError("lofi.bn_batches", o.bn_batches, "must be > 0, or null for a full pass")
        Lofi._validate_exchange(cfg, o)
        Lofi._validate_churn(cfg, o)
        streaming.validate(o, exchange_for(cfg).nodes_keep_rounds)
        adapters = cfg.model.lora is not None
        if adapters and o.outer_optimizer != "none":
            raise ConfigError("lofi.outer_optimizer", o.outer_optimizer, "not offered with model.lora: set it to none")
        if o.probe_steps and (adapters or cfg.model.family == "hf_causal_lm"):
            raise ConfigError(
                "lofi.probe_steps",
                o.probe_steps,
                "a probe trains a new classifier head with every other weight frozen: not offered with "
                "model.lora or a causal LM; set it to 0",
            )
        if o.probe_steps and o.outer_optimizer != "none" and not exchange_for(cfg).nodes_keep_rounds:
            raise ConfigError(
                "lofi.probe_steps",
                o.probe_steps,
                "the driver's outer step starts from the pretrained head, not the probed one: with "
                "lofi.outer_optimizer use peer rounds (lofi.exchange: peers), or set probe_steps to 0",
            )
        rounds = o.average_every is not None or o.sync == "time"
        if o.round_momentum == "reset" and (o.fragments > 1 or not rounds):
            raise ConfigError(
                "lofi.round_momentum",
                o.round_momentum,
                "resets the optimizer state when a whole model lands: it needs rounds (lofi.average_every "
                "or sync: time) and lofi.fragments: 1",
            )
        if cfg.optim.budget_s is not None and o.fragments > 1:
            raise ConfigError(
                "optim.budget_s",
                cfg.optim.budget_s,
                "a budget ends lo-fi where its time does, with one final round of the whole model: not with "
                "lofi.fragments > 1; remove the budget or set fragments: 1",
            )
        if adapters and o.soup == "greedy":
            raise ConfigError("lofi.soup", o.soup, "not offered with model.lora: set it to uniform")
        if adapters and o.average_every is not None and cfg.eval_every:
            raise ConfigError(
                "eval_every",
                cfg.eval_every,
                "a curve with model.lora and lofi.average_every is not offered: set eval_every: 0",
            )

    @staticmethod
    def check(ctx: RunContext) -> None:
        from raylowcomm.strategies.lofi.config import check_schedule
        from raylowcomm.training import total_steps

        o = Lofi.opts(ctx.cfg)
        streaming.check(o, ctx.architecture, ctx.fine_tune, merging_for(ctx.spec).sync_unit)
        try:
            dense_names(ctx.architecture, ctx.spec.family, o.dense)
        except ValueError as err:
            raise ConfigError("lofi.dense", o.dense, f"{err}: name its tensors by pattern (`classifier.*`)") from None
        sizes = ctx.data.train.sizes(node_slots(ctx.cfg, o))  # None with data.node_files: only the nodes know theirs
        steps = total_steps(ctx.cfg.optim, min(sizes)) if sizes else None
        if sizes:
            check_schedule(ctx.cfg, o, min(sizes))
            check_membership(ctx.cfg, o, steps)
        check_kills(ctx.cfg, steps, {ev.node: ev.step for ev in o.leave}, "lofi.leave")

    @staticmethod
    def _validate_churn(cfg: RunConfig, o: LofiConfig) -> None:
        """Lockstep rounds wait for every node: a kill no restart meets would end the run."""
        if not on_quorum(o, cfg.nodes.elastic):
            check_kills_restarted(
                cfg, per_node=True, why="lockstep rounds wait for every node (lofi.quorum lets the others go on)"
            )

    @staticmethod
    def _validate_schedule(o: LofiConfig) -> None:
        every = o.average_every if isinstance(o.average_every, list) else [o.average_every]
        if o.average_every is not None and (not every or any(h <= 0 for h in every)):
            raise ConfigError(
                "lofi.average_every",
                o.average_every,
                "must be > 0 (a list: each entry), or null for one average at the end",
            )
        if o.probe_steps < 0:
            raise ConfigError("lofi.probe_steps", o.probe_steps, "must be a number of steps >= 0")
        if o.warmup_steps < 0:
            raise ConfigError("lofi.warmup_steps", o.warmup_steps, "must be a number of steps >= 0")
        if o.warmup_steps and o.average_every is None:
            raise ConfigError(
                "lofi.warmup_steps",
                o.warmup_steps,
                "a warm-up of rounds needs rounds after it: set lofi.average_every (or warmup_steps: 0)",
            )

    @staticmethod
    def _validate_exchange(cfg: RunConfig, o: LofiConfig) -> None:
        if o.compress not in CODECS:
            raise ConfigError("lofi.compress", o.compress, f"choose one of {', '.join(CODECS)}")
        if o.exchange == "driver" and o.compress != "none":
            raise ConfigError(
                "lofi.exchange",
                o.exchange,
                "compressed outer gradients travel between the nodes: set lofi.exchange: peers (or auto)",
            )
        if not 0 < o.topk_fraction <= 1:
            raise ConfigError("lofi.topk_fraction", o.topk_fraction, "must be in (0, 1]")
        if not 1 <= o.compress_block <= MAX_COMPRESS_BLOCK:
            raise ConfigError("lofi.compress_block", o.compress_block, f"must be in [1, {MAX_COMPRESS_BLOCK}]")
        if o.dense and (o.compress == "none" or o.exchange == "driver"):
            raise ConfigError(
                "lofi.dense",
                o.dense,
                "names tensors that cross whole beside compressed ones: set lofi.compress (peer rounds), or dense: []",
            )
        if on_quorum(o, cfg.nodes.elastic) and not exchange_for(cfg).nodes_keep_rounds:
            field, value = next(
                (
                    (f"lofi.{name}", getattr(o, name))
                    for name in ("quorum", "sync", "join", "leave")
                    if getattr(o, name) not in (None, "steps", [])
                ),
                ("nodes.count", cfg.nodes.count_as_given()),
            )
            raise ConfigError(field, value, "quorum rounds are peer rounds: set lofi.exchange: peers (or a compress)")
        exchange_for(cfg).validate(cfg, o)
        if o.keep_training and not on_quorum(o, cfg.nodes.elastic) and not o.overlap:
            raise ConfigError(
                "lofi.keep_training",
                o.keep_training,
                "a node keeps what it trains while its payload waits for a quorum round or its round is in "
                "flight: set lofi.quorum (or lofi.sync: time) or lofi.overlap, or false",
            )

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, n = ctx.cfg, self.opts(ctx.cfg), ctx.cfg.nodes.count
        clock, ledger, slots = TrainClock(), Ledger(), node_slots(cfg, opts)
        ctx.fresh_state(self.name)
        (what, start), watch = ctx.initial_model(), Stopwatch()
        initial = start if what == "initial_weights" else None  # None: the nodes load the weights, not the driver
        exchange = exchange_for(cfg)(ctx, opts, initial)
        with NodeGroup(LofiNode, cfg, ledger, restarts=cfg.restarts, bundles=self.bundles(cfg)) as group:
            with watch("start"):
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
                    trained = self._train(ctx, group, plan, exchange, start, first)
            return self._finish(ctx, group, plan, exchange, trained, clock, watch)

    def _train(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, exchange: Exchange, initial, first: int = 0
    ) -> dict:
        """The rounds from round `first`: train to each boundary with no communication, then the
        exchange's averaging round. Training time as DDP measures it: the nodes' own loop time (slowest
        node per round) plus the averaging rounds; Ray call overhead is left out of both."""
        n, ledger, budget = len(group), group.ledger, ctx.cfg.optim.budget_s
        # snapshots: (step, train_s at step, bytes sent by then)
        train_s, trained, snapshots, began, round_s = 0.0, [], [], time.perf_counter(), 0.0
        for i, until in enumerate(plan.boundaries[first:], first):
            if budget is not None and trained and train_s >= budget:  # the last round took the rest
                if landing := exchange.landing(plan, i):  # lofi.overlap: it lands where the nodes stand
                    ledger.send("train", "control", landing[0][0], copies=n)
                    waits = group.call("land_round", landing[0][0], phase="train")
                    for stats, wait in zip(trained[-1], waits):  # beside the wait for the round before it
                        stats["round_wait_at_stop_s"] = wait
                    exchange.landed(group, plan.boundaries[i - 1], "train")
                plan.stop_at(plan.boundaries[i - 1], i)  # the final round comes where that one did
                break
            round_s = 0.0
            last = i == len(plan.boundaries) - 1
            landing = exchange.landing(plan, i)  # the round in flight lands in this call
            ledger.send("setup" if i == 0 else "train", "control", [until, *landing] if landing else until, copies=n)
            due = [s for s in plan.snapshots if (plan.boundaries[i - 1] if i else 0) < s <= until]
            sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
            seconds = None if budget is None else budget - train_s  # the rest of the budget, on the nodes' clocks
            trained.append(
                group.call(
                    "train",
                    until,
                    due,
                    landing[0] if landing else None,
                    seconds,
                    phase="final" if last else "train",
                    what="train_stats",
                )
            )
            if landing:
                exchange.landed(group, until, "final" if last else "train")
            for s in due:  # a node restarted from a later checkpoint than s has no time for it: the others tell
                times = [r["snapshot_s"][s] for r in trained[-1] if s in r["snapshot_s"]]
                if times:
                    snapshots.append((s, train_s + max(times), sent))
            train_s += max(s["train_s"] for s in trained[-1])
            losses = [s["mean_loss"] for s in trained[-1] if s["mean_loss"] is not None]
            ctx.report(
                {
                    "step": until,
                    "steps": plan.steps,
                    "bytes": ledger.total_bytes,
                    **({"train_loss": sum(losses) / len(losses)} if losses else {}),
                }
            )
            for stats in trained[-1]:
                if stats["restored_from"] is not None:
                    logger.info(
                        "[lofi] node %d died and resumed from its checkpoint at step %d",
                        stats["node"],
                        stats["restored_from"],
                    )
                    ledger.send("train", "recovery_refetch", initial)
                    ledger.send("train", "recovery_refetch", ctx.data.train)
            if budget is not None and not last and train_s >= budget:  # spent: this segment's end is the run's
                plan.stop_at(max(s["step"] for s in trained[-1]), i)
                break
            if not last:
                round_clock = TrainClock()
                exchange.round(group, plan, i + 1, until)
                round_s = round_clock.elapsed()
                train_s += round_s
        reached = max((s["step"] for s in trained[-1]), default=plan.steps) if trained else plan.steps
        if budget is not None and reached < plan.steps:  # the last segment ended by time
            plan.stop_at(reached, len(plan.boundaries) - 1)
        per_node = [list(calls) for calls in zip(*trained)]
        wall_s = time.perf_counter() - began
        slowest = max(trained[-1], key=lambda s: s["train_s"]) if trained else {}
        return {
            "last_step_s": slowest.get("last_step_s", 0.0) + round_s,  # the last step (and a round after it)
            "nodes": per_node,
            "train_s": train_s,
            "snapshots": snapshots,
            "goodput": goodput(lockstep_accounts(group, trained), wall_s),
        }

    def _finish(
        self,
        ctx: RunContext,
        group: NodeGroup,
        plan: Plan,
        exchange: Exchange,
        trained: dict,
        clock: TrainClock,
        watch: Stopwatch,
    ) -> RunRecord:
        cfg, opts, n, ledger = ctx.cfg, self.opts(ctx.cfg), len(group), group.ledger
        with watch("evaluate_nodes"):
            node_metrics = group.evaluate_all()
        metric, on_all = make_task(ctx.data.task).metric, cfg.data.eval_on_nodes
        collect_clock = TrainClock()
        final = exchange.finish(ctx, group, plan, metric, node_metrics)
        collect_s = collect_clock.elapsed()
        watch.add("collect", collect_s)
        details = {
            "steps_per_node": plan.steps,
            "averaging_steps": plan.boundaries if plan.averaging else [plan.steps],
            "soup_nodes": final.nodes,
            "exchange": exchange.name,
            **exchange.details(),
        }
        curve_offset_s = collect_s  # the points' offset: the final collection, not the recalibration after it
        with watch("curve"):
            curve = final_phase.snapshot_curve(
                group,
                trained["snapshots"],
                plan,
                cfg.optim.batch_size,
                collect_s,
                on_all,
                sum(
                    ledger.bytes_by_kind.get(f"final/{what}", 0)
                    for what in (plan.average.what, *final_phase.COLLECTION_KINDS)
                ),
            )
        if opts.bn_recalibrate and batchnorm_layers(ctx.architecture):
            before = final_phase.score_average(group, plan, final.weights, final.on_nodes, on_all)
            details["average_without_bn_recalibration"] = mean_metrics(before)
            bn_clock = TrainClock()
            final_phase.recalibrate_bn(group, final, opts.bn_batches)
            bn_s = bn_clock.elapsed()
            collect_s += bn_s
            watch.add("bn_recalibrate", bn_s)
        with watch("score_average"):
            per_node = final_phase.score_average(group, plan, final.to_score, final.on_nodes, on_all)
        metrics = mean_metrics(per_node)
        final_phase.save_on_node(ctx, group, plan, final, self.name)
        if on_all:  # the test rows are the nodes': each scored the average on its own
            details["average_on_nodes"] = per_node
        details["collect_s"], details["phases_s"] = collect_s, watch.parts
        if cfg.optim.budget_s is not None:
            details["budget"] = budget_details(
                cfg.optim.budget_s, trained["train_s"], plan.steps, trained.get("last_step_s", 0.0)
            )
        details["curve_note"] = (
            f"lo-fi points: averages of node snapshots made after training; time = slowest node's "
            f"training time at the step + {curve_offset_s:.2f} s, the measured time to collect and "
            f"average the {n} final models; bytes include that collection"
            + (
                f"; the points before the last are not BN-recalibrated, the last (the result) is, "
                f"its time + {collect_s - curve_offset_s:.2f} s more for it"
                if "average_without_bn_recalibration" in details
                else ""
            )
        )
        final_phase.warn_if_worse(metric, metrics, node_metrics, details)
        infos = group.call("info", phase="final", what="node_info")  # last: peaks include node 0's save
        nodes = [
            {**info, "metrics": m, "train": calls} for info, m, calls in zip(infos, node_metrics, trained["nodes"])
        ]
        samples = trained.get("samples", sum(s["samples"] for calls in trained["nodes"] for s in calls))
        return finish_record(
            self.name,
            ctx,
            ledger,
            clock,
            metrics=metrics,
            step=plan.steps,
            samples=samples,
            train_s=trained["train_s"],
            infos=infos,
            weights=final.weights,
            curve=curve,
            nodes=nodes,
            details=details,
            curve_wall_s=trained["train_s"] + collect_s,
            goodput=trained["goodput"],
        )
