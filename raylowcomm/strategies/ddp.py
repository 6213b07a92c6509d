"""The baseline: ordinary data-parallel fine-tuning with gradients all-reduced every step
(Ray Train's TorchTrainer; gloo on CPU, nccl on GPU), on the same shards, batch size per worker,
optimizer and number of steps as the lo-fi nodes. A DDP communication hook adds up the gradient
buckets each rank hands to all-reduce: the `train` bytes are counted, not a formula. Curve: at
every `eval_every` step the ranks meet while rank 0 scores its replica (identical but for BN
statistics; rank 0's is the model saved), out of the training time.

Failures: each evaluation is a `ray.train.report`, and every `checkpoint_every` steps (and at
the end) it carries a checkpoint: rank 0 writes model + optimizer + step + curve, every rank its
BN statistics and its tally (safetensors). Ray Train restarts the group up to `nodes.max_restarts`
times; every rank loads the latest checkpoint and continues `train_steps` from its step (data
order and dropout are an uninterrupted run's). The Train run's name is stable (storage
`ddp/ray_train/ddp`): `run --resume` continues from its latest checkpoint; a new run deletes it.
A rank that cannot read its data (a ConfigError) is not restarted: it would fail again. The ranks
agree on it when they tell each other their shard sizes, return, and the driver raises the error.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar, Literal

import ray
import torch
from torch import nn

from raylowcomm.actors import Node, process_info
from raylowcomm.catalog import TaskSpec
from raylowcomm.common.batches import group_seed, num_examples
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.seeding import node_seed
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.data import TrainSource
from raylowcomm.execution import node_bundle, pin_bundles, resolve_hosts
from raylowcomm.models import ModelSpec
from raylowcomm.progress import ProgressPoster
from raylowcomm.storage import Storage
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
    curve_point,
    eval_points,
    finish_record,
)
from raylowcomm.tasks import mean_metrics
from raylowcomm.training import StepHooks, load_checkpoint, make_optimizer, save_checkpoint, total_steps, train_steps

logger = logging.getLogger(__name__)

STATE_FILE, RANK_FILE = "state.safetensors", "rank{}.safetensors"
ATTEMPTS, DATA_ERROR = "ddp/attempts.json", "ddp/data_error.json"


@dataclass
class DdpConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when nodes.gpus > 0, else gloo."""


@dataclass
class DdpLoop:
    """What every Ray Train worker is given: recipes and object references, no data. It travels as
    train_loop_config {"loop": DdpLoop} (Ray Train's own record of that config wants a dict)."""

    cfg: RunConfig
    spec: ModelSpec
    task: TaskSpec
    weights: ray.ObjectRef
    """The initial weights, or the `ModelRecipe` by which each worker loads them itself; fetched by each worker."""
    steps: int | None
    """None (data.node_files): the ranks agree on the smallest shard's."""
    storage: Storage
    data: TrainSource
    eval_sets: ray.ObjectRef
    progress: ProgressPoster | None


def counting_allreduce_hook(counter: dict):
    """The default all-reduce, after adding up the bytes of the gradient bucket it sends."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        buffer = bucket.buffer()
        counter["allreduce_bytes"] += buffer.numel() * buffer.element_size()
        counter["buckets"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return hook


class TaskLoss(nn.Module):
    """The task's loss as a module's forward. DDP syncs gradients only for work done inside the
    forward it wraps, and some tasks reach past `model.forward` (prompt scoring reads the base
    model and a few rows of the LM head), so DDP wraps this."""

    def __init__(self, model: nn.Module, task):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, batch) -> torch.Tensor:
        return self.task.loss(self.model, batch)


class Tally:
    """What one rank has done in the run so far, over every attempt of its checkpoint lineage:
    carried in its checkpoint file, so a restarted rank's totals are an uninterrupted rank's."""

    def __init__(self, carried: dict | None = None):
        self.counts = {"loss_sum": 0.0, "allreduce_bytes": 0, "buckets": 0, "train_s": 0.0, **(carried or {})}

    def loss(self, wrapped: nn.Module, batch) -> torch.Tensor:
        """`train_steps`' task interface for the (DDP-wrapped) TaskLoss; sums losses as train_steps does."""
        loss = wrapped(batch)
        self.counts["loss_sum"] += loss.item()
        return loss

    def at(self, clock: TrainClock) -> dict:
        return {**self.counts, "train_s": self.counts["train_s"] + clock.elapsed(),
                "writer": {"host": socket.gethostname(), "pid": os.getpid()}}


