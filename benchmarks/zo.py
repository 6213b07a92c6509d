"""Zeroth-order estimators: held-out accuracy vs steps and vs forward passes, on the SmolLM2 prompt
task or on the WAN bench's classifier.

    python -m benchmarks.zo [--workload smollm2|wan] [--variants two_point one_sided] [--seeds 0,1,2]
                            [--out runs/zo] [--set KEY=VALUE ...]

Each variant is the workload's example (smollm2: examples/spsa_smollm2_rotten_tomatoes.yaml; wan:
examples/wan_compare.yaml's SPSA, the pretrained EfficientNet-Lite0's new classifier on MNIST, one
replica over all 2,000 rows) with its estimator, step rule, samples and lr (WORKLOADS). A run is one
SPSA node's replica in this process, without Ray: the driver's
`prepare` (same model, held-out rows and training shard as `raylowcomm run`), then the node's own
loop, `Replica.compute` on `batch_at` of its shard and `Replica.apply` of its codes, so the
weights are bit for bit those of a one-node `raylowcomm run` of the same config (tested) at a
third of its memory: no second model copy in an actor, no Ray. It scores the held-out set at step
0 (zero-shot) and every `eval_every` steps, and prints, per variant, the mean held-out accuracy
over the seeds at each evaluated step and forward count, and the final accuracy's mean ± 95%
interval. A benchmark: it prints figures and asserts nothing; runs/zo/<variant>/seed_<s>.json
keeps each run's curve, so `--reuse` rebuilds the tables and a variant's seeds can run in
separate processes (`--variants two_point --seeds 1`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS: dict[str, tuple[Path, list[str], dict[str, list[str]]]] = {
    # (example, overrides every variant takes, variants). The example is the two-point recipe (final norm
    # only, plain steps, lr 3e-2); the others change what they name.
    "smollm2": (
        ROOT / "examples" / "spsa_smollm2_rotten_tomatoes.yaml",
        [],
        {
            "two_point": [],
            "one_sided": ["spsa.estimator=one_sided_batch", "spsa.step=normalised", "spsa.samples=3", "spsa.lr=1.0e-2"],
            # MeZO's full-parameter recipe (the example before it tuned the final norm only): for comparison.
            "two_point_all": ["spsa.include=null", "spsa.lr=1.0e-5"],
            # LoRA adapters (r 8 on q_proj and v_proj, peft's default for Llama): the norm is frozen under peft.
            "two_point_lora": ["model.lora.r=8", "spsa.include=null", "spsa.lr=1.0e-3"],
        },
    ),
    # The WAN bench's SPSA: the new classifier only (12,810 weights), 4 samples a step, lr 0.06, 62 steps
    # (2 epochs); `--set spsa.steps=N` runs longer, as SPSA's bytes allow.
    "wan": (
        ROOT / "examples" / "wan_compare.yaml",
        ["strategies=[spsa]", "nodes.count=1", "eval_every=31"],
        {
            "two_point": [],
            "one_sided": ["spsa.estimator=one_sided_batch", "spsa.step=normalised", "spsa.lr=2.0e-2"],
        },
    ),
}


def run_replica(cfg, out: Path) -> dict:
    """One node's SPSA run of `cfg` in this process: its curve (step, forwards, held-out accuracy and
    loss, training seconds so far) from step 0 and its final parameter hash."""
    import torch

    from raylowcomm.common.batches import batch_at, group_seed
    from raylowcomm.common.hashing import parameter_hash
    from raylowcomm.common.seeding import node_seed
    from raylowcomm.runner import prepare
    from raylowcomm.strategies.spsa import Spsa
    from raylowcomm.tasks import make_task, score_sets
    from raylowcomm.training import autocast, total_steps

    torch.set_num_threads(max(1, int(cfg.nodes.cpus)))  # a node's threads
    ctx, o = prepare(cfg, out), Spsa.opts(cfg)
    shard, task = ctx.data.train.load(0, 1), make_task(ctx.data.task)
    steps = o.steps or total_steps(cfg.optim, ctx.data.train.sizes(1)[0])
    Spsa.validate(cfg)
    replica = o.make_replica(ctx.load_driver_weights(), 0, cfg.seed, cfg.optim)
    sets, train_s, points = ctx.eval_sets(val=False), 0.0, []
    for step in range(steps + 1):
        if step % (cfg.eval_every or steps) == 0 or step == steps:
            metrics = score_sets(task, ctx.load_driver_weights(), sets, cfg.eval_rows)
            points.append(
                {
                    "step": step,
                    "forwards": replica.forwards,
                    "accuracy": metrics["id_accuracy"],
                    "loss": metrics["id_loss"],
                    "train_s": round(train_s, 1),
                }
            )
            print(f"  seed {cfg.seed} step {step}: {points[-1]}", flush=True)
        if step == steps:
            break
        t0 = time.perf_counter()
        with autocast(cfg.optim.precision, "cpu"):
            batch = batch_at(shard, step, cfg.optim.batch_size, node_seed(cfg.seed, 0), group_seed(cfg))
            replica.compute(task.loss, batch)
        replica.apply([0], b"")
        train_s += time.perf_counter() - t0
    return {"seed": cfg.seed, "curve": points, "hash": parameter_hash(replica.params)}


def mean_curve(runs: list[dict]) -> list[dict]:
    """The seeds' curves point by point (they evaluate at the same steps): mean accuracy and loss."""
    rows = []
    for points in zip(*(r["curve"] for r in runs), strict=True):
        n = len(points)
        rows.append(
            {
                "step": points[0]["step"],
                "forwards": points[0]["forwards"],
                "accuracy": sum(p["accuracy"] for p in points) / n,
                "loss": sum(p["loss"] for p in points) / n,
                "per_seed": [round(p["accuracy"], 4) for p in points],
            }
        )
    return rows


