"""Interlocking backpropagation (Gomez et al. 2020) in plain torch.

A model is split into K sequential stages (index k = 0 .. K-1). Every stage but the last
has an auxiliary head; the last stage ends with the model's real head. "Head j" means the
head on top of stage j and L_j its loss (L_{K-1} is the real loss).

Routing, for a communication width n with 1 <= n <= K (stage k's *update set* U(k)):

* ``farthest``: U(k) = {f(k)} with f(k) = min(k + n - 1, K - 1). Stage k's parameters get
  dL_{f(k)}/dθ_k only. n = 1 is purely local learning, n = K is end-to-end backprop of the
  final loss (every f(k) = K - 1).
* ``sum``: U(k) = {k, ..., min(k + n - 1, K - 1)}. Stage k's parameters get
  d(Σ_{j in U(k)} L_j)/dθ_k.

In both rules head j's parameters φ_j are trained by L_j alone, and head j's loss reaches at
most n stages: its own and the n - 1 before it.

Messages. Stage k receives x_k = h_{k-1} (detached) and sends h_k downstream. Backward, it
sends stage k - 1 the dict {j: dL_j/dx_k} for the heads j in
``upstream_heads(k) = {j >= k : j in U(i) for some i < k}``; every such j satisfies
j - (k - 1) <= n - 1, so no message travels more than n - 1 hops from its head, and with
n = 1 nothing is sent. Stage k waits from stage k + 1 for exactly ``upstream_heads(k + 1)``.
Its own head k is available right after its forward, so dL_k/dx_k can go upstream before
anything comes back from downstream (the early send that keeps stages from serialising).

Gradient blocking is detach + explicit ``torch.autograd.grad`` calls, no custom autograd;
every payload is a plain tensor (h forward, a dict of tensors backward), so its nbytes can be
counted. No Ray here: a Ray actor wraps one :class:`InterlockStage` and calls its methods
(raylowcomm.strategies.interlocking).

The rules above are `rules`'s, one stage's work is `stage.InterlockStage`'s (both importable from
here); this module runs the stages together in one process: the reference semantics of one batch
and of the pipeline, and the ground-truth gradients they are checked against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raylowcomm.core.interlock.rules import Rule, check_routing, message_plan, update_heads
from raylowcomm.core.interlock.rules import upstream_heads as upstream_heads
from raylowcomm.core.interlock.schedule import submission_order
from raylowcomm.core.interlock.stage import InterlockStage, LossFn
from raylowcomm.core.interlock.stage import build_stages as build_stages


@dataclass(frozen=True)
class GradMessage:
    """One backward message from stage ``src`` to stage ``src - 1``."""

    mb_id: int
    src: int
    heads: tuple[int, ...]
    nbytes: int


@dataclass
class BatchTrace:
    """What one batch cost and produced in :func:`run_interlocked_batch`."""

    losses: list[float]  # per head (stage), mean over micro-batches
    forward_bytes: int  # activations sent downstream
    grad_messages: list[GradMessage]  # every non-empty upstream dict


def run_interlocked_batch(
    stages: Sequence[InterlockStage], micro_batches: Iterable[tuple[Tensor, Tensor]], step: bool = True
) -> BatchTrace:
    """Reference semantics of one batch, sequentially in process: for each (inputs, targets)
    micro-batch, forward through all stages, flush every stage's early (local) upstream
    gradients, then route downstream gradients from the last stage back; finally step every
    stage (if ``step``)."""
    K = len(stages)
    messages: list[GradMessage] = []
    forward_bytes = 0

    def deliver(src: int, mb_id: int, msg: dict[int, Tensor], inbox: list[dict[int, Tensor]]) -> None:
        if msg:
            messages.append(GradMessage(mb_id, src, tuple(sorted(msg)), sum(t.nbytes for t in msg.values())))
            inbox[src - 1].update(msg)

    for mb_id, (inputs, targets) in enumerate(micro_batches):
        h = inputs
        for k, stage in enumerate(stages):
            h = stage.forward(mb_id, h, targets)
            if k < K - 1:
                forward_bytes += h.nbytes
        inbox: list[dict[int, Tensor]] = [{} for _ in stages]
        for k, stage in enumerate(stages):
            deliver(k, mb_id, stage.backward(mb_id, {}), inbox)
        for k in reversed(range(K)):
            if stages[k].needs_from_downstream():
                deliver(k, mb_id, stages[k].backward(mb_id, inbox[k]), inbox)
    losses = [sum(v.values()) / len(v) for v in (s.pop_losses() for s in stages)]
    if step:
        for stage in stages:
            if not stage.ready_to_step:
                raise RuntimeError(f"stage {stage.index} has incomplete micro-batches")
            stage.step()
    return BatchTrace(losses=losses, forward_bytes=forward_bytes, grad_messages=messages)


def run_pipeline(
    stages: Sequence[InterlockStage], batches: Sequence[Sequence[tuple[Tensor, Tensor]]], stage_batches: int = 1
) -> None:
    """The Ray pipeline's semantics in one process: every call of ``schedule.submission_order`` in
    turn (the stages' micro-batches per step = micro-batches per batch), a stage stepping as soon as
    a call completes its batch, as `StageWorker` does. Running the calls in the driver's order is
    one execution the actors may take, and each stage sees the same calls in the same order."""
    K, M = len(stages), len(batches[0])
    out: dict = {}  # (batch, call) -> ((h, targets) for the next stage, its upstream message)
    for b, call in submission_order(message_plan(K, stages[0].width, stages[0].rule), M, len(batches), stage_batches):
        stage, mb_id = stages[call.stage], b * M + call.mb
        if call.kind == "forward":
            x, y = batches[b][call.mb] if call.stage == 0 else out[(b, call.source)][0]
            out[(b, call)] = ((stage.forward(mb_id, x, y), y), stage.backward(mb_id, {}))
        else:
            out[(b, call)] = (None, stage.backward(mb_id, out[(b, call.source)][1]))
        if stage.ready_to_step:
            stage.step()


def reference_gradients(
    full_model_parts: Sequence[nn.Module],
    heads: Sequence[nn.Module],
    batch: tuple[Tensor, Tensor],
    width: int,
    rule: Rule,
    loss_fn: LossFn = F.cross_entropy,
) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Ground truth from ONE autograd graph, no detach: for each stage k the gradient of its
    n-way objective (farthest: ∂L_{f(k)}/∂θ_k; sum: ∂Σ_{j in U(k)} L_j/∂θ_k) and for each aux
    head j ∂L_j/∂φ_j. Returns (per-stage, per-head) dicts name -> gradient (zeros if unused)."""
    K = len(full_model_parts)
    check_routing(K, width, rule)
    inputs, targets = batch
    h, losses = inputs, []
    for k, part in enumerate(full_model_parts):
        h = part(h)
        losses.append(loss_fn(heads[k](h) if k < K - 1 else h, targets))

    def grads(objective: Tensor, module: nn.Module) -> dict[str, Tensor]:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        gs = torch.autograd.grad(
            objective, [p for _, p in named], retain_graph=True, allow_unused=True, materialize_grads=True
        )
        return {name: g for (name, _), g in zip(named, gs)}

    stage_grads = [
        grads(sum(losses[j] for j in sorted(update_heads(k, K, width, rule))), part)
        for k, part in enumerate(full_model_parts)
    ]
    head_grads = [grads(losses[j], heads[j]) for j in range(K - 1)]
    return stage_grads, head_grads
