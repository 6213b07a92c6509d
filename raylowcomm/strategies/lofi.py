"""lo-fi (Wortsman et al. 2022): every node fine-tunes its own copy on its own shard with no
communication; the driver averages the weights once at the end.

What crosses: initial weights and each node's shard (setup); with `average_every`, each round's
node weights and the re-broadcast average (train); final weights, metrics and, for BatchNorm
models, the averaged model out and its recomputed BN statistics back (final).

Curve without communicating: at every `eval_every` step a node saves a snapshot of its weights
on its own disk and notes its training time. After training, the driver averages snapshot s
across nodes and scores it; the point's time is the slowest node's training time at s plus the
measured time of the final collection (fetching and averaging the N models, as that link
costs), and its bytes are the bytes sent up to s plus one collection of the N models. Snapshot
averages are plain (or by-examples) averages: no BN recalibration, soup or outer step; only the
final point has those. Fetching the snapshots is measurement, outside the run's ledger.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import ray
from safetensors.torch import load_file

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.averaging import OuterNesterov, StreamingAverage, batchnorm_layers, combine_bn_statistics, greedy_soup, measure_bn_statistics
from raylowcomm.data import num_examples
from raylowcomm.ledger import Ledger, payload_nbytes
from raylowcomm.models import ModelSpec, build_model, state_dict_of
from raylowcomm.runtime import actor_options, device_for, setup_threads
from raylowcomm.strategies.base import RunContext, RunRecord, Stopwatch, curve_point, eval_points
from raylowcomm.tasks import score_model, task_for
from raylowcomm.training import (batch_at, load_checkpoint, make_optimizer, peak_rss_bytes, save_checkpoint, save_weights,
                                 steps_per_epoch, total_steps, train_steps)


@dataclass
class LofiConfig:
    average_every: int | None = None
    """Average and re-broadcast every this many `average_unit`s; None = lo-fi, once at the end."""
    average_unit: Literal["steps", "epochs"] = "steps"
    outer_optimizer: Literal["none", "nesterov"] = "none"
    """nesterov: DiLoCo's outer SGD with Nesterov momentum on the averaged update."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    weighting: Literal["uniform", "examples"] = "uniform"
    soup: Literal["uniform", "greedy"] = "uniform"
    """greedy: add a node's model only if the held-out (data.val_size) score does not drop."""
    bn_recalibrate: bool = True
    """Recompute BatchNorm statistics of the average on every node's shard (BN models only)."""
    bn_batches: int | None = None
    """Batches per node for the BN statistics (None: one pass over the shard)."""


def node_seed(run_seed: int, node: int) -> int:
    return run_seed * 1000 + node


