"""The time model `raylowcomm plan` predicts with: what a strategy's run costs in compute and on the
link, for N nodes on a link of a given rate and latency. Plain Python, no Ray, no torch.

A rate is each node's outgoing rate, as `tc tbf` shapes the WAN bench's hosts and as a cloud VM's egress
cap works; what a node receives is limited by its senders' rates, not its own. Transfers from different
nodes run at once. Compute does not hide a transfer unless the strategy overlaps them
(`Cost.overlap_steps`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from raylowcomm.core.interlock.schedule import Link, StageCost, simulate

Topology = Literal["allreduce", "peers", "star", "spsa", "pipeline"]


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of `nbytes` on each of n nodes: 2(n − 1) steps (reduce-scatter, then
    all-gather), each moving a 1/n chunk over every node's link at once, each paying the latency."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) * link.seconds(nbytes / n)


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Every node fetches each peer's `nbytes` payload over its own link (and serves its own to each
    peer on the other direction): (n − 1) payloads in a row, one latency."""
    if n < 2:
        return 0.0
    return link.latency_s + (n - 1) * nbytes / link.bytes_per_s


def star_up_s(nbytes: float, n: int, link: Link) -> float:
    """Every node sends its `nbytes` state to the driver, each over its own link at once (the driver's
    own host's node sends nothing)."""
    if n < 2:
        return 0.0
    return link.latency_s + nbytes / link.bytes_per_s


def star_down_s(nbytes: float, n: int, link: Link) -> float:
    """The average goes back from the driver's host over its one link, a copy to each of the n − 1 other
    hosts: Ray's object store does not relay it between nodes that already hold it (docs/planning.md
    has the measurement)."""
    if n < 2:
        return 0.0
    return link.latency_s + (n - 1) * nbytes / link.bytes_per_s


