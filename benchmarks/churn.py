"""Churn, measured: lock-step rounds, quorum rounds, sync by time and DDP with one slow node and
preemptions, against the same runs without churn.

    python -m benchmarks.churn [--seeds 0 1 2] [--settings NAME ...] [--out runs/bench/churn.json] [--cpu-quota]

The workload is examples/lofi_vs_ddp_mnist.yaml on 4 nodes of half a CPU each (2 × 2 on this
machine's cores), 1,000 images a node, 62 steps. Churn: node 3 runs 3× slower, and one of the other
three, drawn from the seed, is preempted at steps 16, 31 and 47, each quarter of the run (drawn
among the nodes at full speed so that every setting sees its three preemptions: under quorum
rounds the slow node may never reach step 47). DDP's Ray Train restarts its group, lo-fi the node;
`nodes.max_restarts` is 3 so that DDP's group survives all three. Every (setting, seed) is one
`raylowcomm run` into OUT_DIR/churn/<setting>/seed_<s>; a run already there is read, not repeated.
Prints a table (mean and 95% Student-t interval over the seeds: ID and shift accuracy, goodput,
training wall time, late payloads, restarts) and writes the JSON and a plot of final ID accuracy
against training wall time. The target is 95% of DDP's mean final ID accuracy without churn; a
setting's time to finish counts as its time to target when its final model reaches it (quorum
rounds keep no learning curve), so it is an upper bound. A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

from raylowcomm.runner import run
from raylowcomm.seedstats import interval, plus_minus
from raylowcomm.strategies import load_config

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "examples" / "lofi_vs_ddp_mnist.yaml"
logger = logging.getLogger(__name__)

BASE = ["nodes.count=4", "nodes.cpus=0.5", "nodes.max_restarts=3", "data.train_size=4000", "checkpoint_every=8"]
_ROUNDS = ["strategies=[lofi]", "lofi.exchange=peers", "lofi.compress=int4"]
SETTINGS: dict[str, tuple[list[str], bool]] = {
    # name: (overrides, with churn)
    "ddp_clean": (["strategies=[ddp]"], False),
    "sync_clean": ([*_ROUNDS, "lofi.average_every=8"], False),
    "ddp": (["strategies=[ddp]"], True),
    "sync": ([*_ROUNDS, "lofi.average_every=8"], True),
    "quorum": ([*_ROUNDS, "lofi.average_every=8", "lofi.quorum=3", "lofi.grace_s=2.0"], True),
    "quorum_half": ([*_ROUNDS, "lofi.average_every=8", "lofi.quorum=0.5", "lofi.grace_s=2.0"], True),
    "time": ([*_ROUNDS, "lofi.sync=time", "lofi.sync_every_s=2.0"], True),
    "quorum_half_keep": (
        [*_ROUNDS, "lofi.average_every=8", "lofi.quorum=0.5", "lofi.grace_s=2.0", "lofi.keep_training=true"],
        True,
    ),
    "time_keep": ([*_ROUNDS, "lofi.sync=time", "lofi.sync_every_s=2.0", "lofi.keep_training=true"], True),
}
SLOW_NODE, SLOW_FACTOR, KILL_STEPS = 3, 3, (16, 31, 47)


def churn(seed: int) -> list[str]:
    """The churn of seed `seed`: the slow node, and a victim drawn from the seed at each quarter's step
    among the other nodes (with quorum rounds the slow node may never reach step 47: every setting gets
    its three preemptions)."""
    draw = random.Random(seed)
    others = [k for k in range(4) if k != SLOW_NODE]
    kills = ",".join(f"{{node: {draw.choice(others)}, at_step: {s}}}" for s in KILL_STEPS)
    return [f"churn.slow=[{{node: {SLOW_NODE}, factor: {SLOW_FACTOR}}}]", f"churn.kill=[{kills}]"]


def measure(out: Path, setting: str, seed: int, cpu_quota: bool = False) -> dict:
    """One run's figures: read from its results.json, or run it first (`cpu_quota`: every node held to its
    half CPU, `churn.cpu_quota`)."""
    where = out / "churn" / setting / f"seed_{seed}"
    path = where / "results.json"
    if not path.is_file():
        overrides, churned = SETTINGS[setting]
        quota = ["churn.cpu_quota=true"] if cpu_quota else []
        cfg = load_config(WORKLOAD, [*BASE, *overrides, *(churn(seed) if churned else []), *quota, f"seed={seed}"])
        logger.info("churn: %s seed %d -> %s", setting, seed, where)
        run(cfg, where, bar=False)
    [rec] = json.loads(path.read_text())
    row = {"setting": setting, "seed": seed}
    if "error" in rec:
        logger.warning("churn: %s seed %d failed: %s", setting, seed, rec["error"])
        return {**row, "error": rec["error"]}
    good, details = rec.get("goodput") or {}, rec["details"]
    return {
        **row,
        "id": rec["metrics"]["id_accuracy"],
        "shift": rec["metrics"].get("shift_accuracy"),
        "goodput": good.get("goodput"),
        "train_s": rec["train_s"],
        "wall_s": rec["wall_s"],
        "restarts": good.get("restarts"),
        "late_payloads": good.get("late_payloads", 0),
        "events": len(details.get("churn", [])),
        "after_setup_bytes": rec["comm"]["by_phase"].get("train", 0) + rec["comm"]["by_phase"].get("final", 0),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per setting: mean and interval over the seeds of every figure, and whether the mean final ID
    accuracy reaches the target (95% of DDP's without churn)."""
    groups: dict[str, list[dict]] = {}
    for r in (r for r in rows if "error" not in r):
        groups.setdefault(r["setting"], []).append(r)
    clean = groups.get("ddp_clean")
    target = 0.95 * interval([r["id"] for r in clean])["mean"] if clean else None
    out = []
    for setting, rs in groups.items():
        row = {"setting": setting, "seeds": sorted(r["seed"] for r in rs), "target": target}
        for key in ("id", "shift", "goodput", "train_s", "late_payloads", "restarts"):
            values = [r[key] for r in rs if r.get(key) is not None]
            row[key] = interval(values) if values else None
        reached = [r["train_s"] for r in rs if target is not None and r["id"] >= target]
        row["finish_at_target_s"] = interval(reached) if len(reached) == len(rs) else None
        out.append(row)
    return out


