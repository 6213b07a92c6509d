"""A config run over several seeds, summarised: per strategy the mean and 95% Student-t interval
(n - 1 degrees of freedom) of every metric (id_*, shift_*), of the bytes (in all, by phase) and
of the time, and the paired difference to DDP per metric: the interval of the per-seed
differences strategy - DDP, over the seeds where both finished. Only `seed` changes between
the runs; the test rows are fixed by data.shuffle_seed, so each difference compares the two
strategies on the same rows.

A strategy that failed in a seed is counted (its seed and error listed), and its statistics are
over the seeds where it finished. One seed gives a mean and no interval. Plain Python and scipy:
no Ray, no torch (`raylowcomm report` rebuilds the table from the seed folders with it).
"""

from __future__ import annotations

import math
import re

CONFIDENCE = 0.95
BASELINE = "ddp"
METRIC = re.compile(r"^(id|shift)_")
PHASES = ("setup", "train", "final")


def interval(values: list[float], confidence: float = CONFIDENCE) -> dict:
    """Mean and two-sided Student-t interval of `values` (sample sd, n - 1 dof): half_width,
    low, high; None for all of them with one value (no spread to estimate), and for the mean too
    with none."""
    n = len(values)
    mean = sum(values) / n if n else None
    out = {"n": n, "mean": mean, "sd": None, "half_width": None, "low": None, "high": None}
    if n < 2:
        return out
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return {**out, "sd": sd, "half_width": half, "low": mean - half, "high": mean + half}


def quantities(record: dict) -> dict[str, float]:
    """The numbers of one finished record that are compared across seeds: its id_* and shift_*
    metrics, bytes in all and by phase (bytes_total, bytes_setup, ...), wall_s and train_s."""
    out = {k: float(v) for k, v in sorted(record.get("metrics", {}).items()) if METRIC.match(k) and _number(v)}
    comm = record.get("comm") or {}
    if comm:
        out["bytes_total"] = float(comm["total_bytes"])
        out.update({f"bytes_{p}": float(comm["by_phase"].get(p, 0)) for p in PHASES})
    for key in ("wall_s", "train_s"):
        if _number(record.get(key)):
            out[key] = float(record[key])
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def summarize(per_seed: dict[int, list[dict]], confidence: float = CONFIDENCE) -> dict:
    """{seed: that seed's records (results.json)} -> what seeds.json holds: for each strategy
    (in the order they ran) the seeds it finished and failed in, an interval per quantity with
    the per-seed values, and `vs_ddp`: per metric the interval of its paired differences to DDP
    (empty without DDP, and for DDP itself)."""
    seeds = sorted(per_seed)
    names = list(dict.fromkeys(r["strategy"] for s in seeds for r in per_seed[s]))
    found = {(s, r["strategy"]): r for s in seeds for r in per_seed[s]}
    values = {
        (s, n): quantities(found[s, n]) for s in seeds for n in names if (s, n) in found and "error" not in found[s, n]
    }
    strategies = []
    for name in names:
        ok = [s for s in seeds if (s, name) in values]
        failed = [
            {"seed": s, "error": _first_line(found[s, name]["error"]) if (s, name) in found else "no record"}
            for s in seeds
            if s not in ok
        ]
        keys = list(dict.fromkeys(k for s in ok for k in values[s, name]))
        stats = {
            k: _with_values(interval, [(s, values[s, name][k]) for s in ok if k in values[s, name]], confidence)
            for k in keys
        }
        paired = {}
        if name != BASELINE and BASELINE in names:
            for k in (k for k in keys if METRIC.match(k)):
                pairs = [
                    (s, values[s, name][k] - values[s, BASELINE][k])
                    for s in ok
                    if (s, BASELINE) in values and k in values[s, name] and k in values[s, BASELINE]
                ]
                paired[k] = _with_values(interval, pairs, confidence)
        strategies.append({"strategy": name, "seeds_ok": ok, "failed": failed, "stats": stats, "vs_ddp": paired})
    return {
        "seeds": seeds,
        "confidence": confidence,
        "baseline": BASELINE if BASELINE in names else None,
        "strategies": strategies,
    }


