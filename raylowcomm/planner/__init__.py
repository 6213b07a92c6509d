"""`raylowcomm plan`: which strategy finishes first on your cluster, from your own measurements.

A run folder (results.json, from `raylowcomm run` or `bench`) or a config (run briefly here) says
what each strategy's step costs in compute and what its steps and rounds send (`calibrate`); the
time model (`costs`) predicts the run's wall time for N nodes on a link of a given rate and latency,
for this model or another size (bytes scale with the parameters that cross, compute with the
parameters or with the FLOPs you state), and says what bounds it: the link or the compute. Repeats of a
run calibrate once, on their median; `check` sets the predictions beside runs measured elsewhere (another
rate, other nodes), the way docs/planning.md checks the planner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from raylowcomm.common.files import read_json, read_records
from raylowcomm.core.interlock.schedule import Link
from raylowcomm.planner.calibrate import costs_of, repeats_of, same_run
from raylowcomm.planner.costs import Cost, Prediction, link_of, predict, time_to_target

logger = logging.getLogger(__name__)
REWRITE = "rerun the run or bench that wrote it, or give another run folder"
"""What to do about a damaged results.json or bench.json the planner calibrates from."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's size, enough to count its parameters' bytes and a LoRA adapter's."""

    params: float
    layers: int
    hidden: int
    kv: int
    ffn: int

    def lora_params(self, rank: int) -> float:
        """LoRA of `rank` on every linear layer of every block (q, k, v, o, gate, up, down)."""
        h, kv, f = self.hidden, self.kv, self.ffn
        per_layer = rank * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)
        return float(per_layer * self.layers)


MODELS = {
    "llama-3-8b": ModelShape(8.03e9, 32, 4096, 1024, 14336),
    "llama-3.2-1b": ModelShape(1.24e9, 16, 2048, 512, 8192),
    "qwen2.5-1.5b": ModelShape(1.54e9, 28, 1536, 256, 8960),
    "smollm2-135m": ModelShape(1.35e8, 30, 576, 192, 1536),
    "smollm2-1.7b": ModelShape(1.71e9, 24, 2048, 2048, 8192),
}
"""`--model` names: public sizes of common decoders (their config.json), for planning without loading them."""


@dataclass
class Target:
    """What the run is for: params (None: as calibrated), the parameters that cross, and compute per step."""

    params: float | None = None
    trainable: float | None = None
    device_flops: float | None = None
    """Effective FLOP/s of one node's device: compute per step = 6 × params × tokens / it (training)."""
    tokens_per_step: float | None = None

    def compute_s(self, cost: Cost) -> float | None:
        """Per-step compute on the stated device; None: scale the calibrated compute with the parameters."""
        if self.device_flops is None or self.params is None:
            return None
        per_forward = 2 * self.params * (self.tokens_per_step or 1.0)
        if cost.topology == "spsa":
            passes = cost.forwards or 2.0  # forwards only
        elif (self.trainable or self.params) < self.params:
            passes = 2.0  # adapters: the forward and the activations' gradients, none for the frozen weights
        else:
            passes = 3.0  # the forward and a backward of twice its cost
        return passes * per_forward / self.device_flops


def bench_run(source: Path) -> dict:
    """What a `bench wan` rate folder's bench.json says of its run (its rate, the link it measured);
    empty elsewhere."""
    bench = source.parent / "bench.json"
    if not bench.exists():
        return {}
    runs = read_json(bench, REWRITE, dict, "a bench's mapping (mode, config, runs)").get("runs")
    return next((run for run in runs or [] if isinstance(run, dict) and run.get("dir") == source.name), {})


def load_source(source: Path) -> list[Cost]:
    """Costs from a run folder's results.json; in a `bench wan` rate folder, the link its bench.json measured
    comes out of the step times."""
    results = source / "results.json"
    if not results.exists():
        raise FileNotFoundError(f"{source} has no results.json: give a folder written by `raylowcomm run` or `bench`")
    measured = bench_run(source).get("link")
    link = link_of(measured["mbit_per_s"] * 1e6) if measured else None
    return costs_of(read_records(results, REWRITE), link)