def _restore(rank: int, node: Node, optimizer) -> tuple[int, list, Tally]:
    """Step, curve and tally from Ray Train's latest checkpoint (a restarted group, a resumed run):
    rank 0's model and optimizer on every rank, then its own BN statistics. Safetensors only."""
    from ray import train

    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return 0, [], Tally()
    with checkpoint.as_directory() as d:
        meta = load_checkpoint(Storage(d), STATE_FILE, node.model, optimizer)
        buffers, tally = Storage(d).load_tensors(RANK_FILE.format(rank))
    node.model.load_state_dict(buffers, strict=False)
    tally.pop("writer", None)
    node.log(f"resuming from the checkpoint at step {meta['step']} ({checkpoint.path})")
    return meta["step"], meta["extra"]["curve"], Tally(tally)


def _report(metrics: dict, step: int, rank: int, node: Node, optimizer, tally: dict | None, curve: list) -> None:
    """`ray.train.report` on every rank; with a checkpoint where `tally` is given."""
    from ray import train

    if tally is None:
        return train.report(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0:
            save_checkpoint(Storage(tmp), STATE_FILE, node.model, optimizer, step, extra={"curve": curve},
                            trainable_only=node.fine_tune.trainable_only())  # LoRA: the frozen base never changes
        params = {k for k, _ in node.model.named_parameters()}
        buffers = {k: v.detach().cpu().contiguous() for k, v in node.model.state_dict().items() if k not in params}
        Storage(tmp).save_tensors(RANK_FILE.format(rank), buffers, tally)
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(tmp))


def _note_attempt(storage: Storage, start: int, counts: dict, step: int, new: bool = False) -> None:
    """Rank 0's record of this attempt (resumed at `start`, reached `step` with `allreduce_bytes`
    counted), the last entry of `ddp/attempts.json` in storage, which outlives the attempt."""
    attempts = storage.read_json(ATTEMPTS) if storage.exists(ATTEMPTS) else []
    entry = {"resumed_from": start, "step": step, "allreduce_bytes": counts["allreduce_bytes"]}
    if new:
        attempts.append({**entry, "bytes_at_start": entry["allreduce_bytes"]})
    else:
        attempts[-1].update(entry)
    storage.write_json(ATTEMPTS, attempts)


def all_gather_nbytes(payloads: list, world: int) -> int:
    """Bytes `dist.all_gather_object` moves: each rank's pickle size (an int64), then every pickle
    padded to the largest, each reaching the world - 1 other ranks."""
    return world * (world - 1) * (8 + max(len(pickle.dumps(p)) for p in payloads))


def _read_shard(loop: DdpLoop, node: Node, rank: int, world: int) -> tuple[object, int | None, tuple | None, int]:
    """Read this rank's shard (and held-out rows) on its host, then agree with the others on the
    steps (with data.node_files the smallest shard's) and on whether every rank could read its data.
    A rank that cannot (a ConfigError: a file missing on its host, an unreadable row) would fail
    the same way after every restart Ray Train makes, so every rank stops at once and rank 0
    leaves the lowest failing rank's error for the driver: (shard, steps, the error as
    (field, value, fix) or None, bytes sent)."""
    import torch.distributed as dist

    shard = None
    try:
        shard = loop.data.load(rank, world)  # read here, on the worker's host: no training row crosses
        node.hold_out(loop.data, world)
        mine = (num_examples(shard), None)
    except ConfigError as err:
        mine = (None, (err.field_name, err.value, err.allowed))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    refused = next((error for _, error in everyone if error is not None), None)
    steps = loop.steps or (None if refused else total_steps(loop.cfg.optim, min(n for n, _ in everyone)))
    return shard, steps, refused, all_gather_nbytes(everyone, world)


def _train_worker(config: dict) -> None:
    """One Ray Train worker (`config`: {"loop": DdpLoop}): a `Node` (model, task, device) whose
    gradients DDP all-reduces; rank 0 scores the curve at a barrier and the final model, where the
    model lives."""
    from ray import train
    from ray.train.torch import prepare_model

    loop: DdpLoop = config["loop"]
    entered, watch = time.time(), Stopwatch()
    rank, world = train.get_context().get_world_rank(), train.get_context().get_world_size()
    with watch("worker_start"):
        node = Node(rank, loop.cfg, loop.spec, loop.task, ray.get(loop.weights))
        node.label = "ddp rank"
        shard, steps, refused, shard_sizes_bytes = _read_shard(loop, node, rank, world)
        if refused is not None:  # left in storage for the driver, not raised: Ray Train would retry it
            if rank == 0:
                loop.storage.write_json(DATA_ERROR, refused)
            return
        optimizer = make_optimizer(loop.cfg.optim, node.model)
        restored = _restore(rank, node, optimizer)
        # Each rank keeps its own BN statistics, as a lo-fi node does: only gradients cross.
        wrapped = prepare_model(TaskLoss(node.model, node.task), parallel_strategy_kwargs={"broadcast_buffers": False})
    worker = _Rank(loop, node, world, optimizer, steps, restored, watch)
    if hasattr(wrapped, "register_comm_hook"):  # a single worker is not wrapped: nothing to all-reduce
        wrapped.register_comm_hook(None, counting_allreduce_hook(worker.tally.counts))
    worker.train(wrapped, shard)
    worker.finish(num_examples(shard), entered, shard_sizes_bytes)


