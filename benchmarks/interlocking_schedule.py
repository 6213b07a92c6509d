"""Interlocking on SmolLM2-135M through the pipeline-schedule model (core/interlock/schedule.py):
K = 2 validated against a real run, K = 4 step times predicted for n = 1, 2, 4, and real K = 4
runs (stages sharing this machine's CPUs: the loss is real, the step time is the model's).

Each stage's calls are timed one stage at a time in this process (1 torch thread, the thread a
1-CPU stage actor has; no Ray), in the order the driver submits them; the model then replays the
actors' schedule with those times: each stage on its own core (`parallel`), or all of them sharing
`--cores` cores (`shared`: how the real runs here ran). The real K = 2 run is the SmolLM2 example;
the model is also fed that run's own per-call times (`as ran`), for stages taking one batch at a
time and for stages overlapping `--stage-batches` batches (`interlocking.overlap`). The K = 4 rows
add overlapping stages and aux heads on a quarter of the positions; the real K = 4 runs are n = K
(end to end) for `--k4-steps` steps and each row of `--k4-runs` for as many steps as fit in the
same predicted wall time.

    python -m benchmarks.interlocking_schedule --out runs/interlocking_schedule.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import yaml

from raylowcomm.common.batches import Source
from raylowcomm.core.interlock.heads import LOSSES
from raylowcomm.core.interlock.routing import InterlockStage, message_plan
from raylowcomm.core.interlock.schedule import Link, StageCost, batch_calls, simulate
from raylowcomm.runner import prepare
from raylowcomm.runtime import init_ray
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.interlocking import Interlocking, build_stages
from raylowcomm.strategies.interlocking.stage import StageWorker
from raylowcomm.tasks import CausalLM
from raylowcomm.training import make_optimizer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "interlocking_smollm2_hamlet.yaml"
LINK = Link(latency_s=0.005, bytes_per_s=125e6)
"""5 ms + 1 Gbit/s per message: RAY_NOTES measured a 1 MB tensor through 2 local stages in 20-27 ms."""


def smollm2_config(
    stages: int,
    n: int,
    rule: str,
    split: list[int] | None,
    steps: int,
    cpus: float,
    eval_every: int = 0,
    example: str | None = None,
    **interlocking,
) -> dict:
    """The SmolLM2 example (examples/interlocking_smollm2_hamlet.yaml, or ``example``) with K, n, rule
    and split set (and any other `interlocking` option)."""
    raw = yaml.safe_load(EXAMPLE.read_text() if example is None else Path(example).read_text())
    raw["interlocking"].update(stages=stages, n=n, rule=rule, split=split, **interlocking)
    raw["optim"]["max_steps"] = steps
    raw["nodes"]["cpus"] = cpus
    raw["eval_every"] = eval_every
    return raw


def build_workers(ctx: RunContext) -> tuple[list[StageWorker], Source]:
    """The stages `Interlocking.run` builds (`build_stages`: untied head, split, aux heads), each its
    own optimizer, as in-process workers, and stage 0's source of micro-batches."""
    cfg, opts = ctx.cfg, Interlocking.opts(ctx.cfg)
    built = build_stages(ctx, opts)
    workers = []
    for k, module in enumerate(built.modules):
        stage = InterlockStage(
            k,
            opts.stages,
            opts.width,
            opts.rule,
            module,
            built.heads[k] if k < opts.stages - 1 else None,
            LOSSES["causal_lm"],
            lambda params: make_optimizer(cfg.optim, params),
            opts.micro_batches,
        )
        workers.append(StageWorker(stage, opts.micro_batches, k == opts.stages - 1, CausalLM()))
    built.source.train = ctx.data.train.load(0, 1)
    return workers, built.source


def replay(workers: list[StageWorker], source: Source, plan, micro_batches: int, batches: int) -> dict:
    """``batches`` batches through the workers, call by call in the driver's order, after one
    warm-up batch whose times are dropped; returns the last batch's outputs by call."""
    for step in range(batches + 1):
        if step == 1:
            for w in workers:
                w.call_s = {kind: [] for kind in w.call_s}
        out: dict = {}
        for call in batch_calls(plan, micro_batches):
            w = workers[call.stage]
            if call.kind == "backward":
                out[call] = (None, w.backward(step, call.mb, out[call.source][1]))
                continue
            x, y = (
                w.inputs(source.micro_batch(step, call.mb, micro_batches)) if call.stage == 0 else out[call.source][0]
            )
            h, early = w.forward(step, call.mb, x, y)
            out[call] = ((h, y), early)
    return out


