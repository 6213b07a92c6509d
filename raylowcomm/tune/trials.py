"""Running a sweep: one Tune function trainable per trial, each reserving a placement group for
its strategies' actors, and the summary of what the trials reported."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from raylowcomm.config import RunConfig
from raylowcomm.strategies import STRATEGIES, from_dict
from raylowcomm.tune.summary import plot_sweep
from raylowcomm.tune.sweep import TRIAL_DRIVER_BUNDLE, Sweep, SweepConfig, SweepError, with_values


def trial_bundles(cfg: RunConfig) -> tuple[list[dict], list[dict]]:
    """(the trial's reservation, what its strategies reserve outside it). Strategies run one
    after another, so the reservation is the largest of theirs (all default ones share a shape)."""
    inside = [STRATEGIES[s].bundles(cfg) for s in cfg.strategies]
    outside = [STRATEGIES[s].external_bundles(cfg) for s in cfg.strategies]
    largest = max(inside, key=_cpus)
    for other in inside:
        if any(b not in largest for b in other):  # shapes differ: reserve all of them
            largest = [b for bundles in inside for b in bundles]
            break
    return [dict(TRIAL_DRIVER_BUNDLE)] + largest, max(outside, key=_cpus)


def _cpus(bundles: list[dict]) -> float:
    return sum(b.get("CPU", 0) for b in bundles)


def _search_space(spec: SweepConfig) -> dict:
    from ray import tune

    make = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": lambda v: tune.uniform(*v),
        "loguniform": lambda v: tune.loguniform(*v),
    }
    return {key: make[kind](values) for key, s in spec.space.items() for kind, values in s.items()}


class TrialFailed(RuntimeError):
    """A strategy of the trial failed: Tune marks the trial as errored, after the trial ran and
    reported the others and wrote every record (the failed one's error included)."""


def _trial(config: dict, raw: dict, experiment_dir: str) -> None:
    """One trial: the base config with this trial's values, its strategies one after another in
    the run's own loop (`runner.run_strategies`), progress and final metrics reported to Tune,
    the run written to TRIAL/run."""
    import ray
    from ray import tune

    from raylowcomm.runner import StrategyHooks, prepare, run_strategies

    cfg = from_dict(with_values(raw, config))
    ctx = prepare(cfg, Path(experiment_dir) / Path(tune.get_context().get_trial_dir()).name / "run")
    pg = ray.util.get_current_placement_group()
    latest: dict[str, Any] = {"placement_group": pg.id.hex() if pg else None}

    def prefix(name: str) -> str:
        return f"{name}/" if len(cfg.strategies) > 1 else ""

    def report(name: str, metrics: dict) -> None:
        # Every result carries every metric seen so far: Tune and ASHA check each one for theirs.
        latest.update({prefix(name) + k: v for k, v in metrics.items()})
        tune.report(dict(latest))

    def finished(name: str, record: dict) -> None:
        if "error" not in record:
            nodes = {n["ray_node_id"] for n in record["nodes"] if "ray_node_id" in n}
            report(
                name,
                {
                    **record["metrics"],
                    "total_bytes": record["comm"]["total_bytes"],
                    "wall_s": record["wall_s"],
                    "ray_nodes_used": len(nodes),
                },
            )

    records = run_strategies(ctx, StrategyHooks(lambda name: lambda metrics: report(name, metrics), finished))
    failed = [f"{r['strategy']}: {r['error']}" for r in records if "error" in r]
    if failed:
        raise TrialFailed("; ".join(failed))


def run_sweep(sweep: Sweep, storage_path: str | None = None) -> dict:
    """Run the trials; write summary.json and sweep.png and return the summary (the CLI prints
    `format_trials` of it and the best config)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raylowcomm.runtime import init_ray

    spec = sweep.spec
    init_ray()
    max_concurrent = _concurrency(sweep)
    name = spec.name or f"{sweep.path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = Path(storage_path or spec.storage_path).resolve()

    def reservation(config: dict):
        cfg = from_dict(with_values(sweep.raw, config))
        return tune.PlacementGroupFactory(trial_bundles(cfg)[0], strategy=cfg.nodes.placement)

    trainable = tune.with_resources(
        tune.with_parameters(_trial, raw=sweep.raw, experiment_dir=str(storage / name)), reservation
    )
    scheduler = None
    if spec.asha:
        a = spec.asha
        scheduler = ASHAScheduler(
            metric=a.metric,
            mode=a.mode,
            time_attr=a.time_attr,
            grace_period=a.grace_period,
            max_t=a.max_t,
            reduction_factor=a.reduction_factor,
        )
    started = time.time()
    tuner = tune.Tuner(
        trainable,
        param_space=_search_space(spec),
        tune_config=tune.TuneConfig(
            num_samples=spec.num_samples, max_concurrent_trials=max_concurrent, scheduler=scheduler
        ),
        run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=1),
    )
    grid = tuner.fit()
    return _summarise(sweep, grid, time.time() - started)


def _concurrency(sweep: Sweep) -> int | None:
    """The biggest trial must fit the cluster (`capacity.check_cluster_fits`, as a run's strategies
    must); with Ray Train reserving outside the trials, at most as many trials as leave it room."""
    import ray

    from raylowcomm.capacity import check_cluster_fits

    configs = [from_dict(with_values(sweep.raw, {k: v})) for k, values in sweep.samples.items() for v in values]
    cfg = max(configs, key=lambda c: sum(_cpus(b) for b in trial_bundles(c)))
    inside, outside = trial_bundles(cfg)
    check_cluster_fits(cfg, {"a trial": inside + outside}, groups=[inside, outside] if outside else [inside])
    need, cluster = _cpus(inside) + _cpus(outside), ray.cluster_resources().get("CPU", 0)
    if _cpus(outside) and need:  # Ray Train reserves outside the trials: leave it room
        fit = max(1, int(cluster // need))
        return min(sweep.spec.max_concurrent or fit, fit)
    return sweep.spec.max_concurrent


def _summarise(sweep: Sweep, grid, wall_s: float) -> dict:
    """summary.json and sweep.png in the experiment folder, from Tune's results."""
    spec = sweep.spec
    trials = []
    for result in grid:
        metrics = result.metrics or {}
        status = "error" if result.error else ("done" if spec.metric in metrics else "stopped early")
        trials.append(
            {
                "trial": metrics.get("trial_id") or Path(result.path).name,
                "values": {k: result.config[k] for k in spec.space},
                "metric": metrics.get(spec.metric),
                "columns": {c: metrics.get(c) for c in spec.columns},
                "status": status,
                "iterations": metrics.get("training_iteration"),
                "error": str(result.error).splitlines()[0] if result.error else None,
                "path": result.path,
            }
        )
    scored = [t for t in trials if t["metric"] is not None]
    if not scored:
        seen = sorted({k for r in grid for k in (r.metrics or {})})
        raise SweepError(
            f"no trial reported metric {spec.metric!r}; reported: {', '.join(seen) or 'nothing (all failed)'}"
        )
    best = (max if spec.mode == "max" else min)(scored, key=lambda t: t["metric"])
    experiment = Path(grid.experiment_path)
    summary = {
        "metric": spec.metric,
        "mode": spec.mode,
        "best": best,
        "trials": trials,
        "wall_s": round(wall_s, 1),
        "experiment": str(experiment),
    }
    (experiment / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["plot"] = str(plot_sweep(sweep, trials, experiment / "sweep.png"))
    return summary
