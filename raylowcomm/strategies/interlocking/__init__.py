"""Interlocking backpropagation on Ray (Gomez et al. 2020): the model split depth-wise into K
stages, one `StageActor` each (stage.py; routing and stage work in core/interlock/), micro-batches in
flight so that all stages compute at once. A stage's ``forward`` puts (h, targets) in the object
store and returns the ref, which the driver hands unread to stage k + 1; gradients travel back
the same way, so the driver only handles refs and small dicts (``details.driver_fetched``). The
driver never waits on a batch as a whole (at most ``max_batches_ahead`` in flight). Curve: every
``eval_every`` batches the pipeline drains and every head is scored through the chain, off the
clock. Bytes: every tensor one stage sends another."""

from __future__ import annotations

import logging
from typing import ClassVar

import ray
import torch

from raylowcomm.actors import NodeGroup
from raylowcomm.common.batches import Source
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import RunConfig
from raylowcomm.core.interlock.heads import LOSS_OF_FAMILY
from raylowcomm.data import TrainSource
from raylowcomm.execution import node_bundle
from raylowcomm.models import ModelSpec, state_dict_of
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
    curve_point,
    eval_points,
    finish_record,
)
from raylowcomm.strategies.interlocking.building import Stages, build_stages, stage_source
from raylowcomm.strategies.interlocking.checks import check_loaded, refuse_churn, validate_config
from raylowcomm.strategies.interlocking.config import OPTION_RULES, InterlockingConfig
from raylowcomm.strategies.interlocking.pipeline import evaluate_chained, final_head_metrics, train_interlocked
from raylowcomm.strategies.interlocking.record import run_details, stage_goodput
from raylowcomm.strategies.interlocking.stage import StageActor
from raylowcomm.training import total_steps

__all__ = [
    "Interlocking",
    "Stages",
    "build_stages",
    "evaluate_chained",
    "final_head_metrics",
    "refuse_churn",
    "stage_goodput",
    "stage_source",
    "train_interlocked",
]

logger = logging.getLogger(__name__)


