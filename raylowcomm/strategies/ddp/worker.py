"""A DDP rank's side: the training loop each Ray Train worker runs (`train_worker`), its byte count
of every all-reduce (`counting_allreduce_hook`), its checkpoints and its record of attempts."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass

import ray
import torch
from torch import nn

from raylowcomm.actors import Node, process_info
from raylowcomm.catalog import TaskSpec
from raylowcomm.common.batches import group_seed, num_examples
from raylowcomm.common.seeding import node_seed
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.data import TrainSource
from raylowcomm.execution.churn import Churn
from raylowcomm.models import ModelSpec
from raylowcomm.progress import ProgressPoster
from raylowcomm.storage import Storage
from raylowcomm.strategies.base import (
    eval_points,
)
from raylowcomm.tasks import mean_metrics
from raylowcomm.training import StepHooks, load_checkpoint, make_optimizer, save_checkpoint, total_steps, train_steps

logger = logging.getLogger(__name__)

STATE_FILE, RANK_FILE = "state.safetensors", "rank{}.safetensors"
ATTEMPTS, DATA_ERROR = "ddp/attempts.json", "ddp/data_error.json"


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
        return {
            **self.counts,
            "train_s": self.counts["train_s"] + clock.elapsed(),
            "writer": {"host": socket.gethostname(), "pid": os.getpid()},
        }


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
            save_checkpoint(
                Storage(tmp),
                STATE_FILE,
                node.model,
                optimizer,
                step,
                extra={"curve": curve},
                trainable_only=node.fine_tune.trainable_only(),
            )  # LoRA: the frozen base never changes
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
        started = {"bytes_at_start": entry["allreduce_bytes"], "train_s_at_start": counts["train_s"]}
        attempts.append({**entry, **started, "entered_at": time.time()})
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


def train_worker(config: dict) -> None:
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

    def __init__(
        self,
        loop: DdpLoop,
        node: Node,
        world: int,
        optimizer,
        steps: int,
        restored: tuple[int, list, Tally],
        watch: Stopwatch,
    ):
        self.loop, self.node, self.rank, self.world, self.optimizer = loop, node, node.rank, world, optimizer
        self.steps, (self.start, self.curve, self.tally), self.watch = steps, restored, watch
        self.points, self.clock = set(eval_points(loop.cfg, steps)), TrainClock()
        self.done, self.last_step_s = steps, 0.0  # the step it ended at: `steps`, or where its budget ran out
        if self.rank == 0:
            _note_attempt(loop.storage, self.start, self.tally.counts, self.start, new=True)

    def train(self, wrapped: nn.Module, shard) -> None:
        cfg, progress = self.loop.cfg, self.loop.progress
        if progress is not None:
            progress.worker, progress.steps = self.rank, self.steps
        churn = Churn.for_node(cfg, self.rank, self.world, self.loop.storage, "ddp")
        hooks = StepHooks(
            on_step=self.on_step,
            log=self.node.log if self.rank == 0 else None,
            log_every=cfg.log_every,
            progress=progress,
            clock=self.clock,
            pace=churn,
            stop=self.over_budget if cfg.optim.budget_s is not None else None,
        )
        stats = train_steps(
            wrapped,
            self.tally,
            self.optimizer,
            shard,
            self.start,
            self.steps,
            cfg.optim.batch_size,
            node_seed(cfg.seed, self.rank),
            hooks,
            precision=cfg.optim.precision,
            device=self.node.device,
            group_seed=group_seed(cfg),
        )
        self.done, self.last_step_s = self.start + stats["steps"], stats["last_step_s"]

    def over_budget(self) -> bool:
        """Whether the run's training time reached optim.budget_s: every rank votes after every step (one
        float32 all-reduced to its maximum), so that all stop at the same step, the first at which any
        rank's clock reached it."""
        import torch
        import torch.distributed as dist

        spent = self.tally.at(self.clock)["train_s"] >= self.loop.cfg.optim.budget_s
        if self.world == 1:
            return spent
        vote = torch.tensor([float(spent)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return bool(vote.item())

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

        cfg, world, steps, done = self.loop.cfg, self.world, self.done, self.tally.at(self.clock)
        with self.watch("evaluate"):
            if cfg.data.eval_on_nodes:  # every rank scores the (same) model on its own held-out rows
                per_rank = [None] * world
                dist.all_gather_object(per_rank, self.node.evaluate([self.loop.eval_sets]))
                final = {"final": mean_metrics(per_rank), "final_per_rank": per_rank}
            else:
                final = {"final": self.node.evaluate([self.loop.eval_sets])} if self.rank == 0 else {}
        mine = {
            "rank": self.rank,
            "examples": examples,
            "allreduce_bytes": done["allreduce_bytes"],
            "buckets": done["buckets"],
            "samples": steps * cfg.optim.batch_size,
            "train_s": done["train_s"],
            "last_step_s": self.last_step_s,
            "resumed_from": self.start,
            **process_info(),
            "mean_loss": done["loss_sum"] / steps if steps else None,
            "entered_at": entered,
            "phases_s": self.watch.parts,
            "final_report_at": time.time(),
            "final_hash": self.node.hash(),
        }  # the replicas must agree: a reader compares them
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        metrics = {
            "workers": everyone,
            "gather_bytes": all_gather_nbytes(everyone, world),
            "shard_sizes_bytes": shard_sizes_bytes,
            "curve": self.curve,
            "steps": steps,
            **final,
        }
        if self.rank == 0:
            _note_attempt(self.loop.storage, self.start, done, steps)
        _report(metrics, steps, self.rank, self.node, self.optimizer, done, self.curve)
