"""The one small interface every strategy implements, and what a run hands to it."""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from torch import nn

from raylowcomm.common.batches import Split
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import RunConfig, bad_nodes
from raylowcomm.data import PreparedData
from raylowcomm.execution import churn, hosts_without, node_bundle
from raylowcomm.finetune import FineTune, ModelRecipe, fine_tune_for, on_meta
from raylowcomm.models import ModelSpec, state_dict_of
from raylowcomm.progress import NoLiveProgress
from raylowcomm.storage import Storage
from raylowcomm.training import dedupe_shared

logger = logging.getLogger("raylowcomm")


def _no_report(metrics: dict) -> None:
    """Outside a sweep, progress goes to the log only."""


@dataclass
class DriverHold:
    """What a run's costly calls found, asked once: the model with its weights on the driver, and who
    loads the weights ("nodes" or "driver")."""

    model: nn.Module | None = None
    source: str | None = None


@dataclass
class RunContext:
    """Identical inputs for every strategy of a run: config, pretrained model, data."""

    cfg: RunConfig
    architecture: nn.Module
    """The model as it trains: with its weights, or (`recipe` given) on the meta device, its names,
    shapes and dtypes only, the nodes loading the weights. Strategies plan with it, at no cost;
    `load_driver_weights` has the weights."""
    spec: ModelSpec
    data: PreparedData
    out_dir: Path
    storage: Storage | None = None
    """Where checkpoints, snapshots, logs and final weights live (config `storage`; default OUT/state)."""
    resume: bool = False
    """Continue from what `storage` holds (raylowcomm run --resume) instead of starting afresh."""
    report: Callable[[dict], None] = _no_report
    """Strategies call it with flat numeric progress metrics at each step, round or eval, e.g.
    {"step": 10, "train_loss": 0.3}; a sweep forwards them to Tune (ASHA stops trials on them)
    and reports the record's final metrics itself."""
    live: Any = field(default_factory=NoLiveProgress)
    """Where workers post their step and loss while they train (a progress.LiveProgress in a run,
    so the driver's view moves between calls): strategies hand `live.poster(k)` to worker k and
    call `live.expect(workers, steps)`; elsewhere (a sweep, tests) it gives no poster."""
    recipe: ModelRecipe | None = None
    """How the nodes load the model themselves (model.source); None: only the driver's weights."""
    fine_tune: FineTune = field(init=False)
    """What trains (every weight, or adapters), made once from `spec`: strategies ask it, not the model."""
    held: DriverHold = field(default_factory=DriverHold)
    """What the costly calls found, shared by every strategy's context of the run (`for_strategy`)."""

    def load_driver_weights(self) -> nn.Module:
        """The model with its weights, on the driver. Where the driver held only its plan (the nodes
        load the weights, model.source), this loads them now: gigabytes at 8B, once per run. For a
        strategy's own need of them (`Strategy.driver_weights`), a test, a benchmark."""
        if self.held.model is None:
            if on_meta(self.architecture) and self.recipe is not None:
                logger.info("the driver loads the model's weights itself")
                self.held.model = self.recipe.load()
            else:
                self.held.model = self.architecture
        return self.held.model

    def initial_model(self) -> tuple[str, object]:
        """What the nodes start from, with the ledger's name for it: the recipe by which they load the
        weights themselves ("model_recipe", a few KB) or the driver's weights ("initial_weights"). May
        probe the hosts (`probe_nodes_load_weights`) and load the weights on the driver."""
        if self.recipe is not None and self.probe_nodes_load_weights():
            return "model_recipe", self.recipe
        return "initial_weights", state_dict_of(self.load_driver_weights())

    def probe_nodes_load_weights(self) -> bool:
        """Whether the nodes load the weights themselves: model.source nodes, or auto where every host of
        the cluster can read them, which the first call asks by a zero-CPU Ray task on each host other
        than the driver's (`execution.hosts_without`); later calls answer from that. No recipe: the
        strategy needs the driver's weights (`Strategy.driver_weights`)."""
        if self.recipe is None:
            return False
        if self.held.source is None:
            missing = [] if self.cfg.model.source == "nodes" else hosts_without(self.recipe.readable)
            self.held.source = "driver" if missing else "nodes"
            if missing:
                logger.info(
                    "model.source auto: %s cannot read the weights; the driver loads and sends them", ", ".join(missing)
                )
        return self.held.source == "nodes"

    def for_strategy(self, report: Callable[[dict], None], live: Any = None) -> RunContext:
        """This run's context for one strategy: its own `report` (and `live` view); the config, model,
        data and what the costly calls found shared with the others."""
        return dataclasses.replace(self, report=report, live=self.live if live is None else live)

    def eval_sets(self, val: bool = True) -> dict[str, Split]:
        """The sets the driver holds: test, shift/<name>, and (unless `val` is False) val."""
        return {k: v for k, v in self.data.eval_sets.items() if val or k != "val"}

    def __post_init__(self) -> None:
        if self.storage is None:
            self.storage = Storage(self.out_dir / "state")
        self.fine_tune = fine_tune_for(self.spec)

    def fresh_state(self, name: str) -> None:
        """A new run of strategy `name` starts from nothing; a resumed one keeps what storage holds."""
        if not self.resume:
            self.storage.delete(name)
        if self.cfg.churn.active:
            churn.mark_start(self.storage, name)


