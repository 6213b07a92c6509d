"""SPSA costs on SmolLM2-135M, printed as a table and saved as JSON (a benchmark, not a test).

1. Replay: applying N updates ÷ (N × one torch.randn fill of all parameters), N = 1, 2, 4, 8,
   Gaussian and Rademacher. The floor of replay is one random draw per element per update.
2. Peak memory (ru_maxrss, each in its own subprocess): an SPSA node's step, inference alone,
   and a backprop + AdamW step on the same batch.
3. Exchange: the real `spsa` strategy on Ray (2 nodes) for a few steps with 1 and 4 samples per
   node per step: the step's wall time beside the nodes' compute and replay, and the bytes of
   codes per step beside the wire bytes of the messages carrying them.

    python benchmarks/spsa_replay.py [--threads 1] [--out runs/bench_spsa.json]
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

MODEL = {"name": "SmolLM2-135M", "family": "hf_causal_lm"}
DATA = {"name": "rotten_tomatoes", "train_size": 256, "test_size": 16, "max_length": 64}
BATCH = 16


def _context(out: Path, **overrides):
    from raylowcomm.strategies import from_dict
    from raylowcomm.runner import prepare

    raw = {"model": MODEL, "data": DATA, "optim": {"lr": 1e-5, "batch_size": BATCH, "eval_batch_size": 16},
           "strategies": ["spsa"], "log_every": 1000}
    raw.update(overrides)
    return prepare(from_dict(raw), out)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def replay(threads: int, repeats: int) -> tuple[list[dict], int]:
    from raylowcomm.core import zo

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(Path(tmp))
    params = zo.trainable_parameters(ctx.model)
    numel = sum(p.numel() for _, p in params)
    scratch = torch.empty(numel)
    gen = torch.Generator().manual_seed(0)
    randn = _best(lambda: scratch.normal_(generator=gen), repeats)
    del scratch
    rows = []
    for kind in zo.KINDS:
        for n in (1, 2, 4, 8):
            updates = [(1000 + i, 1e-3) for i in range(n)]
            t = _best(lambda: zo.apply_step_(params, updates, 1e-9, kind=kind), repeats)
            rows.append({"kind": kind, "N": n, "replay_s": t, "randn_fill_s": randn, "ratio": t / (n * randn)})
    return rows, numel


def memory_probe(mode: str, threads: int) -> dict:
    """Runs in a subprocess: load the model, do one `mode` step on one batch, report ru_maxrss."""
    from raylowcomm.core import zo
    from raylowcomm.tasks import task_for

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(Path(tmp))
    model, batch = ctx.model, {k: v[:BATCH] for k, v in ctx.data.train.items()}
    task = task_for(ctx.spec.family, 32, data=DATA["name"])
    t0 = time.perf_counter()
    if mode == "inference":
        model.eval()
        with torch.inference_mode():
            task.loss(model, batch)
    elif mode == "spsa":
        params = zo.trainable_parameters(model)
        g = zo.spsa_projected_grads(model, params, task.loss, batch, [1], 1e-3, "rademacher")
        zo.apply_step_(params, [(1, g[0])], 1e-5, kind="rademacher")
    else:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        task.loss(model, batch).backward()
        optimizer.step()
    return {"mode": mode, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": time.perf_counter() - t0}


def memory(threads: int) -> dict:
    out = {}
    for mode in ("spsa", "inference", "backprop_adamw"):
        proc = subprocess.run([sys.executable, __file__, "--probe", mode, "--threads", str(threads)],
                              capture_output=True, text=True, check=True)
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def exchange(samples_list: list[int], steps: int) -> list[dict]:
    from raylowcomm.runtime import init_ray
    from raylowcomm.strategies.spsa import Spsa

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init_ray()
        for samples in samples_list:
            ctx = _context(Path(tmp) / f"s{samples}", optim={"lr": 1e-5, "batch_size": BATCH, "max_steps": steps, "eval_batch_size": 16},
                           nodes={"count": 2, "cpus": 1}, spsa={"samples": samples, "verify_every": steps})
            det = Spsa().run(ctx).details
            rows.append({"samples": samples, "nodes": 2, "step_ms": 1e3 * det["mean_step_s"],
                         "compute_ms": 1e3 * det["mean_compute_s"], "replay_ms": 1e3 * det["mean_replay_s"],
                         "exchange_ms": 1e3 * det["mean_exchange_s"], "exchange_ms_per_sample": 1e3 * det["mean_exchange_s"] / samples,
                         "grad_bytes_per_step": det["payload_bytes_per_step"], "wire_bytes_per_step": det["wire_bytes_per_step"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (an SPSA node actor with nodes.cpus=1 has 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="SPSA steps per exchange measurement")
    p.add_argument("--out", default="runs/bench_spsa.json")
    p.add_argument("--probe", choices=["spsa", "inference", "backprop_adamw"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(memory_probe(args.probe, args.threads)))
        return

    rows, numel = replay(args.threads, args.repeats)
    print(f"\nReplay on SmolLM2-135M ({numel:,} parameters, {args.threads} thread(s)): time of N updates / (N x one randn fill)")
    print(f"{'kind':<11}{'N':>3}{'replay s':>10}{'randn s':>9}{'ratio':>7}")
    for r in rows:
        print(f"{r['kind']:<11}{r['N']:>3}{r['replay_s']:>10.3f}{r['randn_fill_s']:>9.3f}{r['ratio']:>7.2f}")

    mem = memory(args.threads)
    spsa, inf, bp = (mem[m]["peak_rss_bytes"] for m in ("spsa", "inference", "backprop_adamw"))
    ratios = {"spsa_over_inference": spsa / inf, "backprop_over_spsa": bp / spsa}
    print(f"\nPeak RSS, batch {BATCH}, one process each")
    for m, v in mem.items():
        print(f"{m:<16}{v['peak_rss_bytes'] / 2**20:>9.0f} MiB  (step {v['step_s']:.2f}s)")
    print(f"SPSA / inference {ratios['spsa_over_inference']:.2f}   backprop+AdamW / SPSA {ratios['backprop_over_spsa']:.2f}")

    ex = exchange([1, 4], args.steps)
    print(f"\nExchange on Ray, 2 nodes, {args.steps} steps (means per step)")
    print(f"{'samples':>7}{'step ms':>10}{'compute ms':>12}{'replay ms':>11}{'exchange ms':>13}{'per sample':>12}"
          f"{'grad B/step':>13}{'wire B/step':>13}")
    for r in ex:
        print(f"{r['samples']:>7}{r['step_ms']:>10.0f}{r['compute_ms']:>12.0f}{r['replay_ms']:>11.0f}{r['exchange_ms']:>13.1f}"
              f"{r['exchange_ms_per_sample']:>12.1f}{r['grad_bytes_per_step']:>13.0f}{r['wire_bytes_per_step']:>13.0f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"parameters": numel, "threads": args.threads, "replay": rows, "memory": mem,
                               "memory_ratios": ratios, "exchange": ex}, indent=2))
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
