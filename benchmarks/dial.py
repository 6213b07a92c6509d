"""The dial, measured: accuracy against bytes sent after setup, lo-fi's settings against DDP.

    python -m benchmarks.dial [--workloads mnist minilm] [--settings NAME ...] [--seeds 0]
                              [--frontier-seeds 0 1 2] [--out runs/bench/dial.json]

Every (workload, setting, seed) is one `raylowcomm run` of the workload's example with the
setting's overrides, into OUT_DIR/dial/<workload>/<setting>/seed_<s>; a run whose results.json is
there already is read, not repeated (a failed one is run again), so the benchmark can be stopped and
started again. First
every setting runs on `--seeds`; then the settings on the accuracy-per-byte frontier (no other
setting has both fewer bytes and a higher mean ID accuracy), and DDP, run on `--frontier-seeds`
too. Prints a table per workload (mean and 95% Student-t interval over the seeds that ran, bytes
after setup ÷ DDP's, training time) and writes the JSON and one frontier plot per workload
(log bytes) beside it; `raylowcomm report` shows both. A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from raylowcomm.runner import run
from raylowcomm.seedstats import interval
from raylowcomm.strategies import load_config

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)

WORKLOADS = {
    "mnist": ROOT / "examples" / "lofi_vs_ddp_mnist.yaml",  # EfficientNet-Lite0 (BatchNorm), MNIST, UCI-digits shift
    "minilm": ROOT / "examples" / "lofi_vs_ddp_minilm.yaml",  # MiniLM, Rotten Tomatoes, Amazon shift
}

_PEERS = ["strategies=[lofi]", "lofi.exchange=peers"]
SETTINGS: dict[str, list[str]] = {
    "ddp": ["strategies=[ddp]"],
    "lofi": ["strategies=[lofi]"],  # one average at the end, full weights through the driver
    "lofi_int8": [*_PEERS, "lofi.compress=int8"],  # one average from int8 outer gradients
    "lofi_int4": [*_PEERS, "lofi.compress=int4"],
    "H16_none": [*_PEERS, "lofi.average_every=16"],
    "H16_int8": [*_PEERS, "lofi.average_every=16", "lofi.compress=int8"],
    "H16_int4": [*_PEERS, "lofi.average_every=16", "lofi.compress=int4"],
    "H32_int4": [*_PEERS, "lofi.average_every=32", "lofi.compress=int4"],
    "H8_int4": [*_PEERS, "lofi.average_every=8", "lofi.compress=int4"],
    "H8_topk5": [*_PEERS, "lofi.average_every=8", "lofi.compress=topk", "lofi.topk_fraction=0.05"],
    "H4_topk1": [*_PEERS, "lofi.average_every=4", "lofi.compress=topk", "lofi.topk_fraction=0.01"],
    "H16_topk5": [*_PEERS, "lofi.average_every=16", "lofi.compress=topk", "lofi.topk_fraction=0.05"],
    "H2_topk1": [*_PEERS, "lofi.average_every=2", "lofi.compress=topk", "lofi.topk_fraction=0.01"],
    "H4_topk2": [*_PEERS, "lofi.average_every=4", "lofi.compress=topk", "lofi.topk_fraction=0.02"],
    "H4_topk3": [*_PEERS, "lofi.average_every=4", "lofi.compress=topk", "lofi.topk_fraction=0.03"],
    "H8_topk1": [*_PEERS, "lofi.average_every=8", "lofi.compress=topk", "lofi.topk_fraction=0.01"],
    "H4_topk5": [*_PEERS, "lofi.average_every=4", "lofi.compress=topk", "lofi.topk_fraction=0.05"],
    "H6_topk3": [*_PEERS, "lofi.average_every=6", "lofi.compress=topk", "lofi.topk_fraction=0.03"],
    "H8_topk3": [*_PEERS, "lofi.average_every=8", "lofi.compress=topk", "lofi.topk_fraction=0.03"],
    "H4_topk1_F2": [
        *_PEERS,
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.01",
        "lofi.fragments=2",
    ],
    "H4_topk1_ov1": [
        *_PEERS,
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.01",
        "lofi.overlap=1",
        "lofi.mix=0",
    ],
}
DEFAULT = {
    "mnist": [
        "ddp",
        "lofi",
        "lofi_int4",
        "H16_none",
        "H16_int8",
        "H16_int4",
        "H32_int4",
        "H8_int4",
        "H8_topk5",
        "H4_topk1",
        "H16_topk5",
        "H8_topk1",
        "H4_topk1_F2",
        "H4_topk1_ov1",
        "H2_topk1",
        "H4_topk2",
        "H4_topk3",
        "H4_topk5",
        "H6_topk3",
        "H8_topk3",
    ],
    "minilm": ["ddp", "lofi", "lofi_int8", "lofi_int4"],
}


def run_dir(out: Path, workload: str, setting: str, seed: int) -> Path:
    return out / "dial" / workload / setting / f"seed_{seed}"


def measure(out: Path, workload: str, setting: str, seed: int) -> dict:
    """One run's figures: read from its results.json, or run it first."""
    where = run_dir(out, workload, setting, seed)
    path = where / "results.json"
    if path.is_file() and any("error" in rec for rec in json.loads(path.read_text())):
        shutil.rmtree(where)  # a failed run (its actors were killed, say) runs again, from the start
    if not path.is_file():
        cfg = load_config(WORKLOADS[workload], [*SETTINGS[setting], f"seed={seed}"])
        logger.info("dial: %s %s seed %d -> %s", workload, setting, seed, where)
        run(cfg, where, bar=False)
    [rec] = json.loads(path.read_text())
    row = {"workload": workload, "setting": setting, "seed": seed, "strategy": rec["strategy"]}
    if "error" in rec:  # a failed run is shown, not averaged
        logger.warning("dial: %s %s seed %d failed: %s", workload, setting, seed, rec["error"])
        return {**row, "error": rec["error"]}
    phases, metrics = rec["comm"]["by_phase"], rec["metrics"]
    return {
        **row,
        "id": metrics["id_accuracy"],
        "shift": metrics.get("shift_accuracy"),
        "after_setup_bytes": phases.get("train", 0) + phases.get("final", 0),
        "total_bytes": rec["comm"]["total_bytes"],
        "train_s": rec["train_s"],
        "wall_s": rec["wall_s"],
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, setting): mean and interval over seeds of ID accuracy, shift accuracy, bytes after
    setup and training time, and DDP's mean bytes after setup ÷ the setting's."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in (r for r in rows if "error" not in r):
        groups.setdefault((r["workload"], r["setting"]), []).append(r)
    ddp = {w: interval([r["after_setup_bytes"] for r in rs])["mean"] for (w, s), rs in groups.items() if s == "ddp"}
    out = []
    for (workload, setting), rs in groups.items():
        row = {"workload": workload, "setting": setting, "seeds": sorted(r["seed"] for r in rs)}
        for key in ("id", "shift", "after_setup_bytes", "train_s"):
            values = [r[key] for r in rs if r[key] is not None]
            row[key] = interval(values) if values else None
        mean_bytes = row["after_setup_bytes"]["mean"]
        row["ddp_bytes_over_these"] = ddp[workload] / mean_bytes if workload in ddp and mean_bytes else None
        out.append(row)
    return out


