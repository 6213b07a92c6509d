"""A strategy's `Cost` from what a real run recorded (its results.json): per-step compute, the bytes
each step or round sends, its rounds and its curve. A run over a shaped link (`bench wan`) has the
link's time in its step times: `link` (the rate it measured) takes the modelled link time back out."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from raylowcomm.core.interlock.schedule import Link, StageCost
from raylowcomm.planner.costs import Cost, predict


def _params(rec: dict) -> float:
    """The model's parameters: as the record says (`details.model_params`), or from full weights it sent
    (float32: 4 bytes each); 0 where neither tells (an older run of peer rounds)."""
    if rec["details"].get("model_params"):
        return float(rec["details"]["model_params"])
    kinds = rec["comm"]["by_kind"]
    saved = next(
        (
            kinds[k]
            for k in ("final/model_checkpoint", "setup/ddp_initial_broadcast", "final/model_weights")
            if k in kinds
        ),
        0,
    )
    return saved / 4 if saved else 0.0


def ddp_cost(rec: dict) -> Cost:
    steps = rec["details"]["steps_per_worker"]
    grad = rec["nodes"][0]["allreduce_bytes"] / steps  # what each rank reduces a step
    params = _params(rec) or grad / 4
    return Cost("ddp", "allreduce", steps, rec["train_s"] / steps, step_bytes=grad, params=params, trainable=grad / 4)


def lofi_cost(rec: dict) -> Cost:
    d, kinds, n = rec["details"], rec["comm"]["by_kind"], len(rec["nodes"])
    steps, rounds = d["steps_per_node"], len(d.get("averaging_steps", [d["steps_per_node"]]))
    compute = max(sum(call["train_s"] for call in node["train"]) for node in rec["nodes"]) / steps
    payloads = ("outer_gradients", "masked_codes", "masked_scales")  # the last two: lofi.secure's
    sent = sum(kinds.get(f"{phase}/{kind}", 0) for phase in ("train", "final") for kind in payloads)
    if d.get("exchange") in ("peers", "quorum"):
        payload = sent / (rounds * n * (n - 1))  # every node fetches each peer's payload each round
        topology = "peers"
    elif sent:  # secure rounds through the driver: N masked payloads up, N sums of their size down
        payload, topology = sent / (rounds * n), "star"
    else:
        payload = kinds.get("final/node_weights", 0) / n  # one node's weights (or adapters and head)
        topology = "star"
    params = _params(rec) or (payload / 4 if topology == "star" else 0.0)  # the star sends whole weights
    trainable = rec["details"].get("trainable_params") or params
    return Cost(
        "lofi", topology, steps, compute, rounds=rounds, round_bytes=payload, params=params, trainable=trainable
    )


def spsa_cost(rec: dict) -> Cost:
    d, n = rec["details"], len(rec["nodes"])
    steps = d["steps"]
    wire = d["wire_bytes_per_step"] / max(1, n)
    params = _params(rec)
    return Cost(
        "spsa",
        "spsa",
        steps,
        d["mean_step_s"],
        step_bytes=wire,
        params=params,
        trainable=params,
        forwards=d.get("forwards_per_node_step") or 0.0,
    )


def interlocking_cost(rec: dict) -> Cost:
    from raylowcomm.core.interlock.routing import message_plan  # torch: only where a pipeline is planned

    d, kinds = rec["details"], rec["comm"]["by_kind"]
    K, micro = d["stages"], d["batches"] * d["micro_batches"]
    plan = message_plan(K, d["n"], d["rule"])
    heads = sum(len(h) for stage in plan for h in stage)
    act = (kinds.get("train/activations", 0) + kinds.get("train/targets", 0)) // (micro * (K - 1))
    grad = kinds.get("train/gradients", 0) // (micro * heads) if heads else 0
    stages = [
        StageCost(
            node["median_call_s"]["forward"],
            node["median_call_s"]["backward"] or 0.0,
            node["median_call_s"]["step"] or 0.0,
            act if k < K - 1 else 0,
            grad if k else 0,
        )
        for k, node in enumerate(rec["nodes"])
    ]
    params = _params(rec)
    return Cost(
        "interlocking",
        "pipeline",
        d["batches"],
        0.0,
        stages=stages,
        plan=plan,
        micro_batches=d["micro_batches"],
        params=params,
        trainable=params,
    )


CALIBRATORS = {"ddp": ddp_cost, "lofi": lofi_cost, "spsa": spsa_cost, "interlocking": interlocking_cost}


def measured_s(rec: dict) -> float:
    """A run's time as the time model counts it: its training, and for lo-fi the final collection of the
    nodes' states (its last round)."""
    collect = rec["details"].get("phases_s", {}).get("collect", 0.0) if rec["strategy"] == "lofi" else 0.0
    return rec["train_s"] + collect


