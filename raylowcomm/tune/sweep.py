"""`raylowcomm tune SWEEP.yaml`: a Ray Tune sweep over any config field.

Each trial is one Tune function trainable that runs the strategies of its config. The trial
reserves, up front, one placement group: an empty bundle for itself plus one bundle per node /
stage actor its strategies start (`strategies.base.actor_bundles`); Ray captures those actors
into it, so trials never compete for half of their actors and a sweep can neither deadlock nor
oversubscribe a small cluster. DDP runs Ray Train, which places its workers in a placement
group of its own (the supported Train-in-Tune pattern); the sweep then caps concurrency so
those fit too.

Sweep file (see tune_configs/):

    base: ../examples/lofi_vs_ddp_mnist.yaml   # run config; relative to this sweep file
    set: {strategies: [lofi], data.train_size: 512}   # fixed overrides, like --set
    space:                                     # dotted config field -> one search space
      nodes.count: {grid: [1, 2]}
      optim.lr: {loguniform: [1.0e-3, 1.0e-1]}  # also: choice: [...], uniform: [lo, hi]
    metric: id_accuracy
    mode: max
    columns: [shift_accuracy, total_bytes]     # optional: more reported metrics in the table
    num_samples: 1                             # repeats of the grid; samples of random spaces
    max_concurrent: null                       # null: as many trials as the cluster fits
    asha: {metric: train_loss, mode: min, grace_period: 1, max_t: 100}   # optional
    storage_path: runs/tune                    # relative to the working directory
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from raylowcomm.config import ConfigError, RunConfig, build_dataclass
from raylowcomm.strategies import from_dict

SPACES = ("grid", "choice", "uniform", "loguniform")
# The driver of a trial waits on its actors most of the time; its bundle holds no CPU so that
# a trial of N one-CPU actors fits on N CPUs.
TRIAL_DRIVER_BUNDLE: dict[str, float] = {}


class SweepError(ValueError):
    """A bad sweep file; the message names the key and what is allowed."""


@dataclass
class AshaConfig:
    metric: str = "train_loss"
    """A progress metric the strategies report while training (ctx.report), e.g. train_loss."""
    mode: Literal["min", "max"] = "min"
    time_attr: str = "training_iteration"
    """What counts as time: Tune's count of reports, or a reported metric such as `step`."""
    grace_period: int = 1
    max_t: int = 100
    reduction_factor: float = 2.0


@dataclass
class SweepConfig:
    base: str
    """The run config the trials start from, relative to the sweep file."""
    space: dict[str, Any]
    metric: str
    mode: Literal["min", "max"]
    set: dict[str, Any] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)
    """More reported metrics shown beside `metric` in the table and summary.json (e.g. both
    strategies' accuracies when a trial runs lofi and ddp)."""
    num_samples: int = 1
    max_concurrent: int | None = None
    asha: AshaConfig | None = None
    storage_path: str = "runs/tune"
    name: str | None = None
    """Experiment folder under storage_path (default: the sweep file's name and a timestamp)."""


@dataclass
class Sweep:
    """A validated sweep: the base config as a raw mapping with the fixed overrides applied."""

    spec: SweepConfig
    raw: dict
    cfg: RunConfig
    samples: dict[str, list]
    """Values per swept key that were checked by building the config (and size the reservation)."""
    path: Path


def _apply(raw: dict, values: dict[str, Any]) -> dict:
    """A copy of `raw` with dotted keys set, e.g. {"optim.lr": 0.01}."""
    raw = copy.deepcopy(raw)
    for dotted, value in values.items():
        node, keys = raw, dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, value, f"'{k}' is not a section")
        node[keys[-1]] = value
    return raw