class Interlocking(Strategy[InterlockingConfig]):
    name: ClassVar[str] = "interlocking"
    Config: ClassVar[type] = InterlockingConfig
    option_rules: ClassVar[dict] = OPTION_RULES
    ignores: ClassVar[dict[str, str]] = {
        "nodes.count": "it starts interlocking.stages actors",
        "nodes.max_restarts": "a dead stage stops the run",
        "checkpoint_every": "stages keep no checkpoints",
        "log_every": "it logs each stage's first and last head loss",
        "optim.group_by_length": "it cuts one stream of batches, not grouped by length",
        "bad_nodes": "its stages pass activations and gradients; no round carries a node's outer update",
    }
    count_field: ClassVar[str] = "interlocking.stages"  # the option that sets how many actors it starts

    @classmethod
    def count(cls, cfg: RunConfig) -> int:
        return cls.opts(cfg).stages  # one actor per stage, whatever nodes.count says

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        return [node_bundle(cfg)] * Interlocking.count(cfg)

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        validate_config(cfg, Interlocking.opts(cfg))

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None:
        return "interlocking splits the model into its stages on the driver"

    @staticmethod
    def check(ctx: RunContext) -> None:
        """The options against the loaded model and data (`check_loaded`): how many units the model has
        and how many test rows time a measured split are known only now."""
        check_loaded(ctx, Interlocking.opts(ctx.cfg))

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, family, clock = ctx.cfg, Interlocking.opts(ctx.cfg), ctx.spec.family, TrainClock()
        torch.manual_seed(cfg.seed)
        built = build_stages(ctx, opts)  # the driver's copy: final weights land in built.model
        with (
            NodeGroup(StageActor, cfg, Ledger(), bundles=self.bundles(cfg)) as group,
            group.stop_on_death("interlocking stage", "each stage holds layers no other has"),
        ):
            self._load(group, built.modules, built.heads, built.source, ctx.data.train, cfg, ctx.spec)
            trained, stage_losses, busy, curve = self._train(ctx, group, built.source)
            per_set, eval_bytes = evaluate_chained(
                group.handles(), built.source.eval_sets, cfg.eval_rows, group.fetch, LOSS_OF_FAMILY[family]
            )
            group.ledger.record("final", "eval_activations", eval_bytes)
            fetched_eval = {key: getattr(group.fetch, key) - trained["fetched"][key] for key in ("bytes", "tensors")}
            infos = group.call("info", phase="final", what="stage_info")
            for module, (state, _) in zip(built.modules, group.call("state", phase="final", what="stage_weights")):
                module.load_state_dict(state)
        train_s, batches = trained["train_s"], trained["batches"]
        details = run_details(cfg, opts, built, trained, infos, busy, per_set, stage_losses, fetched_eval)
        return finish_record(
            self.name,
            ctx,
            group.ledger,
            clock,
            metrics=final_head_metrics(per_set),
            step=batches,
            samples=batches * cfg.optim.batch_size,
            train_s=train_s,
            infos=infos,
            weights=state_dict_of(built.model),
            curve=curve,
            nodes=[{**i, "busy_s": b} for i, b in zip(infos, busy)],
            details=details,
            goodput=stage_goodput(busy, train_s),
        )

    def _load(
        self,
        group: NodeGroup,
        modules: list,
        heads: list,
        source: Source,
        recipe: TrainSource,
        cfg: RunConfig,
        spec: ModelSpec,
    ) -> None:
        """One stage actor per module, its aux head beside it; stage 0 also gets the evaluation sets
        and how to read the training data (not the data)."""
        opts, K, loaded = Interlocking.opts(cfg), len(modules), []
        for what, data in (("data_recipe", recipe), ("eval_data", source.eval_sets)):  # stage 0's
            group.ledger.send("setup", what, data)
        for k in range(K):
            ref = group.put((modules[k], heads[k] if k < K - 1 else None), "setup", "stage_modules")
            actor = group.start(k, cfg.nodes.cpus, cfg.nodes.gpus, cfg.churn.cpu_quota)
            loaded.append(
                actor.load.remote(
                    k,
                    K,
                    opts.width,
                    opts.rule,
                    ref,
                    LOSS_OF_FAMILY[spec.family],
                    cfg.optim,
                    opts.micro_batches,
                    *((source, recipe) if k == 0 else ()),
                    spec=spec,
                )
            )
        ray.get(loaded)

    def _train(self, ctx: RunContext, group: NodeGroup, source: Source) -> tuple[dict, list, list, list]:
        cfg, opts = ctx.cfg, Interlocking.opts(ctx.cfg)
        K, actors = opts.stages, group.handles()
        steps = total_steps(cfg.optim, ctx.data.train.sizes(1)[0])
        budget = cfg.optim.budget_s if cfg.optim.budget_s is not None else opts.time_budget_s
        logger.info(
            "[interlocking] K=%d n=%d rule=%s, %d steps x %d micro-batches%s",
            K,
            opts.width,
            opts.rule,
            steps,
            opts.micro_batches,
            f", budget {budget}s" if budget else "",
        )
        seen = _Reports(ctx, group, actors, K, steps)
        trained = train_interlocked(
            actors,
            K,
            opts.width,
            opts.rule,
            opts.micro_batches,
            steps,
            group.fetch,
            budget,
            opts.max_batches_ahead,
            seen.absorb,
            frozenset(eval_points(cfg, steps)),
            seen.evaluate,
            opts.max_batches_ahead if opts.overlap else 1,
        )
        stage_losses = seen.stage_losses
        for k in (k for k in range(K) if stage_losses[k]):
            logger.info(
                "[interlocking] stage %d head loss: first %.4f last %.4f", k, stage_losses[k][0], stage_losses[k][-1]
            )
        trained["fetched"] = {"bytes": group.fetch.bytes, "tensors": group.fetch.tensors}
        return trained, stage_losses, seen.busy, seen.curve


class _Reports:
    """What the driver gathers while the stages train: each stage's head losses (a mean per batch), its
    busy time and the bytes it sent (booked in the ledger), the progress shown live, and the curve, a
    point at each evaluation (the pipeline drained, every head scored through the chain)."""

    def __init__(self, ctx: RunContext, group: NodeGroup, actors: list, stages: int, steps: int):
        self.ctx, self.group, self.actors, self.steps = ctx, group, actors, steps
        self.stage_losses: list[list[float]] = [[] for _ in range(stages)]
        self.busy, self.curve = [0.0] * stages, []

    def absorb(self, batch_reports: list[dict]) -> None:
        ledger, last = self.group.ledger, self.stage_losses[-1]
        for r in batch_reports:
            k = r["stage"]
            if r["losses"]:
                self.stage_losses[k].append(sum(r["losses"]) / len(r["losses"]))
            self.busy[k] += r["busy_s"]
            for what, size in ((what, size) for what, sizes in r["sent"].items() for size in sizes):
                ledger.record("train", what, size)
        self.ctx.report(
            {
                "step": len(last),
                "steps": self.steps,
                "bytes": ledger.total_bytes,
                **({"train_loss": last[-1]} if last else {}),
            }
        )

    def evaluate(self, batch: int, train_s: float) -> None:
        ctx, cfg, ledger = self.ctx, self.ctx.cfg, self.group.ledger
        per_set, sent = evaluate_chained(
            self.actors,
            ctx.eval_sets(val=False),
            cfg.eval_rows,
            self.group.fetch,
            LOSS_OF_FAMILY[ctx.spec.family],
        )
        ledger.record("final", "curve_eval_activations", sent)  # measurement: not in the point's bytes
        sent_so_far = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
        self.curve.append(
            curve_point(batch, train_s, batch * cfg.optim.batch_size, sent_so_far, final_head_metrics(per_set))
        )
