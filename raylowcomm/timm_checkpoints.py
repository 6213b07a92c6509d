"""A timm architecture with a checkpoint's weights, and the check that the checkpoint fits it:
timm itself loads a checkpoint of another architecture under a new head with a warning only, so a
wrong model.timm_arch or model.path is an error here, naming the field and how to fix it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from raylowcomm.config import ConfigError, ModelConfig


def timm_field(cfg: ModelConfig) -> tuple[str, str, str]:
    """(field, value, fix) of an error about a timm checkpoint that does not fit its architecture."""
    field = "model.timm_arch" if cfg.timm_arch else "model.path" if cfg.path else "model.name"
    return field, cfg.timm_arch or cfg.path or cfg.name, "set model.timm_arch to the checkpoint's architecture"


def timm_model(cfg: ModelConfig, arch: str, num_classes: int | None, source: str | None) -> nn.Module:
    """timm's `arch` with the checkpoint `source`'s weights (None: random); weights that do not fit
    it are an error naming the field, checked before timm loads them (see `check_fits`)."""
    import timm

    field, value, fix = timm_field(cfg)
    if source is None:
        return timm.create_model(arch, pretrained=False, num_classes=num_classes)
    check_fits(arch, num_classes, source, field, value, fix)
    try:
        overlay = {"file": source}
        return timm.create_model(arch, pretrained=True, num_classes=num_classes, pretrained_cfg_overlay=overlay)
    except RuntimeError as err:  # a tensor of another shape
        if "state_dict" not in str(err):
            raise
        detail = (str(err).splitlines()[1:] or [str(err)])[0].strip().rstrip(".")  # the first tensor that does not fit
        raise ConfigError(
            field, value, f"the weights do not fit timm architecture {arch!r} ({detail}): {fix}"
        ) from None


def check_fits(arch: str, num_classes: int | None, source: str, field: str, value: str, fix: str) -> None:
    """Under a new head timm loads a checkpoint of another architecture with a warning only, keeping
    the tensors whose names match (none): the checkpoint must hold most of `arch`'s tensors by name
    (not all: timm adapts some checkpoints as it loads them)."""
    import timm
    from timm.models import load_state_dict

    with torch.device("meta"):  # the architecture's tensor names, nothing allocated
        expected = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    head = expected.pretrained_cfg.get("classifier") or ()
    names = [k for k in expected.state_dict() if not k.startswith(head)]
    held = load_state_dict(source).keys()
    missing = [k for k in names if k not in held]
    if len(missing) > len(names) / 2:
        raise ConfigError(
            field,
            value,
            f"the weights do not fit timm architecture {arch!r}: {len(missing)} of its "
            f"{len(names)} tensors are not in {Path(source).name} (e.g. {missing[0]}): "
            f"{fix}",
        )
