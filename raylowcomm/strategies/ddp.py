"""The baseline: ordinary data-parallel fine-tuning with gradients all-reduced every step
(Ray Train's TorchTrainer; gloo on CPU, nccl on GPU), on the same shards, batch size per worker,
optimizer and number of steps as the lo-fi nodes.

The bytes of the `train` phase are not a formula: a DDP communication hook adds up the gradient
buckets each rank hands to all-reduce, step by step.

Curve: at every `eval_every` step all ranks meet at a barrier while rank 0 scores its replica
(the replicas are identical but for BN statistics, and rank 0's is the model that is saved);
that time is taken out of the training time.
"""

from __future__ import annotations

import logging
import pickle
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import ray
import torch
from torch import nn

from raylowcomm.actors import Node, process_info
from raylowcomm.config import RunConfig
from raylowcomm.data import num_examples
from raylowcomm.ledger import Ledger
from raylowcomm.models import state_dict_of
from raylowcomm.seeding import node_seed
from raylowcomm.strategies.base import RunContext, RunRecord, curve_point, eval_points, finish_record, node_bundle, warn_unused
from raylowcomm.training import TrainClock, make_optimizer, save_weights, total_steps, train_steps

logger = logging.getLogger(__name__)


@dataclass
class DdpConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when nodes.gpus > 0, else gloo."""


def counting_allreduce_hook(counter: dict):
    """The default all-reduce, after adding up the bytes of the gradient bucket it sends."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        buffer = bucket.buffer()
        counter["bytes"] += buffer.numel() * buffer.element_size()
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

    @staticmethod
    def loss(wrapped: nn.Module, batch) -> torch.Tensor:
        """`train_steps`' task interface, for the (possibly DDP-wrapped) TaskLoss."""
        return wrapped(batch)