def aux_head_share(w: StageWorker, h: torch.Tensor, y: torch.Tensor, repeats: int = 3) -> tuple[float, float]:
    """(thread-CPU seconds of the aux head's loss forward + backward on ``h``, the head's share of
    the stage's trained parameters): what a stage without an aux head would not spend."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        LOSSES["causal_lm"](w.stage.head(h.detach()), y).backward()
        times.append(time.thread_time() - start)
    w.stage.optimizer.zero_grad(set_to_none=True)
    head = sum(p.numel() for p in w.stage.head.parameters())
    return statistics.median(times), head / (head + sum(p.numel() for p in w.stage.params))


def measure_costs(ctx: RunContext, batches: int = 3) -> tuple[list[StageCost], list[StageCost]]:
    """Median thread-CPU seconds (what a call costs with a core to itself, even on a loaded machine)
    of every stage's forward call, backward call and optimizer step, 1 torch thread, and message
    sizes; second, the same stages without aux heads (their loss pass and share of the step removed)."""
    opts, threads = Interlocking.opts(ctx.cfg), torch.get_num_threads()
    workers, source = build_workers(ctx)
    for w in workers:
        w.clock = time.thread_time
    torch.set_num_threads(1)
    try:
        out = replay(workers, source, message_plan(opts.stages, opts.width, opts.rule), opts.micro_batches, batches)
        first = {c.stage: out[c][0] for c in out if c.kind == "forward" and c.mb == 0}  # (h, y) per stage
        shares = [aux_head_share(w, *first[k]) for k, w in enumerate(workers[:-1])] + [(0.0, 0.0)]
    finally:
        torch.set_num_threads(threads)
    med = [{kind: statistics.median(v) if v else 0.0 for kind, v in w.call_s.items()} for w in workers]
    sent = [{kind: statistics.median(v) if v else 0 for kind, v in w.sent.items()} for w in workers]
    costs = [
        StageCost(
            m["forward"],
            m["backward"],
            m["step"],
            int(s["activations"] + s["targets"]),
            int(sent[k - 1]["activations"]) if k else 0,
        )
        for k, (m, s) in enumerate(zip(med, sent))
    ]
    plain = [
        dataclasses.replace(c, forward_s=c.forward_s - head_s, step_s=c.step_s * (1 - share))
        for c, (head_s, share) in zip(costs, shares)
    ]
    return costs, plain


def costs_from_record(rec: dict, measured: list[StageCost] | None = None, wall: bool = True) -> list[StageCost]:
    """The run's own median per-call times, CPU contention included: whole actor calls (``wall``:
    object-store get and put included) or the stage work inside them; message sizes from
    ``measured``, else from the record's `sent` bytes per message."""
    out, sizes = (
        [],
        _message_sizes(rec) if measured is None else [(c.activation_bytes, c.gradient_bytes) for c in measured],
    )
    for node, (act, grad) in zip(rec["nodes"], sizes):
        m, suffix = node["median_call_s"], "_wall" if wall else ""
        out.append(StageCost(m["forward" + suffix], m["backward" + suffix] or 0.0, m["step"], act, grad))
    return out


def _message_sizes(rec: dict) -> list[tuple[int, int]]:
    """(activation + targets, one head's gradient) bytes per stage from the record's training bytes:
    every stage sends h of one shape, once per micro-batch, and the plan says how many gradients."""
    d, kinds = rec["details"], rec["comm"]["by_kind"]
    K, micro = d["stages"], d["batches"] * d["micro_batches"]
    heads = sum(len(h) for plan in message_plan(K, d["n"], d["rule"]) for h in plan)
    act = (kinds.get("train/activations", 0) + kinds.get("train/targets", 0)) // (micro * (K - 1))
    grad = kinds.get("train/gradients", 0) // (micro * heads) if heads else 0
    return [(act if k < K - 1 else 0, grad if k else 0) for k in range(K)]


def as_ran(path: str) -> dict:
    """A saved run (results.json) modelled with the per-call times it met, vs its measured steady
    step time: how well the schedule alone explains it."""
    rec = next(r for r in json.loads(Path(path).read_text()) if r["strategy"] == "interlocking")
    d = rec["details"]
    ahead = d.get("stage_batches", 1)  # records before overlapping stages: one batch a stage
    opts = argparse.Namespace(
        stages=d["stages"],
        width=d["n"],
        rule=d["rule"],
        micro_batches=d["micro_batches"],
        max_batches_ahead=ahead if ahead > 1 else 2,
        overlap=ahead > 1,
    )
    real = d["steady_step_time_s"]
    out = {"real_steady_s": real}
    for what, wall in (("work", False), ("wall", True)):
        if all(node["median_call_s"].get("forward_wall") for node in rec["nodes"]) or not wall:
            out[what] = predict(costs_from_record(rec, wall=wall), opts, None)["step_time_s"]
            print(
                f"{path}: model on the run's {what} times {out[what]:.3f} s/step vs measured {real:.3f} "
                f"({(out[what] / real - 1) * 100:+.1f}%)"
            )
    return out


