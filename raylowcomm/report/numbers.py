"""The report's numbers: the primary metric, DDP's target, where a curve crosses it, and one run's
table of finals, times and bytes to target and ratios to DDP."""

from __future__ import annotations

TARGET_FRACTION = 0.95


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