def _space_samples(key: str, spec: Any) -> tuple[str, list]:
    """The kind of one search space and the values that represent it (all of a grid, both bounds)."""
    where = f"space.{key}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPACES:
        raise SweepError(f"{where}: expected a mapping with one of {', '.join(SPACES)}, e.g. {{grid: [1, 2]}}; got {spec!r}")
    kind, values = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}.{kind}: expected a non-empty list of values; got {values!r}")
        return kind, values
    if (not isinstance(values, list) or len(values) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) or values[0] >= values[1]):
        raise SweepError(f"{where}.{kind}: expected [low, high] with low < high; got {values!r}")
    if kind == "loguniform" and values[0] <= 0:
        raise SweepError(f"{where}.loguniform: bounds must be > 0; got {values!r}")
    return kind, [float(v) for v in values]


def load_sweep(path: str | Path, overrides: list[str] = ()) -> Sweep:
    """Read and check a sweep file; every swept value is tried on the config before Ray starts."""
    from raylowcomm.config import apply_overrides, load_yaml_mapping
    from raylowcomm.strategies import STRATEGIES

    path = Path(path)
    if not path.exists():
        raise SweepError(f"sweep file {path}: no such file")
    try:
        data = load_yaml_mapping(path, "SWEEP")
    except ConfigError as err:  # a folder, unreadable, malformed YAML (with line and column), not a mapping
        raise SweepError(f"sweep file {path}: {err}") from None
    try:
        spec: SweepConfig = build_dataclass(SweepConfig, data, "")
    except (ConfigError, TypeError) as err:
        raise SweepError(f"sweep file {path}: {err}") from None
    if not spec.space:
        raise SweepError(f"sweep file {path}: 'space' is empty; name at least one config field to sweep")
    for k in ("num_samples", "max_concurrent"):
        if getattr(spec, k) is not None and getattr(spec, k) < 1:
            raise SweepError(f"sweep file {path}: {k} = {getattr(spec, k)} must be >= 1")
    base = path.parent / spec.base
    if not base.exists():
        raise SweepError(f"sweep file {path}: base = {spec.base!r}: no such file (paths are relative to the sweep file: {base})")
    try:
        raw = load_yaml_mapping(base, "base")
    except ConfigError as err:
        raise SweepError(f"sweep file {path}: {err}") from None
    try:
        raw = _apply(raw, spec.set)
        raw = apply_overrides(raw, list(overrides))
        cfg = from_dict(raw)
    except ConfigError as err:
        raise SweepError(f"sweep file {path}: base config with 'set' and --set: {err}") from None
    for section in ("model", "data"):  # user paths stay relative to where the sweep was started
        value = raw.get(section, {}).get("path")
        if value is not None:
            raw[section]["path"] = str(Path(value).resolve())

    samples: dict[str, list] = {}
    first = {k: _space_samples(k, v)[1][0] for k, v in spec.space.items()}
    for key, space in spec.space.items():
        section = key.split(".")[0]
        if section in STRATEGIES and section not in cfg.strategies:
            raise SweepError(f"sweep file {path}: space.{key} sweeps options of '{section}', which this sweep does not run "
                             f"(strategies: {cfg.strategies}); set strategies in 'set'")
        _, values = _space_samples(key, space)
        for value in values:
            try:
                from_dict(_apply(raw, {**first, key: value}))
            except ConfigError as err:
                raise SweepError(f"sweep file {path}: space.{key} value {value!r}: {err}") from None
        samples[key] = values

    prefixes = [f"{s}/" for s in cfg.strategies] if len(cfg.strategies) > 1 else [""]
    named = [("metric", spec.metric)] + [(f"columns[{i}]", c) for i, c in enumerate(spec.columns)]
    for where, metric in named + ([("asha.metric", spec.asha.metric)] if spec.asha else []):
        if not any(metric.startswith(p) for p in prefixes):
            raise SweepError(f"sweep file {path}: {where} = {metric!r}: with several strategies, name the strategy, "
                             f"e.g. {prefixes[0]}{metric}")
    return Sweep(spec, raw, cfg, samples, path)