def predict(costs: list[StageCost], opts, cores: float | None, batches: int = 12) -> dict:
    """The model's step time for ``opts``'s pipeline, the stages overlapping batches as the run would."""
    tl = simulate(
        costs,
        message_plan(opts.stages, opts.width, opts.rule),
        opts.micro_batches,
        batches,
        LINK,
        opts.max_batches_ahead,
        cores,
        opts.max_batches_ahead if opts.overlap else 1,
    )
    return {
        "step_time_s": tl.step_time_s,
        "busy_fraction": [round(b, 3) for b in tl.busy_fraction],
        "busiest_stage_s": max(tl.busy_s) / batches,
    }  # per batch: no schedule of these calls steps faster


def real_run(ctx: RunContext, raw: dict, name: str) -> dict:
    cfg = from_dict(raw)
    weights = ctx.load_driver_weights()
    rec = Interlocking().run(RunContext(cfg, weights, ctx.spec, ctx.data, ctx.out_dir / name)).to_dict()
    (ctx.out_dir / name).mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / name / "results.json").write_text(json.dumps([rec], default=str))  # for --as-ran
    d = rec["details"]
    return {
        "steady_step_time_s": d["steady_step_time_s"],
        "step_time_s": d["step_time_s"],
        "batches": d["batches"],
        "busy_fraction": d["busy_fraction"],
        "perplexity": rec["metrics"]["id_perplexity"],
        "curve": [(p["step"], p["id_perplexity"]) for p in rec["curve"]],
        "record": rec,
    }


def context_for(ctx: RunContext, raw: dict) -> RunContext:
    return RunContext(from_dict(raw), ctx.load_driver_weights(), ctx.spec, ctx.data, ctx.out_dir)


def k2_validation(ctx: RunContext, args) -> dict:
    """Isolated costs → model (parallel, and sharing the cores) vs the real K = 2 example run, its
    stages taking one batch at a time and (``overlap``) ``--stage-batches`` at once."""
    out: dict = {"loadavg_before": os.getloadavg()}
    for key, overlap in (("one_at_a_time", False), ("overlap", True)):
        raw = yaml.safe_load(EXAMPLE.read_text())
        raw["optim"]["max_steps"] = max(1, args.k2_steps)
        raw["interlocking"].update(overlap=overlap, max_batches_ahead=args.stage_batches if overlap else 2)
        k2 = context_for(ctx, raw)
        opts = Interlocking.opts(k2.cfg)
        costs = out["costs"] if "costs" in out else [c.__dict__ for c in measure_costs(k2)[0]]
        out["costs"] = costs
        costs = [StageCost(**c) for c in costs]
        row = {"parallel": predict(costs, opts, None), "shared": predict(costs, opts, args.cores)}
        if args.k2_steps:
            run = real_run(ctx, raw, "k2" if not overlap else "k2_overlap")
            row["real"] = {k: v for k, v in run.items() if k != "record"}
            row["as_ran"] = predict(costs_from_record(run["record"], costs), opts, None)
        out[key] = row
    return out


K4_ROWS = {  # row: (n, interlocking options beyond the split)
    "1": (1, {}),
    "2": (2, {}),
    "4": (4, {}),
    "2-overlap": (2, {"overlap": True}),
    "4-overlap": (4, {"overlap": True}),
    "2-aux0.25": (2, {"aux_positions": 0.25}),
    "2-overlap-aux0.25": (2, {"overlap": True, "aux_positions": 0.25}),
}
"""Rows with `overlap` use the costs of the row without it: a call costs the same in either order."""


