"""Building LoRA adapters (peft): the peft config for a model, wrapping it, starting its adapters from a
seed, what a node sends (the tensors that train), and which layers are adapted under which names.

Two forms of a state dict appear in this package. The PEFT model's names its frozen weights
`base_model.model.<path>.base_layer.weight`, its adapters `<path>.lora_A.default.weight` and
`<path>.lora_B.default.weight`, and a trainable head `<path>.modules_to_save.default.weight`
(next to a frozen `original_module` copy). The plain model (the architecture without adapters,
what merging gives) names the same weights `<path>.weight`; `plain_key` maps one to the other.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import peft
import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from raylowcomm.config import ConfigError, LoraConfig
from raylowcomm.models import ModelSpec

ADAPTER = "default"
"""The one adapter every model here carries (peft's default name)."""
PREFIX = "base_model.model."
"""What a PEFT model's state-dict keys start with (a plain model's do not)."""
_ADAPTER_ONLY = re.compile(r"\.(lora_\w+|original_module)\.")
_TASK_TYPE = {"hf_classifier": peft.TaskType.SEQ_CLS, "hf_causal_lm": peft.TaskType.CAUSAL_LM}

State = dict[str, torch.Tensor]


# --- building ----------------------------------------------------------------------------------


def _timm_targets(model: nn.Module, head: str) -> list[str]:
    """peft knows no default for timm: every Linear and ungrouped Conv2d outside the head (grouped,
    i.e. depthwise, convolutions cannot be merged by peft)."""
    return [
        name
        for name, module in model.named_modules()
        if not (name == head or name.startswith(head + "."))
        and (isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1))
    ]


def peft_config(cfg: LoraConfig, family: str, model: nn.Module) -> peft.LoraConfig:
    """The peft config; the new head goes in `modules_to_save` (peft's task types do that for HF
    classifiers) so it trains and is saved with the adapter."""
    kwargs = {"r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": cfg.target_modules}
    if family in _TASK_TYPE:
        kwargs["task_type"] = _TASK_TYPE[family]
    else:
        head = model.pretrained_cfg["classifier"]
        kwargs["modules_to_save"] = [head]
        if cfg.target_modules is None:
            kwargs["target_modules"] = _timm_targets(model, head)
    return peft.LoraConfig(**kwargs)


def apply_lora(model: nn.Module, spec: ModelSpec, seed: int | None = None) -> nn.Module:
    """`model` wrapped in the adapters `spec.lora` asks for: base frozen, adapters and head trainable.
    With `seed` the adapters start from `init_adapters(seed)`; without, from the global RNG (a model
    that then loads a state dict, as actors do)."""
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, peft_config(spec.lora, spec.family, model))
    except ValueError as err:  # peft: no default for this architecture, or a name that matches nothing
        raise ConfigError("model.lora.target_modules", spec.lora.target_modules, str(err)) from None
    _head_in_fp32(wrapped)
    if seed is not None:
        init_adapters(wrapped, seed)
    return wrapped


def _head_in_fp32(model: nn.Module) -> None:
    """On a bf16/fp16 base (model.dtype) what trains stays fp32: peft keeps the adapters fp32 and
    casts their input itself (its autocast_adapter_dtype); the new head is made fp32 here and its
    input cast to fp32 on the way in, so the logits and the loss are fp32 too."""
    for module in model.modules():
        if isinstance(module, peft.utils.ModulesToSaveWrapper):
            head = module.modules_to_save[ADAPTER]
            if any(p.dtype != torch.float32 for p in head.parameters()):
                head.float()
                head.register_forward_pre_hook(_to_fp32)


def _to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """Every adapted layer of a PEFT model with its module name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def init_adapters(model: nn.Module, seed: int, only: set[str] | None = None) -> None:
    """Adapters as at a fresh start, from `seed` alone: A Kaiming-uniform (peft's init) drawn from a
    private CPU generator in module order, so it depends on neither the global RNG nor the device;
    B zero, so the adapted model computes exactly what its base does. `only`: the layers (module
    names) to restart; every layer's A is still drawn, so a layer's draw does not depend on which."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, layer in lora_modules(model):
            a = layer.lora_A[ADAPTER].weight
            fresh = torch.empty(a.shape, dtype=a.dtype)
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            if only is None or name in only:
                a.copy_(fresh)
                layer.lora_B[ADAPTER].weight.zero_()


# --- what a node has and sends -----------------------------------------------------------------


def trainable_state(model: nn.Module) -> State:
    """The tensors that train (adapters and head): what a node sends. CPU copies, contiguous, so
    later steps do not change what was sent."""
    return {
        name: p.detach().cpu().clone(memory_format=torch.contiguous_format)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass(frozen=True)
class AdaptedLayer:
    """One adapted layer: PEFT-form keys of its factors and frozen weight, the plain-form key of
    that weight, and the scale (alpha / r) of its update scale·B·A."""

    a: str
    b: str
    base: str
    plain: str
    scale: float
    shape: tuple[int, ...]

    def delta(self, state: State) -> torch.Tensor:
        """scale·B·A from a node's tensors, in float64, shaped like the weight. For a convolution,
        A is (r, in, kh, kw) and B (out, r, 1, 1): the same product over the flattened factors."""
        b, a = state[self.b].double().flatten(1), state[self.a].double().flatten(1)
        return (self.scale * (b @ a)).view(self.shape)


def _check_mergeable(name: str, layer: LoraLayer) -> None:
    base = layer.get_base_layer()
    if ADAPTER in layer.lora_embedding_A or getattr(layer, "fan_in_fan_out", False) or getattr(base, "groups", 1) > 1:
        raise NotImplementedError(
            f"{name}: only Linear and ungrouped Conv LoRA layers can be averaged exactly; "
            "leave embeddings, GPT-2 Conv1D and depthwise convolutions out of "
            "model.lora.target_modules"
        )


def lora_layers(model: nn.Module) -> list[AdaptedLayer]:
    """Every adapted layer of a PEFT model, in module order."""
    layers = []
    for name, layer in lora_modules(model):
        _check_mergeable(name, layer)
        base = f"{name}.base_layer.weight"
        layers.append(
            AdaptedLayer(
                a=f"{name}.lora_A.{ADAPTER}.weight",
                b=f"{name}.lora_B.{ADAPTER}.weight",
                base=base,
                plain=plain_key(base),
                scale=float(layer.scaling[ADAPTER]),
                shape=tuple(layer.get_base_layer().weight.shape),
            )
        )
    return layers


def plain_key(key: str) -> str | None:
    """The plain model's name for a PEFT state-dict key; None for adapter factors and the frozen
    copy of the original head. A plain key maps to itself."""
    if _ADAPTER_ONLY.search(key):
        return None
    return key.removeprefix(PREFIX).replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")