@dataclass
class Cost:
    """One strategy's run as the time model sees it, per node: calibrated from a real run (`calibrate`)."""

    strategy: str
    topology: Topology
    steps: int
    """Steps (batches, for interlocking) per node."""
    compute_s: float
    """One step's compute on one node, the link left out."""
    step_bytes: float = 0.0
    """allreduce: the gradient each node reduces per step; spsa: the bytes each node sends per step."""
    rounds: int = 0
    """peers / star: the averaging rounds, the final one included."""
    round_bytes: float = 0.0
    """peers: one node's payload per round; star: one node's weights."""
    overlap_steps: int = 0
    """peers: steps of compute a round's transfer hides behind (lofi.overlap)."""
    round_s: float = 0.0
    """peers: a round's own work on a node besides its transfer (encoding, decoding and averaging the peers'
    payloads, the round's calls) at `nodes` nodes; it grows with the n − 1 payloads a node lands
    (`benchmarks.round_cost` measures it; docs/benchmarks.md has the figures).
    star: the driver's averaging of the n states, its round file and the nodes' loading of the average;
    it grows with the n states the driver averages."""
    nodes: int = 2
    """The calibrating run's nodes (stages, for the pipeline), at which it measured `round_s`."""
    measured_s: float = 0.0
    """The calibrating run's own time as `predict` counts it (`calibrate.measured_s`): what a check compares."""
    fragments: int = 1
    """peers: fragments (Streaming DiLoCo): rounds × fragments syncs of 1/fragments of the payload."""
    stages: list[StageCost] = field(default_factory=list)
    """pipeline: each stage's call times and message bytes."""
    plan: list = field(default_factory=list)
    """pipeline: the routing plan (`routing.message_plan`)."""
    micro_batches: int = 1
    overhead_s: float = 0.0
    """pipeline: each batch's time outside the stages' calls and their messages (the driver's dispatch, the
    first calls, the curve's points), what the calibrating run took beyond its modelled schedule."""
    params: float = 0.0
    """The model's parameters where calibrated (bytes and compute scale from them)."""
    trainable: float = 0.0
    """The parameters that train (and cross, in full-weight strategies): all of them, or the adapters."""
    forwards: float = 0.0
    """spsa: forward passes per node and step."""
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, ID metric) of the calibrating run: where the target is reached."""

    @property
    def label(self) -> str:
        """The strategy, and for lo-fi how its rounds travel."""
        if self.topology == "peers":
            return f"lofi, {self.rounds} peer rounds"
        if self.topology == "star":
            return "lofi, one average" if self.rounds == 1 else f"lofi, {self.rounds} averages (star)"
        return self.strategy

    def for_steps(self, steps: int | None) -> Cost:
        """The same run made `steps` long: rounds in proportion (the final one kept), no curve."""
        if steps is None or steps == self.steps:
            return self
        rounds = 1 + math.ceil((self.rounds - 1) * steps / self.steps) if self.rounds else 0
        return replace(self, steps=steps, rounds=rounds, curve=[])

    def scaled(self, params: float | None, trainable: float | None, compute_s: float | None) -> Cost:
        """The same run for another model: bytes scale with the parameters that cross, compute as given
        (or with the parameters)."""
        if params is None:
            return self
        if not (self.trainable or self.params):
            raise ValueError(f"{self.strategy}'s record does not say its model's size: rerun it to plan another size")
        share = (trainable or params) / (self.trainable or self.params)
        ratio = params / self.params
        # a round's work is per crossing parameter, on the device whose speed the given compute implies
        device = compute_s / self.compute_s / ratio if compute_s is not None and self.compute_s else 1.0
        return replace(
            self,
            params=params,
            trainable=trainable or params,
            compute_s=compute_s if compute_s is not None else self.compute_s * ratio,
            round_s=self.round_s * share * device,
            step_bytes=self.step_bytes if self.topology == "spsa" else self.step_bytes * share,
            round_bytes=self.round_bytes * share,
            stages=[
                replace(s, forward_s=s.forward_s * ratio, backward_s=s.backward_s * ratio, step_s=s.step_s * ratio)
                for s in self.stages
            ],
        )


@dataclass
class Prediction:
    strategy: str
    nodes: int
    compute_s: float
    """The run's compute, one node's (the pipeline: its busiest stage's)."""
    link_s: float
    """The run's time on the link that compute does not hide."""
    step_s: float
    """The whole run's time over its steps."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.link_s

    @property
    def bound(self) -> str:
        """Which of the two sets the time, and by how much: 'link 3.2x' is 3.2 times the compute; past
        1000x the other is noise beside it ('compute >1000x')."""
        if self.link_s > self.compute_s:
            return _times("link", self.link_s / self.compute_s) if self.compute_s else "link"
        return _times("compute", self.compute_s / self.link_s) if self.link_s else "compute"


def _times(name: str, ratio: float) -> str:
    return f"{name} {ratio:.1f}x" if ratio < 1000 else f"{name} >1000x"


def predict(cost: Cost, n: int, link: Link) -> Prediction:
    """The run's time for n nodes on `link` (interlocking: K = its stages, one per host; n is ignored)."""
    if cost.topology == "star":  # the driver averages n states
        grows = n / cost.nodes
    else:  # a node lands n − 1 payloads
        grows = max(1, n - 1) / max(1, cost.nodes - 1)
    compute = cost.steps * cost.compute_s + cost.rounds * cost.round_s * grows
    if cost.topology == "allreduce":
        comm = cost.steps * ring_allreduce_s(cost.step_bytes, n, link)
    elif cost.topology == "peers":
        sync = all_gather_s(cost.round_bytes / cost.fragments, n, link)
        comm = cost.rounds * cost.fragments * max(0.0, sync - cost.overlap_steps * cost.compute_s)
    elif cost.topology == "star":  # the final average stays on the driver: every round but the last comes back
        comm = cost.rounds * star_up_s(cost.round_bytes, n, link) + max(0, cost.rounds - 1) * star_down_s(
            cost.round_bytes, n, link
        )
    elif cost.topology == "spsa":  # every node's bytes to the driver and everyone's back: two latencies a step
        comm = cost.steps * (2 * link.latency_s + (n - 1) * cost.step_bytes / link.bytes_per_s) if n > 1 else 0.0
    else:
        return _pipeline(cost, link)
    return Prediction(cost.label, n, compute, comm, (compute + comm) / cost.steps)


def _pipeline(cost: Cost, link: Link, batches: int = 12) -> Prediction:
    """Interlocking's schedule (`core/interlock/schedule`) on the link, against its busiest stage's work
    alone. The schedule delays each message by the link's time but lets messages overlap; a link carries
    one at a time, so a step also takes at least the busiest link's bytes per batch over its rate."""
    timeline = simulate(cost.stages, cost.plan, cost.micro_batches, batches, link)
    ideal = simulate(cost.stages, cost.plan, cost.micro_batches, batches, Link())
    wire = max(
        max(s.activation_bytes, s.gradient_bytes * sum(len(h) for h in cost.plan[k])) * cost.micro_batches
        for k, s in enumerate(cost.stages)
    )
    step = max(timeline.step_time_s, wire / link.bytes_per_s) + cost.overhead_s
    compute = cost.steps * (max(ideal.busy_s) / batches + cost.overhead_s)
    return Prediction(cost.label, len(cost.stages), compute, max(0.0, cost.steps * step - compute), step)


def time_to_target(cost: Cost, pred: Prediction, target: float, higher_is_better: bool = True) -> float | None:
    """Seconds to the first curve point at or past `target`, at the predicted time per step; None where
    the calibrating run never reached it."""
    for step, value in cost.curve:
        if (value >= target) if higher_is_better else (value <= target):
            return step * pred.total_s / cost.steps
    return None


def rate_bytes(bits_per_s: float) -> float:
    return bits_per_s / 8


def link_of(bits_per_s: float, latency_ms: float = 0.0) -> Link:
    if bits_per_s <= 0 or not math.isfinite(bits_per_s):
        raise ValueError(f"a link rate must be a positive number of bits/s, not {bits_per_s}")
    return Link(latency_ms / 1000, rate_bytes(bits_per_s))