def _with_values(fn, pairs: list[tuple[int, float]], confidence: float) -> dict:
    return {**fn([v for _, v in pairs], confidence), "seeds": [s for s, _ in pairs], "values": [v for _, v in pairs]}


def _first_line(text: str) -> str:
    return str(text).strip().partition("\n")[0]


# ------------------------------------------------------------------------------------- the table


def plus_minus(stat: dict | None, digits: int = 1, scale: float = 1.0, sign: str = "") -> str:
    """An `interval` as `mean ± half-width` (scaled, ``digits`` decimals, ``sign`` "+" to sign the
    mean); the mean alone for one value; `-` for none."""
    if not stat or stat["mean"] is None:
        return "-"
    mean = f"{stat['mean'] * scale:{sign}.{digits}f}"
    return mean if stat.get("half_width") is None else f"{mean} ± {stat['half_width'] * scale:.{digits}f}"


def label(key: str) -> str:
    """A quantity's name in the table, with its unit."""
    if key.startswith("bytes_"):
        return f"{key.replace('_', ' ')} MB"
    return {"wall_s": "wall s", "train_s": "train s"}.get(key, key)


def shown(key: str, stat: dict, signed: bool = False) -> str:
    """`mean ± half-width` in the quantity's unit (bytes in MB); `mean (n=1, no interval)`; `-`."""
    if stat["mean"] is None:
        return "-"
    scale, digits = (1e-6, 2) if key.startswith("bytes_") else (1, 1) if key.endswith("_s") else (1, 4)
    mean = f"{stat['mean'] * scale:{'+' if signed else ''}.{digits}f}"
    if stat["half_width"] is None:
        return f"{mean} (n={stat['n']}, no interval)"
    return f"{mean} ± {stat['half_width'] * scale:.{digits}f}"


def rows(summary: dict) -> list[list[str]]:
    """One row per strategy and quantity: strategy, seeds finished/run, quantity, mean ± interval,
    paired difference to DDP; a strategy's failures follow its rows, one per failed seed."""
    out, total = [], len(summary["seeds"])
    for entry in summary["strategies"]:
        first = [entry["strategy"], f"{len(entry['seeds_ok'])}/{total}"]
        for key, stat in entry["stats"].items():
            diff = entry["vs_ddp"].get(key)
            cell = shown(key, diff, signed=True) if diff and diff["n"] else ""
            cell += f" (n={diff['n']})" if diff and diff["half_width"] is not None else ""
            out.append(first + [label(key), shown(key, stat), cell])
            first = ["", ""]
        for failure in entry["failed"]:
            out.append(first + ["FAILED", f"seed {failure['seed']}: {failure['error'][:80]}", ""])
            first = ["", ""]
    return out


def header(summary: dict) -> list[str]:
    pct = f"{summary['confidence']:.0%}"
    return [
        "strategy",
        "seeds ok",
        "quantity",
        f"mean ± {pct} interval",
        f"paired − {summary['baseline']}" if summary["baseline"] else "paired − ddp (no ddp)",
    ]


def caption(summary: dict) -> str:
    seeds = ", ".join(str(s) for s in summary["seeds"])
    return (
        f"{len(summary['seeds'])} seeds ({seeds}); mean ± {summary['confidence']:.0%} Student-t interval "
        "(n − 1 dof) over the seeds a strategy finished; paired: the interval of the per-seed differences to "
        "DDP on the same test rows. An interval that contains 0 is no evidence of a difference."
    )


def format_table(summary: dict) -> str:
    """The plain-text table `raylowcomm run --seeds` prints."""
    table = [header(summary)] + rows(summary)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join([caption(summary), "", *lines])


def markdown(summary: dict) -> list[str]:
    """The same table in markdown, for report.md."""
    table = [header(summary)] + rows(summary)
    clean = [[c.replace("|", "\\|") for c in r] for r in table]
    return [
        caption(summary),
        "",
        "| " + " | ".join(clean[0]) + " |",
        "|" + "---|" * len(clean[0]),
        *("| " + " | ".join(r) + " |" for r in clean[1:]),
        "",
    ]
