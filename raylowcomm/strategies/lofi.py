"""lo-fi (Wortsman et al. 2022): every node fine-tunes its own copy on its own shard with no
communication; the driver averages the weights once at the end (or every `average_every`).

Curve without communicating: at every `eval_every` step a node snapshots its weights in storage.
After training the driver averages snapshot s across nodes and scores it (plain or
by-examples average: no BN recalibration, soup or outer step); the point's time is the slowest
node's training time at s plus the measured time of the final collection, its bytes those sent
by s plus one collection. Fetching the snapshots is measurement, outside the run's ledger.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

import ray

from raylowcomm.actors import DriverFetches, Node, NodeGroup
from raylowcomm.common.batches import batch_at, group_seed, num_examples, steps_per_epoch
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.seeding import epoch_seed, node_seed
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.averaging import (
    OuterNesterov,
    batchnorm_layers,
    combine_bn_statistics,
    greedy_soup,
    measure_bn_statistics,
)
from raylowcomm.data import TrainSource
from raylowcomm.finetune import NodeAverage
from raylowcomm.models import state_dict_of
from raylowcomm.storage import Storage
from raylowcomm.strategies.base import RunContext, RunRecord, Strategy, curve_point, eval_points, finish_record
from raylowcomm.tasks import make_task, mean_metrics
from raylowcomm.training import StepHooks, load_checkpoint, make_optimizer, save_checkpoint, total_steps, train_steps

logger = logging.getLogger(__name__)


@dataclass
class LofiConfig:
    average_every: int | None = None
    """Average and re-broadcast every this many `average_unit`s; None = lo-fi, once at the end."""
    average_unit: Literal["steps", "epochs"] = "steps"
    """What average_every counts: optimizer steps, or epochs of the smallest shard."""
    outer_optimizer: Literal["none", "nesterov"] = "none"
    """nesterov: DiLoCo's outer SGD with Nesterov momentum on the averaged update."""
    outer_lr: float = 0.7
    """The outer step's learning rate (outer_optimizer: nesterov; DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """The outer step's Nesterov momentum (DiLoCo's 0.9)."""
    weighting: Literal["uniform", "examples"] = "uniform"
    """uniform: every node counts the same in the average; examples: by its number of training examples."""
    soup: Literal["uniform", "greedy"] = "uniform"
    """greedy: add a node's model only if the held-out (data.val_size) score does not drop."""
    bn_recalibrate: bool = True
    """Recompute BatchNorm statistics of the average on every node's shard (BN models only)."""
    bn_batches: int | None = None
    """Batches per node for the BN statistics (None: one pass over the shard)."""
    lora_average: Literal["delta", "factors"] = "delta"
    """With model.lora, nodes send adapters only. delta: the exact average of what they learned,
    base + mean_k (alpha/r)·B_k·A_k, merged; factors: mean(B)·mean(A), FedAvg of the factors, to compare.
    After an averaging round every node merges the average into its base and restarts its adapters
    from one seeded initialisation (a new one each round), so replicas start each round identical."""


