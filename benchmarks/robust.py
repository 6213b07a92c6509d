"""One bad node, measured: what it costs lo-fi's peer rounds under each aggregation rule, against the
clean run with the plain mean.

    python -m benchmarks.robust [--seeds N] [--workload mnist|minilm] [--scenarios NAME ...]
                                [--rules NAME ...] [--out runs/bench/robust]

The workload is 4 nodes of half a CPU each with int8 peer rounds: the MNIST dial
(examples/lofi_vs_ddp_mnist.yaml, lo-fi only, 750 images a node so that a run stays short on 2 cores,
2 epochs of 23 steps, a round every 6 steps: 8 rounds, the last at step 46) or MiniLM (examples/lofi_vs_ddp_minilm.yaml,
400 reviews a node, 2 epochs of 25 steps, a round every 8). Scenarios (`bad_nodes:`, docs/fault-tolerance.md):
clean; node 3 sends −10·Δ every round (sign_flip); Gaussian noise of norm about 10·‖Δ‖ (noise); a NaN
in round 1 only (nonfinite, with `lofi.on_bad_payload: drop` for every rule, the mean's included:
under the default `fail` the run stops, so the mean's row there is the mean with drop); node 3
trains with every label shifted by one class (permuted_labels) or at 100 × the learning rate
(learning_rate); and honest_only, nodes 0-2 alone on their three shards (node 3's never trained), with
the mean: the best a rule that leaves node 3 out can reach. Rules (`lofi.aggregate`, docs/robust.md):
mean (with `on_bad_payload: fail`, the default, but in nonfinite), and clip (κ 2), trimmed_mean
(β 0.25) and median, each with `on_bad_payload: drop`: its norm screen (10 × the round's median norm)
before the rule; clip_cosine adds the cosine screen (`bad_cosine_factor: 0.5`).

Every (scenario, rule, seed) is one `raylowcomm run` into OUT/<workload>/<scenario>/<rule>/seed_<s>
(`benchmarks.sweep.seed_record`); a run whose results.json is there is read, not repeated (a failed one
runs again), so the benchmark can be stopped and started again. Prints a table (per scenario and rule:
final ID accuracy, mean ± 95% Student-t interval over the seeds, and the paired difference to the
clean run with the mean, seed by seed) and writes it as OUT/robust_<workload>.md beside the JSON.
A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks.sweep import seed_record
from raylowcomm.seedstats import interval, plus_minus
from raylowcomm.strategies import load_config

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger(__name__)

_NODES = ["strategies=[lofi]", "lofi.exchange=peers", "lofi.compress=int8", "nodes.count=4", "nodes.cpus=0.5"]
WORKLOADS: dict[str, tuple[Path, list[str]]] = {
    # 3,000 images: 750 a node, 23 steps an epoch, 2 epochs, a round every 6 steps (7 rounds)
    "mnist": (
        ROOT / "examples" / "lofi_vs_ddp_mnist.yaml",
        [*_NODES, "lofi.average_every=6", "data.train_size=3000", "optim.epochs=2"],
    ),
    # 1,600 reviews: 400 a node, 25 steps an epoch, 2 epochs, a round every 8 steps (6 rounds)
    "minilm": (
        ROOT / "examples" / "lofi_vs_ddp_minilm.yaml",
        [*_NODES, "lofi.average_every=8", "data.train_size=1600", "optim.epochs=2"],
    ),
}
BAD_NODE = 3
SCENARIOS: dict[str, list[str]] = {
    "clean": [],
    "sign_flip": [f"bad_nodes=[{{node: {BAD_NODE}, update: sign_flip, scale: 10}}]"],
    "noise": [f"bad_nodes=[{{node: {BAD_NODE}, update: noise, scale: 10}}]"],
    # the default on_bad_payload (fail) stops the run at the NaN: every rule here drops it
    "nonfinite": [f"bad_nodes=[{{node: {BAD_NODE}, update: nonfinite, round: 1}}]", "lofi.on_bad_payload=drop"],
    "permuted_labels": [f"bad_nodes=[{{node: {BAD_NODE}, update: permuted_labels}}]"],
    "learning_rate": [f"bad_nodes=[{{node: {BAD_NODE}, update: learning_rate, scale: 100}}]"],
    "honest_only": ["nodes.count=3"],  # and 3/4 of the workload's train_size (`overrides`): 3 shards as large
}
ONLY_MEAN = {"honest_only"}
"""Scenarios with nothing for a rule to do: run with the mean alone."""
_SCREENED = ["lofi.on_bad_payload=drop"]  # the norm screen (10x the round's median norm)
RULES: dict[str, list[str]] = {
    "mean": ["lofi.aggregate=mean"],
    "clip": ["lofi.aggregate=clip", "lofi.clip_kappa=2.0", *_SCREENED],
    "clip_cosine": ["lofi.aggregate=clip", "lofi.clip_kappa=2.0", *_SCREENED, "lofi.bad_cosine_factor=0.5"],
    "trimmed_mean": ["lofi.aggregate=trimmed_mean", "lofi.trim=0.25", *_SCREENED],
    "median": ["lofi.aggregate=median", *_SCREENED],
}
BASELINE = ("clean", "mean")


def run_dir(out: Path, workload: str, scenario: str, rule: str, seed: int) -> Path:
    return out / workload / scenario / rule / f"seed_{seed}"


def overrides(workload: str, scenario: str, rule: str, seed: int) -> list[str]:
    """The run's `--set`s: the workload's, the scenario's and the rule's; honest_only keeps a node's shard
    size (3/4 of the workload's training rows over 3 nodes)."""
    base = WORKLOADS[workload][1]
    if scenario == "honest_only":
        size = next(int(b.split("=")[1]) for b in base if b.startswith("data.train_size="))
        base = [*base, f"data.train_size={size * 3 // 4}"]
    return [*base, *SCENARIOS[scenario], *RULES[rule], f"seed={seed}"]


def measure(out: Path, workload: str, scenario: str, rule: str, seed: int) -> dict:
    """One run's figures: read from its results.json, or run it first (a failed one again)."""
    cfg = load_config(WORKLOADS[workload][0], overrides(workload, scenario, rule, seed))
    rec = seed_record(
        cfg, seed, run_dir(out, workload, scenario, rule, seed).parent, f"robust: {workload} {scenario} {rule}", True
    )
    row = {"workload": workload, "scenario": scenario, "rule": rule, "seed": seed}
    if "error" in rec:  # a failed run is shown, not averaged
        logger.warning("robust: %s %s %s seed %d failed: %s", workload, scenario, rule, seed, rec["error"])
        return {**row, "error": rec["error"].splitlines()[0] if rec["error"] else "failed"}
    details = rec.get("details") or {}
    dropped = details.get("dropped_payloads") or []  # per node: how many of its payloads rounds left out
    return {
        **row,
        "id": rec["metrics"]["id_accuracy"],
        "dropped": sum(dropped.values() if isinstance(dropped, dict) else dropped),
        "train_s": rec.get("train_s"),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per (scenario, rule), in the order they ran: the seeds, the mean and interval of final ID
    accuracy, and the interval of its difference to the clean run with the mean, paired by seed over
    the seeds both finished (none for that run itself); failed seeds are counted, not averaged."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["rule"]), []).append(r)
    base = {r["seed"]: r["id"] for r in groups.get(BASELINE, []) if "error" not in r}
    out = []
    for (scenario, rule), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        paired = [r["id"] - base[r["seed"]] for r in ok if r["seed"] in base]
        out.append(
            {
                "scenario": scenario,
                "rule": rule,
                "seeds": sorted(r["seed"] for r in ok),
                "failed": [{"seed": r["seed"], "error": r["error"]} for r in rs if "error" in r],
                "id": interval([r["id"] for r in ok]) if ok else None,
                "minus_clean_mean": interval(paired) if paired and (scenario, rule) != BASELINE else None,
                "dropped": sum(r.get("dropped", 0) for r in ok),
            }
        )
    return out


def table(summary: list[dict], workload: str, command: str) -> str:
    """The markdown table: one row per (scenario, rule), ID accuracy and its paired difference to the
    clean mean in points; a row whose every seed failed says so."""
    lines = [
        f"`{command}`",
        "",
        f"{workload}, 4 nodes, node {BAD_NODE} bad: final ID accuracy (%), mean ± 95% interval over the seeds; "
        "− clean mean: the paired difference (points) to the clean run with the mean, seed by seed",
        "",
        "| scenario | rule | seeds | ID accuracy | − clean mean | payloads dropped |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary:
        failed = f" ({len(r['failed'])} failed: {r['failed'][0]['error']})" if r["failed"] else ""
        acc = plus_minus(r["id"], 1, 100) if r["id"] else "fails"
        diff = plus_minus(r["minus_clean_mean"], 1, 100, "+") if r["minus_clean_mean"] else "-"
        lines.append(f"| {r['scenario']} | {r['rule']} | {len(r['seeds'])}{failed} | {acc} | {diff} | {r['dropped']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--workload", default="mnist", choices=list(WORKLOADS))
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--out", default="runs/bench/robust", help="the folder for the runs, the JSON and the table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    cases = [(s, r) for s in args.scenarios for r in args.rules if r == "mean" or s not in ONLY_MEAN]
    cases = [BASELINE, *(c for c in cases if c != BASELINE)]  # first: every difference is to it
    rows = [measure(out, args.workload, s, r, seed) for seed in range(args.seeds) for s, r in cases]
    summary = summarize(rows)
    command = "python -m benchmarks.robust " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(summary, args.workload, command.strip())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"robust_{args.workload}.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=2))
    (out / f"robust_{args.workload}.md").write_text(text + "\n")
    print(text, flush=True)
    print(f"wrote {out / f'robust_{args.workload}.md'} and {out / f'robust_{args.workload}.json'}")


if __name__ == "__main__":
    main()
