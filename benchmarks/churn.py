"""Churn, measured: lock-step rounds, quorum rounds, sync by time and DDP with one slow node and
preemptions, against the same runs without churn.

    python -m benchmarks.churn [--seeds 0 1 2] [--settings NAME ...] [--out runs/bench/churn.json] [--cpu-quota]
        [--epochs 2] [--average-every 8] [--sync-every-s 2.0]

The workload is examples/lofi_vs_ddp_mnist.yaml on 4 nodes of half a CPU each (2 × 2 on this
machine's cores), 1,000 images a node, 31 steps an epoch, 2 epochs (62 steps; `--epochs` for a longer
run, rounds every `--average-every` steps or `--sync-every-s` seconds). Churn: node 3 runs 3× slower,
and one of the other three, drawn from the seed, is preempted at each quarter of the run (steps 16, 31
and 47 of 62; drawn among the nodes at full speed so that every setting sees its three preemptions:
under quorum rounds the slow node may never reach the last). DDP's Ray Train restarts its group, lo-fi the node;
`nodes.max_restarts` is 3 so that DDP's group survives all three. Every (setting, seed) is one
`raylowcomm run` into OUT_DIR/churn/<setting>/seed_<s> (churn_e<epochs>_h<H>_t<T> off the defaults); a
run already there is read, not repeated.
Prints a table (mean and 95% Student-t interval over the seeds: ID and shift accuracy, goodput,
training wall time, late payloads, restarts) and writes the JSON and a plot of final ID accuracy
against training wall time. The target is 95% of DDP's mean final ID accuracy without churn (of lockstep
rounds' where `ddp_clean` is not among the settings); a
setting's time to finish counts as its time to target when its final model reaches it (quorum
rounds keep no learning curve), so it is an upper bound. A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from pathlib import Path

from benchmarks.sweep import seed_record
from raylowcomm.seedstats import interval, plus_minus
from raylowcomm.strategies import load_config

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "examples" / "lofi_vs_ddp_mnist.yaml"
logger = logging.getLogger(__name__)

BASE = ["nodes.count=4", "nodes.cpus=0.5", "nodes.max_restarts=3", "data.train_size=4000", "checkpoint_every=8"]
_ROUNDS = ["strategies=[lofi]", "lofi.exchange=peers", "lofi.compress=int4"]
STEPS_PER_EPOCH, EPOCHS, EVERY, EVERY_S = 31, 2, 8, 2.0
SLOW_NODE, SLOW_FACTOR = 3, 3


def settings(every: int = EVERY, every_s: float = EVERY_S) -> dict[str, tuple[list[str], bool]]:
    """Each setting's overrides and whether it runs under churn, rounds every `every` steps or `every_s`
    seconds."""
    steps, timed = (
        [*_ROUNDS, f"lofi.average_every={every}"],
        [*_ROUNDS, "lofi.sync=time", f"lofi.sync_every_s={every_s}"],
    )
    half = ["lofi.quorum=0.5", "lofi.grace_s=2.0"]
    return {
        "ddp_clean": (["strategies=[ddp]"], False),
        "sync_clean": (steps, False),
        "ddp": (["strategies=[ddp]"], True),
        "sync": (steps, True),
        "quorum": ([*steps, "lofi.quorum=3", "lofi.grace_s=2.0"], True),
        "quorum_half": ([*steps, *half], True),
        "time": (timed, True),
        "time_half": ([*timed, *half], True),
        "quorum_half_keep": ([*steps, *half, "lofi.keep_training=true"], True),
        "time_keep": ([*timed, "lofi.keep_training=true"], True),
    }


SETTINGS = list(settings())


def kill_steps(epochs: int = EPOCHS) -> list[int]:
    """The steps at each quarter of a run of `epochs` (16, 31 and 47 of 62)."""
    steps = STEPS_PER_EPOCH * epochs
    return [math.ceil(steps * q / 4) for q in (1, 2, 3)]


def churn(seed: int, epochs: int = EPOCHS) -> list[str]:
    """The churn of seed `seed`: the slow node, and a victim drawn from the seed at each quarter's step
    among the other nodes (with quorum rounds the slow node may never reach the last: every setting gets
    its three preemptions)."""
    draw = random.Random(seed)
    others = [k for k in range(4) if k != SLOW_NODE]
    kills = ",".join(f"{{node: {draw.choice(others)}, at_step: {s}}}" for s in kill_steps(epochs))
    return [f"churn.slow=[{{node: {SLOW_NODE}, factor: {SLOW_FACTOR}}}]", f"churn.kill=[{kills}]"]


def folder(epochs: int = EPOCHS, every: int = EVERY, every_s: float = EVERY_S) -> str:
    """Where a run length's and rounds' runs go: `churn` for the defaults."""
    return "churn" if (epochs, every, every_s) == (EPOCHS, EVERY, EVERY_S) else f"churn_e{epochs}_h{every}_t{every_s:g}"


def measure(
    out: Path,
    setting: str,
    seed: int,
    cpu_quota: bool = False,
    epochs: int = EPOCHS,
    every: int = EVERY,
    every_s: float = EVERY_S,
) -> dict:
    """One run's figures: read from its results.json, or run it first (`cpu_quota`: every node held to its
    half CPU, `churn.cpu_quota`)."""
    overrides, churned = settings(every, every_s)[setting]
    quota = ["churn.cpu_quota=true"] if cpu_quota else []
    length = [f"optim.epochs={epochs}"]
    cfg = load_config(
        WORKLOAD,
        [*BASE, *length, *overrides, *(churn(seed, epochs) if churned else []), *quota, f"seed={seed}"],
    )
    rec = seed_record(cfg, seed, out / folder(epochs, every, every_s) / setting, f"churn: {setting}")
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
    reference = "ddp_clean" if "ddp_clean" in groups else "sync_clean"
    clean = groups.get(reference)
    target = 0.95 * interval([r["id"] for r in clean])["mean"] if clean else None
    out = []
    for setting, rs in groups.items():
        row = {"setting": setting, "seeds": sorted(r["seed"] for r in rs), "target": target, "target_from": reference}
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
    whose = {"ddp_clean": "DDP's", "sync_clean": "lockstep rounds'"}[summary[0]["target_from"]] if summary else ""
    return (f"target ID accuracy {target:.3f} (95% of {whose} without churn)\n" if target else "") + "\n".join(lines)


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
    parser.add_argument(
        "--settings",
        nargs="+",
        default=[s for s in SETTINGS if s != "time_half"],  # the 62-step runs the docs report, as they ran
        choices=SETTINGS,
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default="runs/bench/churn.json", help="the JSON to write (runs go beside it)")
    parser.add_argument(
        "--cpu-quota",
        action="store_true",
        help="hold each node to its half CPU (churn.cpu_quota: a cgroup; root), as on its own machine",
    )
    parser.add_argument(
        "--epochs", type=int, default=EPOCHS, help=f"the run's length ({STEPS_PER_EPOCH} steps an epoch)"
    )
    parser.add_argument("--average-every", type=int, default=EVERY, help="steps between rounds (lofi.average_every)")
    parser.add_argument("--sync-every-s", type=float, default=EVERY_S, help="seconds between payloads, sync: time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.out)
    shape = (args.epochs, args.average_every, args.sync_every_s)
    rows = [measure(path.parent, s, seed, args.cpu_quota, *shape) for seed in args.seeds for s in args.settings]
    summary = summarize(rows)
    plot_path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, plot_path)
    path.write_text(json.dumps({"summary": summary, "runs": rows, "plot": plot_path.name}, indent=2))
    print(table(summary), flush=True)
    print(f"wrote {path} and {plot_path}")


if __name__ == "__main__":
    main()
