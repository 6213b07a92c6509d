"""A run: build the model and data once, run each strategy on them, write the records."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml

from raylowcomm.config import ConfigError, RunConfig, yaml_problem
from raylowcomm.config.checks import check_seed, check_storage
from raylowcomm.data import describe_data, prepare_data
from raylowcomm.env import quiet_loaders, set_hub_defaults
from raylowcomm.execution import check_placement, resolve_hosts
from raylowcomm.finetune import ModelRecipe, load_pretrained
from raylowcomm.models import image_preprocessing
from raylowcomm.progress import LiveProgress, ProgressView
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
    recipe = ModelRecipe(cfg.model, plan.num_classes, cfg.seed) if on_nodes else None
    t2 = time.perf_counter()
    data = prepare_data(cfg, tokenizer, image_preprocessing(model), plan)
    timings.update(model_load_s=round(t2 - t1, 3), data_load_s=round(time.perf_counter() - t2 + t1 - t0, 3))
    sizes = data.train.sizes(cfg.nodes.count)  # None with node_files: the nodes know theirs
    if sizes:
        total_steps(cfg.optim, min(sizes))  # batch size vs shard size, checked now
    ctx = RunContext(cfg, model, spec, data, out_dir, storage=storage, resume=resume, recipe=recipe)
    for name in cfg.strategies:
        STRATEGIES[name].check(ctx)  # options the loaded model or data cannot take
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return ctx


def check_resumable(cfg: RunConfig, out_dir: str | Path) -> None:
    """A run can be resumed from `out_dir` only with the config it was started with."""
    saved = Path(out_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError("--resume", str(out_dir), "holds no run (no config.yaml): give the folder a run wrote")
    before, now = _saved_config(saved), yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    before.pop("out_dir", None), now.pop("out_dir", None)  # OUT itself, however the first run spelled it
    changed = sorted(_differences(before, now))
    if changed:
        raise ConfigError(
            "--resume",
            str(out_dir),
            f"the run there had other settings ({', '.join(changed[:5])}): resume with the config it was started with",
        )


def _saved_config(saved: Path) -> dict:
    """The config a run wrote to OUT/config.yaml; a damaged one (truncated, not YAML, not a mapping)
    is a ConfigError naming the file and, for bad YAML, the line, not a parser's traceback."""
    try:
        before = yaml.safe_load(saved.read_text())
        problem = "is empty" if before is None else "holds no config mapping"
    except yaml.YAMLError as err:
        before, problem = None, yaml_problem(err)
    except (UnicodeDecodeError, OSError) as err:
        before, problem = None, f"cannot be read ({err})"
    if not isinstance(before, dict):
        raise ConfigError("--resume", str(saved), f"{problem}: the run's saved config is damaged; copy the config "
                                                  "the run was started with over it, or start afresh in a new folder")
    return before


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if a != b else []


def finished_records(out_dir: Path) -> dict[str, dict]:
    """The strategies a stopped run finished (results.json), by name: a resumed run keeps them."""
    path = out_dir / "results.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    return {r["strategy"]: r for r in records if "error" not in r}


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
        ctx.live = live
        shown = _ShownProgress(board, ProgressView(bar), live, progress, out, timings)
        records = run_strategies(ctx, StrategyHooks(shown.report_to, shown.finished), kept)
    logger.info("%s", format_table(records))
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


def seed_config(cfg: RunConfig, seed: int, out_dir: str | Path) -> RunConfig:
    """`cfg` for one seed of a multi-seed run: only `seed` changes (the test, val and training rows
    stay those of data.shuffle_seed); it writes into OUT/seed_<seed>, its state under `storage`
    in seed_<seed> too, so seeds never share a checkpoint."""
    one = copy.deepcopy(cfg)
    one.seed, one.out_dir = seed, str(Path(out_dir) / f"seed_{seed}")
    if one.storage:
        one.storage = f"{one.storage.rstrip('/')}/seed_{seed}"
    return one


def check_seeds_resumable(cfg: RunConfig, seeds: list[int], out_dir: str | Path) -> None:
    """`--resume OUT --seeds ...`: OUT must hold a multi-seed run, and each seed folder that holds a
    run must have been started with this config (the others start afresh)."""
    started = [s for s in seeds if (Path(out_dir) / f"seed_{s}" / "config.yaml").is_file()]
    if not started and not (Path(out_dir) / "seeds.json").is_file():
        raise ConfigError("--resume", str(out_dir), "holds no multi-seed run (no seeds.json, no seed_<s>/config.yaml)")
    for s in started:
        check_resumable(seed_config(cfg, s, out_dir), Path(out_dir) / f"seed_{s}")


