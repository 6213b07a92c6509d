"""Interlocking backpropagation on Ray (Gomez et al. 2020): the model split depth-wise into K
stages, one `StageActor` each (stage.py; routing and stage work in core/interlock/), micro-batches in
flight so that all stages compute at once. A stage's ``forward`` puts (h, targets) in the object
store and returns the ref, which the driver hands unread to stage k + 1; gradients travel back
the same way, so the driver only handles refs and small dicts (``details.driver_fetched``). The
driver never waits on a batch as a whole (at most ``max_batches_ahead`` in flight). Curve: every
``eval_every`` batches the pipeline drains and every head is scored through the chain, off the
clock. Bytes: every tensor one stage sends another."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import asdict
from typing import ClassVar

import ray
import torch

from raylowcomm import catalog
from raylowcomm.actors import NodeGroup
from raylowcomm.common.batches import Source, batch_at, num_examples
from raylowcomm.common.goodput import NodeAccount, goodput
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.interlock.heads import LOSS_OF_FAMILY, aux_heads
from raylowcomm.core.interlock.splitting import (
    is_hf_decoder,
    is_timm_cnn,
    measure_balance,
    model_units,
    split_model,
    units_per_stage,
    untie_lm_head,
)
from raylowcomm.data import TrainSource
from raylowcomm.execution import node_bundle
from raylowcomm.models import ASSET_TIMM_ARCH, ModelSpec, state_dict_of
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
    budget_details,
    curve_point,
    eval_points,
    finish_record,
)
from raylowcomm.strategies.interlocking.config import OPTION_RULES, InterlockingConfig
from raylowcomm.strategies.interlocking.pipeline import evaluate_chained, final_head_metrics, train_interlocked
from raylowcomm.strategies.interlocking.stage import StageActor
from raylowcomm.tasks import make_task
from raylowcomm.training import total_steps

logger = logging.getLogger(__name__)


def refuse_churn(cfg: RunConfig) -> None:
    if cfg.churn.active:
        raise ConfigError(
            "churn",
            "set",
            "interlocking's stages each hold layers no other has and are not restarted: run churn "
            "with lofi, ddp or spsa, or remove the churn section",
        )


def stage_goodput(busy: list[float], train_s: float) -> dict:
    """A stage's useful time is its forwards, backwards and optimizer steps (every one reaches the model:
    a lost stage ends the run); the rest of the training phase it waits for activations or gradients,
    the pipeline's bubble and transfers (`idle_at_barriers_s`)."""
    return goodput([NodeAccount(k, b, max(0.0, train_s - b), 0.0) for k, b in enumerate(busy)], train_s)


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
    }
    count_field: ClassVar[str] = "interlocking.stages"  # the option that sets how many actors it starts

    @classmethod
    def count(cls, cfg: RunConfig) -> int:
        return cls.opts(cfg).stages  # one actor per stage, whatever nodes.count says

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        return [node_bundle(cfg)] * Interlocking.count(cfg)

    @staticmethod
    def _validate_heads(cfg: RunConfig, o: InterlockingConfig) -> None:
        if not 0 < o.aux_positions <= 1:
            raise ConfigError("interlocking.aux_positions", o.aux_positions, "a fraction in (0, 1] of the positions")
        if o.aux_positions < 1 and cfg.model.family != "hf_causal_lm":
            raise ConfigError(
                "interlocking.aux_positions",
                o.aux_positions,
                "reads a subset of a decoder's token positions: set it to 1 for this model",
            )

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = Interlocking.opts(cfg)
        refuse_churn(cfg)
        for name in ("stages", "micro_batches", "max_batches_ahead"):
            if getattr(o, name) < 1:
                raise ConfigError(f"interlocking.{name}", getattr(o, name), "must be >= 1")
        if not 1 <= o.n <= o.stages:
            raise ConfigError("interlocking.n", o.n, f"must be in 1..interlocking.stages ({o.stages})")
        if cfg.optim.batch_size % o.micro_batches:
            raise ConfigError(
                "interlocking.micro_batches",
                o.micro_batches,
                f"must divide optim.batch_size ({cfg.optim.batch_size}) evenly",
            )
        Interlocking._validate_heads(cfg, o)
        if o.time_budget_s is not None and o.time_budget_s <= 0:
            raise ConfigError("interlocking.time_budget_s", o.time_budget_s, "must be > 0, or null for no budget")
        for name, per_stage in (("aux_widths", False), ("split", True)):
            value = getattr(o, name)
            if value is not None and (not value or min(value) < 1 or (per_stage and len(value) != o.stages)):
                raise ConfigError(
                    f"interlocking.{name}",
                    value,
                    "must be a non-empty list of positive numbers" + (", one per stage" if per_stage else ""),
                )
        if cfg.model.family == "hf_classifier":
            raise ConfigError(
                "model.family", cfg.model.family, "interlocking splits timm CNNs and causal LMs (hf_causal_lm)"
            )
        if cfg.data.node_files is not None or cfg.data.eval_on_nodes:
            field = "data.node_files" if cfg.data.node_files is not None else "data.eval_on_nodes"
            raise ConfigError(
                field,
                getattr(cfg.data, field[5:]),
                "interlocking trains one model on one stream of "
                "batches and scores it on the driver's sets: not offered",
            )
        kind = catalog.declared_kind(cfg.data.name, cfg.data.source, cfg.data.columns)
        if cfg.model.family == "hf_causal_lm" and kind not in ("text", None):
            raise ConfigError(
                "data.name",
                cfg.data.name,
                f"interlocking trains a causal LM on plain text: {catalog.FAMILY_DATA['text']}",
            )
        arch = cfg.model.timm_arch or ASSET_TIMM_ARCH.get(cfg.model.name, cfg.model.name)
        if cfg.model.family == "timm" and not any(kind in arch for kind in ("resnet", "efficientnet", "mobilenet")):
            raise ConfigError(
                "model.name",
                cfg.model.name,
                "interlocking splits timm ResNets and EfficientNet/MobileNet models (e.g. resnet18)",
            )
        if cfg.model.family == "hf_causal_lm" and cfg.model.lora is not None:
            raise ConfigError(
                "model.lora",
                dataclasses.asdict(cfg.model.lora),
                "interlocking splits a causal LM's own "
                "decoder layers, not adapters wrapped around them: train it without LoRA "
                "(model.lora: null)",
            )

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None:
        return "interlocking splits the model into its stages on the driver"

    @staticmethod
    def check(ctx: RunContext) -> None:
        """The options against the loaded model and data: how many units (stem + blocks, or decoder
        layers) the model has and how many test rows time a measured split are known only now."""
        cfg, opts, family = ctx.cfg, Interlocking.opts(ctx.cfg), ctx.spec.family
        if family == "timm" and not is_timm_cnn(ctx.architecture):
            raise ConfigError(
                "model.name",
                cfg.model.name,
                "has neither ResNet layers (layer1..4) nor conv_stem + "
                "blocks: interlocking splits timm ResNets and EfficientNet/MobileNet models "
                "(e.g. resnet18)",
            )
        if family == "hf_causal_lm" and not is_hf_decoder(ctx.architecture):
            field = "model.path" if cfg.model.path else "model.name"
            raise ConfigError(
                field,
                getattr(cfg.model, field[6:]),
                "is not a Llama-style decoder (model.embed_tokens, "
                "layers, norm, rotary_emb and lm_head): interlocking splits those",
            )
        units, what = model_units(ctx.architecture, family), "stem + blocks" if family == "timm" else "decoder layers"
        if opts.split is not None and sum(opts.split) != units:
            raise ConfigError(
                "interlocking.split",
                opts.split,
                f"must add up to the model's {units} units ({what}), one entry per stage",
            )
        if opts.stages > units:
            raise ConfigError("interlocking.stages", opts.stages, f"the model has only {units} units ({what}) to split")
        micro, test = cfg.optim.batch_size // opts.micro_batches, num_examples(ctx.data.eval_sets["test"])
        if opts.balance == "measured" and opts.split is None and test < micro:
            raise ConfigError(
                "interlocking.balance",
                opts.balance,
                f"times a micro-batch ({micro} rows) of the test "
                f"set, which has {test}: raise data.test_size, or use blocks or params",
            )

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts, family, clock = ctx.cfg, Interlocking.opts(ctx.cfg), ctx.spec.family, TrainClock()
        torch.manual_seed(cfg.seed)
        K = opts.stages
        model = copy.deepcopy(ctx.load_driver_weights()).float().train()  # the driver's copy: final weights land in it
        untied = family == "hf_causal_lm" and untie_lm_head(model)
        task = ctx.data.task  # one stream of batches from one source: stage 0 reads the training rows
        source = Source(
            "image" if family == "timm" else "tokens",
            None,
            ctx.eval_sets(),
            cfg.optim.batch_size,
            cfg.seed,
            task.image_size,
            cfg.eval_rows,
            task.mean,
            task.std,
        )
        balance = opts.balance  # measured: timed on a micro-batch of the test set (the driver holds no training row)
        if opts.balance == "measured" and opts.split is None:
            size = cfg.optim.batch_size // opts.micro_batches
            x = make_task(task).inputs(batch_at(ctx.data.eval_sets["test"], 0, size, cfg.seed))
            balance = measure_balance(model, family, x, ctx.spec.num_classes, opts.aux_widths, cfg.nodes.cpus)
        modules = split_model(model, family, K, balance, opts.split)
        heads = aux_heads(
            model,
            modules,
            family,
            ctx.spec.num_classes,
            opts.aux_widths,
            opts.aux_init_from_lm_head,
            opts.aux_positions,
            cfg.seed,
        )
        with (
            NodeGroup(StageActor, cfg, Ledger(), bundles=self.bundles(cfg)) as group,
            group.stop_on_death("interlocking stage", "each stage holds layers no other has"),
        ):
            self._load(group, modules, heads, source, ctx.data.train, cfg, ctx.spec)
            trained, stage_losses, busy, curve = self._train(ctx, group, source)
            per_set, eval_bytes = evaluate_chained(
                group.handles(), source.eval_sets, cfg.eval_rows, group.fetch, LOSS_OF_FAMILY[family]
            )
            group.ledger.record("final", "eval_activations", eval_bytes)
            fetched_eval = {key: getattr(group.fetch, key) - trained["fetched"][key] for key in ("bytes", "tensors")}
            infos = group.call("info", phase="final", what="stage_info")
            for module, (state, _) in zip(modules, group.call("state", phase="final", what="stage_weights")):
                module.load_state_dict(state)
        train_s, batches = trained["train_s"], trained["batches"]
        details = {
            "stages": K,
            "n": opts.width,
            "rule": opts.rule,
            "micro_batches": opts.micro_batches,
            "stage_batches": opts.max_batches_ahead if opts.overlap else 1,
            "micro_batch_size": cfg.optim.batch_size // opts.micro_batches,
            "balance": opts.balance,
            "units_per_stage": units_per_stage(modules, family),
            "batches": batches,
            "step_time_s": train_s / batches if batches else None,
            **(
                {  # it stops submitting at the budget; the batches in flight then finish
                    "budget": {
                        **budget_details(cfg.optim.budget_s, trained["stopped_at_s"], batches, trained["last_step_s"]),
                        "train_s_with_batches_in_flight": train_s,
                    }
                }
                if cfg.optim.budget_s is not None and "stopped_at_s" in trained
                else {}
            ),
            "steady_step_time_s": max(
                (i["median_step_interval_s"] for i in infos if i["median_step_interval_s"] is not None), default=None
            ),
            "busy_fraction": [b / train_s for b in busy] if train_s > 0 else None,
            "heads": {
                name: {f"head{k}" + ("_final" if k == K - 1 else "_aux"): m for k, m in enumerate(heads_m)}
                for name, heads_m in per_set.items()
            },
            "train_head_loss_last": [v[-1] if v else None for v in stage_losses],
            "driver_fetched": {"train": trained["fetched"], "eval": fetched_eval},
            "lm_head_untied": untied,
            **({"measured_costs_s": asdict(balance)} if balance != opts.balance else {}),
        }
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
            weights=state_dict_of(model),
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
        K, actors, ledger = opts.stages, group.handles(), group.ledger
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
        stage_losses, busy, curve = [[] for _ in range(K)], [0.0] * K, []

        def absorb(batch_reports: list[dict]) -> None:
            for r in batch_reports:
                k = r["stage"]
                if r["losses"]:
                    stage_losses[k].append(sum(r["losses"]) / len(r["losses"]))
                busy[k] += r["busy_s"]
                for what, size in ((what, size) for what, sizes in r["sent"].items() for size in sizes):
                    ledger.record("train", what, size)
            ctx.report(
                {
                    "step": len(stage_losses[K - 1]),
                    "steps": steps,
                    "bytes": ledger.total_bytes,
                    **({"train_loss": stage_losses[K - 1][-1]} if stage_losses[K - 1] else {}),
                }
            )

        def evaluate(batch: int, train_s: float) -> None:
            per_set, sent = evaluate_chained(
                actors, ctx.eval_sets(val=False), cfg.eval_rows, group.fetch, LOSS_OF_FAMILY[ctx.spec.family]
            )
            ledger.record("final", "curve_eval_activations", sent)  # measurement: not in the point's bytes
            sent_so_far = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
            curve.append(
                curve_point(batch, train_s, batch * cfg.optim.batch_size, sent_so_far, final_head_metrics(per_set))
            )

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
            absorb,
            frozenset(eval_points(cfg, steps)),
            evaluate,
            opts.max_batches_ahead if opts.overlap else 1,
        )
        for k in (k for k in range(K) if stage_losses[k]):
            logger.info(
                "[interlocking] stage %d head loss: first %.4f last %.4f", k, stage_losses[k][0], stage_losses[k][-1]
            )
        trained["fetched"] = {"bytes": group.fetch.bytes, "tensors": group.fetch.tensors}
        return trained, stage_losses, busy, curve
