"""A run: build the model and data once, run each strategy on them, write the records."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml

from raylowcomm.capacity import check_cluster_fits
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.config.checks import check_storage
from raylowcomm.data import describe_data, prepare_data
from raylowcomm.env import quiet_loaders, set_hub_defaults
from raylowcomm.failures import NodeFailed
from raylowcomm.finetune import ModelRecipe, load_pretrained
from raylowcomm.model_overrides import check_overrides
from raylowcomm.models import image_preprocessing
from raylowcomm.progress import LiveProgress, ProgressView
from raylowcomm.results_table import format_results_table
from raylowcomm.resume import finished_records
from raylowcomm.run_progress import RunProgress
from raylowcomm.runtime import init_ray
from raylowcomm.strategies import STRATEGIES, nodes_may_load
from raylowcomm.strategies.base import RunContext
from raylowcomm.tensorboard import TensorBoardLog
from raylowcomm.training import total_steps

logger = logging.getLogger("raylowcomm")


def prepare(cfg: RunConfig, out_dir: Path, timings: dict | None = None, resume: bool = False) -> RunContext:
    """Everything that can fail on bad input happens here, before any actor starts; `timings`
    gets the seconds spent loading the model and the data (asset materialisation included)."""
    timings = {} if timings is None else timings
    storage = check_storage(cfg, out_dir)  # written once now: storage that cannot be written stops the run here
    t0 = time.perf_counter()
    plan = describe_data(cfg)  # the data's columns, classes and task: bad input stops here, before the model loads
    t1 = time.perf_counter()
    on_nodes = nodes_may_load(cfg)  # the driver plans with the architecture alone (on the meta device)
    model, spec, tokenizer = load_pretrained(cfg.model, plan.num_classes, cfg.seed, meta=on_nodes)
    check_overrides(cfg, spec.hf_config, tokenizer, plan.num_classes, plan.columns)  # not a stage's IndexError later
    recipe = ModelRecipe(cfg.model, plan.num_classes, cfg.seed) if on_nodes else None
    t2 = time.perf_counter()
    data = prepare_data(cfg, tokenizer, image_preprocessing(model), plan)
    timings.update(model_load_s=round(t2 - t1, 3), data_load_s=round(time.perf_counter() - t2 + t1 - t0, 3))
    sizes = data.train.sizes(cfg.nodes.count)  # None with node_files: the nodes know theirs
    if sizes:
        total_steps(cfg.optim, min(sizes))  # batch size vs shard size, checked now
    ctx = RunContext(cfg, model, spec, data, out_dir, storage=storage, resume=resume, recipe=recipe)
    given = cfg.to_dict()  # as the user wrote it: a check may resolve settings (lofi.dial: auto) into ctx.cfg
    for name in cfg.strategies:
        STRATEGIES[name].check(ctx)  # options the loaded model or data cannot take
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(given, sort_keys=False))  # what --resume compares with
    return ctx


def run(
    cfg: RunConfig,
    out_dir: str | Path | None = None,
    progress: Callable[[str, dict], None] | None = None,
    verbose: bool = False,
    bar: bool | None = None,
    resume: bool = False,
) -> list[dict]:
    """Run every strategy of `cfg` and return their records (what results.json holds); the file
    is rewritten after each strategy, so none is lost. `progress(strategy, metrics)` sees what
    the strategies report while they train (step, steps planned, train_loss, bytes, evaluations),
    one call at a time: the live view's thread calls it too, between the strategy's own reports;
    what it raises from the strategy's report ends that strategy, from the live view's is logged;
    `verbose` shows what actors, Ray and the model and data loaders print; `bar`: a progress bar
    (default: on a terminal); `resume`: keep the strategies the run in `out_dir` finished and
    continue the others from their checkpoints in storage."""
    set_hub_defaults()
    if not verbose:
        quiet_loaders(hf_model=cfg.model.family != "timm")
    out, timings = Path(out_dir or cfg.out_dir), {}
    kept = finished_records(out) if resume else {}
    ctx = prepare(cfg, out, timings, resume=resume)
    t0 = time.perf_counter()
    init_ray(verbose=verbose)
    timings["ray_start_s"] = round(time.perf_counter() - t0, 3)
    check_cluster_fits(cfg)
    with TensorBoardLog(out) as board, LiveProgress() as live:
        shown = RunProgress(board, ProgressView(bar), live, progress, out, timings)
        records = run_strategies(ctx, StrategyHooks(shown.report_to, shown.finished, live), kept)
    logger.info("%s", format_results_table(records))
    logger.info(
        "time: %s",
        ", ".join(
            f"{k} {v}"
            if not isinstance(v, dict)
            else f"{k} {v['wall_s']:.1f} s (training {v.get('train_s') or 0:.1f} s)"
            for k, v in timings.items()
        ),
    )
    logger.info("results: %s; curves: tensorboard --logdir %s", out / "results.json", out / "tensorboard")
    return records


@dataclass
class StrategyHooks:
    """What a caller of `run_strategies` does around each strategy: the CLI's run (progress view,
    TensorBoard, timings) and a Tune trial (reports to Tune) differ here and nowhere else."""

    report_to: Callable[[str], Callable[[dict], None]]
    """Strategy name -> the `ctx.report` it calls with its progress metrics."""
    finished: Callable[[str, dict], None]
    """Called with each record that ran (a failed one included) before results.json is rewritten."""
    live: Any = None
    """Where the strategies' workers post their progress (`RunContext.live`); None: the context's own."""


def run_strategies(ctx: RunContext, hooks: StrategyHooks, kept: dict[str, dict] | None = None) -> list[dict]:
    """The one loop over a run's strategies, for `raylowcomm run` and a Tune trial alike: each
    strategy in turn on the same context; a failure is that strategy's record (its actors are
    released) and the next one runs; results.json is rewritten after each, so none is lost;
    `kept` (a resumed run's finished records) are written again, not run."""
    records: list[dict] = []
    for name in ctx.cfg.strategies:
        if kept and name in kept:
            logger.info("=== %s: finished before, kept ===", name)
            records.append(kept[name])
        else:
            logger.info("=== %s ===", name)
            records.append(_run_one(ctx.for_strategy(hooks.report_to(name), hooks.live), name))
            hooks.finished(name, records[-1])
        _write_records(ctx, records)
    return records


def _run_one(ctx: RunContext, name: str) -> dict:
    started = time.time()
    try:
        return STRATEGIES[name]().run(ctx).to_dict()
    except Exception as err:  # one strategy failing must not lose the others' results; its actors are gone
        error = failure_message(err)
        if error.startswith(f"{ConfigError.__name__}: "):  # the user's data, found on a node: no stack to read
            logger.error("%s failed; its actors were released: %s", name, error)
        else:
            logger.exception("%s failed; its actors were released", name)
        failure = getattr(err, "failure", None)  # the node's or stage's own (failures.NodeFailed), where known
        return {
            "strategy": name,
            "error": error,
            **({"failure": failure} if failure else {}),
            "wall_s": round(time.time() - started, 3),
        }


def failure_message(err: BaseException) -> str:
    """ "<Type>: <message>" of the exception an actor or worker raised itself, where Ray wraps it: a
    Ray Train rank's own failure, a task's cause, or the cause of an actor's failed creation; a node's
    or stage's own exception as the driver raised it again (`NodeFailed`: cause first, then who)."""
    if isinstance(err, NodeFailed):
        return str(err)
    failures = getattr(err, "worker_failures", None)  # ray.train.WorkerGroupError: rank -> its exception
    if failures:
        err = failures[min(failures)]
    if (
        isinstance(err, ray.exceptions.RayActorError)
        and err.args
        and isinstance(err.args[0], ray.exceptions.RayTaskError)
    ):
        err = err.args[0]  # ActorDiedError(cause): the creation task's error
    if isinstance(err, ray.exceptions.RayTaskError):
        err = err.cause
    return f"{type(err).__name__}: {err}"


def _write_records(ctx: RunContext, records: list[dict]) -> None:
    """results.json in OUT and in storage, rewritten after every strategy, kept ones included."""
    (ctx.out_dir / "results.json").write_text(json.dumps(records, indent=2, default=str))
    ctx.storage.write_json("results.json", records)
