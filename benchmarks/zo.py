"""Zeroth-order estimators: held-out accuracy vs steps and vs forward passes, on the SmolLM2 prompt
task or on the WAN bench's classifier.

    python -m benchmarks.zo [--workload smollm2|wan] [--variants two_point one_sided] [--seeds 0,1,2]
                            [--out runs/zo] [--set KEY=VALUE ...] [--nodes 1,2,4 --target 0.65]

Each variant is the workload's example (smollm2: examples/spsa_smollm2_rotten_tomatoes.yaml; wan:
examples/wan_compare.yaml's SPSA, the pretrained EfficientNet-Lite0's new classifier on MNIST, one
replica over all 2,000 rows) with its estimator, step rule, samples and lr (WORKLOADS). A run is one
SPSA node's replica in this process, without Ray: the driver's
`prepare` (same model, held-out rows and training shard as `raylowcomm run`), then the nodes' own
step (`raylowcomm.strategies.spsa.step_as_nodes`: each node's codes on its batch, all of them applied), so the
weights are bit for bit those of a one-node `raylowcomm run` of the same config (tested) at a
third of its memory: no second model copy in an actor, no Ray. It scores the held-out set at step
0 (zero-shot) and every `eval_every` steps, and prints, per variant, the mean held-out accuracy
over the seeds at each evaluated step and forward count, and the final accuracy's mean ± 95%
interval. A benchmark: it prints figures and asserts nothing; runs/zo/<variant>/seed_<s>.json
keeps each run's curve, so `--reuse` rebuilds the tables and a variant's seeds can run in
separate processes (`--variants two_point --seeds 1`).

`--nodes 1,2,4 --target 0.65`: SPSA across machines, samples per node fixed, so a step at N nodes
averages N times the perturbations (each node's on its own batch of its 1/N shard); every run stops
at the first evaluated step at the target, and the table gives the steps to it at each N, their
ratio to one node's paired by seed, and OUT/<variant>_nodes.png the curves.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TWO_POINT = ["spsa.estimator=two_point", "spsa.step=plain", "spsa.samples=1", "spsa.lr=3.0e-2"]
"""The SmolLM2 example's two-point recipe (its default until 2026-12-05; final norm only): the variants name
every setting they measure, so they stay those recipes whatever the example's defaults become."""

