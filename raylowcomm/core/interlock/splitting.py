"""Interlocking's stages: a timm CNN (stem + blocks) or a Hugging Face decoder (its layers) cut
into K contiguous stages that share the model's modules, balanced by block count, parameters or
measured forward + backward time (aux heads included): how many units each stage gets is
`balance`'s, the timing that feeds it `measure_balance` here."""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raylowcomm.core.interlock.balance import Balance, StageCosts, stage_sizes, unit_costs
from raylowcomm.core.interlock.balance import balanced_sizes as balanced_sizes
from raylowcomm.core.interlock.heads import decoder_aux_heads, resnet_aux_heads


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


def split_timm_resnet(
    model: nn.Module, num_stages: int, balance: Balance = "blocks", sizes: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Split a timm ResNet into ``num_stages`` sequential stages sharing the model's modules.

    Units are the stem (conv1, bn1, act1, maxpool) and every residual block of layer1..layer4,
    so 1 <= num_stages <= 1 + number of blocks (splits may fall inside a layer). Units are
    grouped contiguously by :func:`balanced_sizes` with cost 1 per unit (``"blocks"``, a rough
    proxy for compute in a ResNet), the unit's parameter count (``"params"``), or explicit
    per-unit costs (e.g. measured times). The last stage ends with global pool + fc.
    """
    stem = nn.Sequential(model.conv1, model.bn1, model.act1, model.maxpool)
    blocks = [b for name in ("layer1", "layer2", "layer3", "layer4") for b in getattr(model, name)]
    head = _ResNetHead(model.global_pool, model.fc, float(model.drop_rate))
    return _group_units([stem, *blocks], head, num_stages, balance, sizes)


def _group_units(
    units: list[nn.Module], head: nn.Module, num_stages: int, balance: Balance, sizes: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Contiguous groups of units by cost (or of the given `sizes`); the head ends the last."""
    costs = unit_costs(units, balance) if sizes is None else [1.0] * len(units)  # given sizes need no costs
    if balance == "params" and sizes is None:
        costs[-1] += sum(p.numel() for p in head.parameters())
    groups = _chunks(units, stage_sizes(costs, num_stages, balance, sizes))
    groups[-1].append(head)
    return [nn.Sequential(*g) for g in groups]


def split_timm_efficientnet(
    model: nn.Module, num_stages: int, balance: Balance = "blocks", sizes: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """The same for timm's EfficientNet / MobileNet family: units are the stem (conv_stem, bn1)
    and every block of ``model.blocks``; the last stage ends with conv_head, bn2, pool and
    classifier (timm ``forward_head``)."""
    stem = nn.Sequential(model.conv_stem, model.bn1)
    blocks = [b for stage in model.blocks for b in stage]
    head = nn.Sequential(
        model.conv_head, model.bn2, _ResNetHead(model.global_pool, model.classifier, float(model.drop_rate))
    )
    return _group_units([stem, *blocks], head, num_stages, balance, sizes)


def split_timm_cnn(
    model: nn.Module, num_stages: int, balance: Balance = "blocks", sizes: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """A timm ResNet or EfficientNet-style model (``conv_stem`` + ``blocks``), split as above."""
    if hasattr(model, "layer1"):
        return split_timm_resnet(model, num_stages, balance, sizes)
    if hasattr(model, "conv_stem") and hasattr(model, "blocks"):
        return split_timm_efficientnet(model, num_stages, balance, sizes)
    raise ValueError(
        f"cannot split {type(model).__name__}: interlocking splits timm ResNets and EfficientNet/MobileNet models"
    )


def is_timm_cnn(model: nn.Module) -> bool:
    """Whether `split_timm_cnn` can split `model`: a timm ResNet or an EfficientNet-style model."""
    return hasattr(model, "layer1") or (hasattr(model, "conv_stem") and hasattr(model, "blocks"))


def is_hf_decoder(model: nn.Module) -> bool:
    """Whether `split_hf_decoder` can split `model`: a Llama-style causal LM (not one wrapped in adapters)."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return hasattr(model, "lm_head") and all(hasattr(inner, a) for a in parts)


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

    def __init__(
        self,
        config,
        layers: Sequence[nn.Module],
        rotary_emb: nn.Module,
        embed_tokens: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ):
        super().__init__()
        self.config = config
        self.embed_tokens, self.layers, self.rotary_emb = embed_tokens, nn.ModuleList(layers), rotary_emb
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = causal_mask(self.config, h, position_ids)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def causal_mask(config, h: Tensor, position_ids: Tensor):
    """transformers' causal mask for a pass without a cache, by the argument names the installed version
    takes (5.17 takes `input_embeds` and `cache_position`, 5.25 `inputs_embeds` and `cache`)."""
    from transformers.masking_utils import create_causal_mask  # lazy: vision users skip transformers

    names = inspect.signature(create_causal_mask).parameters
    kwargs = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    optional = {"cache": None, "cache_position": position_ids[0], "past_key_values": None}
    kwargs.update({name: value for name, value in optional.items() if name in names})
    return create_causal_mask(**kwargs)


def split_hf_decoder(
    model: nn.Module, num_stages: int, balance: Balance = "blocks", sizes: Sequence[int] | None = None
) -> list[DecoderStage]:
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
    costs = unit_costs(layers, balance) if sizes is None else [1.0] * len(layers)
    if balance == "params" and sizes is None:
        costs[0] += inner.embed_tokens.weight.numel()
        costs[-1] += sum(p.numel() for p in (*inner.norm.parameters(), *model.lm_head.parameters()))
    groups = _chunks(layers, stage_sizes(costs, num_stages, balance, sizes))
    last = num_stages - 1
    return [
        DecoderStage(
            model.config,
            g,
            inner.rotary_emb,
            embed_tokens=inner.embed_tokens if k == 0 else None,
            norm=inner.norm if k == last else None,
            lm_head=model.lm_head if k == last else None,
        )
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


def split_model(
    model: nn.Module, family: str, num_stages: int, balance: Balance, sizes: Sequence[int] | None = None
) -> list[nn.Module]:
    """A timm CNN or an HF decoder, split into `num_stages` stage modules (of `sizes` units if given)."""
    split = split_timm_cnn if family == "timm" else split_hf_decoder
    return split(model, num_stages, balance, sizes)


def model_units(model: nn.Module, family: str) -> int:
    """How many units (stem + blocks, or decoder layers) `split_model` can put into stages."""
    return timm_cnn_units(model) if family == "timm" else model.config.num_hidden_layers


def units_per_stage(stages: Sequence[nn.Module], family: str) -> list[int]:
    """Units (stem + blocks, or decoder layers) in each stage; a CNN's last stage holds its head too."""
    return [len(m) - (k == len(stages) - 1) if family == "timm" else len(m.layers) for k, m in enumerate(stages)]


def measure_balance(
    model: nn.Module,
    family: str,
    x: Tensor,
    num_classes: int | None,
    widths: Sequence[int],
    cpus: float | None = None,
    repeats: int = 3,
) -> StageCosts:
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


def _measure_balance(
    probe: nn.Module, family: str, x: Tensor, num_classes: int | None, widths: Sequence[int], repeats: int
) -> StageCosts:
    units = split_model(probe, family, model_units(probe, family), "blocks")
    unit_costs = measure_unit_costs(units, x, repeats)
    heads = resnet_aux_heads(units, num_classes, widths) if family == "timm" else decoder_aux_heads(probe, 2, False)
    outputs, h = [], x
    with torch.no_grad():
        for unit in units[:-1]:
            h = unit(h)
            outputs.append(h)
    costs = [measure_unit_costs([head], out, repeats)[0] for head, out in zip(heads, outputs)]
    return StageCosts(unit_costs, costs if family == "timm" else costs * (len(units) - 1))
