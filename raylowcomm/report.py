"""The benchmark report, rebuilt from saved results: learning curves against wall time and bytes,
and per run (link rate) the time and bytes each strategy needs to reach a target metric set by
DDP, the baseline every strategy must beat (`raylowcomm report DIR`).

A bench directory holds `bench.json` ({"mode", "config", "runs": [{"label", "rate", "dir",
"collect_note"?}]}), each run's `results.json` (records of raylowcomm/run.py) and optionally
`benchmarks/*.json` (python -m benchmarks). A plain run directory (results.json only) is read as
one local run; a multi-seed one (`raylowcomm run --seeds`: seeds.json, seed_<s>/results.json) as
one run per seed, with the table across seeds (raylowcomm.seedstats) first. Nothing here needs Ray or torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

TARGET_FRACTION = 0.95


class ReportError(Exception):
    """DIR is not something a report can be built from."""


# ---------------------------------------------------------------------------------------- numbers


def primary_metric(records: list[dict]) -> str:
    """Accuracy where the task has one (classifiers), else the loss (language models)."""
    ok = [r for r in records if "error" not in r]
    return "id_accuracy" if any("id_accuracy" in r.get("metrics", {}) for r in ok) else "id_loss"


def higher_is_better(metric: str) -> bool:
    return not metric.endswith(("loss", "perplexity"))


def target_value(ddp_final: float, metric: str, fraction: float = TARGET_FRACTION) -> float:
    """`fraction` of DDP's final accuracy; for a loss DDP's final / fraction (lower is better)."""
    return ddp_final * fraction if higher_is_better(metric) else ddp_final / fraction


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def crossing(curve: list[dict], metric: str, target: float, axis: str = "wall_s") -> float | None:
    """Where on `axis` (wall_s or bytes) the curve first reaches `target`, linearly interpolated
    between the last point short of it and the first at or past it; None if it never does."""
    higher = higher_is_better(metric)
    prev: dict | None = None
    for point in (p for p in curve if metric in p and axis in p):
        value = point[metric]
        if _reached(value, target, higher):
            if prev is None:
                return float(point[axis])
            frac = (target - prev[metric]) / (value - prev[metric])
            return float(prev[axis] + frac * (point[axis] - prev[axis]))
        prev = point
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summarize_run(records: list[dict], metric: str, fraction: float = TARGET_FRACTION) -> dict:
    """One run's table: per strategy its final metric, time and bytes to the target, total bytes,
    and ratios to DDP. Without a working DDP there is no target and no ratio (said in `note`)."""
    ddp = next((r for r in records if r.get("strategy") == "ddp"), None)
    note, target = None, None
    if ddp is None:
        note = "DDP is not in this run: no target, no ratios to DDP."
    elif "error" in ddp:
        note = "DDP failed in this run: no target, no ratios to DDP."
    elif metric not in ddp.get("metrics", {}):
        note = f"DDP reported no {metric}: no target, no ratios to DDP."
    else:
        target = target_value(ddp["metrics"][metric], metric, fraction)
    rows = []
    for r in records:
        if "error" in r:
            rows.append({"strategy": r.get("strategy", "?"), "error": r["error"], "wall_s": r.get("wall_s")})
            continue
        curve = r.get("curve") or []
        rows.append(
            {
                "strategy": r["strategy"],
                "final": r.get("metrics", {}).get(metric),
                "metrics": r.get("metrics", {}),
                "time_to_target_s": crossing(curve, metric, target, "wall_s") if target is not None else None,
                "bytes_to_target": crossing(curve, metric, target, "bytes") if target is not None else None,
                "total_bytes": r.get("comm", {}).get("total_bytes"),
                "train_s": r.get("train_s"),
                "wall_s": r.get("wall_s"),
                "goodput": (r.get("goodput") or {}).get("goodput"),
                "curve_points": len(curve),
                "curve_note": (r.get("details") or {}).get("curve_note"),
            }
        )
    base = (
        next((row for row in rows if row["strategy"] == "ddp" and "error" not in row), None)
        if target is not None
        else None
    )
    for row in rows:
        if "error" in row:
            continue
        row["bytes_vs_ddp"] = _ratio(row["total_bytes"], base["total_bytes"]) if base else None
        t = row["time_to_target_s"]
        row["speedup_vs_ddp"] = _ratio(base["time_to_target_s"], t) if base and t is not None else None
    return {
        "metric": metric,
        "target": target,
        "ddp_final": ddp["metrics"][metric] if target is not None else None,
        "note": note,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------ input


def load_bench(bench_dir: str | Path) -> dict:
    """bench.json with each run's records attached (None where results.json is missing)."""
    bench_dir = Path(bench_dir)
    if not bench_dir.is_dir():
        raise ReportError(f"{bench_dir} is not a directory")
    if (bench_dir / "bench.json").exists():
        bench = json.loads((bench_dir / "bench.json").read_text())
    elif (bench_dir / "results.json").exists():
        bench = {
            "mode": "local",
            "config": _read_config(bench_dir),
            "runs": [{"label": bench_dir.name, "rate": None, "dir": "."}],
        }
    elif (bench_dir / "seeds.json").exists():  # raylowcomm run --seeds: one run per seed
        seeds = json.loads((bench_dir / "seeds.json").read_text())
        bench = {
            "mode": "local",
            "config": seeds.get("config"),
            "confidence": seeds.get("confidence"),
            "runs": [
                {"label": f"seed {s}", "rate": None, "dir": d, "seed": int(s)} for s, d in seeds.get("dirs", {}).items()
            ],
        }
    elif (bench_dir / "benchmarks").is_dir():
        bench = {"mode": "local", "config": None, "runs": []}
    else:
        raise ReportError(f"{bench_dir} has no bench.json, results.json, seeds.json or benchmarks/ to report on")
    for run in bench.setdefault("runs", []):
        path = bench_dir / run.get("dir", run["label"]) / "results.json"
        run["records"] = json.loads(path.read_text()) if path.exists() else None
    return bench


