"""The report's plots (a curve per strategy, a panel per run) and markdown (each run's table, any
benchmark JSON, the TensorBoard pointer, the table across seeds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raylowcomm.report.numbers import higher_is_better


def plot_curves(bench: dict, metric: str, axis: str, path: Path, targets: list[float | None]) -> None:
    """One panel per run, one line per strategy, the same colour for a strategy in every panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = bench["runs"] or [{"label": "no runs", "records": []}]
    fig = Figure(figsize=(5.5 * len(runs), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    names = sorted(
        {r["strategy"] for run in runs for r in run.get("records") or [] if "strategy" in r},
        key=lambda n: (n != "ddp", n),
    )
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}  # DDP always blue
    for ax, run, target in zip(axes, runs, targets + [None] * len(runs)):
        drawn = 0
        for r in run.get("records") or []:
            pts = [p for p in r.get("curve") or [] if metric in p and axis in p and (axis != "bytes" or p[axis] > 0)]
            if "error" in r or not pts:
                continue
            ax.plot(
                [p[axis] for p in pts],
                [p[metric] for p in pts],
                marker="o",
                ms=3,
                color=colours[r["strategy"]],
                label=r["strategy"],
            )
            drawn += 1
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=1, label="target")
        if not drawn:
            ax.text(0.5, 0.5, "no curve points recorded", ha="center", va="center", transform=ax.transAxes)
        if axis == "bytes" and drawn:
            ax.set_xscale("log")
        ax.set_title(run["label"] + (f" (link {run['rate']})" if run.get("rate") not in (None, run["label"]) else ""))
        ax.set_xlabel("training wall time (s)" if axis == "wall_s" else "bytes sent so far (log)")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    axes[0].set_ylabel(metric)
    fig.savefig(path, dpi=120)


# -------------------------------------------------------------------------------------- markdown


def _num(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    clean = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in clean]


def _result_row(row: dict, has_target: bool, shift: str | None) -> list[str]:
    """One scored strategy's cells in a run's table; `shift`: the shift metric's column, if shown."""
    reach = "no curve" if not row["curve_points"] else "not reached"
    ttt = row["time_to_target_s"]
    time_to_target = f"{ttt:.3g} s" if ttt is not None and ttt < 100 else f"{ttt:.0f} s" if ttt is not None else reach
    bytes_to_target = human_bytes(row["bytes_to_target"]) if row["bytes_to_target"] is not None else reach
    return (
        [row["strategy"], _num(row["final"])]
        + ([_num(row["metrics"].get(shift))] if shift else [])
        + [
            time_to_target if has_target else "-",
            _num(row["speedup_vs_ddp"], ".2f") + ("×" if row["speedup_vs_ddp"] is not None else ""),
            human_bytes(row["total_bytes"]),
            _num(row["bytes_vs_ddp"], ".3g"),
            bytes_to_target if has_target else "-",
            _num(row["train_s"], ".1f"),
            _num(row["wall_s"], ".1f"),
            f"{row['goodput']:.1%}" if row.get("goodput") is not None else "-",
        ]
    )


