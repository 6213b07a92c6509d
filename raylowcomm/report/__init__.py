"""The benchmark report, rebuilt from saved results: learning curves against wall time and bytes,
and per run (link rate) the time and bytes each strategy needs to reach a target metric set by
DDP, the baseline every strategy must beat (`raylowcomm report DIR`).

A bench directory holds `bench.json` ({"mode", "config", "runs": [{"label", "rate", "dir",
"collect_note"?}]}), each run's `results.json` (records of raylowcomm/runner.py) and optionally
`benchmarks/*.json` (python -m benchmarks). A plain run directory (results.json only) is read as
one local run; a multi-seed one (`raylowcomm run --seeds`: seeds.json, seed_<s>/results.json) as
one run per seed, with the table across seeds (raylowcomm.seedstats) first. Nothing here needs Ray or torch.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from raylowcomm.common.files import FileError, read_json
from raylowcomm.report.loading import REWRITE, ReportError, load_bench
from raylowcomm.report.markdown import (
    benchmark_section,
    human_bytes,
    plot_curves,
    run_section,
    seeds_section,
    tensorboard_line,
)
from raylowcomm.report.numbers import (
    TARGET_FRACTION,
    crossing,
    higher_is_better,
    primary_metric,
    summarize_run,
    target_value,
)

__all__ = [
    "TARGET_FRACTION",
    "ReportError",
    "benchmark_section",
    "build_report",
    "crossing",
    "higher_is_better",
    "human_bytes",
    "load_bench",
    "primary_metric",
    "run_section",
    "summarize_run",
    "target_value",
    "write_report",
]


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
            try:  # one damaged benchmark file is said in its section; the rest of the report stands
                lines += benchmark_section(path.stem, read_json(path, REWRITE))
            except FileError as err:
                lines += [f"### {path.stem}", "", f"unreadable: {err.problem}", ""]
    if cfg:
        lines += ["## Config", "", "```yaml", yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write_report(bench_dir: str | Path, fraction: float = TARGET_FRACTION) -> Path:
    text = build_report(bench_dir, fraction)
    path = Path(bench_dir) / "report.md"
    path.write_text(text)
    return path