def frontier(summary: list[dict], workload: str) -> list[str]:
    """The settings no other setting beats on both axes (fewer mean bytes after setup, higher mean ID
    accuracy), cheapest first."""
    rows = [r for r in summary if r["workload"] == workload]

    def beaten(r: dict) -> bool:
        b, a = r["after_setup_bytes"]["mean"], r["id"]["mean"]
        return any(
            (o["after_setup_bytes"]["mean"] <= b and o["id"]["mean"] > a)
            or (o["after_setup_bytes"]["mean"] < b and o["id"]["mean"] >= a)
            for o in rows
        )

    return [r["setting"] for r in sorted(rows, key=lambda r: r["after_setup_bytes"]["mean"]) if not beaten(r)]


def _shown(stat: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if not stat or stat["mean"] is None:
        return "-"
    mean = f"{stat['mean'] * scale:.{digits}f}"
    return mean if stat["half_width"] is None else f"{mean} ± {stat['half_width'] * scale:.{digits}f}"


def table(summary: list[dict], workload: str, on_frontier: list[str]) -> str:
    lines = [
        f"{workload}: mean ± 95% interval over the seeds run (ID/shift in %, bytes in MB)",
        f"{'setting':<11} {'seeds':<7} {'ID':<13} {'shift':<13} {'MB after setup':<18} {'DDP÷':>7} "
        f"{'train s':<12} frontier",
    ]
    for r in sorted((r for r in summary if r["workload"] == workload), key=lambda r: -r["after_setup_bytes"]["mean"]):
        ratio = f"{r['ddp_bytes_over_these']:.0f}" if r["ddp_bytes_over_these"] else "-"
        lines.append(
            f"{r['setting']:<11} {len(r['seeds']):<7} {_shown(r['id'], 100):<13} "
            f"{_shown(r['shift'], 100):<13} {_shown(r['after_setup_bytes'], 1e-6):<18} {ratio:>7} "
            f"{_shown(r['train_s']):<12} {'*' if r['setting'] in on_frontier else ''}"
        )
    return "\n".join(lines)


def plot(summary: list[dict], workload: str, on_frontier: list[str], path: Path) -> None:
    """ID accuracy against bytes after setup (log), with intervals; the frontier joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary if r["workload"] == workload]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x, y = r["after_setup_bytes"]["mean"], r["id"]["mean"] * 100
        err = (r["id"]["half_width"] or 0) * 100
        ax.errorbar(
            x,
            y,
            yerr=err,
            fmt="s" if r["setting"] == "ddp" else "o",
            capsize=3,
            color="black" if r["setting"] == "ddp" else None,
        )
        ax.annotate(r["setting"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = sorted((r for r in rows if r["setting"] in on_frontier), key=lambda r: r["after_setup_bytes"]["mean"])
    ax.plot([r["after_setup_bytes"]["mean"] for r in front], [r["id"]["mean"] * 100 for r in front], "--", color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent after setup (log)")
    ax.set_ylabel("ID accuracy (%)")
    ax.set_title(f"{workload}: accuracy per byte (mean ± 95% over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="default: each workload's list")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds every setting runs")
    parser.add_argument(
        "--frontier-seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds the frontier's settings and DDP run"
    )
    parser.add_argument("--out", default="runs/bench/dial.json", help="the JSON to write (runs go beside it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.out)
    out = path.parent
    rows = []
    for workload in args.workloads:
        settings = args.settings or DEFAULT[workload]
        rows += [measure(out, workload, s, seed) for s in settings for seed in args.seeds]
        on_frontier = frontier(summarize(rows), workload)
        extra = [s for s in settings if s in on_frontier or s == "ddp"]
        rows += [
            measure(out, workload, s, seed) for s in extra for seed in args.frontier_seeds if seed not in args.seeds
        ]
    summary, plots, tables = summarize(rows), [], {}
    for workload in args.workloads:
        on_frontier = frontier(summary, workload)
        tables[workload] = on_frontier
        plots.append(f"{path.stem}_{workload}.png")
        plot(summary, workload, on_frontier, out / plots[-1])
        print(table(summary, workload, on_frontier), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "frontier": tables, "runs": rows, "plots": plots}, indent=2))
    print(f"wrote {path} and {', '.join(plots)}")


if __name__ == "__main__":
    main()
