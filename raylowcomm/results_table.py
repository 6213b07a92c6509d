"""The table a run logs at its end: one run's records side by side (seedstats has the multi-seed one)."""

from __future__ import annotations

from raylowcomm.strategies import STRATEGIES


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def format_results_table(records: list[dict]) -> str:
    """One row per strategy (and per node, and the strategy's own rows): the scores, the bytes by
    phase, time, throughput, goodput (useful over reserved node-seconds, where the record has it),
    memory; a failed strategy's row names its error."""
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
        "goodput",
        "peak RSS MB",
    ]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["strategy"], "FAILED: " + r["error"].partition("\n")[0][:60]] + [""] * (len(cols) - 2))
            continue
        key = "accuracy" if "id_accuracy" in r["metrics"] else "loss"
        rows += [row + [""] * (len(cols) - len(row)) for row in _strategy_rows(r, key)]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [cols] + rows]
    scored = [r["metrics"] for r in records if "metrics" in r]  # none when every strategy failed: no metric to name
    metric = "accuracy" if any("id_accuracy" in m for m in scored) else "loss"
    return (f"\n(id/shift = {metric})" if scored else "") + "\n" + "\n".join(lines)


def _strategy_rows(r: dict, key: str) -> list[list[str]]:
    """A scored record's rows: the strategy's own (scores, MB by phase, time, throughput, goodput,
    memory), one per node that was scored, then the strategy's own extra rows (`table_rows`);
    `key` is the metric shown, accuracy or loss."""
    m, c = r["metrics"], r["comm"]["by_phase"]
    rows = [
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
            f"{r['goodput']['goodput']:.1%}" if (r.get("goodput") or {}).get("goodput") is not None else "-",
            _mb(r["peak_rss_bytes"]),
        ]
    ]
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
                    "",
                    _mb(node["peak_rss_bytes"]),
                ]
            )
    return rows + list(STRATEGIES[r["strategy"]].table_rows(r, key))