def variant_runs(
    workload: str, name: str, seeds: list[int], overrides: list[str], out: Path, reuse: bool
) -> list[dict]:
    """Each seed's run of a variant: read from OUT/<name>/seed_<s>.json with `reuse`, else run and saved there."""
    from raylowcomm.strategies import load_config

    config, common, variants = WORKLOADS[workload]
    runs = []
    for seed in seeds:
        path = out / name / f"seed_{seed}.json"
        if not (reuse and path.exists()):
            cfg = load_config(str(config), common + variants[name] + overrides + [f"seed={seed}"])
            print(f"{workload} {name}, seed {seed}: {' '.join(variants[name] + overrides)}", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run_replica(cfg, out / name / f"seed_{seed}"), indent=2))
        runs.append(json.loads(path.read_text()))
    return runs


def main(argv: list[str] | None = None) -> dict:
    from raylowcomm.seedstats import interval

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smollm2")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["two_point", "one_sided"],
        help="the workload's: " + "; ".join(f"{w}: {', '.join(v[2])}" for w, v in WORKLOADS.items()),
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override every variant's config, as raylowcomm run --set",
    )
    parser.add_argument("--reuse", action="store_true", help="read the runs OUT already holds instead of rerunning")
    parser.add_argument("--out", default="runs/zo")
    args = parser.parse_args(argv)
    out, seeds, result = Path(args.out), [int(s) for s in args.seeds.split(",")], {}
    unknown = set(args.variants) - set(WORKLOADS[args.workload][2])
    if unknown:
        parser.error(f"no variant {', '.join(sorted(unknown))} for --workload {args.workload}")
    for name in args.variants:
        runs = variant_runs(args.workload, name, seeds, args.overrides, out, args.reuse)
        result[name] = {
            "curve": mean_curve(runs),
            "seeds": seeds,
            "final": interval([r["curve"][-1]["accuracy"] for r in runs]),
        }
    print(f"\n{'variant':14s} {'step':>5s} {'forwards':>9s} {'accuracy':>9s} {'loss':>7s}  per seed")
    for name, r in result.items():
        for p in r["curve"]:
            print(
                f"{name:14s} {p['step']:5d} {p['forwards']:9d} {100 * p['accuracy']:8.1f}% {p['loss']:7.4f}  "
                f"{', '.join(f'{100 * a:.1f}' for a in p['per_seed'])}"
            )
    for name, r in result.items():
        f = r["final"]
        half = f"± {100 * f['half_width']:.1f}" if f["half_width"] is not None else "(one seed, no interval)"
        print(f"{name}: final held-out accuracy {100 * f['mean']:.1f}% {half} (95%, seeds {r['seeds']})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "zo.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
