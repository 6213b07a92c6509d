"""SPSA costs on SmolLM2-135M, printed as a table and saved as JSON (a benchmark, not a test).

0. Step vs floor, in process (1 thread, as a node with nodes.cpus=1): a `Replica` steps with
   `samples` perturbations and applies the codes of `nodes` publishers; each part of its step is
   printed beside the floor, 2·samples forwards + the replay of nodes·samples updates, and the
   ratio step/floor. The machine's load average is printed too: other processes skew it.
1. Replay: applying N updates ÷ (N × one torch.randn fill of all parameters), N = 1, 2, 4, 8,
   Gaussian and Rademacher. The floor of replay is one random draw per element per update.
2. Peak memory (ru_maxrss, each in its own subprocess): an SPSA node's step, inference alone,
   and a backprop + AdamW step on the same batch.
3. Exchange: the real `spsa` strategy on Ray (2 nodes) for a few steps with 1 and 4 samples per
   node per step: the step's wall time beside the nodes' compute and replay and the floor of
   part 0, and the bytes of codes per step beside the wire bytes of the messages carrying them.

    python benchmarks/spsa_replay.py [--threads 1] [--parts floor,replay,memory,ray] [--out runs/bench_spsa.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from raylowcomm.common.timing import best_of

MODEL = {"name": "SmolLM2-135M", "family": "hf_causal_lm"}
DATA = {"name": "rotten_tomatoes", "train_size": 256, "test_size": 16, "max_length": 64}
BATCH = 16


def _context(out: Path, **overrides):
    from raylowcomm.runner import prepare
    from raylowcomm.strategies import from_dict

    raw = {
        "model": MODEL,
        "data": DATA,
        "optim": {"lr": 1e-5, "batch_size": BATCH, "eval_batch_size": 16},
        "strategies": ["spsa"],
        "log_every": 1000,
    }
    raw.update(overrides)
    return prepare(from_dict(raw), out)


def _workload(threads: int):
    """(model, a training batch of BATCH, the task whose loss SPSA measures) with torch on `threads`."""
    from raylowcomm.tasks import task_for

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(Path(tmp))
    batch = {k: v[:BATCH] for k, v in ctx.data.train.load_all().items()}
    return ctx.load_driver_weights(), batch, task_for(ctx.spec.family, 32, data=DATA["name"])


def step_parts(samples: int, nodes: int, steps: int, threads: int) -> dict:
    """A Replica's step split into its parts (mean seconds per step, after one warm-up step) beside
    its floor: 2·samples forwards + the replay of nodes·samples updates. The other publishers'
    codes are copies of its own: what they hold does not change the work."""
    from raylowcomm.core.zo.codec import codec_for
    from raylowcomm.core.zo.draws import z_chunks
    from raylowcomm.core.zo.perturb import parked
    from raylowcomm.core.zo.replay import Replica

    model, batch, task = _workload(threads)
    rep = Replica(model, 0, 0, codec_for("log"), eps=1e-3, samples=samples, lr=1e-9)
    tensors = [p for _, p in rep.params]
    walls = []
    for step in range(steps + 1):
        if step == 1:  # the first step pays for lazy allocations and caches
            rep.times, walls = dict.fromkeys(rep.times, 0.0), []
        t0 = time.perf_counter()
        payload, _ = rep.compute(task.loss, batch)
        rep.apply(list(range(nodes)), payload * (nodes - 1))
        walls.append(time.perf_counter() - t0)

    def park_and_restore() -> None:
        with parked(tensors, rep.spare):
            pass

    row = {"samples": samples, "nodes": nodes, **{k: v / steps for k, v in rep.times.items()}}
    row["z_gen_s"] = best_of(lambda: all(True for _ in z_chunks(tensors, 1, "rademacher")), 2)  # a pass drawing z only
    row["restore_s"] = best_of(park_and_restore, 3)
    row["replay_per_update_s"] = row["replay_s"] / (nodes * samples)
    row["floor_s"] = row["forward_plus_s"] + row["forward_minus_s"] + row["replay_s"]
    row["step_s"] = sum(walls) / steps
    row["ratio"] = row["step_s"] / row["floor_s"]
    row["load_avg"] = os.getloadavg()[0]
    return row


def replay(threads: int, repeats: int) -> tuple[list[dict], int]:
    from raylowcomm.core.zo.perturb import KINDS, apply_step_, trainable_parameters

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(Path(tmp))
    params = trainable_parameters(ctx.load_driver_weights())
    numel = sum(p.numel() for _, p in params)
    scratch = torch.empty(numel)
    gen = torch.Generator().manual_seed(0)
    randn = best_of(lambda: scratch.normal_(generator=gen), repeats)
    rows = []
    for kind in KINDS:
        for n in (1, 2, 4, 8):
            updates = [(1000 + i, 1e-3) for i in range(n)]
            t = best_of(lambda updates=updates, kind=kind: apply_step_(params, updates, 1e-9, kind=kind), repeats)
            rows.append({"kind": kind, "N": n, "replay_s": t, "randn_fill_s": randn, "ratio": t / (n * randn)})
    return rows, numel


def memory_probe(mode: str, threads: int) -> dict:
    """Runs in a subprocess: load the model, do one `mode` step on one batch, report ru_maxrss."""
    from raylowcomm.core.zo.perturb import apply_step_, spsa_projected_grads, trainable_parameters

    model, batch, task = _workload(threads)
    t0 = time.perf_counter()
    if mode == "inference":
        model.eval()
        with torch.inference_mode():
            task.loss(model, batch)
    elif mode == "spsa":
        params = trainable_parameters(model)
        g = spsa_projected_grads(model, params, task.loss, batch, [1], 1e-3, "rademacher")
        apply_step_(params, [(1, g[0])], 1e-5, kind="rademacher")
    else:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        task.loss(model, batch).backward()
        optimizer.step()
    return {
        "mode": mode,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": time.perf_counter() - t0,
    }


def memory(threads: int) -> dict:
    out = {}
    for mode in ("spsa", "inference", "backprop_adamw"):
        proc = subprocess.run(
            [sys.executable, __file__, "--probe", mode, "--threads", str(threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def exchange(samples_list: list[int], steps: int, parts: dict[int, dict]) -> list[dict]:
    """The strategy on Ray. Its nodes report their compute and replay, not the forwards within, so
    step/floor = (step / the nodes' work, on Ray) x (work / floor, in process: `parts`), each
    factor measured under one load."""
    from raylowcomm.runtime import init_ray
    from raylowcomm.strategies.spsa import Spsa

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_ray()
        for samples in samples_list:
            ctx = _context(
                Path(tmp) / f"s{samples}",
                optim={"lr": 1e-5, "batch_size": BATCH, "max_steps": steps, "eval_batch_size": 16},
                nodes={"count": 2, "cpus": 1},
                spsa={"samples": samples, "verify_every": steps},
            )
            det = Spsa().run(ctx).details
            step_over_work = det["mean_step_s"] / (det["mean_compute_s"] + det["mean_replay_s"])
            rows.append(
                {
                    "samples": samples,
                    "nodes": 2,
                    "step_ms": 1e3 * det["mean_step_s"],
                    "compute_ms": 1e3 * det["mean_compute_s"],
                    "replay_ms": 1e3 * det["mean_replay_s"],
                    "exchange_ms": 1e3 * det["mean_exchange_s"],
                    "exchange_ms_per_sample": 1e3 * det["mean_exchange_s"] / samples,
                    "grad_bytes_per_step": det["payload_bytes_per_step"],
                    "wire_bytes_per_step": det["wire_bytes_per_step"],
                    "step_over_work": step_over_work,
                    "work_over_floor": parts[samples]["ratio"],
                    "ratio": step_over_work * parts[samples]["ratio"],
                    "load_avg": os.getloadavg()[0],
                }
            )
    return rows


FLOOR_ROWS = [  # (label, key, per what): the parts of a step, then the floor and the ratio
    ("z generation, one pass", "z_gen_s", "1 per sample, in perturb"),
    ("perturb θ±εz", "perturb_s", "2 per sample"),
    ("forward +", "forward_plus_s", "1 per sample"),
    ("forward -", "forward_minus_s", "1 per sample"),
    ("restore θ (swap)", "restore_s", "1 per step"),
    ("replay", "replay_s", "nodes x samples updates"),
    ("  per update", "replay_per_update_s", ""),
    ("floor: fwd± + replay", "floor_s", ""),
    ("step: compute + apply", "step_s", ""),
    ("step / floor", "ratio", ""),
]


def print_floor(rows: list[dict], steps: int, threads: int) -> None:
    print(
        f"\nStep vs floor in process, SmolLM2-135M, batch {BATCH}, {threads} thread(s), "
        f"{rows[0]['nodes']} nodes' updates, rademacher: s per step, mean of {steps} steps; "
        f"load average {max(r['load_avg'] for r in rows):.1f}"
    )
    print(f"{'part':<24}" + "".join(f"{'samples=' + str(r['samples']):>12}" for r in rows) + "   per")
    for label, key, per in FLOOR_ROWS:
        print(f"{label:<24}" + "".join(f"{r[key]:>12.3f}" for r in rows) + f"   {per}")


def print_replay(rows: list[dict], numel: int, threads: int) -> None:
    print(
        f"\nReplay on SmolLM2-135M ({numel:,} parameters, {threads} thread(s)): "
        "time of N updates / (N x one randn fill)"
    )
    print(f"{'kind':<11}{'N':>3}{'replay s':>10}{'randn s':>9}{'ratio':>7}")
    for r in rows:
        print(f"{r['kind']:<11}{r['N']:>3}{r['replay_s']:>10.3f}{r['randn_fill_s']:>9.3f}{r['ratio']:>7.2f}")


def print_memory(mem: dict, ratios: dict) -> None:
    print(f"\nPeak RSS, batch {BATCH}, one process each")
    for m, v in mem.items():
        print(f"{m:<16}{v['peak_rss_bytes'] / 2**20:>9.0f} MiB  (step {v['step_s']:.2f}s)")
    print(
        f"SPSA / inference {ratios['spsa_over_inference']:.2f}   "
        f"backprop+AdamW / SPSA {ratios['backprop_over_spsa']:.2f}"
    )


def print_exchange(ex: list[dict], steps: int) -> None:
    print(
        f"\nExchange on Ray, 2 nodes, {steps} steps (means per step; "
        f"work = the nodes' largest compute + largest replay; step/floor = step/work x work/floor in process); "
        f"load average {max(r['load_avg'] for r in ex):.1f}"
    )
    print(
        f"{'samples':>7}{'step ms':>10}{'compute ms':>12}{'replay ms':>11}{'exchange ms':>13}{'per sample':>12}"
        f"{'step/work':>11}{'work/floor':>12}{'step/floor':>12}{'grad B/step':>13}{'wire B/step':>13}"
    )
    for r in ex:
        print(
            f"{r['samples']:>7}{r['step_ms']:>10.0f}{r['compute_ms']:>12.0f}{r['replay_ms']:>11.0f}{r['exchange_ms']:>13.1f}"
            f"{r['exchange_ms_per_sample']:>12.1f}{r['step_over_work']:>11.3f}{r['work_over_floor']:>12.3f}{r['ratio']:>12.3f}"
            f"{r['grad_bytes_per_step']:>13.0f}{r['wire_bytes_per_step']:>13.0f}"
        )


PARTS = ("floor", "replay", "memory", "ray")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (an SPSA node actor with nodes.cpus=1 has 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="SPSA steps per step-vs-floor and exchange measurement")
    p.add_argument("--samples", default="1,4", help="perturbations per node per step to measure, comma-separated")
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, of {', '.join(PARTS)} (ray runs floor too: its ratio is to that floor)",
    )
    p.add_argument("--out", default="runs/bench_spsa.json")
    p.add_argument("--probe", choices=["spsa", "inference", "backprop_adamw"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(memory_probe(args.probe, args.threads)))
        return
    parts, samples = set(args.parts.split(",")), [int(s) for s in args.samples.split(",")]
    if parts - set(PARTS):
        p.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")

    result: dict = {"threads": args.threads}
    if parts & {"floor", "ray"}:
        result["floor"] = [step_parts(s, 2, args.steps, args.threads) for s in samples]
        print_floor(result["floor"], args.steps, args.threads)
    if "replay" in parts:
        result["replay"], result["parameters"] = replay(args.threads, args.repeats)
        print_replay(result["replay"], result["parameters"], args.threads)
    if "memory" in parts:
        mem = result["memory"] = memory(args.threads)
        spsa, inf, bp = (mem[m]["peak_rss_bytes"] for m in ("spsa", "inference", "backprop_adamw"))
        result["memory_ratios"] = {"spsa_over_inference": spsa / inf, "backprop_over_spsa": bp / spsa}
        print_memory(mem, result["memory_ratios"])
    if "ray" in parts:
        result["exchange"] = exchange(samples, args.steps, {r["samples"]: r for r in result["floor"]})
        print_exchange(result["exchange"], args.steps)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