@ray.remote
class LofiNode:
    """One node: its own copy of the model, its own shard, its own optimizer, a checkpoint."""

    def __init__(self, node: int, spec: ModelSpec, weights: dict, shard: dict, eval_sets: dict, cfg: RunConfig, checkpoint: str):
        setup_threads(cfg.nodes.cpus)
        self.node, self.cfg, self.shard, self.eval_sets = node, cfg, shard, eval_sets
        self.seed = node_seed(cfg.seed, node)
        self.checkpoint = Path(checkpoint)
        device = device_for(cfg.nodes.gpus)
        self.model = build_model(spec).to(device)
        self.task = task_for(spec.family, cfg.data.image_size, device, data=cfg.data.name)
        self.optimizer = make_optimizer(cfg.optim, self.model)
        self.step, self.restored_from = 0, None
        if self.checkpoint.exists():
            self.step = load_checkpoint(self.checkpoint, self.model, self.optimizer)["step"]
            self.restored_from = self.step
            self._log(f"restarted: resuming from checkpoint at step {self.step}")
        else:
            self.model.load_state_dict(weights)

    def _log(self, msg: str) -> None:
        print(f"[lofi node {self.node}] {msg}", flush=True)

    def _save(self, step: int) -> None:
        save_checkpoint(self.checkpoint, self.model, self.optimizer, step)

    def _snapshot_path(self, step: int) -> Path:
        return self.checkpoint.parent / "snapshots" / f"{self.checkpoint.stem}_step{step}.safetensors"

    def train(self, until: int, snapshot_at: list[int]) -> dict:
        """Steps up to `until`; at each step in `snapshot_at`, a snapshot on local disk and the
        training time so far in this call (the snapshot's own saving time left out)."""
        every, snaps = self.cfg.checkpoint_every, set(snapshot_at)
        started, saving_s, snapshot_s = time.perf_counter(), 0.0, {}

        def on_step(step):
            nonlocal saving_s
            if step % every == 0 or step == until:
                self._save(step)
            if step in snaps:
                t = time.perf_counter()
                snapshot_s[step] = t - started - saving_s
                save_weights(self._snapshot_path(step), state_dict_of(self.model))
                saving_s += time.perf_counter() - t

        stats = train_steps(self.model, self.task, self.optimizer, self.shard, self.step, until, self.cfg.optim.batch_size,
                            self.seed, log=self._log, log_every=self.cfg.log_every, on_step=on_step)
        stats["train_s"] -= saving_s
        self.step, restored, self.restored_from = until, self.restored_from, None
        return {"node": self.node, "step": until, "restored_from": restored, "snapshot_s": snapshot_s, **stats}

    def snapshot(self, step: int) -> dict:
        return load_file(str(self._snapshot_path(step)))

    def weights(self) -> dict:
        return state_dict_of(self.model)

    def load_weights(self, state: dict) -> None:
        """A new global model (averaging round); checkpointed at once so a restart keeps it."""
        self.model.load_state_dict(state)
        self._save(self.step)

    def evaluate(self) -> dict:
        sets = self.eval_sets
        metrics = score_model(self.task, self.model, sets["test"], sets.get("shift"), self.cfg.optim.eval_batch_size)
        if "val" in sets:
            metrics["val_" + self.task.metric] = self.task.evaluate(self.model, sets["val"], self.cfg.optim.eval_batch_size)[self.task.metric]
        return metrics

    def bn_statistics(self, state: dict, max_batches: int | None) -> tuple[dict, int]:
        self.model.load_state_dict(state)
        per_epoch = steps_per_epoch(num_examples(self.shard), self.cfg.optim.batch_size)
        n = min(per_epoch, max_batches or per_epoch)
        batches = (batch_at(self.shard, i, self.cfg.optim.batch_size, self.seed) for i in range(n))
        return measure_bn_statistics(self.model, batches, self.task.forward)

    def info(self) -> dict:
        ctx, pg = ray.get_runtime_context(), ray.util.get_current_placement_group()
        return {"node": self.node, "host": socket.gethostname(), "ray_node_id": ctx.get_node_id(), "pid": os.getpid(),
                "placement_group": pg.id.hex() if pg else None, "peak_rss_bytes": peak_rss_bytes(),
                "examples": num_examples(self.shard)}


def _collect(ledger: Ledger, phase: str, what: str, refs: list) -> list:
    values = ray.get(refs)
    for v in values:
        ledger.send(phase, what, v)
    return values


def _stream_average(ledger: Ledger, phase: str, refs: list, weights: list[float]) -> dict:
    """Fetch node weights one at a time as they are ready: one running sum + one incoming copy."""
    avg, pending = StreamingAverage(), dict(zip(refs, weights))
    while pending:
        [ready], _ = ray.wait(list(pending), num_returns=1)
        state = ray.get(ready)
        ledger.send(phase, "node_weights", state)
        avg.add(state, pending.pop(ready))
        del state
    return avg.result()


def _snapshot_curve(nodes: list, snapshots: list[tuple[int, float, int]], weights: list[float], model, task, ctx: RunContext,
                    collect_s: float, collect_bytes: int) -> list[dict]:
    """Score the average of the nodes' snapshots at each curve step (see the module docstring);
    `model` is scratch space, loaded with the final average again by the caller."""
    cfg, curve, batch = ctx.cfg, [], ctx.cfg.optim.batch_size
    final = {k: v.clone() for k, v in model.state_dict().items()}
    for step, train_s, sent in snapshots:
        try:
            average = _stream_average(Ledger(), "final", [node.snapshot.remote(step) for node in nodes], weights)
        except ray.exceptions.RayTaskError as err:  # e.g. a node restarted on another host, without its snapshots
            print(f"[lofi] no curve point at step {step}: a node's snapshot is gone ({type(err.cause).__name__})", flush=True)
            continue
        model.load_state_dict(average)
        metrics = score_model(task, model, ctx.data.test, ctx.data.shift, cfg.optim.eval_batch_size)
        curve.append(curve_point(step, train_s + collect_s, step * batch * len(nodes), sent + collect_bytes, metrics))
    model.load_state_dict(final)
    return curve


def _better(metric: str, a: float, b: float) -> bool:
    return a > b if metric == "accuracy" else a < b