def run_section(run: dict, summary: dict | None, fraction: float) -> list[str]:
    title = run["label"] + (f" — link shaped to {run['rate']}" if run.get("rate") else " — no link shaping")
    lines = [f"## {title}", ""]
    if run.get("collect_note"):
        lines += [run["collect_note"], ""]
    if run.get("link"):
        link = run["link"]
        lines += [
            f"Link measured before the run: {link['mbit_per_s']} Mbit/s ({link['bytes'] / 1e6:.0f} MB host 1 → host 0 "
            f"in {link['seconds']} s over TCP).",
            "",
        ]
    if summary is None:
        return lines + [f"No results.json in `{run.get('dir', run['label'])}/`.", ""]
    metric, target = summary["metric"], summary["target"]
    if target is not None:
        how = f"{fraction:.0%} of" if higher_is_better(metric) else f"/ {fraction:g} of"
        lines += [f"Target {metric} = {target:.4f} ({how} DDP's final {summary['ddp_final']:.4f}).", ""]
    else:
        lines += [summary["note"], ""]
    shift = "shift_" + metric[3:]
    has_shift = any(shift in row.get("metrics", {}) for row in summary["rows"])
    header = (
        ["strategy", f"final {metric}"]
        + ([shift] if has_shift else [])
        + [
            "time to target",
            "speed-up vs DDP",
            "bytes sent",
            "bytes / DDP",
            "bytes to target",
            "train s",
            "wall s",
            "goodput",
        ]
    )
    rows, notes, failed = [], [], []
    for row in summary["rows"]:
        if "error" in row:
            failed.append(f"- **{row['strategy']}** failed after {_num(row['wall_s'], '.1f')} s: {row['error']}")
            rows.append([row["strategy"], "FAILED"] + ["-"] * (len(header) - 2))
            continue
        rows.append(_result_row(row, target is not None, shift if has_shift else None))
        if row["curve_note"]:
            notes.append(f"- **{row['strategy']}**: {row['curve_note']}")
    lines += _table(header, rows) + [""]
    if notes:
        lines += ["How the curve times were obtained:", ""] + notes + [""]
    if failed:
        lines += ["Failed:", ""] + failed + [""]
    return lines


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, dict):
        return "; ".join(f"{k}={_cell(x)}" for k, x in v.items())
    if isinstance(v, list):
        return " / ".join(_cell(x) for x in v)
    return str(v)


def _dict_rows(items: list[dict]) -> list[str]:
    header = list(dict.fromkeys(k for item in items for k in item))
    return _table(header, [[_cell(item.get(k)) for k in header] for item in items])


def benchmark_section(name: str, data: Any) -> list[str]:
    """Any benchmark JSON as markdown, without knowing its shape: lists of records become tables,
    a dict of records a table keyed by name, scalars one line, anything else compact JSON; the
    images a `plots` list names (files beside the JSON, in DIR/benchmarks) are shown first."""
    lines = [f"### {name}", ""]
    if isinstance(data, dict) and isinstance(data.get("plots"), list):  # image files beside the JSON
        lines += [f"![{plot}](benchmarks/{plot})" for plot in data["plots"]] + [""]
        data = {k: v for k, v in data.items() if k != "plots"}
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        return lines + _dict_rows(data) + [""]
    if not isinstance(data, dict):
        return lines + [f"`{json.dumps(data)}`", ""]
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    if scalars:
        lines += [", ".join(f"{k}: {_cell(v)}" for k, v in scalars.items()), ""]
    for key, v in data.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            lines += [f"**{key}**", ""] + _dict_rows(v) + [""]
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()) and key != "config":
            lines += [f"**{key}**", ""] + _dict_rows([{"": k, **x} for k, x in v.items()]) + [""]
        elif isinstance(v, (dict, list)):
            flat = all(not isinstance(x, (dict, list)) for x in (v.values() if isinstance(v, dict) else v))
            lines += [f"**{key}**: " + (_cell(v) if flat else f"`{json.dumps(v)}`"), ""]
    return lines


def tensorboard_line(bench_dir: str | Path, bench: dict) -> list[str]:
    """The line pointing at the TensorBoard event files (`raylowcomm.tensorboard`): DIR/tensorboard,
    or DIR itself when only the runs' own folders have one (TensorBoard searches sub-folders)."""
    bench_dir = Path(bench_dir)
    if (bench_dir / "tensorboard").is_dir():
        logdir = bench_dir / "tensorboard"
    elif any((bench_dir / run.get("dir", run["label"]) / "tensorboard").is_dir() for run in bench["runs"]):
        logdir = bench_dir
    else:
        return []
    return [
        f"TensorBoard curves (training loss, evaluation metrics and bytes sent, against step and training "
        f"wall time): `tensorboard --logdir {logdir}`.",
        "",
    ]


def seeds_section(bench: dict) -> list[str]:
    """A multi-seed run's table (raylowcomm.seedstats), recomputed from each seed's results.json."""
    from raylowcomm.seedstats import CONFIDENCE, markdown, summarize

    per_seed = {run["seed"]: run["records"] for run in bench["runs"] if "seed" in run and run["records"] is not None}
    if not per_seed:
        return []
    return ["## Across seeds", "", *markdown(summarize(per_seed, bench.get("confidence") or CONFIDENCE))]