def k4_predictions(ctx: RunContext, args) -> dict:
    """Every row of `K4_ROWS` (and end to end without aux heads: a plain pipeline), each stage on its
    own core and all sharing ``args.cores``; ratios to end to end (n = 4, aux heads trained, one
    batch a stage)."""
    rows, measured = {}, {}
    for name in K4_ROWS:
        k4 = context_for(ctx, k4_config(name, args, steps=1))
        opts = Interlocking.opts(k4.cfg)
        key = (opts.width, opts.aux_positions)
        if key not in measured:
            measured[key] = measure_costs(k4)
        costs, plain = measured[key]
        rows[name] = {
            "costs": [c.__dict__ for c in costs],
            "parallel": predict(costs, opts, None),
            "shared": predict(costs, opts, args.cores),
        }
        if name == "4":
            rows["4 plain"] = {
                "costs": [c.__dict__ for c in plain],
                "parallel": predict(plain, opts, None),
                "shared": predict(plain, opts, args.cores),
            }
    for row in rows.values():
        row["ratio_parallel"] = row["parallel"]["step_time_s"] / rows["4"]["parallel"]["step_time_s"]
        row["ratio_shared"] = row["shared"]["step_time_s"] / rows["4"]["shared"]["step_time_s"]
    return rows


def k4_config(name: str, args, steps: int, eval_every: int = 0) -> dict:
    """Row ``name`` of `K4_ROWS` as a run config (half a CPU a stage, as the real runs here)."""
    n, options = K4_ROWS[name]
    if options.get("overlap"):
        options = {**options, "max_batches_ahead": args.stage_batches}
    raw = smollm2_config(4, n, "farthest", args.split, steps, 0.5, eval_every, args.example, **options)
    raw["seed"] = args.seed
    return raw