class _Rank:
    """One started rank: its training with the curve and checkpoints at barriers, its final report."""

    def __init__(self, loop: DdpLoop, node: Node, world: int, optimizer, steps: int, restored: tuple[int, list, Tally],
                 watch: Stopwatch):
        self.loop, self.node, self.rank, self.world, self.optimizer = loop, node, node.rank, world, optimizer
        self.steps, (self.start, self.curve, self.tally), self.watch = steps, restored, watch
        self.points, self.clock = set(eval_points(loop.cfg, steps)), TrainClock()
        if self.rank == 0:
            _note_attempt(loop.storage, self.start, self.tally.counts, self.start, new=True)

    def train(self, wrapped: nn.Module, shard) -> None:
        cfg, progress = self.loop.cfg, self.loop.progress
        if progress is not None:
            progress.worker, progress.steps = self.rank, self.steps
        hooks = StepHooks(on_step=self.on_step, log=self.node.log if self.rank == 0 else None, log_every=cfg.log_every,
                          progress=progress, clock=self.clock)
        train_steps(wrapped, self.tally, self.optimizer, shard, self.start, self.steps, cfg.optim.batch_size,
                    node_seed(cfg.seed, self.rank), hooks, precision=cfg.optim.precision, device=self.node.device,
                    group_seed=group_seed(cfg))

    def on_step(self, step: int) -> None:
        """At a curve step or a checkpoint step before the last, the ranks meet (out of the training
        time): rank 0 scores its replica for the curve, and every rank reports."""
        import torch.distributed as dist

        every = self.loop.cfg.checkpoint_steps
        if step == self.steps or (step not in self.points and step % every):
            return
        dist.barrier()
        with self.clock.paused(), self.watch("curve_and_checkpoints"):
            now, metrics = self.tally.at(self.clock), {"step": step}
            if self.rank == 0:
                metrics.update(train_s=now["train_s"], allreduce_bytes=now["allreduce_bytes"])
                if step in self.points:
                    self.curve.append({**metrics, **self.node.evaluate([self.loop.eval_sets])})
                _note_attempt(self.loop.storage, self.start, now, step)
            _report(metrics, step, self.rank, self.node, self.optimizer, None if step % every else now, self.curve)

    def finish(self, examples: int, entered: float, shard_sizes_bytes: int) -> None:
        """Score the final model, gather every rank's numbers, and report them with the last checkpoint."""
        import torch.distributed as dist

        cfg, world, steps, done = self.loop.cfg, self.world, self.steps, self.tally.at(self.clock)
        with self.watch("evaluate"):
            if cfg.data.eval_on_nodes:  # every rank scores the (same) model on its own held-out rows
                per_rank = [None] * world
                dist.all_gather_object(per_rank, self.node.evaluate([self.loop.eval_sets]))
                final = {"final": mean_metrics(per_rank), "final_per_rank": per_rank}
            else:
                final = {"final": self.node.evaluate([self.loop.eval_sets])} if self.rank == 0 else {}
        mine = {"rank": self.rank, "examples": examples, "allreduce_bytes": done["allreduce_bytes"],
                "buckets": done["buckets"], "samples": steps * cfg.optim.batch_size, "train_s": done["train_s"],
                "resumed_from": self.start, **process_info(), "mean_loss": done["loss_sum"] / steps if steps else None,
                "entered_at": entered, "phases_s": self.watch.parts, "final_report_at": time.time(),
                "final_hash": self.node.hash()}  # the replicas must agree: a reader compares them
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        metrics = {"workers": everyone, "gather_bytes": all_gather_nbytes(everyone, world),
                   "shard_sizes_bytes": shard_sizes_bytes, "curve": self.curve, "steps": steps, **final}
        if self.rank == 0:
            _note_attempt(self.loop.storage, self.start, done, steps)
        _report(metrics, steps, self.rank, self.node, self.optimizer, done, self.curve)


