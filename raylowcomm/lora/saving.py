"""Saving a LoRA result: the adapter and head as peft writes them, or the merged full model."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from torch import nn

from raylowcomm.lora.adapters import PREFIX, State, apply_lora
from raylowcomm.models import ModelSpec, build_architecture, state_dict_of
from raylowcomm.training import save_weights

logger = logging.getLogger(__name__)


def save_lora(model_or_state: nn.Module | State, spec: ModelSpec, out_dir: str | Path, merge: bool) -> Path:
    """Save a LoRA result. merge=False: the adapter and head as peft writes them
    (adapter_model.safetensors + adapter_config.json: small, `PeftModel.from_pretrained` puts them
    on the base). merge=True: the full merged model (`merge_and_unload`): a Hugging Face folder, or
    model.safetensors for timm. Takes a PEFT model, its state dict, or a plain merged state
    (`average_delta`'s output: merge only, since an average of adapters is no longer one rank-r
    adapter)."""
    state = state_dict_of(model_or_state) if isinstance(model_or_state, nn.Module) else model_or_state
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(k.startswith(PREFIX) for k in state):
        model = apply_lora(build_architecture(spec), spec)
        model.load_state_dict(state)
        if not merge:
            model.save_pretrained(str(out))
            logger.info("saved the adapter to %s", out)
            return out
        plain = model.merge_and_unload()
    elif merge:
        plain = build_architecture(spec)
        plain.load_state_dict(state)
    else:
        raise ValueError(
            "an averaged (merged) state cannot be saved as an adapter: save it with merge=True (model.merge: true)"
        )
    if hasattr(plain, "save_pretrained"):
        plain.save_pretrained(str(out))
    else:
        save_weights(out / "model.safetensors", state_dict_of(plain))
    logger.info("saved the merged model to %s", out)
    return out


def save_adapter(weights: State, model: nn.Module, out_dir: Path) -> Path:
    """The adapter as peft writes it, from the adapters and head alone, on a copy of `model` whose
    base is on the meta device (the driver of a run whose nodes loaded the weights): peft writes
    the tensors that train, never the base."""
    wrapped = copy.deepcopy(model)
    wrapped.load_state_dict(weights, strict=False, assign=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir))
    logger.info("saved the adapter to %s", out_dir)
    return out_dir
