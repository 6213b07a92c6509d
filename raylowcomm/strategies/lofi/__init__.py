"""lo-fi (Wortsman et al. 2022): every node fine-tunes its own copy on its own shard with no
communication; the driver averages the weights once at the end (or every `average_every`).

Curve without communicating: at every `eval_every` step a node snapshots its weights in storage.
After training the driver averages snapshot s across nodes and scores it (plain or
by-examples average: no BN recalibration, soup or outer step); the point's time is the slowest
node's training time at s plus the measured time of the final collection, its bytes those sent
by s plus one collection. Fetching the snapshots is measurement, outside the run's ledger.

Rounds that travel node to node, compressed (`exchange: peers`, `compress`), and the final average
from compressed outer gradients: `rounds`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import ClassVar

import ray

from raylowcomm.actors import DriverFetches, NodeGroup
from raylowcomm.common.batches import steps_per_epoch
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.averaging import OuterNesterov, batchnorm_layers, combine_bn_statistics, greedy_soup
from raylowcomm.core.compression import CODECS
from raylowcomm.finetune import NodeAverage
from raylowcomm.models import state_dict_of
from raylowcomm.strategies.base import RunContext, RunRecord, Strategy, curve_point, eval_points, finish_record
from raylowcomm.strategies.lofi import rounds, streaming
from raylowcomm.strategies.lofi.config import MAX_COMPRESS_BLOCK, LofiConfig
from raylowcomm.strategies.lofi.node import LofiNode
from raylowcomm.tasks import make_task, mean_metrics
from raylowcomm.training import total_steps

logger = logging.getLogger(__name__)

COLLECTION_KINDS = ("outer_gradients", "round_replies", "round_args", "verify_hash")
"""What the final collection of peer rounds books (besides the star's `plan.average.what`): a curve
point's bytes include one such collection."""

def gather_nodes(group: NodeGroup, plan: Plan, phase: str, method: str = "weights", *args,
                 fetch: DriverFetches | None = None):
    """The nodes' `method(*args)` states, streamed in as they are ready and gathered by the run's
    average: full weights into one running sum (one incoming copy at a time), adapters kept (with
    their weights, for the driver to combine on its base or a node to merge on its own)."""
    stream = group.stream(method, *args, phase=phase, what=plan.average.what, fetch=fetch)
    return plan.average.gather(stream, plan.weights)


def average_nodes(group: NodeGroup, plan: Plan, phase: str, method: str = "weights", *args,
                  fetch: DriverFetches | None = None) -> dict:
    """The average of the nodes' `method(*args)` states, as plain weights."""
    return plan.average.combine(gather_nodes(group, plan, phase, method, *args, fetch=fetch))


@dataclass
class Plan:
    """When the nodes stop: averaging boundaries, curve snapshots, and each node's weight."""

    steps: int
    boundaries: list[int]
    averaging: bool
    weights: list[float]
    snapshots: list[int]
    average: NodeAverage
    """How the nodes' states are gathered and combined (full weights, or adapters on their base)."""
    fragments: list[int | None]
    """The fragment each boundary's round syncs (ALL at the last; None throughout with one fragment)."""
    landings: list[int] | None = None
    """With lofi.overlap: the step at which the round sent at each boundary (but the last) lands."""


def plan_rounds(cfg: RunConfig, opts: LofiConfig, shard_sizes: list[int], average: NodeAverage) -> Plan:
    steps = total_steps(cfg.optim, min(shard_sizes))
    every = opts.average_every
    if every is not None and opts.average_unit == "epochs":
        every *= steps_per_epoch(min(shard_sizes), cfg.optim.batch_size)
    boundaries, fragments = streaming.schedule(every, opts.fragments, steps) if every else ([steps], [streaming.ALL])
    weights = [float(s) if opts.weighting == "examples" else 1.0 for s in shard_sizes]
    averaging = every is not None or opts.outer_optimizer != "none"
    return Plan(steps, boundaries, averaging, weights, eval_points(cfg, steps), average,
                fragments if opts.fragments > 1 else [None] * len(boundaries),
                streaming.landings(boundaries, opts.overlap) if opts.overlap else None)


class Lofi(Strategy):
    name: ClassVar[str] = "lofi"
    Config: ClassVar[type] = LofiConfig

    @staticmethod
    def table_rows(record: dict, metric: str) -> list[list[str]]:
        """The average as scored before BatchNorm recalibration, where it was recalibrated."""
        bn = record.get("details", {}).get("average_without_bn_recalibration")
        if not bn:
            return []
        shift = f"{bn[f'shift_{metric}']:.4f}" if f"shift_{metric}" in bn else "-"
        return [["  avg w/o BN recal", f"{bn[f'id_{metric}']:.4f}", shift]]

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None:
        """What starts from, or merges into, weights the driver holds; one final average of adapters
        is merged and saved on node 0, where the base is."""
        o = cfg.options["lofi"]
        peers = rounds.uses_peers(o)
        if o.outer_optimizer != "none" and not peers:
            return "lofi.outer_optimizer steps the global model on the driver"
        if peers and not rounds.nodes_hold_result(o, cfg.model.lora is not None):
            return "lo-fi's one compressed average is decoded on the driver from the pretrained weights"
        if cfg.model.lora is not None and o.average_every is not None and not peers:
            return "lofi.average_every with model.lora merges each round's average into the base on the driver"
        if cfg.model.lora is not None and cfg.eval_every:
            return "eval_every with model.lora: lo-fi's curve merges snapshot averages into the base on the driver"
        if cfg.model.lora is not None and cfg.model.family == "timm" and o.bn_recalibrate and not peers:
            return "lofi.bn_recalibrate with model.lora recalibrates the merged average on the driver"
        return None

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = cfg.options["lofi"]
        if o.average_every is not None and o.average_every <= 0:
            raise ConfigError("lofi.average_every", o.average_every, "must be > 0, or null for one average at the end")
        if o.soup == "greedy" and (cfg.data.val_size == 0 or cfg.data.eval_on_nodes):
            raise ConfigError("lofi.soup", o.soup, "a greedy soup needs a held-out split on the driver: "
                                                   "set data.val_size > 0 (not with data.eval_on_nodes)")
        if not 0 < o.outer_lr:
            raise ConfigError("lofi.outer_lr", o.outer_lr, "must be > 0")
        if not 0 <= o.outer_momentum < 1:
            raise ConfigError("lofi.outer_momentum", o.outer_momentum, "must be in [0, 1)")
        if o.bn_batches is not None and o.bn_batches <= 0:
            raise ConfigError("lofi.bn_batches", o.bn_batches, "must be > 0, or null for a full pass")
        Lofi._validate_exchange(cfg)
        streaming.validate(cfg, rounds.uses_peers(o))
        adapters = cfg.model.lora is not None
        if adapters and o.outer_optimizer != "none":
            raise ConfigError("lofi.outer_optimizer", o.outer_optimizer, "not offered with model.lora: set it to none")
        if adapters and o.soup == "greedy":
            raise ConfigError("lofi.soup", o.soup, "not offered with model.lora: set it to uniform")
        if adapters and o.average_every is not None and cfg.eval_every:
            raise ConfigError("eval_every", cfg.eval_every,
                              "a curve with model.lora and lofi.average_every is not offered: set eval_every: 0")

    @staticmethod
    def check(ctx: RunContext) -> None:
        from raylowcomm.strategies.lofi.config import check_schedule

        streaming.check(ctx.cfg.options["lofi"], ctx.architecture, ctx.fine_tune)
        sizes = ctx.data.train.sizes(ctx.cfg.nodes.count)  # None with data.node_files: only the nodes know theirs
        if sizes:
            check_schedule(ctx.cfg, min(sizes))

    @staticmethod
    def _validate_exchange(cfg: RunConfig) -> None:
        o = cfg.options["lofi"]
        if o.compress not in CODECS:
            raise ConfigError("lofi.compress", o.compress, f"choose one of {', '.join(CODECS)}")
        if o.exchange == "driver" and o.compress != "none":
            raise ConfigError("lofi.exchange", o.exchange, "compressed outer gradients travel between the nodes: "
                                                           "set lofi.exchange: peers (or auto)")
        if not 0 < o.topk_fraction <= 1:
            raise ConfigError("lofi.topk_fraction", o.topk_fraction, "must be in (0, 1]")
        if not 1 <= o.compress_block <= MAX_COMPRESS_BLOCK:
            raise ConfigError("lofi.compress_block", o.compress_block, f"must be in [1, {MAX_COMPRESS_BLOCK}]")
        if o.compress == "none":
            Lofi._warn_unused_codec(o)
        if not rounds.uses_peers(o):
            return
        field = "lofi.compress" if o.compress != "none" else "lofi.exchange"
        value = o.compress if o.compress != "none" else o.exchange
        if cfg.model.lora is not None and o.overlap and o.mix:
            raise ConfigError("lofi.mix", o.mix, "with model.lora a landed round restarts the adapters it merged, "
                                                 "which leaves nothing of the node's own to mix: set lofi.mix: 0")
        if o.soup == "greedy":
            raise ConfigError(field, value, "a greedy soup needs every node's full model: set lofi.soup: uniform")

    @staticmethod
    def _warn_unused_codec(o: LofiConfig) -> None:
        """The codec's options, set away from their defaults with compress: none, are said, not ignored."""
        defaults = LofiConfig()
        for name in ("topk_fraction", "compress_block", "error_feedback"):
            if getattr(o, name) != getattr(defaults, name):
                logger.warning("lofi: lofi.%s=%s does not apply: lofi.compress is none (outer gradients "
                               "cross uncompressed)", name, getattr(o, name))

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, n = ctx.cfg, ctx.cfg.options["lofi"], ctx.cfg.nodes.count
        clock, ledger = TrainClock(), Ledger()
        ctx.fresh_state(self.name)
        (what, start), watch = ctx.initial_model(), Stopwatch()
        initial = start if what == "initial_weights" else None  # None: the nodes load the weights, not the driver
        with NodeGroup(LofiNode, cfg, ledger, restarts=cfg.restarts, bundles=self.bundles(cfg)) as group:
            with watch("start"):
                weights_ref = group.put(start, "setup", what, copies=n)
                group.share_eval_sets(ctx.eval_sets(), keys=list(range(n)))
                # how to read the data, not the data
                recipe = group.put(ctx.data.train, "setup", "data_recipe", copies=n)
                for k in range(n):
                    group.start(k, k, ctx.spec, ctx.data.task, weights_ref, recipe, cfg, ctx.storage,
                                ctx.live.poster(k))
                group.ready()
            sizes = ctx.data.train.sizes(n) or group.call("examples", phase="setup", what="shard_sizes")
            plan = plan_rounds(cfg, opts, sizes, ctx.fine_tune.node_average(initial, ctx.architecture,
                                                                             opts.lora_average))
            ctx.live.expect(n, plan.steps)
            logger.info("[lofi] %d nodes x %d steps, averaging at steps %s", n, plan.steps,
                        plan.boundaries if plan.averaging else [plan.steps])
            params = {k for k, _ in ctx.architecture.named_parameters()}
            outer = OuterNesterov(initial, params, opts.outer_lr, opts.outer_momentum) \
                if opts.outer_optimizer == "nesterov" and not rounds.uses_peers(opts) else None  # peers: the nodes'
            if rounds.uses_peers(opts):
                first = self._resume_peers(group, plan) if ctx.resume else 0
            else:
                first = self._resume_round(ctx, group, outer, plan) if ctx.resume else 0
            with watch("train"):
                trained = self._train(ctx, group, plan, outer, start, first)
            return self._finish(ctx, group, plan, outer, trained, clock, watch)

    @staticmethod
    def _resume_peers(group: NodeGroup, plan: Plan) -> int:
        """Peer rounds: every node restored its round state itself; the run continues after their round."""
        done, steps = zip(*group.call("round_of", phase="train"))
        if len(set(done)) > 1:
            raise RuntimeError(f"lo-fi nodes resumed at different averaging rounds {done}: the run was stopped "
                               "during a round's exchange, which a resume does not repair; start it afresh")
        if done[0] >= len(plan.boundaries):
            raise RuntimeError(f"lo-fi's final round ({done[0]}) had finished when the run stopped: the average is in "
                               f"storage ({rounds.GLOBAL}); start afresh to score it again")
        sent_at = plan.boundaries[done[0]]
        if max(steps) > sent_at:  # lofi.overlap: trained past the send of a round that never landed
            raise RuntimeError(f"lo-fi nodes trained to steps {list(steps)}, past step {sent_at} where round "
                               f"{done[0] + 1} was sent: the run stopped while that exchange was in flight "
                               "(lofi.overlap), which a resume does not repair; start it afresh")
        logger.info("[lofi] resuming after averaging round %d (peer rounds)", done[0])
        return done[0]

    def _resume_round(self, ctx: RunContext, group: NodeGroup, outer, plan: Plan) -> int:
        """The averaging round a resumed run continues at: nodes whose checkpoint predates the last
        global model saved in storage load it (the others have it already)."""
        if not ctx.storage.exists(rounds.GLOBAL):
            return 0
        state, momentum, _, done = rounds.read_round(ctx.storage, rounds.GLOBAL)
        if outer is not None:
            outer.state, outer.buf = state, momentum
        plan.average.rebase(state)
        group.call("load_weights", group.put(state, "train", "resume_global_weights", copies=len(group)), done)
        logger.info("[lofi] resuming after averaging round %d", done)
        return done

    def _train(self, ctx: RunContext, group: NodeGroup, plan: Plan, outer, initial, first: int = 0) -> dict:
        """The rounds from round `first`: train to each boundary with no communication, average
        between rounds. Training time as DDP measures it: the nodes' own loop time (slowest node
        per round) plus the driver's averaging rounds; Ray call overhead is left out of both."""
        n, ledger, peers = len(group), group.ledger, rounds.uses_peers(ctx.cfg.options["lofi"])
        # snapshots: (step, train_s at step, bytes sent by then); fetched: what the driver read back in peer rounds
        train_s, trained, snapshots, fetched = 0.0, [], [], {"bytes": 0, "tensors": 0}
        for i, until in enumerate(plan.boundaries[first:], first):
            last = i == len(plan.boundaries) - 1
            landing = rounds.landing(plan, i) if peers else []  # the round in flight lands in this call
            ledger.send("setup" if i == 0 else "train", "control", [until, *landing] if landing else until, copies=n)
            due = [s for s in plan.snapshots if (plan.boundaries[i - 1] if i else 0) < s <= until]
            sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
            trained.append(group.call("train", until, due, *landing, phase="final" if last else "train",
                                      what="train_stats"))
            if landing:
                rounds.check_global(group, until, ledger, "final" if last else "train")
            for s in due:  # a node restarted from a later checkpoint than s has no time for it: the others tell
                times = [r["snapshot_s"][s] for r in trained[-1] if s in r["snapshot_s"]]
                if times:
                    snapshots.append((s, train_s + max(times), sent))
            train_s += max(s["train_s"] for s in trained[-1])
            losses = [s["mean_loss"] for s in trained[-1] if s["mean_loss"] is not None]
            ctx.report({"step": until, "steps": plan.steps, "bytes": ledger.total_bytes,
                        **({"train_loss": sum(losses) / len(losses)} if losses else {})})
            for stats in trained[-1]:
                if stats["restored_from"] is not None:
                    logger.info("[lofi] node %d died and resumed from its checkpoint at step %d", stats["node"],
                                stats["restored_from"])
                    ledger.send("train", "recovery_refetch", initial)
                    ledger.send("train", "recovery_refetch", ctx.data.train)
            if not last and peers:
                round_clock = TrainClock()
                rounds.exchange_round(group, i + 1, until, plan.weights, fetched, fragment=plan.fragments[i],
                                      overlap=plan.landings is not None)
                train_s += round_clock.elapsed()
            elif not last:
                round_clock = TrainClock()
                average = average_nodes(group, plan, "train")
                average = outer.step(average) if outer is not None else average
                plan.average.rebase(average)
                rounds.write_round(ctx.storage, rounds.GLOBAL, i + 1, average, outer.buf if outer is not None else None)
                group.call("load_weights", group.put(average, "train", "global_weights", copies=n), i + 1)
                train_s += round_clock.elapsed()
        return {"rounds": trained, "train_s": train_s, "snapshots": snapshots, "fetched": fetched}

    def _finish(self, ctx: RunContext, group: NodeGroup, plan: Plan, outer, trained: dict, clock: TrainClock,
                watch: Stopwatch) -> RunRecord:
        cfg, opts, n, ledger = ctx.cfg, ctx.cfg.options["lofi"], len(group), group.ledger
        with watch("evaluate_nodes"):
            node_metrics = group.evaluate_all()
        metric, on_all = make_task(ctx.data.task).metric, cfg.data.eval_on_nodes
        collect_clock, held = TrainClock(), rounds.uses_peers(opts)  # held: the nodes hold the average
        average, to_score, soup_kept = self._collect(ctx, group, plan, metric, node_metrics)
        collect_s = collect_clock.elapsed()
        watch.add("collect", collect_s)
        if outer is not None:
            average = outer.step(average)
        details = {"steps_per_node": plan.steps, "averaging_steps": plan.boundaries if plan.averaging else [plan.steps],
                   "soup_nodes": soup_kept, "exchange": "peers" if held else "driver"}
        if held:  # what the driver read back during training: refs and sizes, no tensor
            details["driver_fetched"] = {"train": trained["fetched"]}
        with watch("curve"):
            curve = self._snapshot_curve(group, trained["snapshots"], plan, cfg.optim.batch_size, collect_s, on_all,
                                         sum(ledger.bytes_by_kind.get(f"final/{what}", 0) for what in
                                             (plan.average.what, *COLLECTION_KINDS)))
        if opts.bn_recalibrate and batchnorm_layers(ctx.architecture):
            details["average_without_bn_recalibration"] = mean_metrics(self._score(group, plan, average, on_all, held))
            bn_clock = TrainClock()
            self._recalibrate_bn(group, average, opts.bn_batches, held)
            bn_s = bn_clock.elapsed()
            collect_s += bn_s
            watch.add("bn_recalibrate", bn_s)
            to_score = average  # recalibrated statistics: the merged model itself
        with watch("score_average"):
            per_node = self._score(group, plan, to_score, on_all, held)
        metrics = mean_metrics(per_node)
        if average is None and held:  # node 0 saves the average it holds (after rounds, or LoRA's merged base)
            group.call("save_plain", None, ctx.storage, f"{self.name}/model.safetensors", phase="final", keys=[0])
        elif average is None:  # the base is on the nodes: node 0 merges the average and saves it
            ledger.record("final", "adapters_to_save", plan.average.sent(to_score)[1])  # as scoring books them
            group.call("save_plain", ray.put(to_score), ctx.storage, f"{self.name}/model.safetensors",
                       phase="final", keys=[0])
        if on_all:  # the test rows are the nodes': each scored the average on its own
            details["average_on_nodes"] = per_node
        details["collect_s"], details["phases_s"] = collect_s, watch.parts
        details["curve_note"] = (f"lo-fi points: averages of node snapshots made after training; time = slowest node's "
                                 f"training time at the step + {collect_s:.2f} s, the measured time to collect and "
                                 f"average the {n} final models"
                                 + (" and recalibrate BN" if "average_without_bn_recalibration" in details else "")
                                 + "; bytes include that collection")
        self._warn_if_worse(metric, metrics, node_metrics, details)
        infos = group.call("info", phase="final", what="node_info")  # last: peaks include node 0's save
        nodes = [{**info, "metrics": m, "train": [r[k] for r in trained["rounds"]]}
                 for k, (info, m) in enumerate(zip(infos, node_metrics))]
        samples = sum(s["samples"] for r in trained["rounds"] for s in r)
        return finish_record(self.name, ctx, ledger, clock, metrics=metrics, step=plan.steps, samples=samples,
                             train_s=trained["train_s"], infos=infos, weights=average, curve=curve, nodes=nodes,
                             details=details, curve_wall_s=trained["train_s"] + collect_s)

    @staticmethod
    def _score(group: NodeGroup, plan: Plan, state: dict, on_all: bool, held: bool) -> list[dict]:
        """Metrics of the average, scored where the device is, not on the driver: by the nodes that hold
        it after peer rounds (nothing sent), else sent to them."""
        if held:
            return group.evaluate_nodes(group.keys() if on_all else group.keys()[:1])
        return group.score_weights(state, "final", on_all, sent=plan.average.sent(state))

    @staticmethod
    def _recalibrate_bn(group: NodeGroup, average: dict, batches: int | None, held: bool) -> None:
        """BatchNorm statistics of the average measured on every node's shard, combined into `average`;
        after peer rounds the nodes measure the average they hold and load the combined statistics."""
        n = len(group)
        ref = None if held else group.put(average, "final", "averaged_weights_for_bn", copies=n)
        combined = combine_bn_statistics(group.call("bn_statistics", ref, batches, phase="final", what="bn_statistics"))
        if average is not None:
            average.update(combined)
        if held:
            group.call("load_bn_statistics", group.put(combined, "final", "combined_bn_statistics", copies=n))

    def _collect(self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str,
                 node_metrics: list[dict]) -> tuple[dict, object, list[int]]:
        """The final average, what is sent to be scored of it, and the nodes in it. Peer rounds: one more
        round, the nodes' compressed Δ on their global model, which leaves the average on every node.
        After averaging rounds (and under LoRA, whose rounds move the base) only the nodes hold the
        model it starts from: None, node 0 saves the average (`rounds.nodes_hold_result`). Lo-fi's one
        average starts from the pretrained weights, which the driver decodes it on too (`rounds.final_round`)."""
        opts, n = ctx.cfg.options["lofi"], len(group)
        if rounds.uses_peers(opts) and rounds.nodes_hold_result(opts, ctx.fine_tune.merges_rounds):
            rounds.exchange_round(group, len(plan.boundaries), plan.steps, plan.weights, {"bytes": 0, "tensors": 0},
                                  "final")
            return None, None, list(range(n))
        if rounds.uses_peers(opts):
            order = [k for k, _ in ctx.model.named_parameters()]
            start, outer = rounds.driver_start(state_dict_of(ctx.model), set(order), opts)
            average = rounds.final_round(group, opts, start, outer, plan, order, {"bytes": 0, "tensors": 0})
            return average, None, list(range(n))
        if opts.soup == "greedy":
            average, soup_kept = self._greedy_soup(group, metric, node_metrics)
            return average, average, soup_kept
        # full weights: the average itself; adapters: the nodes', merged where they are scored (and, where
        # the driver holds no base, saved: None)
        to_score = gather_nodes(group, plan, "final")
        merge_on_node = plan.average.what == "node_adapters" and ctx.nodes_load_weights()
        average = None if merge_on_node else plan.average.combine(to_score)
        return average, to_score, list(range(n))

    @staticmethod
    def _greedy_soup(group: NodeGroup, metric: str, node_metrics: list[dict]) -> tuple[dict, list[int]]:
        """Add nodes' models best first while the held-out score (on a node) does not drop."""
        sign = 1 if metric == "accuracy" else -1
        order = sorted(range(len(group)), key=lambda k: node_metrics[k]["val_" + metric], reverse=sign > 0)

        def score(state):
            return group.score_weights(state, "final", val=True)[0]["val_" + metric] * sign

        fetches = [lambda k=k: group.call("weights", what="node_weights", keys=[k])[0] for k in order]
        average, kept, _ = greedy_soup(fetches, score)
        return average, [order[j] for j in kept]

    @staticmethod
    def _snapshot_curve(group: NodeGroup, snapshots: list[tuple[int, float, int]], plan: Plan, batch: int,
                        collect_s: float, on_all: bool, collect_bytes: int) -> list[dict]:
        """Score the average of the nodes' snapshots at each curve step (see the module docstring),
        on the nodes; fetching the snapshots and sending the averages back is measurement."""
        curve, n = [], len(group)
        for step, train_s, sent in snapshots:
            try:  # fetching snapshots is measurement: a scratch ledger
                average = average_nodes(group, plan, "final", "snapshot", step, fetch=DriverFetches(Ledger()))
            except ray.exceptions.RayTaskError as err:  # e.g. a node restarted on another host, without its snapshots
                logger.warning("[lofi] no curve point at step %d: a node's snapshot is gone (%s)", step,
                               type(err.cause).__name__)
                continue
            metrics = mean_metrics(group.score_weights(average, "final", on_all, ledger=Ledger()))
            curve.append(curve_point(step, train_s + collect_s, step * batch * n, sent + collect_bytes, metrics))
        return curve

    @staticmethod
    def _warn_if_worse(metric: str, metrics: dict, node_metrics: list[dict], details: dict) -> None:
        node_mean = sum(m[f"id_{metric}"] for m in node_metrics) / len(node_metrics)
        details[f"node_mean_id_{metric}"] = node_mean
        worse = node_mean > metrics[f"id_{metric}"] if metric == "accuracy" else node_mean < metrics[f"id_{metric}"]
        if worse:
            msg = (f"lo-fi: the average scores worse than the mean of the nodes (id_{metric} "
                   f"{metrics[f'id_{metric}']:.4f} vs {node_mean:.4f}): averaging left the shared basin. "
                   "Try lofi.average_every (a few rounds), a lower lr, or a greedy soup.")
            warnings.warn(msg, stacklevel=1)
            details["warning"] = msg