WORKLOADS: dict[str, tuple[Path, list[str], dict[str, list[str]]]] = {
    # (example, overrides every variant takes, variants). The SmolLM2 example is the one-sided recipe (final
    # norm only, one-sided batch of 3 + 1 base, normalised steps, lr 1e-2); the others change what they name.
    "smollm2": (
        ROOT / "examples" / "spsa_smollm2_rotten_tomatoes.yaml",
        [],
        {
            "two_point": TWO_POINT,
            "one_sided": ["spsa.estimator=one_sided_batch", "spsa.step=normalised", "spsa.samples=3", "spsa.lr=1.0e-2"],
            # MeZO's full-parameter recipe (the example before it tuned the final norm only): for comparison.
            "two_point_all": [*TWO_POINT, "spsa.include=null", "spsa.lr=1.0e-5"],
            # LoRA adapters (r 8 on q_proj and v_proj, peft's default for Llama): the norm is frozen under peft.
            "two_point_lora": [*TWO_POINT, "model.lora.r=8", "spsa.include=null", "spsa.lr=1.0e-3"],
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


def run_replica(cfg, out: Path, nodes: int = 1, target: float | None = None) -> dict:
    """SPSA on `nodes` nodes in this process, one replica standing for all (they are bit-identical): each
    step it computes node k's codes on node k's batch of its shard (1/nodes of the training set, its own
    seeds), then applies every node's codes in node order, as each node of a `nodes.count` run does.
    Returns its curve (step, forwards in all, held-out accuracy and loss, training seconds so far) from
    step 0, the first evaluated step at `target` accuracy (where it stops), and its final parameter hash."""
    import torch

    from raylowcomm.common.hashing import parameter_hash
    from raylowcomm.runner import prepare
    from raylowcomm.strategies.base import eval_points
    from raylowcomm.strategies.spsa import Spsa, planned_steps, step_as_nodes
    from raylowcomm.tasks import make_task, score_sets

    torch.set_num_threads(max(1, int(cfg.nodes.cpus)))  # a node's threads
    ctx, o = prepare(cfg, out), Spsa.opts(cfg)
    shards, task = [ctx.data.train.load(k, nodes) for k in range(nodes)], make_task(ctx.data.task)
    steps = planned_steps(cfg, o, ctx.data.train.sizes(nodes))
    Spsa.validate(cfg)
    replica = o.make_replica(ctx.load_driver_weights(), 0, cfg.seed, cfg.optim)
    sets, train_s, points, reached = ctx.eval_sets(val=False), 0.0, [], None
    scored = {0, *eval_points(cfg, steps), steps}  # the driver's: before the first step, its curve's, the last
    for step in range(steps + 1):
        if step in scored:
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
            if target is not None and points[-1]["accuracy"] >= target:
                reached = step
                break
        if step == steps:
            break
        t0 = time.perf_counter()
        step_as_nodes(replica, task.loss, shards, cfg, step)
        train_s += time.perf_counter() - t0
    return {
        "seed": cfg.seed,
        "nodes": nodes,
        "curve": points,
        "target": target,
        "steps_to_target": reached,
        "hash": parameter_hash(replica.params),
    }


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
    workload: str,
    name: str,
    seeds: list[int],
    overrides: list[str],
    out: Path,
    reuse: bool,
    nodes: int = 1,
    target: float | None = None,
) -> list[dict]:
    """Each seed's run of a variant on `nodes` nodes: read from OUT/<name>/seed_<s>.json (OUT/<name>/n<N>/…
    with a target or N > 1) with `reuse`, else run and saved there."""
    from raylowcomm.strategies import load_config

    config, common, variants = WORKLOADS[workload]
    folder = out / name if nodes == 1 and target is None else out / name / f"n{nodes}"
    runs = []
    for seed in seeds:
        path = folder / f"seed_{seed}.json"
        if not (reuse and path.exists()):
            cfg = load_config(
                str(config), common + variants[name] + overrides + [f"seed={seed}", f"nodes.count={nodes}"]
            )
            print(
                f"{workload} {name}, {nodes} node(s), seed {seed}: {' '.join(variants[name] + overrides)}", flush=True
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run_replica(cfg, folder / f"seed_{seed}", nodes, target), indent=2))
        runs.append(json.loads(path.read_text()))
    return runs


def scaling(runs_by_n: dict[int, list[dict]]) -> dict:
    """Steps and forwards to the target at each N (mean ± 95% interval over the seeds that reached it), and
    each N's steps over N = 1's, paired by seed."""
    from raylowcomm.seedstats import interval

    base = {r["seed"]: r["steps_to_target"] for r in runs_by_n.get(1, [])}
    table = {}
    for n, runs in runs_by_n.items():
        hit = [r for r in runs if r["steps_to_target"] is not None]
        last = [r["curve"][-1] for r in runs if r["curve"][-1]["step"]]
        per_step = last[0]["forwards"] // last[0]["step"] if last else None
        ratios = [r["steps_to_target"] / base[r["seed"]] for r in hit if base.get(r["seed"])]
        table[n] = {
            "steps": interval([r["steps_to_target"] for r in hit]) if hit else None,
            "per_seed": {r["seed"]: r["steps_to_target"] for r in runs},
            "forwards_per_node_per_step": per_step // n if per_step else None,
            "vs_one_node": interval(ratios) if ratios else None,
            "missed": [r["seed"] for r in runs if r["steps_to_target"] is None],
        }
    return table


def plot_scaling(runs_by_n: dict[int, list[dict]], path: Path, target: float) -> None:
    """Held-out accuracy against steps, every run, one colour per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (n, runs) in enumerate(sorted(runs_by_n.items())):
        for j, r in enumerate(runs):
            steps, acc = [p["step"] for p in r["curve"]], [100 * p["accuracy"] for p in r["curve"]]
            ax.plot(steps, acc, color=f"C{i}", alpha=0.8, label=f"N = {n}" if j == 0 else None)
    ax.axhline(100 * target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    parser.add_argument(
        "--nodes",
        default="1",
        help="comma-separated node counts (samples per node fixed: N nodes, N x the perturbations)",
    )
    parser.add_argument(
        "--target", type=float, help="held-out accuracy (e.g. 0.65): each run stops there; steps to it at each N"
    )
    parser.add_argument("--out", default="runs/zo")
    args = parser.parse_args(argv)
    out, seeds, result = Path(args.out), [int(s) for s in args.seeds.split(",")], {}
    unknown = set(args.variants) - set(WORKLOADS[args.workload][2])
    if unknown:
        parser.error(f"no variant {', '.join(sorted(unknown))} for --workload {args.workload}")
    counts = [int(n) for n in args.nodes.split(",")]
    if args.target is not None or counts != [1]:
        return scaling_main(args, seeds, counts, out)
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


def scaling_main(args, seeds: list[int], counts: list[int], out: Path) -> dict:
    """--nodes / --target: each variant at each N, steps to the target, the table and the plot."""
    from raylowcomm.seedstats import plus_minus

    if args.target is None:
        raise SystemExit("--nodes needs --target: the accuracy whose steps are compared across N")
    result = {}
    for name in args.variants:
        runs_by_n = {
            n: variant_runs(args.workload, name, seeds, args.overrides, out, args.reuse, n, args.target) for n in counts
        }
        result[name] = scaling(runs_by_n)
        plot_scaling(runs_by_n, out / f"{name}_nodes.png", args.target)
        print(f"\n{name}: steps to {100 * args.target:.0f}% held-out accuracy (seeds {seeds})")
        print(f"{'N':>3s} {'steps':>14s} {'per seed':>22s} {'fwd/node/step':>14s} {'vs N = 1':>14s}  missed")
        for n, row in result[name].items():
            steps = row["steps"]
            ratio = row["vs_one_node"]
            print(
                f"{n:3d} {plus_minus(steps, 1):>14s} {str(list(row['per_seed'].values())):>22s} "
                f"{row['forwards_per_node_per_step'] or '-':>14} {plus_minus(ratio, 2):>14s}  {row['missed'] or ''}"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "zo_nodes.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