def table(summary: list[dict]) -> str:
    head = ["setting", "seeds", "ID acc", "shift acc", "goodput %", "train s", "late payloads", "restarts", "reached"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary:
        reached = "all seeds" if r["finish_at_target_s"] is not None else "not every seed"
        cells = [
            r["setting"],
            str(len(r["seeds"])),
            plus_minus(r["id"], 3),
            plus_minus(r["shift"], 3),
            plus_minus(r["goodput"], 1, 100),
            plus_minus(r["train_s"], 0),
            plus_minus(r["late_payloads"]),
            plus_minus(r["restarts"]),
            reached,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    target = summary[0]["target"] if summary else None
    return (f"target ID accuracy {target:.3f} (95% of DDP's without churn)\n" if target else "") + "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setting in SETTINGS:
        pts = [(r["train_s"], r["id"]) for r in rows if r["setting"] == setting and "error" not in r]
        if pts:
            ax.scatter(*zip(*pts), label=setting)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("final ID accuracy")
    ax.set_title("4 nodes: node 3 at 1/3 speed, a preemption each quarter (not *_clean)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default="runs/bench/churn.json", help="the JSON to write (runs go beside it)")
    parser.add_argument(
        "--cpu-quota",
        action="store_true",
        help="hold each node to its half CPU (churn.cpu_quota: a cgroup; root), as on its own machine",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.out)
    rows = [measure(path.parent, s, seed, args.cpu_quota) for seed in args.seeds for s in args.settings]
    summary = summarize(rows)
    plot_path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, plot_path)
    path.write_text(json.dumps({"summary": summary, "runs": rows, "plot": plot_path.name}, indent=2))
    print(table(summary), flush=True)
    print(f"wrote {path} and {plot_path}")


if __name__ == "__main__":
    main()
