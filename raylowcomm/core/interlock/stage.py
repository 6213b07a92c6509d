"""One interlocking stage's work, `InterlockStage`: its module, aux head and optimizer; the forward,
the backward messages its routing rule asks for (`rules`), and the step, with gradients of batches
begun before the current one's step kept apart (see `routing`'s docstring for the protocol)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raylowcomm.common.layout import laid_out_like
from raylowcomm.core.interlock.rules import Rule, check_routing, update_heads, upstream_heads

LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD as in the paper's ResNet runs (lr 0.1, momentum 0.9, weight decay 2e-4)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=2e-4)


@dataclass
class _InFlight:
    """What one micro-batch's backward still needs on a stage."""

    x: Tensor
    h: Tensor
    unprocessed: set[int]  # heads of U(k) ∪ upstream_heads(k) not yet backpropagated
    batch: int
    params: list[nn.Parameter]  # the weights its graph ran with (stashed if a step came in between)
    ready: dict[int, Tensor] = field(default_factory=dict)  # dL_j/dh_k received, not yet used
    params_only_sum: Tensor | None = None  # Σ dL_j/dh_k over heads only used for θ_k


@dataclass
class _Ahead:
    """A batch begun while an earlier one is not yet stepped: its gradients wait here, in the
    order they came, until that step; then they become the parameters' ``.grad``."""

    grads: list[Tensor | None]  # stage parameters, then head parameters
    completed: int = 0


