"""The end of a lo-fi run, once the exchange has its final average (`FinalModel`): the average
scored where the device is, its BatchNorm statistics recalibrated on the nodes' shards, node 0's save
where the driver holds no model, and the curve from the nodes' snapshots."""

from __future__ import annotations

import logging
import warnings

import ray

from raylowcomm.actors import DriverFetches, NodeGroup
from raylowcomm.common.ledger import Ledger
from raylowcomm.core.averaging import combine_bn_statistics
from raylowcomm.failures import NodeFailed
from raylowcomm.strategies.base import RunContext, curve_point
from raylowcomm.strategies.lofi.exchange import FinalModel
from raylowcomm.strategies.lofi.plan import Plan, average_nodes
from raylowcomm.tasks import mean_metrics

logger = logging.getLogger(__name__)

COLLECTION_KINDS = ("outer_gradients", "round_replies", "round_args", "verify_hash")
"""What the final collection of peer rounds books (besides the star's `plan.average.what`): a curve
point's bytes include one such collection."""


def save_on_node(ctx: RunContext, group: NodeGroup, plan: Plan, final: FinalModel, name: str) -> None:
    """Where the driver holds no model of the result, the first node in the run (node 0, unless it left)
    saves it: the average it holds (after peer rounds), or the nodes' adapters it is sent, merged on its base."""
    if final.weights is not None:
        return  # saved with the record
    rel = f"{name}/model.safetensors"
    if final.on_nodes:
        group.call("save_plain", None, ctx.storage, rel, phase="final", keys=group.keys()[:1])
        return
    ledger = group.ledger
    ledger.record("final", "adapters_to_save", plan.average.sent(final.to_score)[1])  # as scoring books them
    group.call("save_plain", ray.put(final.to_score), ctx.storage, rel, phase="final", keys=group.keys()[:1])


def score_average(group: NodeGroup, plan: Plan, state, on_nodes: bool, on_all: bool) -> list[dict]:
    """Metrics of the average, scored where the device is, not on the driver: by the nodes that hold
    it after peer rounds (nothing sent), else `state` sent to them."""
    if on_nodes:
        return group.evaluate_nodes(group.keys() if on_all else group.keys()[:1])
    return group.score_weights(state, "final", on_all, sent=plan.average.sent(state))


def recalibrate_bn(group: NodeGroup, final: FinalModel, batches: int | None) -> None:
    """BatchNorm statistics of the average measured on every node's shard, combined into the
    average (which is then what is scored); nodes that hold the average measure it in place and
    load the combined statistics."""
    n = len(group)
    ref = None if final.on_nodes else group.put(final.weights, "final", "averaged_weights_for_bn", copies=n)
    combined = combine_bn_statistics(group.call("bn_statistics", ref, batches, phase="final", what="bn_statistics"))
    if final.weights is not None:
        final.weights.update(combined)
        final.to_score = final.weights  # recalibrated statistics: the merged model itself
    if final.on_nodes:
        group.call("load_bn_statistics", group.put(combined, "final", "combined_bn_statistics", copies=n))


def snapshot_curve(
    group: NodeGroup,
    snapshots: list[tuple[int, float, int]],
    plan: Plan,
    batch: int,
    collect_s: float,
    on_all: bool,
    collect_bytes: int,
) -> list[dict]:
    """Score the average of the nodes' snapshots at each curve step (see the module docstring),
    on the nodes; fetching the snapshots and sending the averages back is measurement."""
    curve, n = [], len(group)
    for step, train_s, sent in snapshots:
        try:  # fetching snapshots is measurement: a scratch ledger
            average = average_nodes(group, plan, "final", "snapshot", step, fetch=DriverFetches(Ledger()))
        except NodeFailed as err:  # e.g. a node restarted on another host, without its snapshots
            logger.warning(
                "[lofi] no curve point at step %d: a node's snapshot is gone (%s)", step, err.failure["type"]
            )
            continue
        metrics = mean_metrics(group.score_weights(average, "final", on_all, ledger=Ledger()))
        curve.append(curve_point(step, train_s + collect_s, step * batch * n, sent + collect_bytes, metrics))
    return curve


def warn_if_worse(metric: str, metrics: dict, node_metrics: list[dict], details: dict) -> None:
    node_mean = sum(m[f"id_{metric}"] for m in node_metrics) / len(node_metrics)
    details[f"node_mean_id_{metric}"] = node_mean
    worse = node_mean > metrics[f"id_{metric}"] if metric == "accuracy" else node_mean < metrics[f"id_{metric}"]
    if worse:
        msg = (
            f"lo-fi: the average scores worse than the mean of the nodes (id_{metric} "
            f"{metrics[f'id_{metric}']:.4f} vs {node_mean:.4f}): averaging left the shared basin. "
            "Try lofi.average_every (a few rounds), a lower lr, or a greedy soup."
        )
        warnings.warn(msg, stacklevel=1)
        details["warning"] = msg