def _release_leaked_placement_groups(before: set[str], bundles: list[dict]) -> None:
    """When a Train run fails while it starts (e.g. gloo cannot connect), Ray Train 2.60 can leave
    its workers' placement group reserved, and the strategies after it would wait forever for
    those CPUs. Remove the groups with exactly our bundles that appeared during the failed fit."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    want = [{k: float(v) for k, v in b.items()} for b in bundles]
    for pg_id, info in ray.util.placement_group_table().items():
        if pg_id in before or info["state"] == "REMOVED" or list(info["bundles"].values()) != want:
            continue
        logger.warning("[ddp] releasing placement group %s that the failed Train run left behind", pg_id)
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


def _attempts_ledger(ledger: Ledger, attempts: list[dict], restarts: int, n: int) -> dict:
    """What failures cost. `train/gradient_allreduce` counts each step's all-reduce once (the hook's
    count, carried in the checkpoints), as an uninterrupted run does. Steps an attempt took past the
    checkpoint the next one resumed from were all-reduced again: `gradient_allreduce_redone`, up to
    that attempt's last report (evaluation or checkpoint), so a lower bound. Each restart of this
    fit repeats the setup: weights, shards and eval sets fetched, weights broadcast by DDP."""
    redone = sum(max(0, a["allreduce_bytes"] - b["bytes_at_start"]) for a, b in pairwise(attempts))
    if redone:
        ledger.record("train", "gradient_allreduce_redone", redone, copies=n)
    if restarts:
        ledger.record("train", "restart_setup_again", ledger.bytes_by_phase["setup"], copies=restarts)
    return {"attempts": attempts, "restarts": restarts, "allreduce_redone_bytes_per_rank_at_least": redone}


def _phases(workers: list[dict], fit_at: float, fitted_at: float) -> dict:
    """Where the Train run's time went: Ray Train starting the workers (controller, placement
    group, process group) until the first entered our loop (after a restart: the earlier attempts
    too), rank 0's own parts, and the end: from rank 0's final report (its checkpoint) until `fit`
    returned. Start and end compare wall clocks of the driver's and the workers' hosts."""
    rank0 = workers[0]
    return {"train_run_start": round(min(w["entered_at"] for w in workers) - fit_at, 3), **rank0["phases_s"],
            "train": round(max(w["train_s"] for w in workers), 3),
            "train_run_end": round(fitted_at - rank0["final_report_at"], 3)}


class Ddp(Strategy[DdpConfig]):
    name: ClassVar[str] = "ddp"
    Config: ClassVar[type] = DdpConfig

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        if Ddp.opts(cfg).backend == "nccl" and cfg.nodes.gpus == 0:
            raise ConfigError("ddp.backend", "nccl", "nccl needs GPUs: set nodes.gpus > 0 or use gloo/auto")
        hosts = cfg.nodes.hosts or []
        if any(h in hosts[:i - 1] for i, h in enumerate(hosts) if i and h != hosts[i - 1]):
            raise ConfigError("nodes.hosts", hosts, "Ray Train numbers DDP's workers host by host: list each host's "
                              "workers together (e.g. [A, A, B]), so rank k runs on nodes.hosts[k]")

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict]:
        """Nothing inside a caller's reservation: Ray Train places its workers in a placement group
        of its own (the supported way to run Train inside a Tune trial)."""
        return []

    @staticmethod
    def external_bundles(cfg: RunConfig) -> list[dict]:
        return [node_bundle(cfg)] * cfg.nodes.count

    def _trainer(self, ctx: RunContext, backend: str, loop: DdpLoop):
        """A Train run with a stable name in storage, so a resumed run finds its checkpoints."""
        from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
        from ray.train import RunConfig as TrainRunConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        cfg = ctx.cfg
        pins = {}  # ScalingConfig takes label_selector from Ray 2.53 on: only a pinned run needs one
        if cfg.nodes.hosts:
            pins["label_selector"] = pin_bundles(cfg.nodes.count, resolve_hosts(cfg.nodes.hosts))
        return TorchTrainer(
            _train_worker, train_loop_config={"loop": loop},
            scaling_config=ScalingConfig(num_workers=cfg.nodes.count, use_gpu=cfg.nodes.gpus > 0,
                                         resources_per_worker=node_bundle(cfg), placement_strategy=cfg.nodes.placement,
                                         **pins),
            torch_config=TorchConfig(backend=backend),
            run_config=TrainRunConfig(name=self.name, storage_path=ctx.storage.uri_of(f"{self.name}/ray_train"),
                                      failure_config=FailureConfig(max_failures=cfg.restarts),
                                      checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, clock, ledger, n = ctx.cfg, TrainClock(), Ledger(), ctx.cfg.nodes.count
        backend = Ddp.opts(cfg).backend.replace("auto", "nccl" if cfg.nodes.gpus > 0 else "gloo")
        ctx.fresh_state(self.name)
        (what, start), sizes = ctx.initial_model(), ctx.data.train.sizes(n)  # weights, or the recipe to load them
        steps = total_steps(cfg.optim, min(sizes)) if sizes else None  # None: node files, the workers agree on it
        ledger.send("setup", what, start, copies=n)
        ledger.send("setup", "ddp_initial_broadcast", ctx.architecture.state_dict(), copies=n - 1)  # sizes only
        ledger.send("setup", "data_recipe", ctx.data.train, copies=n)  # how to read the data, not the data
        eval_sets = ctx.eval_sets(val=False)
        for split in eval_sets.values():  # rank 0 scores the curve and the final model
            ledger.send("setup", "eval_sets", split)
        logger.info("[ddp] %d workers x %s steps, %s", n, steps or "(their shards')", backend)
        ctx.live.expect(n, steps)
        earlier = len(ctx.storage.read_json(ATTEMPTS)) if ctx.storage.exists(ATTEMPTS) else 0
        trainer = self._trainer(ctx, backend, DdpLoop(
            cfg=cfg, spec=ctx.spec, task=ctx.data.task, weights=ray.put(start), steps=steps, storage=ctx.storage,
            data=ctx.data.train, eval_sets=ray.put(eval_sets), progress=ctx.live.poster()))
        ctx.storage.delete(DATA_ERROR)  # a resumed run's earlier refusal
        before, fit_at = set(ray.util.placement_group_table()), time.time()
        try:
            result = trainer.fit()
        except Exception:
            _release_leaked_placement_groups(before, [node_bundle(cfg)] * n)
            raise
        if ctx.storage.exists(DATA_ERROR):
            raise ConfigError(*ctx.storage.read_json(DATA_ERROR))
        ledger.record("setup", "shard_sizes", result.metrics["shard_sizes_bytes"])
        attempts = ctx.storage.read_json(ATTEMPTS)
        details = _attempts_ledger(ledger, attempts, len(attempts) - earlier - 1, n)
        details["phases_s"] = _phases(result.metrics["workers"], fit_at, time.time())
        return self._finish(ctx, ledger, clock, result, backend, details)

    def _finish(self, ctx: RunContext, ledger: Ledger, clock: TrainClock, result, backend: str,
                details: dict) -> RunRecord:
        cfg, n, steps = ctx.cfg, ctx.cfg.nodes.count, result.metrics["steps"]
        workers, setup_bytes = result.metrics["workers"], ledger.bytes_by_phase["setup"]
        ctx.report({"step": steps, "steps": steps, "train_loss": sum(w["mean_loss"] for w in workers) / n})
        curve = [curve_point(p["step"], p["train_s"], p["step"] * cfg.optim.batch_size * n,
                             setup_bytes + n * p["allreduce_bytes"],
                             {k: v for k, v in p.items() if k not in ("step", "train_s", "allreduce_bytes")})
                 for p in result.metrics["curve"]]
        for w in workers:
            ledger.record("train", "gradient_allreduce", w["allreduce_bytes"])
        ledger.record("final", "worker_stats_gather", result.metrics["gather_bytes"])
        ledger.send("final", "eval_metrics", result.metrics["final"])
        collecting = time.perf_counter()
        with result.checkpoint.as_directory() as d:
            tensors, _ = Storage(d).load_tensors(STATE_FILE)
        details["phases_s"]["collect"] = round(time.perf_counter() - collecting, 3)
        state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
        ledger.send("final", "model_checkpoint", state)  # under LoRA rank 0 checkpoints the adapters and head only
        details = {"steps_per_worker": steps, "backend": backend,
                   "allreduce_buckets_per_rank": [w["buckets"] for w in workers], **details, "train_run": result.path}
        return finish_record(self.name, ctx, ledger, clock, metrics=result.metrics["final"], step=steps,
                             samples=sum(w["samples"] for w in workers), train_s=max(w["train_s"] for w in workers),
                             infos=workers, weights=state, curve=curve, nodes=workers, details=details)