class InterlockStage:
    """One stage with its aux head and its own optimizer; the per-micro-batch work of
    interlocking backprop, exactly as a Ray actor will run it.

    Protocol per micro-batch ``mb_id``: ``forward`` (send the returned h downstream), then
    ``backward(mb_id, {})`` at once (its result is the early upstream message, from heads
    available locally), then ``backward(mb_id, msg)`` for each message from downstream until
    all of ``needs_from_downstream()`` arrived; each call returns the upstream message for
    stage k - 1. After ``micro_batches_per_step`` micro-batches are complete ``ready_to_step``
    is true and ``step()`` applies the accumulated update (losses are scaled by
    1 / micro_batches_per_step so the update is that of the mean loss).

    Micro-batch ``mb_id`` belongs to batch ``mb_id // micro_batches_per_step``. A later batch may
    begin before the current one is stepped (a pipeline that overlaps batches): its gradients are
    kept apart until then, and if its graphs are alive at the step, the step moves the stage onto
    fresh parameter tensors and leaves the old ones to those graphs (PipeDream's weight stashing),
    so each micro-batch's gradient is that of the weights its forward ran with. With one batch at
    a time none of this happens: the gradients accumulate in ``.grad`` and the step is in place.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        width: int,
        rule: Rule,
        module: nn.Module,
        head: nn.Module | None,
        loss_fn: LossFn = F.cross_entropy,
        optimizer_factory: OptimizerFactory = default_optimizer,
        micro_batches_per_step: int = 1,
    ):
        """``head`` is the aux head, None for a stage whose output is already the logits
        (the last one); ``loss_fn(logits, targets)``."""
        check_routing(num_stages, width, rule)
        self.index, self.num_stages, self.width, self.rule = index, num_stages, width, rule
        self.module, self.head, self.loss_fn = module, head, loss_fn
        self.update_set = update_heads(index, num_stages, width, rule)
        self.upstream_set = upstream_heads(index, num_stages, width, rule)
        self._handled = self.update_set | self.upstream_set
        self._params_only = self.update_set - self.upstream_set  # heads batched into one θ pass
        self._from_downstream = (
            frozenset() if index == num_stages - 1 else upstream_heads(index + 1, num_stages, width, rule)
        )
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.head_params = [p for p in head.parameters() if p.requires_grad] if head is not None else []
        self.optimizer = optimizer_factory(self.params + self.head_params)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_scale = 1.0 / micro_batches_per_step
        self.micro_batches_per_step = micro_batches_per_step
        self._in_flight: dict[int, _InFlight] = {}
        self._current: int | None = None  # the batch accumulating in .grad, next to step
        self._completed = 0  # its complete micro-batches
        self._ahead: dict[int, _Ahead] = {}  # later batches begun before its step
        self._stashes = 0
        self._losses: dict[int, Tensor] = {}

    def needs_from_downstream(self) -> set[int]:
        """Heads j whose dL_j/dh_k this stage must receive from stage k + 1."""
        return set(self._from_downstream)

    def sends_upstream(self) -> set[int]:
        """Heads j whose dL_j/dx_k this stage sends to stage k - 1 (empty for n = 1)."""
        return set(self.upstream_set)

    def forward(self, mb_id: int, x: Tensor, targets: Tensor) -> Tensor:
        """Run the stage and its own head's loss (training the head), keep the graph for
        backward, return the detached output to send downstream."""
        if mb_id in self._in_flight:
            raise ValueError(f"stage {self.index}: micro-batch {mb_id} is already in flight")
        batch = mb_id // self.micro_batches_per_step
        if self._current is None:
            self._current = batch
        ahead = batch != self._current
        if ahead and batch not in self._ahead:
            self._ahead[batch] = _Ahead([None] * (len(self.params) + len(self.head_params)))
        x = x.detach()
        if self.upstream_set:
            x.requires_grad_()
        h = self.module(x)
        own = self.index in self._handled
        h_out = h.detach().requires_grad_(own)
        loss = self.loss_fn(self.head(h_out) if self.head is not None else h_out, targets)
        state = _InFlight(x=x, h=h, unprocessed=set(self._handled), batch=batch, params=list(self.params))
        if loss.requires_grad and not ahead:
            (loss * self.loss_scale).backward()
            if own:
                state.ready[self.index] = h_out.grad
        elif loss.requires_grad:  # a later batch's head gradient waits apart from the current one's
            grads = torch.autograd.grad(
                loss * self.loss_scale, self.head_params + ([h_out] if own else []), allow_unused=True
            )
            self._accumulate(grads[: len(self.head_params)], batch, offset=len(self.params))
            if own:
                state.ready[self.index] = grads[-1]
        self._losses[mb_id] = loss.detach()
        self._in_flight[mb_id] = state
        return h_out.detach()

    def backward(self, mb_id: int, grads_from_downstream: dict[int, Tensor]) -> dict[int, Tensor]:
        """Take any newly arrived {j: dL_j/dh_k}, accumulate θ_k's gradient for the heads in
        U(k) and return {j: dL_j/dx_k} for the newly processed heads that stage k - 1 needs."""
        state = self._in_flight[mb_id]
        for j, g in grads_from_downstream.items():
            if j not in self._from_downstream or j not in state.unprocessed or j in state.ready:
                raise ValueError(f"stage {self.index}: unexpected or repeated gradient for head {j} (mb {mb_id})")
            state.ready[j] = g
        upstream: dict[int, Tensor] = {}
        for j in sorted(state.ready):
            g = state.ready.pop(j)
            if j in self.upstream_set:
                with_params = j in self.update_set
                grads = torch.autograd.grad(
                    state.h, [state.x] + (state.params if with_params else []), g, retain_graph=True, allow_unused=True
                )
                upstream[j] = grads[0]
                self._accumulate(grads[1:], state.batch)
            else:
                state.params_only_sum = g if state.params_only_sum is None else state.params_only_sum + g
            state.unprocessed.discard(j)
            if state.params_only_sum is not None and not (self._params_only & state.unprocessed):
                self._accumulate(
                    torch.autograd.grad(
                        state.h, state.params, state.params_only_sum, retain_graph=True, allow_unused=True
                    ),
                    state.batch,
                )
                state.params_only_sum = None
        if not state.unprocessed:
            del self._in_flight[mb_id]  # frees the graph
            if state.batch == self._current:
                self._completed += 1
            else:
                self._ahead[state.batch].completed += 1
        return upstream

    def _accumulate(self, grads: Sequence[Tensor | None], batch: int, offset: int = 0) -> None:
        """Add gradients of batch ``batch`` in: to ``.grad`` for the current batch, else to its waiting
        sums (``offset``: where ``grads`` start in stage-then-head parameter order)."""
        if batch == self._current:
            for p, g in zip((self.params + self.head_params)[offset:], grads):
                if g is not None:
                    p.grad = laid_out_like(p, g if p.grad is None else p.grad + g)
            return
        sums = self._ahead[batch].grads
        for i, g in enumerate(grads, start=offset):
            if g is not None:
                sums[i] = g if sums[i] is None else sums[i] + g

    @property
    def ready_to_step(self) -> bool:
        """All ``micro_batches_per_step`` micro-batches of the current update are complete."""
        return self._completed >= self.micro_batches_per_step

    @property
    def stashes(self) -> int:
        """Steps taken while a later batch's graphs held the weights (each kept a copy of them alive)."""
        return self._stashes

    def step(self) -> None:
        """Apply the accumulated update (stage + aux head) and clear the gradients; the next batch
        begun, if any, becomes the current one, its waiting gradients its ``.grad``."""
        if self._in_flight:
            self._stash()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._current, self._completed = None, 0
        if self._ahead:
            self._current = min(self._ahead)
            waiting = self._ahead.pop(self._current)
            self._completed = waiting.completed
            for p, g in zip(self.params + self.head_params, waiting.grads):
                p.grad = g if g is None else laid_out_like(p, g)

    def _stash(self) -> None:
        """Move the stage onto fresh copies of its parameters, the optimizer's state with them, so
        the in-place step leaves the tensors that in-flight graphs saved untouched."""
        fresh = {id(p): nn.Parameter(p.detach().clone()) for p in self.params}
        for module in self.module.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in fresh:
                    module._parameters[name] = fresh[id(p)]
        for group in self.optimizer.param_groups:
            group["params"] = [fresh.get(id(p), p) for p in group["params"]]
        for p in self.params:
            fresh[id(p)].grad = p.grad
            if p in self.optimizer.state:
                self.optimizer.state[fresh[id(p)]] = self.optimizer.state.pop(p)
            p.grad = None
        self.params = [fresh[id(p)] for p in self.params]
        self._stashes += 1

    def pop_losses(self) -> dict[int, float]:
        """Own-head losses (unscaled) of the micro-batches forwarded since the last call."""
        losses = {mb: float(v) for mb, v in self._losses.items()}
        self._losses.clear()
        return losses


def build_stages(
    modules: Sequence[nn.Module],
    heads: Sequence[nn.Module],
    width: int,
    rule: Rule,
    loss_fn: LossFn = F.cross_entropy,
    optimizer_factory: OptimizerFactory = default_optimizer,
    micro_batches_per_step: int = 1,
) -> list[InterlockStage]:
    """One :class:`InterlockStage` per module; ``heads`` are the K - 1 aux heads."""
    if len(heads) != len(modules) - 1:
        raise ValueError(f"need {len(modules) - 1} aux heads for {len(modules)} stages, got {len(heads)}")
    return [
        InterlockStage(
            k,
            len(modules),
            width,
            rule,
            m,
            heads[k] if k < len(heads) else None,
            loss_fn,
            optimizer_factory,
            micro_batches_per_step,
        )
        for k, m in enumerate(modules)
    ]
