"""Interlocking backprop step time and accuracy at a fixed wall-clock budget, for n = 1 .. K.

Same model, data, K, micro-batching and budget for every n (rule `farthest`, so n = K is
end-to-end backprop); each n trains for `--budget` seconds of wall time and is then scored.
Step time is the steady-state one (median interval between optimizer steps of the slowest
stage), so pipeline fill and the final drain do not count; the ratio is to n = K. With
`--balance measured` (the default) units and aux heads are timed once and that split is used
for every n; the table prints each stage's measured cost beside the ratio.

    python benchmarks/interlocking_steptime.py --budget 60 --out runs/interlocking_steptime.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from raylowcomm.common.batches import batch_at
from raylowcomm.core.interlock.splitting import balanced_sizes, measure_balance
from raylowcomm.runner import prepare
from raylowcomm.runtime import init_ray
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.interlocking import Interlocking
from raylowcomm.tasks import ImageClassification


def base_config(stages: int, micro_batches: int, batch_size: int, balance: str) -> dict:
    """resnet10t from random init (no pretrained ResNet is bundled offline) on MNIST 32x32."""
    return {
        "model": {"name": "resnet10t", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 4000, "test_size": 1000, "image_size": 32, "shift": "none"},
        "optim": {
            "name": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 2e-4,
            "batch_size": batch_size,
            "epochs": 100,
        },
        "nodes": {"cpus": 1},
        "strategies": ["interlocking"],
        "log_every": 1000,
        "interlocking": {
            "stages": stages,
            "rule": "farthest",
            "micro_batches": micro_batches,
            "balance": balance,
            "aux_widths": [64, 32],
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--balance",
        default="measured",
        choices=["blocks", "params", "measured"],
        help="measured: units and aux heads timed once, that split for every n",
    )
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of training per n")
    ap.add_argument("--out", default="runs/interlocking_steptime.json")
    args = ap.parse_args(argv)

    raw = base_config(args.stages, args.micro_batches, args.batch_size, args.balance)
    raw["interlocking"]["time_budget_s"] = args.budget
    cfg = from_dict(raw)
    out = Path(args.out)
    ctx = prepare(cfg, out.parent / (out.stem + "_runs"))
    stage_costs = None
    if args.balance == "measured":
        x = ImageClassification(32).inputs(
            batch_at(ctx.data.eval_sets["test"], 0, args.batch_size // args.micro_batches, cfg.seed)
        )
        model = ctx.load_driver_weights()
        costs = measure_balance(model, "timm", x, ctx.spec.num_classes, raw["interlocking"]["aux_widths"], cpus=1)
        sizes = balanced_sizes(costs.units, args.stages, costs.boundaries)
        ends = [sum(sizes[: k + 1]) for k in range(args.stages)]
        stage_costs = [
            sum(costs.units[e - s : e]) + (costs.boundaries[e - 1] if k < args.stages - 1 else 0.0)
            for k, (s, e) in enumerate(zip(sizes, ends))
        ]
        raw["interlocking"]["split"] = sizes
        cfg = from_dict(raw)
    init_ray(num_cpus=args.stages)
    rows = []
    for n in range(1, args.stages + 1):
        run_cfg = copy.deepcopy(cfg)
        Interlocking.opts(run_cfg).n = n
        run_ctx = RunContext(run_cfg, ctx.load_driver_weights(), ctx.spec, ctx.data, ctx.out_dir / f"n{n}")
        rec = Interlocking().run(run_ctx).to_dict()
        d = rec["details"]
        rows.append(
            {
                "n": n,
                "steady_step_time_s": d["steady_step_time_s"],
                "mean_step_time_s": d["step_time_s"],
                "batches": d["batches"],
                "train_s": rec["train_s"],
                "samples_per_s": rec["samples_per_s"],
                "busy_fraction": d["busy_fraction"],
                "id_accuracy": rec["metrics"]["id_accuracy"],
                "aux_accuracy": [h["accuracy"] for h in d["heads"]["test"].values()][:-1],
                "train_bytes": rec["comm"]["by_phase"]["train"],
                "units_per_stage": d["units_per_stage"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    ref = rows[-1]["steady_step_time_s"]
    for r in rows:
        r["ratio_to_end_to_end"] = r["steady_step_time_s"] / ref
    print(
        f"\nK={args.stages}, {args.micro_batches} micro-batches of {args.batch_size // args.micro_batches}, "
        f"budget {args.budget:.0f} s per n, rule farthest (n=K: end-to-end), "
        f"units per stage {rows[0]['units_per_stage']}"
        + (
            f", measured stage costs (units + aux head, fwd+bwd per micro-batch) "
            f"{' / '.join(f'{c * 1000:.1f} ms' for c in stage_costs)}"
            if stage_costs
            else ""
        )
    )
    print(
        f"{'n':>2}  {'step s':>7}  {'ratio':>5}  {'mean step s':>11}  {'batches':>7}  {'busy':>11}  "
        f"{'final acc':>9}  aux acc"
    )
    for r in rows:
        print(
            f"{r['n']:>2}  {r['steady_step_time_s']:7.3f}  {r['ratio_to_end_to_end']:5.2f}  "
            f"{r['mean_step_time_s']:11.3f}  {r['batches']:>7}  "
            f"{'/'.join(f'{b:.2f}' for b in r['busy_fraction']):>11}  {r['id_accuracy']:9.4f}  "
            f"{' '.join(f'{a:.4f}' for a in r['aux_accuracy'])}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": raw, "rows": rows, "stage_costs_s": stage_costs}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