@ray.remote
class LofiNode(Node):
    """One node: its own copy of the model, its own shard, its own optimizer, a checkpoint."""

    label = "lofi node"

    def __init__(self, node: int, spec, task, weights: dict, data: TrainSource, cfg: RunConfig, storage: Storage,
                 progress=None):
        super().__init__(node, cfg, spec, task)
        self.progress = progress  # a progress.ProgressPoster where the driver watches live
        self.shard = data.load(node, cfg.nodes.count)  # read here, on the node's host: no training row crosses
        self.hold_out(data, cfg.nodes.count)
        self.seed, self.storage = node_seed(cfg.seed, node), storage
        self.checkpoint = f"lofi/checkpoints/node{node}.safetensors"
        self.optimizer = make_optimizer(cfg.optim, self.model)
        self.step, self.restored_from, self.rounds = 0, None, 0
        self.model.load_state_dict(weights)  # a checkpoint may hold what trains only: the rest comes from here
        if storage.exists(self.checkpoint):  # restarted, wherever Ray placed it, or a resumed run
            meta = load_checkpoint(storage, self.checkpoint, self.model, self.optimizer)
            self.step, self.rounds = meta["step"], meta["extra"].get("rounds", 0)
            self.restored_from = self.step
            self.log(f"resuming from its checkpoint at step {self.step} ({storage.uri_of(self.checkpoint)})")

    def _save(self, step: int) -> None:
        """Model and optimizer; under LoRA the adapters and head only until an average is merged
        into the base (lofi.average_every), after which the base is this node's own too."""
        save_checkpoint(self.storage, self.checkpoint, self.model, self.optimizer, step, extra={"rounds": self.rounds},
                        trainable_only=self.fine_tune.trainable_only(base_moved=self.rounds > 0))

    def _snapshot_path(self, step: int) -> str:
        return f"lofi/snapshots/node{self.rank}_step{step}.safetensors"

    def train(self, until: int, snapshot_at: list[int]) -> dict:
        """Steps up to `until`; at each step in `snapshot_at`, a snapshot on local disk and the
        training time so far in this call (saving the snapshot is not training)."""
        clock, snaps, snapshot_s = TrainClock(), set(snapshot_at), {}

        def on_step(step):
            if step % self.cfg.checkpoint_steps == 0 or step == until:
                self._save(step)
            if step in snaps:
                snapshot_s[step] = clock.elapsed()
                with clock.paused():
                    self.storage.save_tensors(self._snapshot_path(step), self.weights())

        hooks = StepHooks(on_step=on_step, log=self.log, log_every=self.cfg.log_every, progress=self.progress,
                          clock=clock)
        stats = train_steps(self.model, self.task, self.optimizer, self.shard, self.step, until,
                            self.cfg.optim.batch_size, self.seed, hooks, precision=self.cfg.optim.precision,
                            device=self.device, group_seed=group_seed(self.cfg))
        self.step, restored, self.restored_from = until, self.restored_from, None
        return {"node": self.rank, "step": until, "restored_from": restored, "snapshot_s": snapshot_s, **stats}

    def snapshot(self, step: int) -> dict:
        return self.storage.load_tensors(self._snapshot_path(step))[0]

    def load_weights(self, state: dict, rounds: int) -> None:
        """The global model of averaging round `rounds`; checkpointed at once so a restart keeps it
        (a node that has it already, resuming, keeps what it has)."""
        if rounds <= self.rounds:
            return
        self._load(state, rounds)
        self.rounds = rounds
        self._save(self.step)

    def _load(self, state: dict, rounds: int) -> None:
        """A global model: its weights, or under LoRA the merged average as the new frozen base with
        fresh adapters (seeded by the round, the same on every node) and a fresh optimizer."""
        if self.fine_tune.load_global(self.model, state, seed=epoch_seed(self.cfg.seed, rounds)):
            self.optimizer = make_optimizer(self.cfg.optim, self.model)

    def bn_statistics(self, state: dict, max_batches: int | None) -> tuple[dict, int]:
        self._load(state, self.rounds + 1)
        per_epoch = steps_per_epoch(num_examples(self.shard), self.cfg.optim.batch_size)
        n = min(per_epoch, max_batches or per_epoch)
        batches = (batch_at(self.shard, i, self.cfg.optim.batch_size, self.seed) for i in range(n))
        stats, count = measure_bn_statistics(self.model, batches, self.task.forward)
        stats = self.fine_tune.plain_names(stats)  # the average's names
        return {k: v.cpu() for k, v in stats.items()}, count  # nothing device-resident goes to the driver

    def examples(self) -> int:
        return num_examples(self.shard)

    def extra_info(self) -> dict:
        return {"examples": num_examples(self.shard)}


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