def _read_config(run_dir: Path) -> dict | None:
    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else None


# ------------------------------------------------------------------------------------------ plots


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


def build_report(bench_dir: str | Path, fraction: float = TARGET_FRACTION) -> str:
    """report.md's text; writes curves_time.png and curves_bytes.png into bench_dir."""
    if not 0 < fraction <= 1:
        raise ReportError(f"target fraction {fraction} must be in (0, 1]")
    bench_dir = Path(bench_dir)
    bench = load_bench(bench_dir)
    all_records = [r for run in bench["runs"] for r in run["records"] or []]
    metric = primary_metric(all_records)
    summaries = [
        summarize_run(run["records"], metric, fraction) if run["records"] is not None else None for run in bench["runs"]
    ]
    mode = bench.get("mode", "local")
    lines = ["# raylowcomm benchmark report", ""]
    if mode == "wan":
        lines.append(
            "Mode **wan**: two Ray nodes in network namespaces, the link between them shaped in both directions "
            "to each run's rate."
        )
    else:
        lines.append("Mode **local**: one machine's embedded Ray, no link shaping.")
    lines.append("")
    cfg = bench.get("config") or {}
    if cfg:
        model, data, nodes = cfg.get("model", {}), cfg.get("data", {}), cfg.get("nodes", {})
        lines += [
            f"Model `{model.get('name')}`, data `{data.get('name')}` ({data.get('train_size')} training examples), "
            f"{nodes.get('count')} nodes; strategies {', '.join(cfg.get('strategies', []))}; "
            f"evaluation every {cfg.get('eval_every') or '— (end only)'} steps. Full config at the end.",
            "",
        ]
    lines += tensorboard_line(bench_dir, bench) + seeds_section(bench)
    if bench["runs"]:
        lines += [
            f"Metric: **{metric}** ({'higher' if higher_is_better(metric) else 'lower'} is better). Time to target: "
            "the curve's training wall time (evaluation excluded), linearly interpolated between evaluations; "
            "speed-up over DDP = DDP's time to target ÷ the strategy's; bytes are everything sent in all "
            "phases, as counted by the byte ledger.",
            "",
            "![metric vs training wall time](curves_time.png)",
            "",
            "![metric vs bytes sent](curves_bytes.png)",
            "",
        ]
        targets = [s["target"] if s else None for s in summaries]
        plot_curves(bench, metric, "wall_s", bench_dir / "curves_time.png", targets)
        plot_curves(bench, metric, "bytes", bench_dir / "curves_bytes.png", targets)
    for run, summary in zip(bench["runs"], summaries):
        lines += run_section(run, summary, fraction)
    bench_files = sorted((bench_dir / "benchmarks").glob("*.json"))
    if bench_files:
        lines += ["## Single-machine benchmarks", ""]
        for path in bench_files:
            try:
                lines += benchmark_section(path.stem, json.loads(path.read_text()))
            except json.JSONDecodeError as err:
                lines += [f"### {path.stem}", "", f"unreadable: {err}", ""]
    if cfg:
        lines += ["## Config", "", "```yaml", yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write_report(bench_dir: str | Path, fraction: float = TARGET_FRACTION) -> Path:
    text = build_report(bench_dir, fraction)
    path = Path(bench_dir) / "report.md"
    path.write_text(text)
    return path
