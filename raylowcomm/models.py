"""Models: pretrained weights through the ordinary loaders (timm, transformers) on the driver,
and a file-free `ModelSpec` from which any actor rebuilds the same architecture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylowcomm import assets
from raylowcomm.config import ConfigError, LoraConfig, ModelConfig

ASSET_TIMM_ARCH = {"efficientnet_lite0": "tf_efficientnet_lite0"}


@dataclass
class ModelSpec:
    """Everything needed to rebuild the architecture; the weights travel separately."""

    family: str
    num_classes: int | None = None
    timm_arch: str | None = None
    hf_config: object | None = None
    lora: LoraConfig | None = None
    """Wrap the architecture in these LoRA adapters (raylowcomm.lora)."""


def model_source(cfg: ModelConfig) -> str:
    """Where the model's weights come from (a bundled asset is materialised): a cheap check that
    they exist, for callers that do not load the model themselves."""
    source = _resolve(cfg)
    if cfg.path is not None and not Path(source).exists():
        raise ConfigError("model.path", cfg.path, "no such file or folder; point it at your local weights or remove it")
    return source


def _resolve(cfg: ModelConfig) -> str:
    if cfg.path:
        return cfg.path
    if cfg.name in assets.ASSETS:
        return str(assets.require(cfg.name))
    return cfg.name


def load_pretrained(cfg: ModelConfig, num_classes: int | None, seed: int):
    """(model, spec, tokenizer). A new head is drawn from `seed`, so it is the same on every node;
    with `cfg.lora` the model comes wrapped in adapters drawn from `seed` too (base frozen)."""
    model, spec, tokenizer = _load_base(cfg, num_classes, seed)
    if cfg.lora is None:
        return model, spec, tokenizer
    from raylowcomm.lora import apply_lora  # peft only for LoRA runs

    spec.lora = cfg.lora
    return apply_lora(model, spec, seed), spec, tokenizer


def _load_base(cfg: ModelConfig, num_classes: int | None, seed: int):
    """The pretrained model without adapters."""
    torch.manual_seed(seed)
    if cfg.family == "timm":
        import timm

        arch = cfg.timm_arch or ASSET_TIMM_ARCH.get(cfg.name, cfg.name)
        if arch not in timm.list_models():
            raise ConfigError("model.timm_arch", arch, "not a timm architecture (see timm.list_models())")
        kwargs = {}
        if cfg.pretrained:
            source = _resolve(cfg) if (cfg.path or cfg.name in assets.ASSETS) else None
            if source is None:
                raise ConfigError("model.path", None, f"pretrained '{arch}' needs local weights: set model.path to a checkpoint file, or model.pretrained=false")
            kwargs["pretrained_cfg_overlay"] = {"file": source}
        model = timm.create_model(arch, pretrained=cfg.pretrained, num_classes=num_classes, **kwargs)
        return model, ModelSpec("timm", num_classes=num_classes, timm_arch=arch), None

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    source = _resolve(cfg)
    if not Path(source).exists() and "/" not in source:
        raise ConfigError("model.name", cfg.name, f"not a bundled asset ({', '.join(a for a, v in assets.ASSETS.items() if v.kind == 'model')}), a local folder or a hub id")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.family == "hf_classifier":
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_classes, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, ModelSpec(cfg.family, num_classes=num_classes, hf_config=model.config), tokenizer


def build_model(spec: ModelSpec) -> nn.Module:
    """The architecture alone (random weights), with `spec.lora`'s adapters: load a state dict into it."""
    if spec.family == "timm":
        import timm

        model = timm.create_model(spec.timm_arch, pretrained=False, num_classes=spec.num_classes)
    else:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if spec.family == "hf_classifier" else AutoModelForCausalLM
        model = auto.from_config(spec.hf_config, dtype=torch.float32)
    if spec.lora is None:
        return model
    from raylowcomm.lora import apply_lora  # peft only for LoRA runs

    return apply_lora(model, spec)


def state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, with tied weights stored once per name as torch does."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def image_preprocessing(model: nn.Module) -> dict | None:
    """How a timm model's pretrained weights expect images: {input_size, mean, std, ...} from its
    pretrained config (timm.data.resolve_data_config); None for a model that takes no images."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA adapters
    if not hasattr(base, "pretrained_cfg"):
        return None
    from timm.data import resolve_data_config

    return resolve_data_config({}, model=base)