class Lofi:
    name: ClassVar[str] = "lofi"
    Config: ClassVar[type] = LofiConfig

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = cfg.options["lofi"]
        if o.average_every is not None and o.average_every <= 0:
            raise ConfigError("lofi.average_every", o.average_every, "must be > 0, or null for one average at the end")
        if o.soup == "greedy" and cfg.data.val_size == 0:
            raise ConfigError("lofi.soup", o.soup, "a greedy soup needs a held-out split: set data.val_size > 0")
        if not 0 < o.outer_lr:
            raise ConfigError("lofi.outer_lr", o.outer_lr, "must be > 0")
        if not 0 <= o.outer_momentum < 1:
            raise ConfigError("lofi.outer_momentum", o.outer_momentum, "must be in [0, 1)")
        if o.bn_batches is not None and o.bn_batches <= 0:
            raise ConfigError("lofi.bn_batches", o.bn_batches, "must be > 0, or null for a full pass")

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts = ctx.cfg, ctx.cfg.options["lofi"]
        clock, ledger, n = Stopwatch(), Ledger(), ctx.cfg.nodes.count
        out = ctx.strategy_dir(self.name)
        ckpt_dir = out / "checkpoints"
        shutil.rmtree(ckpt_dir, ignore_errors=True)

        initial = state_dict_of(ctx.model)
        shards, eval_sets = ctx.shards(), ctx.eval_sets()
        weights_ref, eval_ref = ray.put(initial), ray.put(eval_sets)
        ledger.send("setup", "initial_weights", initial, copies=n)
        ledger.send("setup", "eval_sets", eval_sets, copies=n)
        shard_refs = [ray.put(shard) for shard in shards]  # held here so a restarted node can re-fetch them
        for shard in shards:
            ledger.send("setup", "data_shard", shard)
        options = actor_options(cfg.nodes.cpus, cfg.nodes.gpus, cfg.nodes.max_restarts, cfg.nodes.placement, cfg.nodes.resources)
        nodes = [LofiNode.options(**options).remote(
                     k, ctx.spec, weights_ref, shard_refs[k], eval_ref, cfg, str(ckpt_dir / f"node{k}.safetensors"))
                 for k in range(n)]

        try:
            ray.get([node.__ray_ready__.remote() for node in nodes])
            steps = total_steps(cfg.optim, min(num_examples(s) for s in shards))
            every = opts.average_every
            if every is not None and opts.average_unit == "epochs":
                every *= steps_per_epoch(min(num_examples(s) for s in shards), cfg.optim.batch_size)
            boundaries = list(range(every, steps, every)) + [steps] if every else [steps]
            averaging = every is not None or opts.outer_optimizer != "none"
            weights = [float(num_examples(s)) if opts.weighting == "examples" else 1.0 for s in shards]
            outer = OuterNesterov(initial, {k for k, _ in ctx.model.named_parameters()}, opts.outer_lr, opts.outer_momentum) \
                if opts.outer_optimizer == "nesterov" else None
            print(f"[lofi] {n} nodes x {steps} steps, averaging at steps {boundaries if averaging else [steps]}", flush=True)

            # Training time as DDP measures it: the nodes' own loop time (slowest node per round),
            # plus the driver's averaging rounds; Ray call overhead is left out of both.
            train_s, rounds, snapshots = 0.0, [], []  # snapshots: (step, train_s at step, bytes sent by then)
            points = eval_points(cfg, steps)
            for i, until in enumerate(boundaries):
                last = i == len(boundaries) - 1
                phase = "final" if last else "train"
                ledger.send("setup" if i == 0 else "train", "control", until, copies=n)
                start = boundaries[i - 1] if i else 0
                due = [s for s in points if start < s <= until]
                sent = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
                rounds.append(_collect(ledger, phase, "train_stats", [node.train.remote(until, due) for node in nodes]))
                for s in due:  # a node restarted from a later checkpoint than s has no time for it: the others tell
                    times = [r["snapshot_s"][s] for r in rounds[-1] if s in r["snapshot_s"]]
                    if times:
                        snapshots.append((s, train_s + max(times), sent))
                train_s += max(s["train_s"] for s in rounds[-1])
                ctx.report({"step": until, "train_loss": sum(s["mean_loss"] for s in rounds[-1]) / n})
                for stats in rounds[-1]:
                    if stats["restored_from"] is not None:
                        print(f"[lofi] node {stats['node']} died and resumed from its checkpoint at step {stats['restored_from']}", flush=True)
                        ledger.send("train", "recovery_refetch", initial)
                        ledger.send("train", "recovery_refetch", shards[stats["node"]])
                if not last:
                    round_clock = Stopwatch()
                    average = _stream_average(ledger, "train", [node.weights.remote() for node in nodes], weights)
                    if outer is not None:
                        average = outer.step(average)
                    ref = ray.put(average)
                    ledger.send("train", "global_weights", average, copies=n)
                    ray.get([node.load_weights.remote(ref) for node in nodes])
                    train_s += round_clock.elapsed()

            node_metrics = _collect(ledger, "final", "node_metrics", [node.evaluate.remote() for node in nodes])
            infos = _collect(ledger, "final", "node_info", [node.info.remote() for node in nodes])
            task = task_for(ctx.spec.family, cfg.data.image_size, data=cfg.data.name)
            metric = task.metric
            soup_kept = list(range(n))
            collect_clock = Stopwatch()
            if opts.soup == "greedy":
                order = sorted(range(n), key=lambda k: node_metrics[k]["val_" + metric], reverse=(metric == "accuracy"))
                refs = [nodes[k].weights.remote() for k in order]
                scorer = build_model(ctx.spec)

                def load(ref):
                    return lambda: _fetch_one(ledger, ref)

                def score(state):
                    scorer.load_state_dict(state)
                    return task.evaluate(scorer, ctx.data.val, cfg.optim.eval_batch_size)[metric] * (1 if metric == "accuracy" else -1)

                average, kept, _ = greedy_soup([load(r) for r in refs], score)
                soup_kept = [order[j] for j in kept]
                collect_s = collect_clock.elapsed()
            else:
                average = _stream_average(ledger, "final", [node.weights.remote() for node in nodes], weights)
                collect_s = collect_clock.elapsed()
            if outer is not None:
                average = outer.step(average)

            model = build_model(ctx.spec)
            model.load_state_dict(average)
            details = {"steps_per_node": steps, "averaging_steps": boundaries if averaging else [steps], "soup_nodes": soup_kept}
            curve = _snapshot_curve(nodes, snapshots, weights, model, task, ctx, collect_s, n * payload_nbytes(average))
            if opts.bn_recalibrate and batchnorm_layers(model):
                details["average_without_bn_recalibration"] = score_model(task, model, ctx.data.test, ctx.data.shift, cfg.optim.eval_batch_size)
                bn_clock = Stopwatch()
                ref = ray.put(average)
                ledger.send("final", "averaged_weights_for_bn", average, copies=n)
                per_node = _collect(ledger, "final", "bn_statistics", [node.bn_statistics.remote(ref, opts.bn_batches) for node in nodes])
                average.update(combine_bn_statistics(per_node))
                model.load_state_dict(average)
                collect_s += bn_clock.elapsed()
            metrics = score_model(task, model, ctx.data.test, ctx.data.shift, cfg.optim.eval_batch_size)
            samples = sum(s["samples"] for r in rounds for s in r)
            curve.append(curve_point(steps, train_s + collect_s, samples, ledger.total_bytes, metrics))
            details["collect_s"] = collect_s
            details["curve_note"] = (f"lo-fi points: averages of node snapshots made after training; time = slowest node's "
                                     f"training time at the step + {collect_s:.2f} s, the measured time to collect and "
                                     f"average the {n} final models" + (" and recalibrate BN" if "average_without_bn_recalibration" in details else "")
                                     + "; bytes include that collection")

            node_records = [{**info, "metrics": m, "train": [r[k] for r in rounds]} for k, (info, m) in enumerate(zip(infos, node_metrics))]
            node_mean = sum(m[f"id_{metric}"] for m in node_metrics) / n
            details["node_mean_" + f"id_{metric}"] = node_mean
            if _better(metric, node_mean, metrics[f"id_{metric}"]):
                msg = (f"lo-fi: the average scores worse than the mean of the nodes (id_{metric} {metrics[f'id_{metric}']:.4f} vs "
                       f"{node_mean:.4f}): averaging left the shared basin. Try lofi.average_every (a few rounds), a lower lr, or a greedy soup.")
                warnings.warn(msg, stacklevel=1)
                details["warning"] = msg
            weights_path = save_weights(out / "model.safetensors", average)
            return RunRecord(self.name, metrics, ledger, clock.elapsed(), samples, train_s,
                             max(i["peak_rss_bytes"] for i in infos), node_records, details, weights_path, curve)
        finally:
            for node in nodes:
                ray.kill(node)


def _fetch_one(ledger: Ledger, ref) -> dict:
    state = ray.get(ref)
    ledger.send("final", "node_weights", state)
    return state