def check(calibrated: list[Cost], runs: list[Cost], link: Link) -> list[dict]:
    """The planner against measured runs: each run (the median of its repeats) beside the prediction of the
    calibration that ran it the same way (`same_run`), at the run's own nodes on `link`."""
    rows = []
    for group in repeats_of(runs):
        run = group[0]
        cost = next((c for c in calibrated if same_run(c, run)), None)
        if cost is None:
            logger.warning("plan --against: no calibrating run ran %s as this run did; left out", run.label)
            continue
        measured = median(c.measured_s for c in group)
        predicted = predict(cost, run.nodes, link).total_s
        rows.append(
            {
                "strategy": run.label,
                "nodes": run.nodes,
                "predicted_s": predicted,
                "measured_s": measured,
                "runs_s": [c.measured_s for c in group],
                "error": predicted / measured - 1,
            }
        )
    return rows


def check_table(rows: list[dict], link: str) -> str:
    lines = [
        "| strategy | N | link | predicted | measured (median) | runs | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = ", ".join(f"{s:.1f}" for s in r["runs_s"])
        lines.append(
            f"| {r['strategy']} | {r['nodes']} | {link} | {r['predicted_s']:.1f} s | {r['measured_s']:.1f} s | "
            f"{runs} | {100 * r['error']:+.1f}% |"
        )
    return "\n".join(lines)


def plan(costs: list[Cost], nodes: list[int], links: list[tuple[str, float]], latency_ms: float, target: Target):
    """Every strategy at every N and link: its Prediction, and its time to target where its curve reaches
    95% of DDP's final metric (the calibrating run's)."""
    ddp = next((c for c in costs if c.strategy == "ddp" and c.curve), None)
    goal = 0.95 * ddp.curve[-1][1] if ddp else None
    rows = []
    for cost in costs:
        try:
            scaled = cost.scaled(target.params, target.trainable, target.compute_s(cost))
        except ValueError as err:
            logger.warning("plan: %s; left out", err)
            continue
        for label, bits in links:
            link = link_of(bits, latency_ms)
            for n in [len(scaled.stages)] if scaled.topology == "pipeline" else nodes:
                pred = predict(scaled, n, link)
                reach = time_to_target(scaled, pred, goal) if goal is not None else None
                rows.append({"link": label, "prediction": pred, "to_target_s": reach})
    return rows


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 360000:
        return f"{seconds / 3600:,.0f} h"
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"


def table(rows: list[dict]) -> str:
    lines = [
        "| strategy | N | link | to finish | compute | link time not hidden | per step | to target | bound by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p: Prediction = r["prediction"]
        lines.append(
            f"| {p.strategy} | {p.nodes} | {r['link']} | {duration(p.total_s)} | {duration(p.compute_s)} | "
            f"{duration(p.link_s)} | {duration(p.step_s)} | {duration(r['to_target_s'])} | {p.bound} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Time to finish against N, one panel per link, a line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, label in zip(axes[0], links):
        by = {}
        for r in rows:
            if r["link"] == label:
                by.setdefault(r["prediction"].strategy, []).append((r["prediction"].nodes, r["prediction"].total_s))
        for name, points in by.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, [y / 3600 for y in ys], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="nodes", ylabel="hours to finish", title=label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def as_json(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        p = r["prediction"]
        out.append(
            {
                "strategy": p.strategy,
                "nodes": p.nodes,
                "link": r["link"],
                "total_s": p.total_s,
                "compute_s": p.compute_s,
                "link_s": p.link_s,
                "step_s": p.step_s,
                "to_target_s": r["to_target_s"],
                "bound": p.bound,
            }
        )
    return out
