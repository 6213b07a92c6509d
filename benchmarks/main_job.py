"""The README's main job, timed end to end as a new user runs it, with where the time went.

    python -m benchmarks.main_job [--config examples/lofi_vs_ddp_minilm.yaml] [--out runs/main_job]

Runs `raylowcomm run CONFIG` in a fresh process and prints its wall time beside the breakdown
the run writes (OUT/timings.json): interpreter start and imports (what the run does not see),
model and data loading (asset materialisation included), Ray start, and per strategy its
training time and the rest (actors, data out, evaluation, collection), then the accuracy table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "lofi_vs_ddp_minilm.yaml"))
    parser.add_argument("--out", default="runs/main_job")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "raylowcomm.cli", "run", args.config, "--out", args.out]
    for override in args.overrides:
        command += ["--set", override]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"the main job failed (exit {proc.returncode})")
    timings = json.loads((Path(args.out) / "timings.json").read_text())
    records = json.loads((Path(args.out) / "results.json").read_text())
    rows = [
        ("model load", timings["model_load_s"]),
        ("data load", timings["data_load_s"]),
        ("Ray start", timings["ray_start_s"]),
    ]
    for r in records:
        t = timings[r["strategy"]]
        rows += [
            (f"{r['strategy']}: training", t["train_s"]),
            (f"{r['strategy']}: setup, evaluation, collection", t["setup_eval_collect_s"]),
        ]
    rows.insert(0, ("interpreter, imports, teardown", wall - sum(v for _, v in rows)))
    print(f"main job: {' '.join(command[1:])}\nwall {wall:.1f} s")
    for label, seconds in rows:
        print(f"  {label:42s} {seconds:7.1f} s")
    for r in records:
        parts = timings[r["strategy"]].get("phases_s") or {}
        print(f"  {r['strategy']} parts: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    for r in records:
        m, c = r["metrics"], r["comm"]["by_phase"]
        print(
            f"  {r['strategy']:12s} id_accuracy {m.get('id_accuracy', float('nan')):.4f}  "
            f"bytes setup/train/final {c['setup'] / 1e6:,.1f} / {c['train'] / 1e6:,.1f} / {c['final'] / 1e6:,.1f} MB"
        )
    result = {
        "wall_s": wall,
        "breakdown": dict(rows),
        "records": [{k: r[k] for k in ("strategy", "metrics", "comm")} for r in records],
    }
    (Path(args.out) / "main_job.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
