"""The dial, measured: accuracy against bytes sent after setup, lo-fi's settings against DDP.

    python -m benchmarks.dial [--workloads mnist minilm] [--settings NAME ...] [--seeds 0]
                              [--frontier-seeds 0 1 2] [--lengths 62 125 250 1ep 2ep]
                              [--out runs/bench/dial.json]

Every (workload, length, setting, seed) is one `raylowcomm run` of the workload's example with the
length's and the setting's overrides, into OUT_DIR/dial/<workload>/<setting>/seed_<s> (with
--lengths, OUT_DIR/dial/<workload>/<length>/<setting>/seed_<s>); a run whose results.json is
there already is read, not repeated (a failed one is run again), so the benchmark can be stopped and
started again. First
every setting runs on `--seeds`; then the settings on the accuracy-per-byte frontier (no other
setting has both fewer bytes and a higher mean ID accuracy), and DDP, run on `--frontier-seeds`
too. Prints a table per workload and length (mean and 95% Student-t interval over the seeds that ran, bytes
after setup ÷ DDP's, training time) and writes the JSON and one frontier plot per workload
(log bytes) beside it; `raylowcomm report` shows both. A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from benchmarks.sweep import seed_record
from raylowcomm.seedstats import interval, plus_minus
from raylowcomm.strategies import load_config

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)

WORKLOADS = {
    "mnist": ROOT / "examples" / "lofi_vs_ddp_mnist.yaml",  # EfficientNet-Lite0 (BatchNorm), MNIST, UCI-digits shift
    "minilm": ROOT / "examples" / "lofi_vs_ddp_minilm.yaml",  # MiniLM, Rotten Tomatoes, Amazon shift
}

LENGTHS: dict[str, dict[str, list[str]]] = {
    # steps a node: 2 x 1,000 images (the short fine-tune), the example's 2 x 2,000, and 4 epochs of those
    # (the asset holds 5,000 rows: a longer run repeats epochs)
    "mnist": {"62": ["data.train_size=2000"], "125": [], "250": ["optim.epochs=4"]},
    "minilm": {"1ep": ["optim.epochs=1"], "2ep": []},
}
"""Run lengths a workload offers (`--lengths`): overrides of its example, none for the example's own."""

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
    "H25_int4": [*_PEERS, "lofi.average_every=25", "lofi.compress=int4"],  # MiniLM 1ep: one round mid-run
    # every node's optimizer state starts afresh at each landed round (no byte)
    "H16_int4_mr": [*_PEERS, "lofi.average_every=16", "lofi.compress=int4", "lofi.round_momentum=reset"],
    "H8_int4_mr": [*_PEERS, "lofi.average_every=8", "lofi.compress=int4", "lofi.round_momentum=reset"],
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
    # the end of a short run: the final round flushes the residual (dense int8, or float32)
    "H6_topk3_fin8": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.final_round=int8",
    ],
    "H6_topk3_finx": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.final_round=exact",
    ],
    "H16_int4_fin8": [*_PEERS, "lofi.average_every=16", "lofi.compress=int4", "lofi.final_round=int8"],
    "H16_int4_finx": [*_PEERS, "lofi.average_every=16", "lofi.compress=int4", "lofi.final_round=exact"],
    # ... or sends the last Δ alone, dense, dropping the residual (as the reference simulation's exact average)
    "H6_topk3_fdx": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.final_round=exact",
        "lofi.final_residual=false",
    ],
    "H16_int4_fdx": [
        *_PEERS,
        "lofi.average_every=16",
        "lofi.compress=int4",
        "lofi.final_round=exact",
        "lofi.final_residual=false",
    ],
    "H6_none": [*_PEERS, "lofi.average_every=6"],
    "H4_none": [*_PEERS, "lofi.average_every=4"],
    "H8_none": [*_PEERS, "lofi.average_every=8"],
    # ternary rounds (int2, 2.25 bits a weight): every 8 steps is about 1/105 of DDP's bytes at 62 steps
    "H8_int2": [*_PEERS, "lofi.average_every=8", "lofi.compress=int2"],
    "H8_int2_dv": [
        *_PEERS,
        "lofi.average_every=8",
        "lofi.compress=int2",
        "lofi.compress_block=128",
        "lofi.dense=[head,vectors]",
    ],
    "H1_none": [*_PEERS, "lofi.average_every=1"],
    "H2_topk3": [*_PEERS, "lofi.average_every=2", "lofi.compress=topk", "lofi.topk_fraction=0.03"],
    # the new head (dh) or the head and every 1-D parameter (dv) cross whole, int8, in every round
    "H6_topk3_dh": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head]",
    ],
    "H6_topk3_dv": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    "H8_topk3_dv": [
        *_PEERS,
        "lofi.average_every=8",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    "H4_topk3_dv": [
        *_PEERS,
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    "H4_topk8_dv": [
        *_PEERS,
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.08",
        "lofi.dense=[head, vectors]",
    ],
    "H6_topk10_dv": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.1",
        "lofi.dense=[head, vectors]",
    ],
    "H8_topk15_dv": [
        *_PEERS,
        "lofi.average_every=8",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.15",
        "lofi.dense=[head, vectors]",
    ],
    "H2_topk3_dv": [
        *_PEERS,
        "lofi.average_every=2",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    # scaled sign: every entry moves every round (top-k 3% moves 3% of them), 1.25 bits a weight at
    # block 64 and 1.06 at block 256
    "H4_sign_b256": [*_PEERS, "lofi.average_every=4", "lofi.compress=sign", "lofi.compress_block=256"],
    "H5_sign": [*_PEERS, "lofi.average_every=5", "lofi.compress=sign"],
    "H4_sign_dv_b256": [
        *_PEERS,
        "lofi.average_every=4",
        "lofi.compress=sign",
        "lofi.compress_block=256",
        "lofi.dense=[head, vectors]",
    ],
    # H growing: the nodes meet early, while they drift apart fastest, then less often
    "H4g_int4": [*_PEERS, "lofi.average_every=[4,12,24]", "lofi.compress=int4"],
    "H8g_int4": [*_PEERS, "lofi.average_every=[8,16]", "lofi.compress=int4"],
    "H6g_int4": [*_PEERS, "lofi.average_every=[6,20]", "lofi.compress=int4"],
    "H8g20_int4": [*_PEERS, "lofi.average_every=[8,20]", "lofi.compress=int4"],
    "H10g_int4": [*_PEERS, "lofi.average_every=[10,20]", "lofi.compress=int4"],
    # the outer step for ten rounds: DiLoCo's Nesterov (lr 0.7, momentum 0.9, tuned for hundreds) and a
    # milder one
    "H6_topk3_n79": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.outer_optimizer=nesterov",
    ],
    "H6_topk3_n105": [
        *_PEERS,
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.outer_optimizer=nesterov",
        "lofi.outer_lr=1.0",
        "lofi.outer_momentum=0.5",
    ],
    "H16_int4_n105": [
        *_PEERS,
        "lofi.average_every=16",
        "lofi.compress=int4",
        "lofi.outer_optimizer=nesterov",
        "lofi.outer_lr=1.0",
        "lofi.outer_momentum=0.5",
    ],
    # a start that does not drift: the nodes probe their heads and share the average first (LP-FT)
    "P8_H16_int4": [*_PEERS, "lofi.probe_steps=8", "lofi.average_every=16", "lofi.compress=int4"],
    "P8_H2_topk3": [
        *_PEERS,
        "lofi.probe_steps=8",
        "lofi.average_every=2",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
    ],
    "P8_H4_topk3_dv": [
        *_PEERS,
        "lofi.probe_steps=8",
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    "P8_H6_topk3_dv": [
        *_PEERS,
        "lofi.probe_steps=8",
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.dense=[head, vectors]",
    ],
    "P8_H4_topk3": [
        *_PEERS,
        "lofi.probe_steps=8",
        "lofi.average_every=4",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
    ],
    "P16_H6_topk3": [
        *_PEERS,
        "lofi.probe_steps=16",
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
    ],
    "P8_H6_topk3": [
        *_PEERS,
        "lofi.probe_steps=8",
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
    ],
    # the start of a short run: a round after each of the first steps, or H growing
    "W4_H6_topk3_fin8": [
        *_PEERS,
        "lofi.warmup_steps=4",
        "lofi.average_every=6",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.final_round=int8",
    ],
    "Hgrow_topk3_fin8": [
        *_PEERS,
        "lofi.average_every=[2,4,8]",
        "lofi.compress=topk",
        "lofi.topk_fraction=0.03",
        "lofi.final_round=int8",
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


def run_dir(out: Path, workload: str, setting: str, seed: int, length: str | None = None) -> Path:
    return out / "dial" / workload / (length or "") / setting / f"seed_{seed}"


def measure(out: Path, workload: str, setting: str, seed: int, length: str | None = None) -> dict:
    """One run's figures: read from its results.json, or run it first (`seed_record`; a failed one again)."""
    overrides = [*LENGTHS[workload].get(length, []), *SETTINGS[setting], f"seed={seed}"]
    rec = seed_record(
        load_config(WORKLOADS[workload], overrides),
        seed,
        run_dir(out, workload, setting, seed, length).parent,
        f"dial: {workload} {length or ''} {setting}",
        rerun_failed=True,
    )
    row = {"workload": workload, "length": length, "setting": setting, "seed": seed, "strategy": rec["strategy"]}
    if "error" in rec:  # a failed run is shown, not averaged
        logger.warning("dial: %s %s seed %d failed: %s", workload, setting, seed, rec["error"])
        return {**row, "error": rec["error"]}
    phases, metrics = rec["comm"]["by_phase"], rec["metrics"]
    steps = rec["details"].get("steps_per_node") or rec["details"].get("steps_per_worker")
    return {
        **row,
        "steps": steps,
        "id": metrics["id_accuracy"],
        "shift": metrics.get("shift_accuracy"),
        "after_setup_bytes": phases.get("train", 0) + phases.get("final", 0),
        "total_bytes": rec["comm"]["total_bytes"],
        "train_s": rec["train_s"],
        "wall_s": rec["wall_s"],
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, length, setting): mean and interval over seeds of ID accuracy, shift accuracy, bytes
    after setup and training time, DDP's mean bytes after setup ÷ the setting's, and the paired difference
    to DDP's ID accuracy over the seeds both ran."""
    groups: dict[tuple[str, str | None, str], list[dict]] = {}
    for r in (r for r in rows if "error" not in r):
        groups.setdefault((r["workload"], r.get("length"), r["setting"]), []).append(r)
    ddp = {(w, n): rs for (w, n, s), rs in groups.items() if s == "ddp"}
    out = []
    for (workload, length, setting), rs in groups.items():
        row = {"workload": workload, "length": length, "setting": setting, "seeds": sorted(r["seed"] for r in rs)}
        for key in ("id", "shift", "after_setup_bytes", "train_s"):
            values = [r[key] for r in rs if r[key] is not None]
            row[key] = interval(values) if values else None
        base = ddp.get((workload, length))
        mean_bytes = row["after_setup_bytes"]["mean"]
        ddp_bytes = interval([r["after_setup_bytes"] for r in base])["mean"] if base else None
        row["ddp_bytes_over_these"] = ddp_bytes / mean_bytes if ddp_bytes and mean_bytes else None
        by_seed = {r["seed"]: r["id"] for r in base or []}
        paired = [r["id"] - by_seed[r["seed"]] for r in rs if r["seed"] in by_seed]
        row["id_minus_ddp"] = interval(paired) if paired and setting != "ddp" else None
        out.append(row)
    return out


def _rows_of(summary: list[dict], workload: str, length: str | None) -> list[dict]:
    return [r for r in summary if r["workload"] == workload and r.get("length") == length]


def frontier(summary: list[dict], workload: str, length: str | None = None) -> list[str]:
    """The settings no other setting beats on both axes (fewer mean bytes after setup, higher mean ID
    accuracy), cheapest first."""
    rows = _rows_of(summary, workload, length)

    def beaten(r: dict) -> bool:
        b, a = r["after_setup_bytes"]["mean"], r["id"]["mean"]
        return any(
            (o["after_setup_bytes"]["mean"] <= b and o["id"]["mean"] > a)
            or (o["after_setup_bytes"]["mean"] < b and o["id"]["mean"] >= a)
            for o in rows
        )

    return [r["setting"] for r in sorted(rows, key=lambda r: r["after_setup_bytes"]["mean"]) if not beaten(r)]


def table(summary: list[dict], workload: str, on_frontier: list[str], length: str | None = None) -> str:
    rows = _rows_of(summary, workload, length)
    steps = f", {length} steps a node" if length and length.isdigit() else f", {length}" if length else ""
    lines = [
        f"{workload}{steps}: mean ± 95% interval over the seeds run (ID/shift in %, bytes in MB)",
        f"{'setting':<17} {'seeds':<6} {'ID':<13} {'− DDP (paired)':<15} {'shift':<13} {'MB after setup':<18} "
        f"{'DDP÷':>7} {'train s':<12} frontier",
    ]
    for r in sorted(rows, key=lambda r: -r["after_setup_bytes"]["mean"]):
        ratio = f"{r['ddp_bytes_over_these']:.0f}" if r["ddp_bytes_over_these"] else "-"
        lines.append(
            f"{r['setting']:<17} {len(r['seeds']):<6} {plus_minus(r['id'], scale=100):<13} "
            f"{plus_minus(r.get('id_minus_ddp'), scale=100):<15} {plus_minus(r['shift'], scale=100):<13} "
            f"{plus_minus(r['after_setup_bytes'], scale=1e-6):<18} {ratio:>7} "
            f"{plus_minus(r['train_s']):<12} {'*' if r['setting'] in on_frontier else ''}"
        )
    return "\n".join(lines)


def plot(summary: list[dict], workload: str, on_frontier: list[str], path: Path, length: str | None = None) -> None:
    """ID accuracy against bytes after setup (log), with intervals; the frontier joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows_of(summary, workload, length)
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
    at = f", {length}" if length else ""
    ax.set_title(f"{workload}{at}: accuracy per byte (mean ± 95% over seeds)")
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
    every_length = sorted({n for lengths in LENGTHS.values() for n in lengths})
    parser.add_argument(
        "--lengths",
        nargs="+",
        choices=every_length,
        help="run lengths (each workload runs those it has; default: the example's own)",
    )
    parser.add_argument("--out", default="runs/bench/dial.json", help="the JSON to write (runs go beside it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.out)
    out = path.parent
    lengths = {w: [n for n in LENGTHS[w] if n in args.lengths] if args.lengths else [None] for w in args.workloads}
    cases = [(w, n) for w in args.workloads for n in lengths[w]]
    rows = []
    for workload, length in cases:
        settings = args.settings or DEFAULT[workload]
        rows += [measure(out, workload, s, seed, length) for s in settings for seed in args.seeds]
        on_frontier = frontier(summarize(rows), workload, length)
        extra = [s for s in settings if s in on_frontier or s == "ddp"]
        rows += [
            measure(out, workload, s, seed, length)
            for s in extra
            for seed in args.frontier_seeds
            if seed not in args.seeds
        ]
    summary, plots, tables = summarize(rows), [], {}
    for workload, length in cases:
        on_frontier = frontier(summary, workload, length)
        name = workload if length is None else f"{workload}_{length}"
        tables[name] = on_frontier
        plots.append(f"{path.stem}_{name}.png")
        plot(summary, workload, on_frontier, out / plots[-1], length)
        print(table(summary, workload, on_frontier, length), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "frontier": tables, "runs": rows, "plots": plots}, indent=2))
    print(f"wrote {path} and {', '.join(plots)}")


if __name__ == "__main__":
    main()