def trial_bundles(cfg: RunConfig) -> tuple[list[dict], list[dict]]:
    """(the trial's reservation, what its strategies reserve outside it). Strategies run one
    after another, so the reservation is the largest of theirs (all default ones share a shape)."""
    from raylowcomm.strategies import STRATEGIES
    from raylowcomm.strategies.base import actor_bundles, external_bundles

    inside = [actor_bundles(STRATEGIES[s], cfg) for s in cfg.strategies]
    outside = [external_bundles(STRATEGIES[s], cfg) for s in cfg.strategies]
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

    make = {"grid": tune.grid_search, "choice": tune.choice, "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v)}
    return {key: make[kind](values) for key, s in spec.space.items() for kind, values in s.items()}


def _trial(config: dict, raw: dict, experiment_dir: str) -> None:
    """One trial: the base config with this trial's values, its strategies one after another,
    progress and final metrics reported to Tune, the run written to TRIAL/run in storage."""
    import ray
    from ray import tune

    from raylowcomm.runner import prepare
    from raylowcomm.strategies import STRATEGIES

    cfg = from_dict(_apply(raw, config))
    ctx = prepare(cfg, Path(experiment_dir) / Path(tune.get_context().get_trial_dir()).name / "run")
    pg = ray.util.get_current_placement_group()
    latest: dict[str, Any] = {"placement_group": pg.id.hex() if pg else None}

    def report(prefix: str, metrics: dict) -> None:
        # Every result carries every metric seen so far: Tune and ASHA check each one for theirs.
        latest.update({prefix + k: v for k, v in metrics.items()})
        tune.report(dict(latest))

    records = []
    for name in cfg.strategies:
        prefix = f"{name}/" if len(cfg.strategies) > 1 else ""
        ctx.report = lambda metrics, prefix=prefix: report(prefix, metrics)
        record = STRATEGIES[name]().run(ctx).to_dict()
        records.append(record)
        (ctx.out_dir / "results.json").write_text(json.dumps(records, indent=2, default=str))
        nodes = {n["ray_node_id"] for n in record["nodes"] if "ray_node_id" in n}
        report(prefix, {**record["metrics"], "total_bytes": record["comm"]["total_bytes"], "wall_s": record["wall_s"],
                        "ray_nodes_used": len(nodes)})


def run_sweep(sweep: Sweep, storage_path: str | None = None) -> dict:
    """Run the trials, print the table and the best config, write summary.json and sweep.png."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raylowcomm.runtime import init_ray

    spec = sweep.spec
    init_ray()
    biggest = max((trial_bundles(from_dict(_apply(sweep.raw, {k: v})))
                   for k, values in sweep.samples.items() for v in values), key=lambda b: _cpus(b[0]) + _cpus(b[1]))
    need, cluster = _cpus(biggest[0]) + _cpus(biggest[1]), ray.cluster_resources().get("CPU", 0)
    if need > cluster:
        msg = f"a trial needs {need:g} CPUs (nodes.count x nodes.cpus) but the cluster has {cluster:g}"
        if not os.environ.get("RAY_ADDRESS"):
            raise SweepError(f"{msg}: lower nodes.count / nodes.cpus, or run on a bigger cluster (RAY_ADDRESS)")
        print(f"warning: {msg}; trials wait until the cluster grows", flush=True)
    max_concurrent = spec.max_concurrent
    if _cpus(biggest[1]) and need:  # Ray Train reserves outside the trials: leave it room
        fit = max(1, int(cluster // need))
        max_concurrent = min(max_concurrent or fit, fit)

    name = spec.name or f"{sweep.path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = Path(storage_path or spec.storage_path).resolve()
    trainable = tune.with_resources(tune.with_parameters(_trial, raw=sweep.raw, experiment_dir=str(storage / name)),
                                    lambda config: tune.PlacementGroupFactory(
                                        trial_bundles(from_dict(_apply(sweep.raw, config)))[0],
                                        strategy=from_dict(_apply(sweep.raw, config)).nodes.placement))
    scheduler = None
    if spec.asha:
        a = spec.asha
        scheduler = ASHAScheduler(metric=a.metric, mode=a.mode, time_attr=a.time_attr, grace_period=a.grace_period,
                                  max_t=a.max_t, reduction_factor=a.reduction_factor)
    started = time.time()
    tuner = tune.Tuner(trainable, param_space=_search_space(spec),
                       tune_config=tune.TuneConfig(num_samples=spec.num_samples, max_concurrent_trials=max_concurrent,
                                                   scheduler=scheduler),
                       run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=1))
    grid = tuner.fit()
    wall_s = time.time() - started

    trials = []
    for result in grid:
        metrics = result.metrics or {}
        status = "error" if result.error else ("done" if spec.metric in metrics else "stopped early")
        trials.append({"trial": metrics.get("trial_id") or Path(result.path).name,
                       "values": {k: result.config[k] for k in spec.space}, "metric": metrics.get(spec.metric),
                       "columns": {c: metrics.get(c) for c in spec.columns},
                       "status": status, "iterations": metrics.get("training_iteration"),
                       "error": str(result.error).splitlines()[0] if result.error else None, "path": result.path})
    scored = [t for t in trials if t["metric"] is not None]
    if not scored:
        seen = sorted({k for r in grid for k in (r.metrics or {})})
        raise SweepError(f"no trial reported metric {spec.metric!r}; reported: {', '.join(seen) or 'nothing (all failed)'}")
    best = (max if spec.mode == "max" else min)(scored, key=lambda t: t["metric"])
    experiment = Path(grid.experiment_path)
    summary = {"metric": spec.metric, "mode": spec.mode, "best": best, "trials": trials, "wall_s": round(wall_s, 1),
               "experiment": str(experiment)}
    (experiment / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot = plot_sweep(sweep, trials, experiment / "sweep.png")
    print(format_trials(spec, trials))
    print(f"\nbest {spec.metric} = {best['metric']:.4f} ({spec.mode}) with "
          + ", ".join(f"{k}={_show(v)}" for k, v in best["values"].items()))
    print(f"sweep: {len(trials)} trials in {wall_s:.0f} s; results: {experiment} (summary.json, {plot.name}, "
          f"per-trial progress.csv / result.json / TensorBoard events, run/results.json)")
    return summary


def _show(value) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _number(value) -> str:
    return "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def format_trials(spec: SweepConfig, trials: list[dict]) -> str:
    keys = list(spec.space)
    rows = [[*(_show(t["values"][k]) for k in keys), _number(t["metric"]),
             *(_number(t.get("columns", {}).get(c)) for c in spec.columns),
             t["status"] + (f": {t['error'][:60]}" if t["error"] else ""), str(t["iterations"] or "-")]
            for t in sorted(trials, key=lambda t: [_show(t["values"][k]) for k in keys])]
    cols = [*keys, spec.metric, *spec.columns, "status", "reports"]
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    return "\n" + "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in [cols] + rows)


def plot_sweep(sweep: Sweep, trials: list[dict], out: Path) -> Path:
    """One panel per swept field: the metric against its values, a line per setting of the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec, keys = sweep.spec, list(sweep.spec.space)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        kind = next(iter(spec.space[key]))
        values = [t["values"][key] for t in trials]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        order = sorted({_show(v) for v in values}) if not numeric else None
        groups: dict[str, list] = {}
        for t in trials:
            if t["metric"] is None:
                continue
            label = ", ".join(f"{k}={_show(t['values'][k])}" for k in keys if k != key) or spec.metric
            x = t["values"][key] if numeric else order.index(_show(t["values"][key]))
            groups.setdefault(label, []).append((x, t["metric"]))
        for label, points in groups.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if kind == "loguniform":
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(order)), order)
        ax.set_xlabel(key)
        ax.set_ylabel(spec.metric)
        if len(groups) > 1 or len(keys) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{sweep.path.name}: {spec.metric} ({spec.mode})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
