"""What a sweep shows: the trials' table, the best config, and one plot panel per swept field."""

from __future__ import annotations

from pathlib import Path

from raylowcomm.tune.sweep import Sweep, SweepConfig


def format_summary(spec: SweepConfig, summary: dict) -> str:
    """The trials' table, the best config, and where the results are: what `raylowcomm tune` prints."""
    best, plot = summary["best"], Path(summary["plot"])
    return (
        format_trials(spec, summary["trials"])
        + f"\n\nbest {spec.metric} = {best['metric']:.4f} ({spec.mode}) with "
        + ", ".join(f"{k}={_show(v)}" for k, v in best["values"].items())
        + f"\nsweep: {len(summary['trials'])} trials in {summary['wall_s']:.0f} s; results: {summary['experiment']} "
        f"(summary.json, {plot.name}, per-trial progress.csv / result.json / TensorBoard events, run/results.json)"
    )


def _show(value) -> str:
    if value is None:
        return "null"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _number(value) -> str:
    return "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def format_trials(spec: SweepConfig, trials: list[dict]) -> str:
    keys = list(spec.space)
    rows = [
        [
            *(_show(t["values"][k]) for k in keys),
            _number(t["metric"]),
            *(_number(t.get("columns", {}).get(c)) for c in spec.columns),
            t["status"] + (f": {t['error'][:60]}" if t["error"] else ""),
            str(t["iterations"] or "-"),
        ]
        for t in sorted(trials, key=lambda t: [_show(t["values"][k]) for k in keys])
    ]
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