@dataclass
class RunRecord:
    """One strategy's results: what results.json holds per strategy."""

    strategy: str
    metrics: dict[str, float]
    ledger: Ledger
    wall_s: float
    samples_seen: int
    train_s: float
    peak_rss_bytes: int
    nodes: list[dict] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    weights_path: str | None = None
    curve: list[dict] = field(default_factory=list)
    """Learning-curve points (see `curve_point`), the final evaluation last."""
    goodput: dict | None = None
    """Useful node-seconds over reserved ones, per node and overall (`common.goodput`)."""

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "metrics": self.metrics,
            "comm": self.ledger.to_dict(),
            "wall_s": round(self.wall_s, 3),
            "train_s": round(self.train_s, 3),
            "samples_seen": self.samples_seen,
            "samples_per_s": round(self.samples_seen / self.train_s, 3) if self.train_s > 0 else None,
            "peak_rss_bytes": self.peak_rss_bytes,
            "nodes": self.nodes,
            "details": self.details,
            "weights": self.weights_path,
            "curve": self.curve,
            **({"goodput": self.goodput} if self.goodput is not None else {}),
        }


def curve_point(step: int, wall_s: float, samples: int, bytes_sent: int, metrics: dict) -> dict:
    """One point of a learning curve, what the WAN report plots: training wall time so far (time
    spent evaluating left out), training samples seen by all nodes, bytes sent so far in all
    phases (the ledger's total at that point), and the evaluation metrics (id_*, shift_*)."""
    return {"step": step, "wall_s": round(wall_s, 3), "samples": int(samples), "bytes": int(bytes_sent), **metrics}


def eval_points(cfg: RunConfig, steps: int) -> list[int]:
    """The steps before the last at which a strategy evaluates for its curve (cfg.eval_every)."""
    return list(range(cfg.eval_every, steps, cfg.eval_every)) if cfg.eval_every else []


Options = TypeVar("Options")


class Strategy(ABC, Generic[Options]):
    """What the runner, a Tune trial and the cluster check call on every strategy. A subclass is
    `Strategy[ItsConfig]`, sets `name` and `Config` (its YAML section's dataclass, the same
    `ItsConfig`) and implements `run`; it reads its options typed with `opts(cfg)`. The rest has
    defaults that fit a strategy starting `nodes.count` node actors, whose optimizer steps every
    weight it trains."""

    name: ClassVar[str]
    Config: ClassVar[type]
    count_field: ClassVar[str] = "nodes.count"
    """The option that sets how many actors it starts: the field a too-big run is told to lower."""
    elastic_nodes: ClassVar[bool] = False
    """Whether it takes a range of nodes (`nodes.count: [min, max]`), starting with what fits."""
    runs_by_default: ClassVar[bool] = False
    """Whether a config that names no strategies (`strategies: null`) runs it."""
    fp32_updates: ClassVar[bool] = True
    """Its optimizer steps every weight it trains, so full fine-tuning needs fp32 weights (config
    refuses bf16/fp16 weights without LoRA); False where updates are applied alike on every replica."""
    ignores: ClassVar[dict[str, str]] = {}
    """Shared fields (dotted) it cannot honour, each with what it does instead: set in a run of it alone,
    an error; beside a strategy that honours them, one warning line (`config.applicability`)."""
    option_rules: ClassVar[dict] = {}
    """When each field of its `Config` can take effect: a `config.applicability.Rule` per field name
    (entries of a list by the list's name, `join.step`); every field has one (tests/test_applicability.py)."""

    @classmethod
    def opts(cls, cfg: RunConfig) -> Options:
        """This strategy's own options (its YAML section, typed as `Config`)."""
        return cfg.options[cls.name]

    @classmethod
    def count(cls, cfg: RunConfig) -> int:
        """How many actors it starts: the value of `count_field`."""
        return cfg.nodes.count

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        """Raise ConfigError for option combinations this strategy cannot run."""

    @staticmethod
    def driver_weights(cfg: RunConfig) -> str | None:
        """Why this strategy needs the model's weights on the driver (model.source cannot be nodes),
        or None: its nodes may load them themselves."""
        return None

    @staticmethod
    def check(ctx: RunContext) -> None:
        """Raise ConfigError for options the loaded model or data cannot take (e.g. a split into
        more stages than the model has blocks): `prepare` calls it before Ray or any actor starts."""

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """The actors it starts, one bundle each, so a caller (a Tune trial) can reserve them up front."""
        return [node_bundle(cfg)] * cfg.nodes.count

    @staticmethod
    def external_bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """Resources it reserves itself, outside its caller's reservation (Ray Train's own placement
        group for DDP); a sweep limits its concurrency so these fit too."""
        return []

    @staticmethod
    def table_rows(record: dict, metric: str) -> list[list[str]]:
        """Rows of its own under its line of the run's table (e.g. a score without a step the
        strategy takes), as [label, id, shift]."""
        return []

    @abstractmethod
    def run(self, ctx: RunContext) -> RunRecord:
        """Train and score on `ctx`, releasing every actor it started, and return the record."""