def k4_runs(ctx: RunContext, args, preds: dict) -> dict:
    """End to end (row "4") for k4_steps; every other row of ``--k4-runs`` for the steps that fit in
    the same predicted (own cores) wall time, each scored at k4_steps too (equal steps)."""
    t4, s4 = preds["4"]["parallel"]["step_time_s"], args.k4_steps
    runs = {}
    for name in ["4"] + [r for r in args.k4_runs if r != "4"]:
        steps = s4 if name == "4" else max(s4, math.floor(s4 * t4 / preds[name]["parallel"]["step_time_s"]))
        try:
            run = real_run(ctx, k4_config(name, args, steps, eval_every=args.eval_every or s4), f"k4_{name}")
        except Exception as e:  # noqa: BLE001 - a stage killed for memory on a shared machine: say so, go on
            runs[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        runs[name] = {k: v for k, v in run.items() if k != "record"}
        runs[name]["shared_predicted_s"] = preds[name]["shared"]["step_time_s"]
        runs[name]["at_k4_steps"] = dict(run["curve"]).get(s4, run["perplexity"])
    return {"runs": runs, "k4_steps": s4, "predicted_s": s4 * t4}


def print_tables(result: dict, args) -> None:
    if "k2" in result:
        print_k2(result["k2"], args)
    print_k4(result, args)


def print_k2(v: dict, args) -> None:
    print(
        f"\nK=2 SmolLM2 example (n=2 sum, 15+15 layers, 2 micro-batches of 2 x 64 tokens); load before "
        f"{'/'.join(f'{x:.1f}' for x in v['loadavg_before'])}"
    )
    for key in ("one_at_a_time", "overlap"):
        row = v[key]
        print(f"  {key}: model, isolated costs, own cores : {row['parallel']['step_time_s']:.3f} s/step")
        print(f"  {key}: model, isolated costs, {args.cores:g} cores : {row['shared']['step_time_s']:.3f} s/step")
        if "real" in row:
            real = row["real"]["steady_step_time_s"]
            for what in ("shared", "as_ran"):
                p = row[what]["step_time_s"]
                print(
                    f"  {key}: model ({what:>6}) vs real steady {real:.3f} s/step: {p:.3f} s "
                    f"({(p / real - 1) * 100:+.1f}%)"
                )


def print_k4(result: dict, args) -> None:
    print(
        f"\nK=4 {args.example or 'SmolLM2'}, split {args.split}, rule farthest, 2 micro-batches; "
        "predicted step time, link 5 ms + 1 Gbit/s"
    )
    print(
        f"{'n':>18}  {'own cores s':>11}  {'ratio':>5}  {f'{args.cores:g} cores s':>9}  {'ratio':>5}  "
        "busiest stage s  busy (own cores)"
    )
    for n, row in result["k4"].items():
        print(
            f"{n:>18}  {row['parallel']['step_time_s']:11.3f}  {row['ratio_parallel']:5.2f}  "
            f"{row['shared']['step_time_s']:9.3f}  {row['ratio_shared']:5.2f}  "
            f"{row['parallel']['busiest_stage_s']:15.3f}  "
            f"{'/'.join(f'{b:.2f}' for b in row['parallel']['busy_fraction'])}"
        )
    if "k4_real" in result:
        r = result["k4_real"]
        print(f"  real runs at equal predicted wall time ({r['predicted_s']:.1f} s on own cores):")
        for name, run in r["runs"].items():
            if "error" in run:
                print(f"  {name:>18}: failed: {run['error']}")
                continue
            print(
                f"  {name:>18}: {run['batches']} steps, steady {run['steady_step_time_s']:.3f} s/step on shared "
                f"cores (model {run['shared_predicted_s']:.3f}), perplexity {run['perplexity']:.2f} "
                f"({run['at_k4_steps']:.2f} after {r['k4_steps']} steps)"
            )


def summarize(paths: list[str]) -> dict:
    """Seeds' saved results (each a --k4-steps run): per K=4 row, the perplexity at equal predicted
    wall time per seed, its mean and 95% interval, and the paired gap to end to end (row / end to
    end − 1); and the predicted step-time ratios over the measurements."""
    from raylowcomm.seedstats import interval, plus_minus

    runs = [json.loads(Path(p).read_text()) for p in paths]
    out: dict = {"seeds": [r["args"]["seed"] for r in runs], "rows": {}}
    names = {name for r in runs for name in r.get("k4_real", {}).get("runs", {})}
    for name in sorted(names, key=list(K4_ROWS).index):
        ppl, gap, steps = [], [], []
        for r in runs:
            real = r.get("k4_real", {}).get("runs", {})
            if name in real and "error" not in real[name] and "error" not in real.get("4", {"error": 1}):
                ppl.append(real[name]["perplexity"])
                gap.append(real[name]["perplexity"] / real["4"]["perplexity"] - 1)
                steps.append(real[name]["batches"])
        ratios = [r["k4"][name]["ratio_parallel"] for r in runs if name in r.get("k4", {})]
        out["rows"][name] = {
            "steps": steps,
            "perplexity": interval(ppl),
            "per_seed": ppl,
            "gap_to_end_to_end": interval(gap),
            "predicted_ratio": interval(ratios),
        }
        row = out["rows"][name]
        print(
            f"{name:>18}: steps {steps}, perplexity {plus_minus(row['perplexity'])} "
            f"{[round(v, 1) for v in ppl]}, gap to end to end {plus_minus(row['gap_to_end_to_end'], 3, sign='+')}, "
            f"predicted step {plus_minus(row['predicted_ratio'], 3)}x end to end's"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--k2-steps", type=int, default=16, help="steps of the real K=2 runs, the model's validation (0: none)"
    )
    ap.add_argument("--k4-steps", type=int, default=16, help="steps of the real K=4 end-to-end run (0: none)")
    ap.add_argument(
        "--split",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[7, 8, 8, 7],
        help="K=4 decoder layers per stage (SmolLM2 has 30)",
    )
    ap.add_argument("--cores", type=float, default=2.0, help="cores the stages of a real run here share")
    ap.add_argument("--k4-runs", nargs="+", default=["4", "2"], choices=list(K4_ROWS), help="K=4 rows to run for real")
    ap.add_argument("--seed", type=int, default=0, help="seed of the real K=4 runs")
    ap.add_argument("--eval-every", type=int, default=0, help="the real K=4 runs' curve (0: at --k4-steps)")
    ap.add_argument(
        "--example",
        help="the K=4 runs' config (default: the SmolLM2 example); examples/interlocking_scratch_hamlet.yaml "
        "is the seed's regime, a small Llama from scratch",
    )
    ap.add_argument(
        "--stage-batches", type=int, default=2, help="batches a stage holds at once in the overlap rows and runs"
    )
    ap.add_argument("--out", default="runs/interlocking_schedule.json")
    ap.add_argument(
        "--as-ran",
        nargs="+",
        metavar="RESULTS",
        help="only model saved runs (results.json) "
        "with the per-call times they met, and compare with their measured step time",
    )
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="only summarise saved results over their seeds")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return
    if args.as_ran:
        for path in args.as_ran:
            as_ran(path)
        return
    out = Path(args.out)
    example = Path(args.example) if args.example else EXAMPLE
    ctx = prepare(from_dict(yaml.safe_load(example.read_text())), out.parent / (out.stem + "_runs"))
    if args.k2_steps or args.k4_steps:
        init_ray(num_cpus=2)
    result: dict = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = (
        ([("k2", k2_validation)] if args.k2_steps else [])
        + [("k4", k4_predictions)]
        + ([("k4_real", k4_runs)] if args.k4_steps else [])
    )
    for key, part in steps:  # saved after each part: a run killed (memory, on a shared machine) keeps the rest
        result[key] = part(ctx, args) if key != "k4_real" else part(ctx, args, result["k4"])
        gc.collect()
        out.write_text(json.dumps({"args": vars(args), **result}, indent=2, default=str))
    print_tables(result, args)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
