"""The end of a lo-fi run, after training: every node scored alone, the exchange's final average
collected, the curve made from the nodes' snapshots, the average recalibrated (BatchNorm), scored and
saved, and the record written. The steps themselves are in `final`; this is their order."""

from __future__ import annotations

from raylowcomm.actors import NodeGroup
from raylowcomm.common.timing import Stopwatch, TrainClock
from raylowcomm.core.averaging import batchnorm_layers
from raylowcomm.strategies.base import RunContext, RunRecord, budget_details, finish_record
from raylowcomm.strategies.lofi import final as final_phase
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.exchange import Exchange, FinalModel, Trained
from raylowcomm.strategies.lofi.plan import Plan
from raylowcomm.tasks import make_task, mean_metrics


def finish_run(
    name: str,
    opts: LofiConfig,
    ctx: RunContext,
    group: NodeGroup,
    plan: Plan,
    exchange: Exchange,
    trained: Trained,
    clock: TrainClock,
    watch: Stopwatch,
) -> RunRecord:
    """The run's record, from the nodes that trained (`trained`) to the average scored and saved."""
    with watch("evaluate_nodes"):
        node_metrics = group.evaluate_all()
    metric, on_all = make_task(ctx.data.task).metric, ctx.cfg.data.eval_on_nodes
    collect_clock = TrainClock()
    final = exchange.finish(ctx, group, plan, metric, node_metrics)
    collect_s = collect_clock.elapsed()
    watch.add("collect", collect_s)
    details = {
        "steps_per_node": plan.steps,
        "averaging_steps": plan.boundaries if plan.averaging else [plan.steps],
        "soup_nodes": final.nodes,
        "exchange": exchange.name,
        **exchange.details(),
        **_resolved(opts, plan),
    }
    with watch("curve"):
        curve = _curve(ctx, group, plan, trained, collect_s)
    bn_s = _recalibrate(opts, ctx, group, plan, final, details, watch)
    with watch("score_average"):
        per_node = final_phase.score_average(group, plan, final.to_score, final.on_nodes, on_all)
    metrics = mean_metrics(per_node)
    final_phase.save_on_node(ctx, group, plan, final, name)
    if on_all:  # the test rows are the nodes': each scored the average on its own
        details["average_on_nodes"] = per_node
    details["collect_s"], details["phases_s"] = collect_s + bn_s, watch.parts
    if ctx.cfg.optim.budget_s is not None:
        details["budget"] = budget_details(ctx.cfg.optim.budget_s, trained.train_s, plan.steps, trained.last_step_s)
    details["curve_note"] = _curve_note(len(group), collect_s, bn_s, "average_without_bn_recalibration" in details)
    final_phase.warn_if_worse(metric, metrics, node_metrics, details)
    infos = group.call("info", phase="final", what="node_info")  # last: peaks include node 0's save
    nodes = [{**info, "metrics": m, "train": calls} for info, m, calls in zip(infos, node_metrics, trained.nodes)]
    return finish_record(
        name,
        ctx,
        group.ledger,
        clock,
        metrics=metrics,
        step=plan.steps,
        samples=trained.samples,
        train_s=trained.train_s,
        infos=infos,
        weights=final.weights,
        curve=curve,
        nodes=nodes,
        details=details,
        curve_wall_s=trained.train_s + collect_s + bn_s,
        goodput=trained.goodput,
    )


def _resolved(opts: LofiConfig, plan: Plan) -> dict:
    """What was settled for the run before it started: lofi.dial: auto's choice, and with lofi.privacy its
    accounting over the rounds whose Δ crossed (`plan.boundaries`: the final round's too; fewer where a
    budget ended the run early)."""
    out = {"dial": opts.dial_record} if opts.dial_record else {}
    if opts.privacy_plan is not None:
        out["privacy"] = opts.privacy_plan.record(len(plan.boundaries))
    return out


def _curve(ctx: RunContext, group: NodeGroup, plan: Plan, trained: Trained, collect_s: float) -> list[dict]:
    """The averages of the nodes' snapshots, each point's time and bytes including one final collection."""
    collected = sum(
        group.ledger.bytes_by_kind.get(f"final/{what}", 0)
        for what in (plan.average.what, *final_phase.COLLECTION_KINDS)
    )
    on_all = ctx.cfg.data.eval_on_nodes
    return final_phase.snapshot_curve(
        group, trained.snapshots, plan, ctx.cfg.optim.batch_size, collect_s, on_all, collected
    )


def _recalibrate(
    opts: LofiConfig, ctx: RunContext, group: NodeGroup, plan: Plan, final: FinalModel, details: dict, watch: Stopwatch
) -> float:
    """BatchNorm statistics of the average recomputed on the nodes' shards (a BN model with
    `lofi.bn_recalibrate`), the average scored before it too; returns the seconds it took (0: none)."""
    if not (opts.bn_recalibrate and batchnorm_layers(ctx.architecture)):
        return 0.0
    before = final_phase.score_average(group, plan, final.weights, final.on_nodes, ctx.cfg.data.eval_on_nodes)
    details["average_without_bn_recalibration"] = mean_metrics(before)
    bn_clock = TrainClock()
    final_phase.recalibrate_bn(group, final, opts.bn_batches)
    bn_s = bn_clock.elapsed()
    watch.add("bn_recalibrate", bn_s)
    return bn_s


def _curve_note(n: int, collect_s: float, bn_s: float, recalibrated: bool) -> str:
    """How the curve's points were made and timed, for the record."""
    note = (
        f"lo-fi points: averages of node snapshots made after training; time = slowest node's "
        f"training time at the step + {collect_s:.2f} s, the measured time to collect and "
        f"average the {n} final models; bytes include that collection"
    )
    if recalibrated:
        note += (
            f"; the points before the last are not BN-recalibrated, the last (the result) is, "
            f"its time + {bn_s:.2f} s more for it"
        )
    return note