def budget_details(budget_s: float, train_s: float, steps: int, last_step_s: float) -> dict:
    """Where a run on a budget (`optim.budget_s`) stopped: at the step whose end reached the budget
    (`train_s` >= budget_s > train_s - last_step_s), or at its cap of steps before it."""
    return {
        "budget_s": budget_s,
        "train_s": train_s,
        "steps": steps,
        "last_step_s": last_step_s,
        "stopped_by": "budget" if train_s >= budget_s else "steps",
    }


def finish_record(
    name: str,
    ctx: RunContext,
    ledger: Ledger,
    clock: TrainClock,
    *,
    metrics: dict,
    step: int,
    samples: int,
    train_s: float,
    infos: list[dict],
    weights: dict | None,
    curve: list[dict] | None = None,
    nodes: list[dict] | None = None,
    details: dict | None = None,
    curve_wall_s: float | None = None,
    final_point: dict | None = None,
    goodput: dict | None = None,
) -> RunRecord:
    """The end every strategy shares, once everything it needed has come back: the curve's last
    point is the final metrics with every byte sent (collecting the result included) at the
    training time (`curve_wall_s` where collecting counts too) with `final_point`'s entries (the
    strategy's own x-axes, such as SPSA's forwards), the weights are saved as
    safetensors (and in the fine-tune's own forms: a LoRA adapter, OUT/<strategy>/adapter; `weights`
    None: a node saved them in storage already), and peak memory is the largest of any actor's."""
    wall_s = train_s if curve_wall_s is None else curve_wall_s
    curve = [*(curve or []), {**curve_point(step, wall_s, samples, ledger.total_bytes, metrics), **(final_point or {})}]
    details = details or {}
    if ctx.cfg.churn.active:
        details["churn"] = churn.booked_events(ctx.storage, name)
    if (bad := bad_nodes.booked(ctx.cfg, name)) is not None:
        details["bad_nodes"] = bad  # which nodes sent a wrong update, and how
    if ctx.data.classes:
        details["classes"] = ctx.data.classes  # class index -> the data's own label name
    params = list(ctx.architecture.parameters())  # what `raylowcomm plan` scales bytes and compute by
    details["model_params"] = sum(p.numel() for p in params)
    details["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    saving = time.perf_counter()
    rel = f"{name}/model.safetensors"
    if weights is not None:  # None: a node saved them there, where the base they need is
        details.update(ctx.fine_tune.save_result(weights, ctx.architecture, ctx.out_dir / name, ctx.cfg.model.merge))
        ctx.storage.save_tensors(rel, dedupe_shared(weights))
    details.setdefault("phases_s", {})["save"] = round(time.perf_counter() - saving, 3)
    weights_path = ctx.storage.uri_of(rel)
    return RunRecord(
        name,
        metrics,
        ledger,
        clock.elapsed(),
        samples,
        train_s,
        max(i["peak_rss_bytes"] for i in infos),
        nodes or [],
        details,
        weights_path,
        curve,
        goodput,
    )