def plan_rounds(cfg: RunConfig, opts: LofiConfig, shard_sizes: list[int], average: NodeAverage) -> Plan:
    steps = total_steps(cfg.optim, min(shard_sizes))
    every = opts.average_every
    if every is not None and opts.average_unit == "epochs":
        every *= steps_per_epoch(min(shard_sizes), cfg.optim.batch_size)
    boundaries = list(range(every, steps, every)) + [steps] if every else [steps]
    weights = [float(s) if opts.weighting == "examples" else 1.0 for s in shard_sizes]
    averaging = every is not None or opts.outer_optimizer != "none"
    return Plan(steps, boundaries, averaging, weights, eval_points(cfg, steps), average)


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
        adapters = cfg.model.lora is not None
        if adapters and o.outer_optimizer != "none":
            raise ConfigError("lofi.outer_optimizer", o.outer_optimizer, "not offered with model.lora: set it to none")
        if adapters and o.soup == "greedy":
            raise ConfigError("lofi.soup", o.soup, "not offered with model.lora: set it to uniform")
        if adapters and o.average_every is not None and cfg.eval_every:
            raise ConfigError("eval_every", cfg.eval_every,
                              "a curve with model.lora and lofi.average_every is not offered: set eval_every: 0")

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, n = ctx.cfg, ctx.cfg.options["lofi"], ctx.cfg.nodes.count
        clock, ledger = TrainClock(), Ledger()
        ctx.fresh_state(self.name)
        initial, watch = state_dict_of(ctx.model), Stopwatch()
        with NodeGroup(LofiNode, cfg, ledger, restarts=cfg.restarts, bundles=self.bundles(cfg)) as group:
            with watch("start"):
                weights_ref = group.put(initial, "setup", "initial_weights", copies=n)
                group.share_eval_sets(ctx.eval_sets(), keys=list(range(n)))
                # how to read the data, not the data
                recipe = group.put(ctx.data.train, "setup", "data_recipe", copies=n)
                for k in range(n):
                    group.start(k, k, ctx.spec, ctx.data.task, weights_ref, recipe, cfg, ctx.storage,
                                ctx.live.poster(k))
                group.ready()
            sizes = ctx.data.train.sizes(n) or group.call("examples", phase="setup", what="shard_sizes")
            plan = plan_rounds(cfg, opts, sizes, ctx.fine_tune.node_average(initial, ctx.model, opts.lora_average))
            ctx.live.expect(n, plan.steps)
            logger.info("[lofi] %d nodes x %d steps, averaging at steps %s", n, plan.steps,
                        plan.boundaries if plan.averaging else [plan.steps])
            params = {k for k, _ in ctx.model.named_parameters()}
            outer = OuterNesterov(initial, params, opts.outer_lr, opts.outer_momentum) \
                if opts.outer_optimizer == "nesterov" else None
            first = self._resume_round(ctx, group, outer, plan) if ctx.resume else 0
            with watch("train"):
                trained = self._train(ctx, group, plan, outer, initial, first)
            return self._finish(ctx, group, plan, outer, trained, clock, watch)

    GLOBAL = "lofi/global.safetensors"
    """The last averaging round's global model (and outer momentum): what a resumed run starts from."""

    def _resume_round(self, ctx: RunContext, group: NodeGroup, outer, plan: Plan) -> int:
        """The averaging round a resumed run continues at: nodes whose checkpoint predates the last
        global model saved in storage load it (the others have it already)."""
        if not ctx.storage.exists(self.GLOBAL):
            return 0
        tensors, meta = ctx.storage.load_tensors(self.GLOBAL)
        state = {k[7:]: v for k, v in tensors.items() if k.startswith("global.")}
        if outer is not None:
            outer.state, outer.buf = state, {k[9:]: v for k, v in tensors.items() if k.startswith("momentum.")}
        plan.average.rebase(state)
        group.call("load_weights", group.put(state, "train", "resume_global_weights", copies=len(group)), meta["round"])
        logger.info("[lofi] resuming after averaging round %d", meta["round"])
        return meta["round"]

    def _save_global(self, ctx: RunContext, state: dict, outer, rounds: int) -> None:
        tensors = {f"global.{k}": v for k, v in state.items()}
        if outer is not None:
            tensors.update({f"momentum.{k}": v for k, v in outer.buf.items()})
        ctx.storage.save_tensors(self.GLOBAL, tensors, {"round": rounds})

    def _train(self, ctx: RunContext, group: NodeGroup, plan: Plan, outer, initial: dict, first: int = 0) -> dict:
        """The rounds from round `first`: train to each boundary with no communication, average
        between rounds. Training time as DDP measures it: the nodes' own loop time (slowest node
        per round) plus the driver's averaging rounds; Ray call overhead is left out of both."""
        n, ledger = len(group), group.ledger
        train_s, rounds, snapshots = 0.0, [], []  # snapshots: (step, train_s at step, bytes sent by then)
        for i, until in enumerate(plan.boundaries[first:], first):
            last = i == len(plan.boundaries) - 1
            ledger.send("setup" if i == 0 else "train", "control", until, copies=n)
            due = [s for s in plan.snapshots if (plan.boundaries[i - 1] if i else 0) < s <= until]
            sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
            rounds.append(group.call("train", until, due, phase="final" if last else "train", what="train_stats"))
            for s in due:  # a node restarted from a later checkpoint than s has no time for it: the others tell
                times = [r["snapshot_s"][s] for r in rounds[-1] if s in r["snapshot_s"]]
                if times:
                    snapshots.append((s, train_s + max(times), sent))
            train_s += max(s["train_s"] for s in rounds[-1])
            losses = [s["mean_loss"] for s in rounds[-1] if s["mean_loss"] is not None]
            ctx.report({"step": until, "steps": plan.steps, "bytes": ledger.total_bytes,
                        **({"train_loss": sum(losses) / len(losses)} if losses else {})})
            for stats in rounds[-1]:
                if stats["restored_from"] is not None:
                    logger.info("[lofi] node %d died and resumed from its checkpoint at step %d", stats["node"],
                                stats["restored_from"])
                    ledger.send("train", "recovery_refetch", initial)
                    ledger.send("train", "recovery_refetch", ctx.data.train)
            if not last:
                round_clock = TrainClock()
                average = average_nodes(group, plan, "train")
                average = outer.step(average) if outer is not None else average
                plan.average.rebase(average)
                self._save_global(ctx, average, outer, i + 1)
                group.call("load_weights", group.put(average, "train", "global_weights", copies=n), i + 1)
                train_s += round_clock.elapsed()
        return {"rounds": rounds, "train_s": train_s, "snapshots": snapshots}

    def _finish(self, ctx: RunContext, group: NodeGroup, plan: Plan, outer, trained: dict, clock: TrainClock,
                watch: Stopwatch) -> RunRecord:
        cfg, opts, n, ledger = ctx.cfg, ctx.cfg.options["lofi"], len(group), group.ledger
        with watch("evaluate_nodes"):
            node_metrics = group.evaluate_all()
        infos = group.call("info", phase="final", what="node_info")
        metric, on_all = make_task(ctx.data.task).metric, cfg.data.eval_on_nodes
        collect_clock = TrainClock()
        if opts.soup == "greedy":
            average, soup_kept = self._greedy_soup(group, metric, node_metrics)
            to_score = average
        else:  # full weights: the average itself; adapters: the nodes', merged where they are scored
            to_score = gather_nodes(group, plan, "final")
            average, soup_kept = plan.average.combine(to_score), list(range(n))
        collect_s = collect_clock.elapsed()
        watch.add("collect", collect_s)
        if outer is not None:
            average = outer.step(average)
        details = {"steps_per_node": plan.steps, "averaging_steps": plan.boundaries if plan.averaging else [plan.steps],
                   "soup_nodes": soup_kept}
        with watch("curve"):
            curve = self._snapshot_curve(group, trained["snapshots"], plan, cfg.optim.batch_size, collect_s, on_all,
                                         ledger.bytes_by_kind.get(f"final/{plan.average.what}", 0))
        if opts.bn_recalibrate and batchnorm_layers(ctx.model):
            details["average_without_bn_recalibration"] = mean_metrics(group.score_weights(average, "final", on_all))
            bn_clock = TrainClock()
            ref = group.put(average, "final", "averaged_weights_for_bn", copies=n)
            stats = group.call("bn_statistics", ref, opts.bn_batches, phase="final", what="bn_statistics")
            average.update(combine_bn_statistics(stats))
            bn_s = bn_clock.elapsed()
            collect_s += bn_s
            watch.add("bn_recalibrate", bn_s)
            to_score = average  # recalibrated statistics: the merged model itself
        with watch("score_average"):
            # scored where the device is, not on the driver
            per_node = group.score_weights(to_score, "final", on_all, sent=plan.average.sent(to_score))
        metrics = mean_metrics(per_node)
        if on_all:  # the test rows are the nodes': each scored the average on its own
            details["average_on_nodes"] = per_node
        details["collect_s"], details["phases_s"] = collect_s, watch.parts
        details["curve_note"] = (f"lo-fi points: averages of node snapshots made after training; time = slowest node's "
                                 f"training time at the step + {collect_s:.2f} s, the measured time to collect and "
                                 f"average the {n} final models"
                                 + (" and recalibrate BN" if "average_without_bn_recalibration" in details else "")
                                 + "; bytes include that collection")
        self._warn_if_worse(metric, metrics, node_metrics, details)
        nodes = [{**info, "metrics": m, "train": [r[k] for r in trained["rounds"]]}
                 for k, (info, m) in enumerate(zip(infos, node_metrics))]
        samples = sum(s["samples"] for r in trained["rounds"] for s in r)
        return finish_record(self.name, ctx, ledger, clock, metrics=metrics, step=plan.steps, samples=samples,
                             train_s=trained["train_s"], infos=infos, weights=average, curve=curve, nodes=nodes,
                             details=details, curve_wall_s=trained["train_s"] + collect_s)

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
