"""The driver's memory does not grow with the training set: peak RSS of `runner.prepare` on a
user CSV of 5,000 vs 50,000 rows (Rotten Tomatoes reviews, repeated and perturbed).

    python -m benchmarks.driver_memory [--rows 5000 50000] [--out runs/bench/driver_memory.json]

Each measurement runs in a fresh Python process, so peaks do not mix:
- cold: `prepare` with an empty `datasets` cache (the driver converts the CSV to Arrow once),
- warm: `prepare` again, the Arrow cache in place (what every later run of the same file does),
- control: warm `prepare`, then `TrainSource.load_all()` in the driver: every training row encoded
  in the driver, as before nodes loaded their own data. It shows what the benchmark would see if
  the driver held the training set.
The model (all-MiniLM-L6-v2) and the evaluation sets (test_size rows) are the same at every size.
Prints a table and writes the JSON. A benchmark: it reports figures, it asserts none.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("cold", "warm", "control")
MB = 1024 * 1024


def make_csv(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` reviews: Rotten Tomatoes snippets cycled, each copy after the first perturbed (two
    words swapped, a copy number appended) so no two rows are equal; columns review / verdict."""
    from raylowcomm import assets

    with open(assets.require("rotten_tomatoes"), newline="") as f:
        source = [(r["text"], "fresh" if r["label"] == "1" else "rotten") for r in csv.DictReader(f)]
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "verdict"])
        for i in range(rows):
            text, verdict = source[i % len(source)]
            if i >= len(source):
                words = text.split()
                if len(words) > 2:
                    a, b = rng.sample(range(len(words)), 2)
                    words[a], words[b] = words[b], words[a]
                text = " ".join(words) + f" (copy {i // len(source)})"
            writer.writerow([text, verdict])
    return path


def config(csv_path: Path, test_size: int):
    from raylowcomm.strategies import from_dict

    return from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"},
            "data": {
                "name": "reviews",
                "source": "csv",
                "files": str(csv_path),
                "columns": {"text": "review", "label": "verdict"},
                "test_size": test_size,
                "max_length": 64,
                "shift": "none",
            },
            "nodes": {"count": 2, "cpus": 1},
            "strategies": ["lofi"],
        }
    )


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(csv_path: Path, mode: str, test_size: int, out_dir: Path) -> dict:
    """In this (fresh) process: RSS before `prepare`, the peak after it (and, for the control,
    after load_all), what the driver holds."""
    import psutil

    from raylowcomm.common.batches import num_examples
    from raylowcomm.common.ledger import payload_nbytes
    from raylowcomm.runner import prepare

    cfg = config(csv_path, test_size)
    process = psutil.Process()
    before, peak_before = process.memory_info().rss / MB, peak_mb()
    t0 = time.perf_counter()
    ctx = prepare(cfg, out_dir)
    prepare_s = time.perf_counter() - t0
    row = {
        "mode": mode,
        "rss_before_mb": round(before, 1),
        "peak_before_mb": round(peak_before, 1),
        "peak_after_prepare_mb": round(peak_mb(), 1),
        "rss_after_prepare_mb": round(process.memory_info().rss / MB, 1),
        "prepare_s": round(prepare_s, 2),
        "train_rows": sum(ctx.data.train.sizes(1)),
        "eval_rows": {k: num_examples(v) for k, v in ctx.data.eval_sets.items()},
        "eval_sets_mb": round(sum(payload_nbytes(v) for v in ctx.data.eval_sets.values()) / MB, 2),
        "recipe_bytes": payload_nbytes(ctx.data.train),
    }
    if mode == "control":
        train = ctx.data.train.load_all()
        row.update(peak_after_load_all_mb=round(peak_mb(), 1), train_tensors_mb=round(payload_nbytes(train) / MB, 1))
    return row


def child(args) -> None:
    row = measure(Path(args.csv), args.mode, args.test_size, Path(args.work))
    print("RESULT " + json.dumps(row), flush=True)


def run_child(csv_path: Path, mode: str, cache: Path, work: Path, test_size: int) -> dict:
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.driver_memory",
        "--child",
        "--csv",
        str(csv_path),
        "--mode",
        mode,
        "--test-size",
        str(test_size),
        "--work",
        str(work / mode),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} on {csv_path.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[5000, 50000], help="training CSV sizes (default: 5000 50000)"
    )
    parser.add_argument("--test-size", type=int, default=1000, help="rows the driver scores on, the same at every size")
    parser.add_argument("--out", default="runs/bench/driver_memory.json", help="the JSON to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--csv", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="driver_memory_") as tmp:
        for rows in args.rows:
            csv_path = make_csv(Path(tmp) / f"reviews_{rows}.csv", rows)
            cache, work = Path(tmp) / f"hf_cache_{rows}", Path(tmp) / f"work_{rows}"
            for mode in MODES:
                row = run_child(csv_path, mode, cache, work, args.test_size)
                row.update(rows=rows, csv_mb=round(csv_path.stat().st_size / MB, 2))
                results.append(row)
                print(
                    f"  {rows:>7,} rows {mode:8s} peak after prepare {row['peak_after_prepare_mb']:8.1f} MB"
                    + (f", after load_all {row['peak_after_load_all_mb']:8.1f} MB" if mode == "control" else ""),
                    flush=True,
                )
    header = [
        "rows",
        "CSV MB",
        "mode",
        "RSS before MB",
        "peak after prepare MB",
        "RSS after MB",
        "prepare s",
        "eval sets MB",
        "recipe B",
        "peak after load_all MB",
    ]
    table = [
        [
            f"{r['rows']:,}",
            f"{r['csv_mb']:.1f}",
            r["mode"],
            f"{r['rss_before_mb']:.0f}",
            f"{r['peak_after_prepare_mb']:.0f}",
            f"{r['rss_after_prepare_mb']:.0f}",
            f"{r['prepare_s']:.1f}",
            f"{r['eval_sets_mb']:.2f}",
            f"{r['recipe_bytes']:,}",
            f"{r['peak_after_load_all_mb']:.0f}" if "peak_after_load_all_mb" in r else "-",
        ]
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    print("\n" + "\n".join("  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in [header] + table))
    by = {(r["rows"], r["mode"]): r for r in results}
    small, large = min(args.rows), max(args.rows)
    if small != large:
        for mode in ("cold", "warm"):
            grow = by[(large, mode)]["peak_after_prepare_mb"] - by[(small, mode)]["peak_after_prepare_mb"]
            print(f"{mode}: peak after prepare grows {grow:+.0f} MB from {small:,} to {large:,} training rows")
        grow = by[(large, "control")]["peak_after_load_all_mb"] - by[(small, "control")]["peak_after_load_all_mb"]
        print(f"control (driver loads every training row): {grow:+.0f} MB")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "driver_memory", "results": results}, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
