"""Full weights vs LoRA adapters (r = 8), per strategy: bytes by phase and accuracy.

    python -m benchmarks.lora_table [--models minilm smollm2] [--weights full lora] [--out runs/lora_table]

For each model it runs the example config (examples/lora_<model>.yaml: lo-fi, DDP and SPSA on
the same data) twice, each in a fresh `raylowcomm run` process: once as it is (adapters) and
once with `model.lora=null` and the full-weight learning rates below. It prints one row per
model, weights and strategy, and lo-fi's collected bytes with adapters as a share of full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Full fine-tunes want smaller steps than adapters: MiniLM's main-job lr; SmolLM2's SPSA example lr.
FULL_WEIGHTS = {
    "minilm": ["model.lora=null", "optim.lr=1.0e-4", "spsa.lr=1.0e-5"],
    "smollm2": ["model.lora=null", "optim.lr=1.0e-5", "spsa.lr=1.0e-6"],
}


def run_config(model: str, weights: str, out: Path) -> list[dict]:
    config = ROOT / "examples" / f"lora_{model}.yaml"
    command = [sys.executable, "-m", "raylowcomm.cli", "run", str(config), "--out", str(out)]
    for override in FULL_WEIGHTS[model] if weights == "full" else []:
        command += ["--set", override]
    print(f"$ {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"{model} {weights} failed (exit {proc.returncode})")
    print(f"  {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads((out / "results.json").read_text())


def collected(record: dict) -> int:
    """What lo-fi's driver collected from the nodes at the end: their weights or adapters."""
    kinds = record["comm"]["by_kind"]
    return kinds.get("final/node_weights", 0) + kinds.get("final/node_adapters", 0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(FULL_WEIGHTS), default=sorted(FULL_WEIGHTS))
    parser.add_argument("--weights", nargs="*", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument(
        "--reuse", action="store_true", help="weights not in --weights: read the runs OUT already holds"
    )
    parser.add_argument("--out", default="runs/lora_table")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = []
    for model in args.models:
        for weights in ("full", "lora"):
            folder = out / f"{model}_{weights}"
            if weights in args.weights:
                records = run_config(model, weights, folder)
            elif args.reuse and (folder / "results.json").exists():
                records = json.loads((folder / "results.json").read_text())
            else:
                continue
            for r in records:
                if "error" in r:
                    raise SystemExit(f"{model} {weights} {r['strategy']}: {r['error']}")
                m, phase = r["metrics"], r["comm"]["by_phase"]
                rows.append(
                    {
                        "model": model,
                        "weights": weights,
                        "strategy": r["strategy"],
                        "setup": phase["setup"],
                        "train": phase["train"],
                        "final": phase["final"],
                        "collected": collected(r) if r["strategy"] == "lofi" else None,
                        "id_accuracy": m.get("id_accuracy"),
                        "shift_accuracy": m.get("shift_accuracy"),
                        "wall_s": r["wall_s"],
                    }
                )
    print(
        f"\n{'model':8s} {'weights':7s} {'strategy':8s} {'setup MB':>10s} {'train MB':>10s} {'final MB':>10s} "
        f"{'ID acc':>7s} {'shift acc':>9s} {'wall s':>7s}"
    )
    for row in rows:
        print(
            f"{row['model']:8s} {row['weights']:7s} {row['strategy']:8s} {row['setup'] / 1e6:10.3f} "
            f"{row['train'] / 1e6:10.3f} {row['final'] / 1e6:10.3f} {row['id_accuracy']:7.3f} "
            f"{row['shift_accuracy']:9.3f} {row['wall_s']:7.0f}"
        )
    for model in args.models:
        lofi = {r["weights"]: r["collected"] for r in rows if r["model"] == model and r["strategy"] == "lofi"}
        if len(lofi) < 2:
            continue
        full, lora = lofi["full"], lofi["lora"]
        print(f"{model}: lo-fi collected {lora:,} B with adapters vs {full:,} B full ({100 * lora / full:.2f}%)")
    result = {"rows": rows}
    (out / "lora_table.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