def run_seeds(
    cfg: RunConfig,
    seeds: list[int],
    out_dir: str | Path | None = None,
    verbose: bool = False,
    bar: bool | None = None,
    resume: bool = False,
) -> dict:
    """`run` once per seed, into OUT/seed_<s>, then OUT/seeds.json (rewritten after each seed):
    per strategy the mean and 95% interval of every metric, the bytes and the time, and the
    paired difference to DDP (raylowcomm.seedstats.summarize). `resume`: the seeds whose folder
    holds a run continue it (as `run(resume=True)`), the others run afresh. Returns the summary."""
    from raylowcomm.seedstats import format_table as seeds_table
    from raylowcomm.seedstats import summarize

    out = Path(out_dir or cfg.out_dir)
    for seed in seeds:  # all of them before the first runs
        check_seed("seeds", seed)
    if resume:
        check_seeds_resumable(cfg, seeds, out)
    per_seed: dict[int, list[dict]] = {}
    summary: dict = {}
    for i, seed in enumerate(seeds, 1):
        one = seed_config(cfg, seed, out)
        logger.info("##### seed %d (%d of %d): %s #####", seed, i, len(seeds), one.out_dir)
        again = resume and (Path(one.out_dir) / "config.yaml").is_file()
        per_seed[seed] = run(one, verbose=verbose, bar=bar, resume=again)
        summary = {**summarize(per_seed), "planned": list(seeds), "dirs": {s: f"seed_{s}" for s in per_seed},
                   "config": {**cfg.to_dict(), "seed": None, "out_dir": str(out)}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "seeds.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info("\n%s", seeds_table(summary))
    logger.info("seeds: %s; again: raylowcomm report %s", out / "seeds.json", out)
    return summary


class _ShownProgress:
    """A run's view of its strategies: each report goes to TensorBoard, the progress view and the
    caller's `progress`, one at a time (the strategy's thread and the live view's both report);
    each record to TensorBoard and timings.json."""

    def __init__(
        self,
        board: TensorBoardLog,
        view: ProgressView,
        live: LiveProgress,
        progress: Callable[[str, dict], None] | None,
        out: Path,
        timings: dict,
    ) -> None:
        self.board, self.view, self.live, self.progress = board, view, live, progress
        self.out, self.timings, self.lock = out, timings, threading.Lock()

    def report_to(self, name: str) -> Callable[[dict], None]:
        def report(metrics: dict) -> None:
            with self.lock:
                self.board.progress(name, metrics)
                self.view.update(name, metrics)
                if self.progress is not None:
                    self.progress(name, metrics)

        self.live.follow(report)
        return report

    def finished(self, name: str, record: dict) -> None:
        if "error" not in record:
            record["details"].update(self.live.details())
        with self.lock:
            self.view.close()
        self.board.record(record)
        self.timings[name] = strategy_timing(record)
        (self.out / "timings.json").write_text(json.dumps(self.timings, indent=2))


@dataclass
class StrategyHooks:
    """What a caller of `run_strategies` does around each strategy: the CLI's run (progress view,
    TensorBoard, timings) and a Tune trial (reports to Tune) differ here and nowhere else."""

    report_to: Callable[[str], Callable[[dict], None]]
    """Strategy name -> the `ctx.report` it calls with its progress metrics."""
    finished: Callable[[str, dict], None]
    """Called with each record that ran (a failed one included) before results.json is rewritten."""


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
            ctx.report = hooks.report_to(name)
            records.append(_run_one(ctx, name))
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
        return {"strategy": name, "error": error, "wall_s": round(time.time() - started, 3)}


def failure_message(err: BaseException) -> str:
    """ "<Type>: <message>" of the exception an actor or worker raised itself, where Ray wraps it: a
    Ray Train rank's own failure, a task's cause, or the cause of an actor's failed creation."""
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


def check_cluster_fits(
    cfg: RunConfig, demands: dict[str, list[dict]] | None = None, groups: list[list[dict]] | None = None
) -> None:
    """Every strategy's actors must fit the cluster: on the local Ray, which cannot grow, asking
    for more CPUs, GPUs or custom resources than it has stops the run now (ConfigError naming the
    field) instead of waiting forever; on a joined cluster, which may autoscale, it is a warning,
    and the actor layer says what it waits for while it waits, unless no node has the resource
    at all (a GPU run on a CPU-only cluster): that stops too, unless nodes.wait_for_resources.
    `demands`: what must fit at once, by who asks (default: each strategy's own bundles; a sweep
    passes a trial's whole reservation); `groups`: the placement groups those bundles start in,
    each placed by nodes.placement on its own (default: one per demand; a trial's Ray Train run
    has a group of its own beside the trial's)."""
    import os

    capacity = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    total = ray.cluster_resources()
    node_ids = resolve_hosts(cfg.nodes.hosts)  # a host no live node has stops the run now
    if demands is None:
        demands = {
            name: STRATEGIES[name].bundles(cfg) + STRATEGIES[name].external_bundles(cfg) for name in cfg.strategies
        }
    for bundles in groups or demands.values():  # STRICT_SPREAD over too few nodes, too much pinned to one
        check_placement(bundles, cfg.nodes.placement, node_ids if len(bundles) == len(node_ids or ()) else None,
                        local=not os.environ.get("RAY_ADDRESS"))
    for name, bundles in demands.items():
        for key in sorted({k for b in bundles for k in b}):
            need, each, have = (
                sum(b.get(key, 0) for b in bundles),
                max(b.get(key, 0) for b in bundles),
                total.get(key, 0),
            )
            largest = max((n.get(key, 0) for n in capacity), default=0)
            if need <= have and each <= largest:
                continue
            field, value = _resource_field(cfg, name, key, too_big_each=each > largest)
            has = (
                f"has {have:g} {key}, at most {largest:g} on one node"
                if have
                else f"has no {key} on any node (set nodes.wait_for_resources if an autoscaler adds them)"
            )
            message = (
                f"{name} starts {len(bundles)} actors needing {need:g} {key} in all ({each:g} each), but the cluster "
                f"{has}: lower {field} or add nodes"
            )
            if os.environ.get("RAY_ADDRESS") and (have or cfg.nodes.wait_for_resources):
                logger.warning("%s; waiting for the cluster to grow", message)
            else:
                raise ConfigError(field, value, message)


def _resource_field(cfg: RunConfig, who: str, key: str, too_big_each: bool) -> tuple[str, object]:
    """The config field to change: what one actor asks for when no node can hold it, else how many
    actors (the strategy's own count field; nodes.count for a sweep's trial)."""
    if too_big_each:
        if key in ("CPU", "GPU"):
            return f"nodes.{key.lower()}s", getattr(cfg.nodes, f"{key.lower()}s")
        return f"nodes.resources.{key}", cfg.nodes.resources.get(key)
    if who in STRATEGIES:
        return STRATEGIES[who].count_field, STRATEGIES[who].count(cfg)
    return "nodes.count", cfg.nodes.count


def strategy_timing(record: dict) -> dict:
    """Where a strategy's wall time went: training (the strategy's own train_s, evaluation left
    out) and the rest (actors and data out, evaluation, collecting the result), and the parts the
    strategy timed itself (details.phases_s: starting actors, evaluating, collecting, saving)."""
    wall, train = record["wall_s"], record.get("train_s")
    return {
        "wall_s": wall,
        "train_s": train,
        "setup_eval_collect_s": round(wall - train, 3) if train is not None else None,
        "phases_s": record.get("details", {}).get("phases_s", {}),
    }


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def format_table(records: list[dict]) -> str:
    cols = [
        "strategy",
        "id",
        "shift",
        "setup MB",
        "train MB",
        "final MB",
        "total MB",
        "wall s",
        "samples/s",
        "peak RSS MB",
    ]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["strategy"], "FAILED: " + r["error"].partition("\n")[0][:60]] + [""] * (len(cols) - 2))
            continue
        m, c = r["metrics"], r["comm"]["by_phase"]
        key = "accuracy" if "id_accuracy" in m else "loss"
        rows.append(
            [
                r["strategy"],
                f"{m[f'id_{key}']:.4f}",
                f"{m[f'shift_{key}']:.4f}" if f"shift_{key}" in m else "-",
                _mb(c["setup"]),
                _mb(c["train"]),
                _mb(c["final"]),
                _mb(r["comm"]["total_bytes"]),
                f"{r['wall_s']:.1f}",
                f"{r['samples_per_s']:.1f}" if r["samples_per_s"] else "-",
                _mb(r["peak_rss_bytes"]),
            ]
        )
        for node in r.get("nodes") or []:
            if "metrics" in node:
                nm = node["metrics"]
                rows.append(
                    [
                        f"  node {node['node']}",
                        f"{nm[f'id_{key}']:.4f}",
                        f"{nm[f'shift_{key}']:.4f}" if f"shift_{key}" in nm else "-",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        _mb(node["peak_rss_bytes"]),
                    ]
                )
        rows += [row + [""] * (len(cols) - len(row)) for row in STRATEGIES[r["strategy"]].table_rows(r, key)]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [cols] + rows]
    scored = [r["metrics"] for r in records if "metrics" in r]  # none when every strategy failed: no metric to name
    metric = "accuracy" if any("id_accuracy" in m for m in scored) else "loss"
    return (f"\n(id/shift = {metric})" if scored else "") + "\n" + "\n".join(lines)
