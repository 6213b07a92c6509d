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
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar, Literal

import ray

from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.applicability import always
from raylowcomm.config.checks import check_kills, check_kills_restarted
from raylowcomm.execution import node_bundle, pin_bundles, resolve_hosts
from raylowcomm.storage import Storage
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
    budget_details,
    curve_point,
    finish_record,
)
from raylowcomm.strategies.ddp.worker import ATTEMPTS, DATA_ERROR, STATE_FILE, DdpLoop, train_worker
from raylowcomm.training import total_steps

logger = logging.getLogger(__name__)


@dataclass
class DdpConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when nodes.gpus > 0, else gloo."""


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
    return {
        "train_run_start": round(min(w["entered_at"] for w in workers) - fit_at, 3),
        **rank0["phases_s"],
        "train": round(max(w["train_s"] for w in workers), 3),
        "train_run_end": round(fitted_at - rank0["final_report_at"], 3),
    }


def _goodput(workers: list[dict], attempts: list[dict]) -> dict:
    """`attempts`: this fit's. A rank's useful time is its training loop's, as its checkpoints carry it
    (what an attempt did past the checkpoint the next resumed from is not in it), less what an earlier
    run had done before this fit; every rank is reserved from this fit's first attempt to rank 0's final
    report, restarts of the whole group included, and restarts with the group. DDP's waits for the
    all-reduce are inside its steps: not told apart from training."""
    first = attempts[0]
    reserved = workers[0]["final_report_at"] - first.get("entered_at", workers[0]["entered_at"])
    before, restarts = first.get("train_s_at_start", 0.0), len(attempts) - 1
    accounts = [NodeAccount(w["rank"], max(0.0, w["train_s"] - before), 0.0, None, restarts) for w in workers]
    return goodput(accounts, reserved)


class Ddp(Strategy[DdpConfig]):
    name: ClassVar[str] = "ddp"
    runs_by_default: ClassVar[bool] = True  # the baseline every run is compared with
    Config: ClassVar[type] = DdpConfig
    option_rules: ClassVar[dict] = {"backend": always}  # validate: nccl needs GPUs
    ignores: ClassVar[dict[str, str]] = {
        "bad_nodes": "its workers all-reduce gradients every step; no round carries one node's outer update"
    }

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        if Ddp.opts(cfg).backend == "nccl" and cfg.nodes.gpus == 0:
            raise ConfigError("ddp.backend", "nccl", "nccl needs GPUs: set nodes.gpus > 0 or use gloo/auto")
        hosts = cfg.nodes.hosts or []
        if any(h in hosts[: i - 1] for i, h in enumerate(hosts) if i and h != hosts[i - 1]):
            raise ConfigError(
                "nodes.hosts",
                hosts,
                "Ray Train numbers DDP's workers host by host: list each host's "
                "workers together (e.g. [A, A, B]), so rank k runs on nodes.hosts[k]",
            )
        check_kills_restarted(
            cfg, per_node=False, why="Ray Train restarts the whole group from its checkpoint after each kill"
        )

    @staticmethod
    def check(ctx: RunContext) -> None:
        """churn.kill against the steps each worker takes (all take the same)."""
        sizes = ctx.data.train.sizes(ctx.cfg.nodes.count)
        check_kills(ctx.cfg, total_steps(ctx.cfg.optim, min(sizes)) if sizes else None, {}, "")

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
            train_worker,
            train_loop_config={"loop": loop},
            scaling_config=ScalingConfig(
                num_workers=cfg.nodes.count,
                use_gpu=cfg.nodes.gpus > 0,
                resources_per_worker=node_bundle(cfg),
                placement_strategy=cfg.nodes.placement,
                **pins,
            ),
            torch_config=TorchConfig(backend=backend),
            run_config=TrainRunConfig(
                name=self.name,
                storage_path=ctx.storage.uri_of(f"{self.name}/ray_train"),
                failure_config=FailureConfig(max_failures=cfg.restarts),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
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
        budget = "" if cfg.optim.budget_s is None else f" at most, until {cfg.optim.budget_s:g} s of training"
        logger.info("[ddp] %d workers x %s steps%s, %s", n, steps or "(their shards')", budget, backend)
        ctx.live.expect(n, steps)
        earlier = len(ctx.storage.read_json(ATTEMPTS)) if ctx.storage.exists(ATTEMPTS) else 0
        trainer = self._trainer(
            ctx,
            backend,
            DdpLoop(
                cfg=cfg,
                spec=ctx.spec,
                task=ctx.data.task,
                weights=ray.put(start),
                steps=steps,
                storage=ctx.storage,
                data=ctx.data.train,
                eval_sets=ray.put(eval_sets),
                progress=ctx.live.poster(),
            ),
        )
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
        record = self._finish(ctx, ledger, clock, result, backend, details)
        record.goodput = _goodput(result.metrics["workers"], attempts[earlier:])
        return record

    def _finish(
        self, ctx: RunContext, ledger: Ledger, clock: TrainClock, result, backend: str, details: dict
    ) -> RunRecord:
        cfg, n, steps = ctx.cfg, ctx.cfg.nodes.count, result.metrics["steps"]
        workers, setup_bytes = result.metrics["workers"], ledger.bytes_by_phase["setup"]
        ctx.report({"step": steps, "steps": steps, "train_loss": sum(w["mean_loss"] for w in workers) / n})
        curve = [
            curve_point(
                p["step"],
                p["train_s"],
                p["step"] * cfg.optim.batch_size * n,
                setup_bytes + n * p["allreduce_bytes"],
                {k: v for k, v in p.items() if k not in ("step", "train_s", "allreduce_bytes")},
            )
            for p in result.metrics["curve"]
        ]
        for w in workers:
            ledger.record("train", "gradient_allreduce", w["allreduce_bytes"])
        if cfg.optim.budget_s is not None and n > 1:  # every rank's float32 vote, all-reduced after every step
            ledger.record("train", "budget_votes", 4 * n * steps)
        ledger.record("final", "worker_stats_gather", result.metrics["gather_bytes"])
        ledger.send("final", "eval_metrics", result.metrics["final"])
        collecting = time.perf_counter()
        with result.checkpoint.as_directory() as d:
            tensors, _ = Storage(d).load_tensors(STATE_FILE)
        details["phases_s"]["collect"] = round(time.perf_counter() - collecting, 3)
        state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
        ledger.send("final", "model_checkpoint", state)  # under LoRA rank 0 checkpoints the adapters and head only
        train_s = max(w["train_s"] for w in workers)
        if cfg.optim.budget_s is not None:
            last = max(workers, key=lambda w: w["train_s"])["last_step_s"]
            details["budget"] = budget_details(cfg.optim.budget_s, train_s, steps, last)
        details = {
            "steps_per_worker": steps,
            "backend": backend,
            "allreduce_buckets_per_rank": [w["buckets"] for w in workers],
            **details,
            "train_run": result.path,
        }
        return finish_record(
            self.name,
            ctx,
            ledger,
            clock,
            metrics=result.metrics["final"],
            step=steps,
            samples=sum(w["samples"] for w in workers),
            train_s=train_s,
            infos=workers,
            weights=state,
            curve=curve,
            nodes=workers,
            details=details,
        )
