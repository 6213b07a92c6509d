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
counted. No Ray here: a Ray actor wraps one :class:`InterlockStage` and calls its methods.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raylowcomm.ledger import payload_nbytes
from raylowcomm.training import batch_at

Rule = Literal["farthest", "sum"]
RULES: tuple[str, ...] = ("farthest", "sum")
LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class StageCosts:
    """Measured seconds (forward + backward) per unit, and of the aux head that a stage ending
    after unit i carries (``boundaries[i]``, one fewer than units): what a stage costs in
    1-way training is its units plus its head."""

    units: list[float]
    boundaries: list[float]


Balance = str | Sequence[float] | StageCosts


# ----------------------------------------------------------------------------- routing


def _check_routing(num_stages: int, n: int, rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not 1 <= n <= num_stages:
        raise ValueError(f"n must be in 1..{num_stages} (number of stages), got {n}")


def update_heads(k: int, num_stages: int, n: int, rule: Rule) -> frozenset[int]:
    """U(k): the heads whose losses update stage k's parameters (see module docstring)."""
    _check_routing(num_stages, n, rule)
    last = min(k + n - 1, num_stages - 1)
    return frozenset({last}) if rule == "farthest" else frozenset(range(k, last + 1))


def upstream_heads(k: int, num_stages: int, n: int, rule: Rule) -> frozenset[int]:
    """Heads j whose dL_j/dx_k stage k must send to stage k - 1 (some earlier stage uses them)."""
    needed: set[int] = set()
    for i in range(k):
        needed |= {j for j in update_heads(i, num_stages, n, rule) if j >= k}
    return frozenset(needed)


# ----------------------------------------------------------------------------- splitting


def balanced_sizes(costs: Sequence[float], num_parts: int, boundaries: Sequence[float] | None = None) -> list[int]:
    """Contiguous partition of ``costs`` into ``num_parts`` non-empty parts minimising the
    largest part's total, a part that ends after unit i (not the last) adding ``boundaries[i]``
    (its aux head); among optimal partitions later parts are kept small (the last stage also
    carries the real head)."""
    boundaries = list(boundaries) if boundaries is not None else [0.0] * len(costs)
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} units into {num_parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: smallest possible max part cost for the first i units in p parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    start = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for p in range(1, num_parts + 1):
        for i in range(p, n + 1):
            head = boundaries[i - 1] if p < num_parts and i < n else 0.0
            for j in range(p - 1, i):  # last part = units j..i-1; larger j wins ties
                value = max(best[p - 1][j], prefix[i] - prefix[j] + head)
                if value <= best[p][i]:
                    best[p][i], start[p][i] = value, j
    sizes, i = [], n
    for p in range(num_parts, 0, -1):
        sizes.append(i - start[p][i])
        i = start[p][i]
    return sizes[::-1]


def _unit_costs(units: Sequence[nn.Module], balance: Balance) -> list[float]:
    if balance == "blocks":
        return [1.0] * len(units)
    if balance == "params":
        return [float(sum(p.numel() for p in u.parameters())) for u in units]
    if isinstance(balance, StageCosts):
        balance = balance.units
    if isinstance(balance, str):
        raise ValueError(f"balance must be 'blocks', 'params' or per-unit costs, got {balance!r}")
    if len(balance) != len(units):
        raise ValueError(f"got {len(balance)} unit costs for {len(units)} units")
    return [float(c) for c in balance]


def _sizes(costs: list[float], num_stages: int, balance: Balance, sizes: Sequence[int] | None) -> list[int]:
    """Units per stage: the given `sizes` (checked), or balanced by cost (and measured aux heads)."""
    if sizes is None:
        return balanced_sizes(costs, num_stages, balance.boundaries if isinstance(balance, StageCosts) else None)
    if len(sizes) != num_stages or sum(sizes) != len(costs) or min(sizes) < 1:
        raise ValueError(f"a split of {len(costs)} units into {num_stages} stages needs {num_stages} sizes >= 1 summing to "
                         f"{len(costs)}, got {list(sizes)}")
    return list(sizes)


def _chunks(items: Sequence, sizes: Sequence[int]) -> list[list]:
    out, i = [], 0
    for s in sizes:
        out.append(list(items[i : i + s]))
        i += s
    return out


class _ResNetHead(nn.Module):
    """timm ``ResNet.forward_head`` without holding a reference to the whole model."""

    def __init__(self, global_pool: nn.Module, fc: nn.Module, drop_rate: float):
        super().__init__()
        self.global_pool, self.fc, self.drop_rate = global_pool, fc, drop_rate

    def forward(self, x: Tensor) -> Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return self.fc(x)


def split_timm_resnet(model: nn.Module, num_stages: int, balance: Balance = "blocks",
                      sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Split a timm ResNet into ``num_stages`` sequential stages sharing the model's modules.

    Units are the stem (conv1, bn1, act1, maxpool) and every residual block of layer1..layer4,
    so 1 <= num_stages <= 1 + number of blocks (splits may fall inside a layer). Units are
    grouped contiguously by :func:`balanced_sizes` with cost 1 per unit (``"blocks"``, a rough
    proxy for compute in a ResNet), the unit's parameter count (``"params"``), or explicit
    per-unit costs (e.g. measured times). The last stage ends with global pool + fc.
    """
    stem = nn.Sequential(model.conv1, model.bn1, model.act1, model.maxpool)
    blocks = [b for name in ("layer1", "layer2", "layer3", "layer4") for b in getattr(model, name)]
    return _group_units([stem, *blocks], _ResNetHead(model.global_pool, model.fc, float(model.drop_rate)), num_stages, balance, sizes)


def _group_units(units: list[nn.Module], head: nn.Module, num_stages: int, balance: Balance,
                 sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Contiguous groups of units by cost (or of the given `sizes`); the head ends the last."""
    costs = _unit_costs(units, balance) if sizes is None else [1.0] * len(units)  # given sizes need no costs
    if balance == "params" and sizes is None:
        costs[-1] += sum(p.numel() for p in head.parameters())
    groups = _chunks(units, _sizes(costs, num_stages, balance, sizes))
    groups[-1].append(head)
    return [nn.Sequential(*g) for g in groups]


def split_timm_efficientnet(model: nn.Module, num_stages: int, balance: Balance = "blocks",
                            sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """The same for timm's EfficientNet / MobileNet family: units are the stem (conv_stem, bn1)
    and every block of ``model.blocks``; the last stage ends with conv_head, bn2, pool and
    classifier (timm ``forward_head``)."""
    stem = nn.Sequential(model.conv_stem, model.bn1)
    blocks = [b for stage in model.blocks for b in stage]
    head = nn.Sequential(model.conv_head, model.bn2, _ResNetHead(model.global_pool, model.classifier, float(model.drop_rate)))
    return _group_units([stem, *blocks], head, num_stages, balance, sizes)


def split_timm_cnn(model: nn.Module, num_stages: int, balance: Balance = "blocks",
                   sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """A timm ResNet or EfficientNet-style model (``conv_stem`` + ``blocks``), split as above."""
    if hasattr(model, "layer1"):
        return split_timm_resnet(model, num_stages, balance, sizes)
    if hasattr(model, "conv_stem") and hasattr(model, "blocks"):
        return split_timm_efficientnet(model, num_stages, balance, sizes)
    raise ValueError(f"cannot split {type(model).__name__}: interlocking splits timm ResNets and EfficientNet/MobileNet models")


def timm_cnn_units(model: nn.Module) -> int:
    """How many units (stem + blocks) `split_timm_cnn` can put into stages."""
    if hasattr(model, "layer1"):
        return 1 + sum(len(getattr(model, name)) for name in ("layer1", "layer2", "layer3", "layer4"))
    return 1 + sum(len(stage) for stage in model.blocks)


class DecoderStage(nn.Module):
    """A contiguous group of decoder layers of a Llama-style causal LM.

    Only hidden states cross stages: position ids, rotary embeddings and the causal mask are
    rebuilt inside each stage from the sequence length (full causal attention, no padding
    mask; right-pad and mask the labels with -100 instead). Stage 0 also holds the token
    embedding (its input is input_ids), the last stage the final norm and lm_head (its output
    is logits).
    """

    def __init__(self, config, layers: Sequence[nn.Module], rotary_emb: nn.Module,
                 embed_tokens: nn.Module | None = None, norm: nn.Module | None = None,
                 lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens, self.layers, self.rotary_emb = embed_tokens, nn.ModuleList(layers), rotary_emb
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask  # lazy: vision users skip transformers

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def split_hf_decoder(model: nn.Module, num_stages: int, balance: Balance = "blocks",
                     sizes: Sequence[int] | None = None) -> list[DecoderStage]:
    """Split a Hugging Face Llama-style causal LM (``model.model.{embed_tokens, layers, norm,
    rotary_emb}``, ``model.lm_head``) into stages sharing its modules; decoder layers are the
    units (``balance`` as in :func:`split_timm_resnet`; embeddings count with the first layer,
    lm_head with the last). Composition equals ``model(input_ids).logits``.

    Tied input/output embeddings would put one parameter in two stages, so they are refused.
    """
    inner = model.model
    if num_stages > 1 and model.lm_head.weight is inner.embed_tokens.weight:
        raise ValueError("lm_head is tied to embed_tokens; untie it (clone the weight) before splitting")
    layers = list(inner.layers[: model.config.num_hidden_layers])
    costs = _unit_costs(layers, balance) if sizes is None else [1.0] * len(layers)
    if balance == "params" and sizes is None:
        costs[0] += inner.embed_tokens.weight.numel()
        costs[-1] += sum(p.numel() for p in (*inner.norm.parameters(), *model.lm_head.parameters()))
    groups = _chunks(layers, _sizes(costs, num_stages, balance, sizes))
    last = num_stages - 1
    return [
        DecoderStage(model.config, g, inner.rotary_emb,
                     embed_tokens=inner.embed_tokens if k == 0 else None,
                     norm=inner.norm if k == last else None,
                     lm_head=model.lm_head if k == last else None)
        for k, g in enumerate(groups)
    ]


def measure_unit_costs(units: Sequence[nn.Module], x: Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward + backward per unit, each fed the previous unit's output
    (``units``: a split with one unit per stage). Per-unit costs for ``balance`` where block
    counts mislead (e.g. an early high-resolution ResNet block costs more than a late one).
    Run it on a copy: it updates BatchNorm statistics and leaves gradients cleared."""
    times: list[list[float]] = [[] for _ in units]
    for rep in range(repeats + 1):  # the first pass only warms up (allocations, kernels)
        h = x
        for i, unit in enumerate(units):
            inp = h.detach().requires_grad_(h.is_floating_point())
            start = time.perf_counter()
            out = unit(inp)
            out.float().square().mean().backward()
            if rep:
                times[i].append(time.perf_counter() - start)
            h = out.detach()
    for unit in units:
        unit.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def untie_lm_head(model: nn.Module) -> bool:
    """Give ``lm_head`` its own copy of a tied input embedding (so the first and last stage
    each own one parameter) and mark the config untied; returns whether it was tied. Both
    copies start equal and train apart from then on."""
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        return False
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return True


# ----------------------------------------------------------------------------- aux heads


def conv_aux_head(in_channels: int, num_classes: int, widths: Sequence[int] = (128, 64)) -> nn.Sequential:
    """The paper code's vision aux net (``conv128_bn_conv64_bn_gbpl_fc``): (3x3 conv, BN, ReLU)
    per width, global average pool, linear."""
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Conv2d(in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        in_channels = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)


def resnet_aux_heads(stages: Sequence[nn.Module], num_classes: int,
                     widths: Sequence[int] = (128, 64)) -> list[nn.Sequential]:
    """One :func:`conv_aux_head` per stage but the last. A ResNet stage's output width is the
    width of its last BatchNorm2d (block bn2/bn3 or downsample BN, or the stem's bn1)."""
    heads = []
    for stage in stages[:-1]:
        bns = [m for m in stage.modules() if isinstance(m, nn.BatchNorm2d)]
        if not bns:
            raise ValueError("cannot infer a stage's output channels: it has no BatchNorm2d")
        heads.append(conv_aux_head(bns[-1].num_features, num_classes, widths))
    return heads


def decoder_aux_heads(model: nn.Module, num_stages: int, init_from_lm_head: bool = True) -> list[nn.Sequential]:
    """One (final-norm copy, vocabulary linear) head per stage but the last; the linear starts
    as a copy of the real lm_head (``init_from_lm_head``) or fresh N(0, initializer_range)."""
    heads = []
    for _ in range(num_stages - 1):
        linear = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        with torch.no_grad():
            if init_from_lm_head:
                linear.weight.copy_(model.lm_head.weight)
            else:
                linear.weight.normal_(0.0, model.config.initializer_range)
        heads.append(nn.Sequential(copy.deepcopy(model.model.norm), linear))
    return heads


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy (labels shifted inside, -100 ignored), as HF causal LMs;
    half-precision logits are upcast to float32 first."""
    logits = logits[:, :-1].flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)


# ----------------------------------------------------------------------------- stage runner


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD as in the paper's ResNet runs (lr 0.1, momentum 0.9, weight decay 2e-4)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=2e-4)


@dataclass
class _InFlight:
    """What one micro-batch's backward still needs on a stage."""

    x: Tensor
    h: Tensor
    unprocessed: set[int]  # heads of U(k) ∪ upstream_heads(k) not yet backpropagated
    ready: dict[int, Tensor] = field(default_factory=dict)  # dL_j/dh_k received, not yet used
    params_only_sum: Tensor | None = None  # Σ dL_j/dh_k over heads only used for θ_k


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
    """

    def __init__(self, index: int, num_stages: int, n: int, rule: Rule, module: nn.Module,
                 head: nn.Module | None, loss_fn: LossFn = F.cross_entropy,
                 optimizer_factory: OptimizerFactory = default_optimizer,
                 micro_batches_per_step: int = 1):
        """``head`` is the aux head, None for a stage whose output is already the logits
        (the last one); ``loss_fn(logits, targets)``."""
        _check_routing(num_stages, n, rule)
        self.index, self.num_stages, self.n, self.rule = index, num_stages, n, rule
        self.module, self.head, self.loss_fn = module, head, loss_fn
        self.update_set = update_heads(index, num_stages, n, rule)
        self.upstream_set = upstream_heads(index, num_stages, n, rule)
        self._handled = self.update_set | self.upstream_set
        self._params_only = self.update_set - self.upstream_set  # heads batched into one θ pass
        self._from_downstream = (frozenset() if index == num_stages - 1
                                 else upstream_heads(index + 1, num_stages, n, rule))
        self.params = [p for p in module.parameters() if p.requires_grad]
        head_params = [p for p in head.parameters() if p.requires_grad] if head is not None else []
        self.optimizer = optimizer_factory(self.params + head_params)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_scale = 1.0 / micro_batches_per_step
        self.micro_batches_per_step = micro_batches_per_step
        self._in_flight: dict[int, _InFlight] = {}
        self._completed = 0
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
        x = x.detach()
        if self.upstream_set:
            x.requires_grad_()
        h = self.module(x)
        own = self.index in self._handled
        h_out = h.detach().requires_grad_(own)
        loss = self.loss_fn(self.head(h_out) if self.head is not None else h_out, targets)
        if loss.requires_grad:
            (loss * self.loss_scale).backward()
        self._losses[mb_id] = loss.detach()
        state = _InFlight(x=x, h=h, unprocessed=set(self._handled))
        if own:
            state.ready[self.index] = h_out.grad
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
                grads = torch.autograd.grad(state.h, [state.x] + (self.params if with_params else []), g,
                                            retain_graph=True, allow_unused=True)
                upstream[j] = grads[0]
                self._accumulate(grads[1:])
            else:
                state.params_only_sum = g if state.params_only_sum is None else state.params_only_sum + g
            state.unprocessed.discard(j)
            if state.params_only_sum is not None and not (self._params_only & state.unprocessed):
                self._accumulate(torch.autograd.grad(state.h, self.params, state.params_only_sum,
                                                     retain_graph=True, allow_unused=True))
                state.params_only_sum = None
        if not state.unprocessed:
            del self._in_flight[mb_id]  # frees the graph
            self._completed += 1
        return upstream

    def _accumulate(self, grads: Sequence[Tensor | None]) -> None:
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    @property
    def ready_to_step(self) -> bool:
        """All ``micro_batches_per_step`` micro-batches of the current update are complete."""
        return self._completed >= self.micro_batches_per_step

    def step(self) -> None:
        """Apply the accumulated update (stage + aux head) and clear the gradients."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._completed = 0

    def pop_losses(self) -> dict[int, float]:
        """Own-head losses (unscaled) of the micro-batches forwarded since the last call."""
        losses = {mb: float(v) for mb, v in self._losses.items()}
        self._losses.clear()
        return losses


def build_stages(modules: Sequence[nn.Module], heads: Sequence[nn.Module], n: int, rule: Rule,
                 loss_fn: LossFn = F.cross_entropy, optimizer_factory: OptimizerFactory = default_optimizer,
                 micro_batches_per_step: int = 1) -> list[InterlockStage]:
    """One :class:`InterlockStage` per module; ``heads`` are the K - 1 aux heads."""
    if len(heads) != len(modules) - 1:
        raise ValueError(f"need {len(modules) - 1} aux heads for {len(modules)} stages, got {len(heads)}")
    return [
        InterlockStage(k, len(modules), n, rule, m, heads[k] if k < len(heads) else None,
                       loss_fn, optimizer_factory, micro_batches_per_step)
        for k, m in enumerate(modules)
    ]


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


def run_interlocked_batch(stages: Sequence[InterlockStage], micro_batches: Iterable[tuple[Tensor, Tensor]],
                          step: bool = True) -> BatchTrace:
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


# ----------------------------------------------------------------------------- reference


def reference_gradients(full_model_parts: Sequence[nn.Module], heads: Sequence[nn.Module],
                        batch: tuple[Tensor, Tensor], n: int, rule: Rule,
                        loss_fn: LossFn = F.cross_entropy) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Ground truth from ONE autograd graph, no detach: for each stage k the gradient of its
    n-way objective (farthest: ∂L_{f(k)}/∂θ_k; sum: ∂Σ_{j in U(k)} L_j/∂θ_k) and for each aux
    head j ∂L_j/∂φ_j. Returns (per-stage, per-head) dicts name -> gradient (zeros if unused)."""
    K = len(full_model_parts)
    _check_routing(K, n, rule)
    inputs, targets = batch
    h, losses = inputs, []
    for k, part in enumerate(full_model_parts):
        h = part(h)
        losses.append(loss_fn(heads[k](h) if k < K - 1 else h, targets))

    def grads(objective: Tensor, module: nn.Module) -> dict[str, Tensor]:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        gs = torch.autograd.grad(objective, [p for _, p in named], retain_graph=True,
                                 allow_unused=True, materialize_grads=True)
        return {name: g for (name, _), g in zip(named, gs)}

    stage_grads = [grads(sum(losses[j] for j in sorted(update_heads(k, K, n, rule))), part)
                   for k, part in enumerate(full_model_parts)]
    head_grads = [grads(losses[j], heads[j]) for j in range(K - 1)]
    return stage_grads, head_grads


# ----------------------------------------------------------------------------- model preparation


def split_model(model: nn.Module, family: str, num_stages: int, balance: Balance, sizes: Sequence[int] | None = None) -> list[nn.Module]:
    """A timm CNN or an HF decoder, split into `num_stages` stage modules (of `sizes` units if given)."""
    split = split_timm_cnn if family == "timm" else split_hf_decoder
    return split(model, num_stages, balance, sizes)


def aux_heads(model: nn.Module, stages: Sequence[nn.Module], family: str, num_classes: int | None,
              widths: Sequence[int], init_from_lm_head: bool) -> list[nn.Module]:
    """An auxiliary head for every stage but the last: conv heads for CNNs, LM heads for decoders."""
    if family == "timm":
        return resnet_aux_heads(stages, num_classes, widths)
    return decoder_aux_heads(model, len(stages), init_from_lm_head)


def units_per_stage(stages: Sequence[nn.Module], family: str) -> list[int]:
    """Units (stem + blocks, or decoder layers) in each stage; a CNN's last stage holds its head too."""
    return [len(m) - (k == len(stages) - 1) if family == "timm" else len(m.layers) for k, m in enumerate(stages)]


def measure_balance(model: nn.Module, family: str, x: Tensor, num_classes: int | None, widths: Sequence[int],
                    cpus: float | None = None, repeats: int = 3) -> StageCosts:
    """Forward + backward seconds of every unit and of the aux head a stage ending after it
    would carry, on input `x`, timed on a copy of the model (the last unit includes the model's
    own head) with the torch threads a stage actor of `cpus` CPUs has. Decoder aux heads are all
    alike, so one is timed for every boundary."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cpus)) if cpus else before)
    try:
        return _measure_balance(copy.deepcopy(model), family, x, num_classes, widths, repeats)
    finally:
        torch.set_num_threads(before)


def _measure_balance(probe: nn.Module, family: str, x: Tensor, num_classes: int | None, widths: Sequence[int],
                     repeats: int) -> StageCosts:
    units = split_model(probe, family, timm_cnn_units(probe) if family == "timm" else probe.config.num_hidden_layers, "blocks")
    unit_costs = measure_unit_costs(units, x, repeats)
    heads = resnet_aux_heads(units, num_classes, widths) if family == "timm" else decoder_aux_heads(probe, 2, False)
    outputs, h = [], x
    with torch.no_grad():
        for unit in units[:-1]:
            h = unit(h)
            outputs.append(h)
    costs = [measure_unit_costs([head], out, repeats)[0] for head, out in zip(heads, outputs)]
    return StageCosts(unit_costs, costs if family == "timm" else costs * (len(units) - 1))


def message_plan(num_stages: int, n: int, rule: str) -> list[list[frozenset[int]]]:
    """For each stage k, the heads carried by each upstream message it emits per micro-batch,
    in emission order: first its forward's early message, then one per backward call (one
    backward call per message stage k + 1 emits). Empty sets are messages never sent."""
    plan: list[list[frozenset[int]]] = [[] for _ in range(num_stages)]
    for k in reversed(range(num_stages)):
        up = upstream_heads(k, num_stages, n, rule)
        incoming = [h for h in plan[k + 1] if h] if k + 1 < num_stages else []
        plan[k] = [frozenset({k}) & up] + [h & up for h in incoming]
    return plan


def map_tensors(value, fn):
    """`fn` on each tensor of a message: an (h, targets) tuple or a {head: gradient} dict."""
    return tuple(fn(v) for v in value) if isinstance(value, tuple) else {j: fn(g) for j, g in value.items()}


class StageWorker:
    """An :class:`InterlockStage` as a pipeline worker, without any transport: micro-batch ids
    from (batch, micro-batch), the optimizer step as soon as a batch is complete, busy time, the
    step times, and the size of every message it hands to the transport (the Ray StageActor)."""

    def __init__(self, stage: InterlockStage, micro_batches: int, last: bool, task):
        """`task` turns a batch into (inputs, targets) and scores logits (raylowcomm.tasks)."""
        self.stage, self.micro_batches, self.last, self.task = stage, micro_batches, last, task
        self.dtype = next(p.dtype for p in stage.module.parameters() if p.is_floating_point())
        self.steps_done, self.step_times = 0, []
        self._reset()

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """A first stage's (x, targets) of a batch, x in the stage's dtype."""
        x = self.task.inputs(batch)
        return (x.to(self.dtype) if x.is_floating_point() else x), self.task.targets(batch)

    def _reset(self) -> None:
        self.busy_s, self.sent = 0.0, {"activations": [], "targets": [], "gradients": []}

    def _timed(self, work):
        start = time.perf_counter()
        out = work()
        if self.stage.ready_to_step:
            self.stage.step()
            self.steps_done += 1
            self.step_times.append(time.perf_counter())
        self.busy_s += time.perf_counter() - start
        return out

    def _upstream(self, msg: dict[int, Tensor]) -> dict[int, Tensor]:
        if msg:
            self.sent["gradients"].append(payload_nbytes(msg))
        return msg

    def forward(self, step: int, mb: int, x: Tensor, y: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """(h for the next stage, the early upstream message {k: dL_k/dx_k}, maybe empty)."""
        mb_id = step * self.micro_batches + mb
        h, early = self._timed(lambda: (self.stage.forward(mb_id, x, y), self.stage.backward(mb_id, {})))
        if not self.last:
            self.sent["activations"].append(payload_nbytes(h))
            self.sent["targets"].append(payload_nbytes(y))
        return h, self._upstream(early)

    def backward(self, step: int, mb: int, msg: dict[int, Tensor]) -> dict[int, Tensor]:
        """Use one downstream message {j: dL_j/dh_k}; the message for stage k − 1 (maybe empty)."""
        return self._upstream(self._timed(lambda: self.stage.backward(step * self.micro_batches + mb, msg)))

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict]:
        """Eval-mode forward of a chunk: (h for the next stage, the task's sums for this head)."""
        modules = [m for m in (self.stage.module, self.stage.head) if m is not None]
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        h = self.stage.module(x)
        metrics = self.task.sums(self.stage.head(h) if self.stage.head is not None else h, y)
        for m, w in zip(modules, was):
            m.train(w)
        metrics["sent_bytes"] = 0 if self.last else payload_nbytes((h, y))
        return h, metrics

    def report(self) -> dict:
        """Since the last report: own-head losses, busy seconds, sizes of every message sent."""
        out = {"losses": list(self.stage.pop_losses().values()), "busy_s": self.busy_s, "sent": self.sent,
               "steps_done": self.steps_done}
        self._reset()
        return out

    def timing(self) -> dict:
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:])]
        return {"steps": self.steps_done, "median_step_interval_s": statistics.median(gaps) if gaps else None}


LOSSES = {"cross_entropy": F.cross_entropy, "causal_lm": causal_lm_loss}
"""A stage's head loss, by name (what travels to a stage actor)."""
LOSS_OF_FAMILY = {"timm": "cross_entropy", "hf_causal_lm": "causal_lm"}


@dataclass
class Source:
    """What stage 0 builds micro-batches from: ``kind`` "image" (uint8 pixels -> the net's
    input, labels as targets) or "tokens" (input_ids are inputs and targets)."""

    kind: Literal["image", "tokens"]
    train: dict[str, Tensor] | None
    """None until stage 0 reads it on its own host."""
    eval_sets: dict[str, dict[str, Tensor]]
    batch_size: int
    seed: int
    image_size: int = 32
    eval_batch_size: int = 256
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    """The model's input normalisation (data.prepare_data reads it from the model's config)."""

    def micro_batch(self, step: int, mb: int, micro_batches: int) -> dict[str, Tensor]:
        """Micro-batch `mb` of training batch `step` (batches as every strategy draws them)."""
        size = self.batch_size // micro_batches
        return {k: v[mb * size:(mb + 1) * size] for k, v in batch_at(self.train, step, self.batch_size, self.seed).items()}

    def eval_chunk(self, name: str, chunk: int) -> dict[str, Tensor]:
        start = chunk * self.eval_batch_size
        return {k: v[start:start + self.eval_batch_size] for k, v in self.eval_sets[name].items()}
