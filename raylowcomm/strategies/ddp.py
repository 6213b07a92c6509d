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

import os
import pickle
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import ray
import torch
from torch import nn

from raylowcomm.config import RunConfig
from raylowcomm.data import num_examples
from raylowcomm.ledger import Ledger
from raylowcomm.models import build_model, state_dict_of
from raylowcomm.runtime import device_for, setup_threads
from raylowcomm.strategies.base import RunContext, RunRecord, Stopwatch, curve_point, eval_points, node_bundle
from raylowcomm.strategies.lofi import node_seed
from raylowcomm.tasks import score_model, task_for
from raylowcomm.training import make_optimizer, peak_rss_bytes, save_weights, total_steps, train_steps


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
    import torch.distributed as dist
    from ray import train
    from ray.train.torch import prepare_model

    cfg: RunConfig = config["cfg"]
    setup_threads(cfg.nodes.cpus)
    rank = train.get_context().get_world_rank()
    model = build_model(config["spec"])
    model.load_state_dict(ray.get(config["weights"]))
    task = task_for(config["spec"].family, cfg.data.image_size, device_for(cfg.nodes.gpus), data=cfg.data.name)
    # Each rank keeps its own BN statistics, as a lo-fi node does: only gradients cross.
    wrapped = prepare_model(TaskLoss(model, task), parallel_strategy_kwargs={"broadcast_buffers": False})
    counter = {"bytes": 0, "buckets": 0}
    if hasattr(wrapped, "register_comm_hook"):  # a single worker is not wrapped: nothing to all-reduce
        wrapped.register_comm_hook(None, counting_allreduce_hook(counter))
    shard = ray.get(config["shards"][rank])
    optimizer = make_optimizer(cfg.optim, model)
    log = (lambda msg: print(f"[ddp rank 0] {msg}", flush=True)) if rank == 0 else None
    points, curve, evaluating_s, started = set(eval_points(cfg, config["steps"])), [], 0.0, time.perf_counter()
    eval_sets = ray.get(config["eval_sets"]) if rank == 0 and points else None

    def on_step(step: int) -> None:
        nonlocal evaluating_s
        if step not in points:
            return
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            metrics = score_model(task, model, eval_sets["test"], eval_sets.get("shift"), cfg.optim.eval_batch_size)
            curve.append({"step": step, "train_s": t - started - evaluating_s, "allreduce_bytes": counter["bytes"], **metrics})
        dist.barrier()
        evaluating_s += time.perf_counter() - t

    stats = train_steps(wrapped, TaskLoss, optimizer, shard, 0, config["steps"], cfg.optim.batch_size, node_seed(cfg.seed, rank),
                        log=log, log_every=cfg.log_every, on_step=on_step)
    stats["train_s"] -= evaluating_s
    ctx, pg = ray.get_runtime_context(), ray.util.get_current_placement_group()
    mine = {"rank": rank, "allreduce_bytes": counter["bytes"], "buckets": counter["buckets"], "samples": stats["samples"],
            "train_s": stats["train_s"], "peak_rss_bytes": peak_rss_bytes(), "host": socket.gethostname(),
            "ray_node_id": ctx.get_node_id(), "pid": os.getpid(), "placement_group": pg.id.hex() if pg else None,
            "mean_loss": stats["mean_loss"]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    gather_bytes = len(pickle.dumps(mine)) * dist.get_world_size()
    metrics = {"workers": everyone, "gather_bytes": gather_bytes, "curve": curve}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            save_weights(Path(tmp) / "model.safetensors", state_dict_of(model))
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
        print(f"[ddp] releasing placement group {pg_id} that the failed Train run left behind", flush=True)
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))


class Ddp:
    name: ClassVar[str] = "ddp"
    Config: ClassVar[type] = DdpConfig

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        from raylowcomm.config import ConfigError

        if cfg.options["ddp"].backend == "nccl" and cfg.nodes.gpus == 0:
            raise ConfigError("ddp.backend", "nccl", "nccl needs GPUs: set nodes.gpus > 0 or use gloo/auto")

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

        cfg, clock, ledger, n = ctx.cfg, Stopwatch(), Ledger(), ctx.cfg.nodes.count
        out = ctx.strategy_dir(self.name)
        backend = cfg.options["ddp"].backend
        if backend == "auto":
            backend = "nccl" if cfg.nodes.gpus > 0 else "gloo"
        initial = state_dict_of(ctx.model)
        shards = ctx.shards()
        steps = total_steps(cfg.optim, min(num_examples(s) for s in shards))
        ledger.send("setup", "initial_weights", initial, copies=n)
        ledger.send("setup", "ddp_initial_broadcast", initial, copies=n - 1)
        for shard in shards:
            ledger.send("setup", "data_shard", shard)
        eval_sets = {k: v for k, v in ctx.eval_sets().items() if k in ("test", "shift")}
        if cfg.eval_every:
            ledger.send("setup", "eval_sets", eval_sets)
        print(f"[ddp] {n} workers x {steps} steps, {backend}", flush=True)
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"cfg": cfg, "spec": ctx.spec, "weights": ray.put(initial), "steps": steps,
                               "shards": [ray.put(s) for s in shards], "eval_sets": ray.put(eval_sets)},
            scaling_config=ScalingConfig(num_workers=n, use_gpu=cfg.nodes.gpus > 0, resources_per_worker=node_bundle(cfg),
                                         placement_strategy=cfg.nodes.placement),
            torch_config=TorchConfig(backend=backend),
            run_config=TrainRunConfig(name=f"ddp-{uuid.uuid4().hex[:8]}", storage_path=str((out / "ray_train").resolve())),
        )
        before = set(ray.util.placement_group_table())
        try:
            result = trainer.fit()
        except Exception:
            _release_leaked_placement_groups(before, [node_bundle(cfg)] * n)
            raise
        workers = result.metrics["workers"]
        ctx.report({"step": steps, "train_loss": sum(w["mean_loss"] for w in workers) / n})
        setup_bytes = ledger.bytes_by_phase["setup"]
        curve = [curve_point(p["step"], p["train_s"], p["step"] * cfg.optim.batch_size * n, setup_bytes + n * p["allreduce_bytes"],
                             {k: v for k, v in p.items() if k not in ("step", "train_s", "allreduce_bytes")})
                 for p in result.metrics["curve"]]
        for w in workers:
            ledger.record("train", "gradient_allreduce", w["allreduce_bytes"])
        ledger.record("final", "worker_stats_gather", result.metrics["gather_bytes"])
        with result.checkpoint.as_directory() as d:
            state = load_file(str(Path(d) / "model.safetensors"))
        ledger.send("final", "model_checkpoint", state)
        model = build_model(ctx.spec)
        model.load_state_dict(state)
        task = task_for(ctx.spec.family, cfg.data.image_size, data=cfg.data.name)
        metrics = score_model(task, model, ctx.data.test, ctx.data.shift, cfg.optim.eval_batch_size)
        weights_path = save_weights(out / "model.safetensors", state)
        train_s = max(w["train_s"] for w in workers)
        curve.append(curve_point(steps, train_s, sum(w["samples"] for w in workers), ledger.total_bytes, metrics))
        details = {"steps_per_worker": steps, "backend": backend, "allreduce_buckets_per_rank": [w["buckets"] for w in workers]}
        return RunRecord(self.name, metrics, ledger, clock.elapsed(), sum(w["samples"] for w in workers),
                         train_s, max(w["peak_rss_bytes"] for w in workers),
                         [{k: v for k, v in w.items()} for w in workers], details, weights_path, curve)
