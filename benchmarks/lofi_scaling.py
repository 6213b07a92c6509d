"""lo-fi vs DDP on one workload with N = 1 and 2 actors: throughput, scaling, bytes by phase.

    python -m benchmarks.lofi_scaling [--steps 30] [--out runs/bench/lofi_scaling.json]

Prints a table and writes the JSON (the runs go to a folder beside it). A benchmark: it reports
figures, it asserts none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from raylowcomm.runner import prepare
from raylowcomm.runtime import init_ray
from raylowcomm.strategies import STRATEGIES, from_dict


def workload(nodes: int, steps: int) -> dict:
    """Pretrained EfficientNet-Lite0 on MNIST 32x32, the same steps per actor at every N."""
    return {
        "model": {"name": "efficientnet_lite0", "family": "timm"},
        "data": {"name": "mnist", "train_size": 2000, "test_size": 500, "image_size": 32},
        "optim": {"name": "sgd", "lr": 0.05, "batch_size": 32, "epochs": 100, "max_steps": steps},
        "nodes": {"count": nodes, "cpus": 1},
        "strategies": ["lofi", "ddp"],
        "log_every": 1000,
        "lofi": {"bn_recalibrate": False},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per actor")
    parser.add_argument("--out", default="runs/bench/lofi_scaling.json", help="the JSON to write")
    args = parser.parse_args(argv)
    path = Path(args.out)
    out = path.parent
    init_ray()
    rows = []
    for strategy in ("lofi", "ddp"):
        for n in (1, 2):
            cfg = from_dict(workload(n, args.steps))
            ctx = prepare(cfg, out / f"lofi_scaling/{strategy}_n{n}")
            rec = STRATEGIES[strategy]().run(ctx).to_dict()
            rows.append(
                {
                    "strategy": strategy,
                    "nodes": n,
                    "samples_per_s": rec["samples_per_s"],
                    "by_phase": rec["comm"]["by_phase"],
                    "total_bytes": rec["comm"]["total_bytes"],
                    "id_accuracy": rec["metrics"]["id_accuracy"],
                }
            )
    single = {r["strategy"]: r["samples_per_s"] for r in rows if r["nodes"] == 1}
    for r in rows:
        r["scaling_efficiency"] = r["samples_per_s"] / (r["nodes"] * single[r["strategy"]])
    ddp_bytes = {r["nodes"]: r["total_bytes"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        r["bytes_vs_ddp"] = r["total_bytes"] / ddp_bytes[r["nodes"]]
    header = (
        f"{'strategy':8s} {'N':>2s} {'samples/s':>10s} {'eff':>6s} {'setup MB':>9s} {'train MB':>9s} "
        f"{'final MB':>9s} {'total MB':>9s} {'bytes/DDP':>9s}"
    )
    print(header)
    for r in rows:
        p = r["by_phase"]
        print(
            f"{r['strategy']:8s} {r['nodes']:>2d} {r['samples_per_s']:>10.1f} {r['scaling_efficiency']:>6.2f} "
            f"{p['setup'] / 1e6:>9.2f} {p['train'] / 1e6:>9.2f} {p['final'] / 1e6:>9.2f} "
            f"{r['total_bytes'] / 1e6:>9.2f} {r['bytes_vs_ddp']:>9.3f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"steps_per_actor": args.steps, "rows": rows}, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