def costs_of(records: list[dict], link: Link | None = None) -> list[Cost]:
    """Every strategy a results.json holds (those that finished), with its curve of ID accuracy (or loss);
    `link`: the link the run met, whose modelled time comes out of the measured step times."""
    out = []
    for rec in records:
        make = CALIBRATORS.get(rec.get("strategy"))
        if make is None or "error" in rec:
            continue
        cost = make(rec)
        metric = "id_accuracy" if "id_accuracy" in rec["metrics"] else "id_loss"
        cost.curve = [(p["step"], p[metric]) for p in rec.get("curve", []) if metric in p and p.get("step")]
        n = cost.nodes = len(rec["nodes"])
        cost.measured_s = measured_s(rec)
        if link is not None and cost.topology in ("allreduce", "spsa"):  # step times include the link's
            cost.compute_s = max(0.0, cost.compute_s - predict(cost, n, link).link_s / cost.steps)
        if cost.topology in ("peers", "star"):  # what the rounds took beyond the nodes' training and transfers
            on_link = predict(cost, n, link or Link()).link_s
            cost.round_s = max(0.0, (cost.measured_s - cost.steps * cost.compute_s - on_link) / cost.rounds)
        if cost.topology == "pipeline":  # what the run took beyond its stages' median calls and messages
            cost.overhead_s = max(0.0, (rec["train_s"] - predict(cost, n, link or Link()).total_s) / cost.steps)
        out.append(cost)
    return out


TIMINGS = ("compute_s", "round_s", "overhead_s", "measured_s")
STAGE_TIMINGS = ("forward_s", "backward_s", "step_s")


def _shape(cost: Cost, nodes: int | None = None) -> Cost:
    """What repeats of one run share: the cost without its timings and curve (at `nodes`, where given)."""
    return replace(
        cost,
        **dict.fromkeys(TIMINGS, 0.0),
        curve=[],
        nodes=cost.nodes if nodes is None else nodes,
        stages=[replace(s, **dict.fromkeys(STAGE_TIMINGS, 0.0)) for s in cost.stages],
    )


def repeats_of(costs: list[Cost]) -> list[list[Cost]]:
    """The costs grouped into repeats of one run: the same strategy at the same nodes, steps, rounds and
    bytes, in the order they first appear."""
    groups: list[list[Cost]] = []
    for cost in costs:
        group = next((g for g in groups if _shape(g[0]) == _shape(cost)), None)
        if group is None:
            groups.append([cost])
        else:
            group.append(cost)
    return groups


def median_of(repeats: list[Cost]) -> Cost:
    """One cost from repeats of a run: the median of each timing, and of the curve's metric at each step
    they all reached. A shared machine computes the same run at different speeds from one run to the next
    (docs/planning.md): the median of several is steadier than any one of them."""
    first = repeats[0]
    if len(repeats) == 1:
        return first
    curves = [dict(c.curve) for c in repeats]
    return replace(
        first,
        **{name: median(getattr(c, name) for c in repeats) for name in TIMINGS},
        stages=[
            replace(stage, **{name: median(getattr(c.stages[k], name) for c in repeats) for name in STAGE_TIMINGS})
            for k, stage in enumerate(first.stages)
        ],
        curve=[(step, median(c[step] for c in curves)) for step, _ in first.curve if all(step in c for c in curves)],
    )


def merge_repeats(costs: list[Cost]) -> list[Cost]:
    """Every run calibrated once: repeats of one run (`repeats_of`) as their median (`median_of`)."""
    return [median_of(group) for group in repeats_of(costs)]


def same_run(calibrated: Cost, run: Cost) -> bool:
    """Whether `run` is the calibrated run made at its own node count: the same strategy, steps, rounds and
    bytes."""
    return _shape(calibrated, run.nodes) == _shape(run)