def _train_worker(config: dict) -> None:
    """One Ray Train worker: a `Node` (model, task, device) whose gradients DDP all-reduces; rank 0
    scores the curve at a barrier and the final model, where the model lives."""
    import torch.distributed as dist
    from ray import train
    from ray.train.torch import prepare_model

    cfg: RunConfig = config["cfg"]
    rank = train.get_context().get_world_rank()
    node = Node(rank, cfg, config["spec"], ray.get(config["weights"]))
    node.label = "ddp rank"
    # Each rank keeps its own BN statistics, as a lo-fi node does: only gradients cross.
    wrapped = prepare_model(TaskLoss(node.model, node.task), parallel_strategy_kwargs={"broadcast_buffers": False})
    counter = {"bytes": 0, "buckets": 0}
    if hasattr(wrapped, "register_comm_hook"):  # a single worker is not wrapped: nothing to all-reduce
        wrapped.register_comm_hook(None, counting_allreduce_hook(counter))
    points, curve, clock = set(eval_points(cfg, config["steps"])), [], TrainClock()

    def on_step(step: int) -> None:
        if step in points:
            dist.barrier()
            with clock.paused():
                if rank == 0:
                    curve.append({"step": step, "train_s": clock.elapsed(), "allreduce_bytes": counter["bytes"],
                                  **node.evaluate([config["eval_sets"]])})
                dist.barrier()

    stats = train_steps(wrapped, TaskLoss, make_optimizer(cfg.optim, node.model), ray.get(config["shards"][rank]), 0,
                        config["steps"], cfg.optim.batch_size, node_seed(cfg.seed, rank),
                        log=node.log if rank == 0 else None, log_every=cfg.log_every, on_step=on_step, clock=clock)
    mine = {"rank": rank, "allreduce_bytes": counter["bytes"], "buckets": counter["buckets"], "samples": stats["samples"],
            "train_s": stats["train_s"], **process_info(), "mean_loss": stats["mean_loss"]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    metrics = {"workers": everyone, "gather_bytes": len(pickle.dumps(mine)) * dist.get_world_size(), "curve": curve}
    if rank == 0:
        metrics["final"] = node.evaluate([config["eval_sets"]])
        with tempfile.TemporaryDirectory() as tmp:
            save_weights(Path(tmp) / "model.safetensors", state_dict_of(node.model))
            train.report(metrics, checkpoint=train.Checkpoint.from_directory(tmp))
    else:
        train.report(metrics)


def _release_leaked_placement_groups(before: set[str], bundles: list[dict]) -> None:
    """When a Train run fails while it starts (e.g. gloo cannot connect), Ray Train 2.60 can leave
    its workers' placement group reserved, and the strategies after it would wait forever for
    those CPUs. Remove the groups with exactly our bundles that appeared during the failed fit."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group
    from ray._raylet import PlacementGroupID

    want = [{k: float(v) for k, v in b.items()} for b in bundles]
    for pg_id, info in ray.util.placement_group_table().items():
        if pg_id in before or info["state"] == "REMOVED" or list(info["bundles"].values()) != want:
            continue
        logger.warning("[ddp] releasing placement group %s that the failed Train run left behind", pg_id)
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


class Ddp:
    name: ClassVar[str] = "ddp"
    Config: ClassVar[type] = DdpConfig

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        from raylowcomm.config import ConfigError

        if cfg.options["ddp"].backend == "nccl" and cfg.nodes.gpus == 0:
            raise ConfigError("ddp.backend", "nccl", "nccl needs GPUs: set nodes.gpus > 0 or use gloo/auto")
        warn_unused(cfg, "ddp", restarts="a failed Train run stops", checkpoints="ddp keeps no node checkpoints")

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict]:
        """Nothing inside a caller's reservation: Ray Train places its workers in a placement group
        of its own (the supported way to run Train inside a Tune trial)."""
        return []

    @staticmethod
    def external_bundles(cfg: RunConfig) -> list[dict]:
        return [node_bundle(cfg)] * cfg.nodes.count

    def run(self, ctx: RunContext) -> RunRecord:
        from ray.train import RunConfig as TrainRunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        from safetensors.torch import load_file

        cfg, clock, ledger, n = ctx.cfg, TrainClock(), Ledger(), ctx.cfg.nodes.count
        backend = cfg.options["ddp"].backend
        if backend == "auto":
            backend = "nccl" if cfg.nodes.gpus > 0 else "gloo"
        initial, shards = state_dict_of(ctx.model), ctx.shards()
        steps = total_steps(cfg.optim, min(num_examples(s) for s in shards))
        ledger.send("setup", "initial_weights", initial, copies=n)
        ledger.send("setup", "ddp_initial_broadcast", initial, copies=n - 1)
        for shard in shards:
            ledger.send("setup", "data_shard", shard)
        eval_sets = ctx.eval_sets(("test", "shift"))
        for split in eval_sets.values():  # rank 0 scores the curve and the final model
            ledger.send("setup", "eval_sets", split)
        logger.info("[ddp] %d workers x %d steps, %s", n, steps, backend)
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"cfg": cfg, "spec": ctx.spec, "weights": ray.put(initial), "steps": steps,
                               "shards": [ray.put(s) for s in shards], "eval_sets": ray.put(eval_sets)},
            scaling_config=ScalingConfig(num_workers=n, use_gpu=cfg.nodes.gpus > 0, resources_per_worker=node_bundle(cfg),
                                         placement_strategy=cfg.nodes.placement),
            torch_config=TorchConfig(backend=backend),
            run_config=TrainRunConfig(name=f"ddp-{uuid.uuid4().hex[:8]}", storage_path=str((ctx.strategy_dir(self.name) / "ray_train").resolve())),
        )
        before = set(ray.util.placement_group_table())
        try:
            result = trainer.fit()
        except Exception:
            _release_leaked_placement_groups(before, [node_bundle(cfg)] * n)
            raise
        workers, setup_bytes = result.metrics["workers"], ledger.bytes_by_phase["setup"]
        ctx.report({"step": steps, "steps": steps, "train_loss": sum(w["mean_loss"] for w in workers) / n})
        curve = [curve_point(p["step"], p["train_s"], p["step"] * cfg.optim.batch_size * n, setup_bytes + n * p["allreduce_bytes"],
                             {k: v for k, v in p.items() if k not in ("step", "train_s", "allreduce_bytes")})
                 for p in result.metrics["curve"]]
        for w in workers:
            ledger.record("train", "gradient_allreduce", w["allreduce_bytes"])
        ledger.record("final", "worker_stats_gather", result.metrics["gather_bytes"])
        ledger.send("final", "eval_metrics", result.metrics["final"])
        with result.checkpoint.as_directory() as d:
            state = load_file(str(Path(d) / "model.safetensors"))
        ledger.send("final", "model_checkpoint", state)
        details = {"steps_per_worker": steps, "backend": backend, "allreduce_buckets_per_rank": [w["buckets"] for w in workers]}
        return finish_record(self.name, ctx, ledger, clock, metrics=result.metrics["final"], step=steps,
                             samples=sum(w["samples"] for w in workers), train_s=max(w["train_s"] for w in workers),
                             infos=workers, weights=state, curve=curve, nodes=workers, details=details)

