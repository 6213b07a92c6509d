"""LoRA adapters (peft) for every strategy: wrapping a model and what a node sends (`adapters`), how
the nodes' adapters are averaged and merged, restarting adapters after an averaging round
(`merging`), saving (`saving`); `LoraFineTune` is what a LoRA run asks all of it through
(`finetune.fine_tune_for`). The only package that knows peft. Plain torch: no Ray. The names below
are importable from here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from raylowcomm.lora.adapters import (
    ADAPTER,
    AdaptedLayer,
    State,
    apply_lora,
    init_adapters,
    lora_layers,
    peft_config,
    plain_key,
    trainable_state,
)
from raylowcomm.lora.merging import (
    AdapterAverage,
    NodeAdapters,
    average_delta,
    average_factors,
    computing,
    merge_and_reset,
    merge_nodes,
)
from raylowcomm.lora.saving import save_adapter, save_lora
from raylowcomm.models import ModelSpec, state_dict_of

__all__ = [
    "ADAPTER",
    "AdaptedLayer",
    "AdapterAverage",
    "LoraFineTune",
    "NodeAdapters",
    "State",
    "apply_lora",
    "average_delta",
    "average_factors",
    "computing",
    "init_adapters",
    "lora_layers",
    "merge_and_reset",
    "merge_nodes",
    "peft_config",
    "plain_key",
    "save_adapter",
    "save_lora",
    "trainable_state",
]


@dataclass(frozen=True)
class LoraFineTune:
    """`finetune.FineTune` for adapters: only the adapters and the new head train, so only they are
    sent, all-reduced and checkpointed (until an average moves the base); lo-fi averages them
    exactly on the nodes' common base, and each averaging round restarts them on the merged one."""

    spec: ModelSpec

    def wrap(self, model: nn.Module, seed: int | None = None) -> nn.Module:
        return apply_lora(model, self.spec, seed)

    def node_state(self, model: nn.Module) -> State:
        return trainable_state(model)

    def trainable_only(self, base_moved: bool = False) -> bool:
        return not base_moved

    def plain_state(self, payload: NodeAdapters | State | None, model: nn.Module) -> State:
        """The nodes' adapters merged on this node's base, a merged model as it came, or (None) this
        node's own model merged."""
        if payload is None:
            return average_delta(state_dict_of(model), [trainable_state(model)], lora_layers(model))
        return payload.merged_on(model) if isinstance(payload, NodeAdapters) else payload

    def plain_names(self, state: State) -> State:
        return {plain_key(k): v for k, v in state.items()}

    def computing(self, model: nn.Module, plain: State) -> contextlib.AbstractContextManager[nn.Module | None]:
        """This node's PEFT model, computing `plain` in place for a while (`computing`)."""
        return computing(model, plain)

    def save_result(self, weights: State, model: nn.Module, out_dir: Path, merge: bool) -> dict[str, str]:
        """The adapter as peft writes it where the result is adapters on the pretrained base (SPSA,
        DDP), and with model.merge the merged model (always the form of lo-fi's average, which is no
        longer one rank-r adapter)."""
        adapters = any(".lora_" in k for k in weights)
        if adapters and any(p.is_meta for p in model.parameters()):  # the base is on the nodes (model.source)
            return {"adapter_dir": str(save_adapter(weights, model, out_dir / "adapter"))}
        full = {**state_dict_of(model), **weights} if adapters else weights
        out = {}
        if adapters:
            out["adapter_dir"] = str(save_lora(full, self.spec, out_dir / "adapter", merge=False))
        if merge:
            out["merged_dir"] = str(save_lora(full, self.spec, out_dir / "merged", merge=True))
        return out
