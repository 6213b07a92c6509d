"""A start that does not drift (LP-FT, Kumar et al. 2022): before the nodes split, each trains the new
head alone for `lofi.probe_steps` steps on its own shard, and the nodes average their heads exactly, so
fine-tuning starts on every node from one briefly trained head instead of a random one, which the nodes
would otherwise pull apart in their first steps. Only heads cross: N up, N down."""

from __future__ import annotations

from torch import nn

from raylowcomm.actors import NodeGroup
from raylowcomm.core.averaging import StreamingAverage


def head_names(model: nn.Module, family: str) -> list[str]:
    """The new head's parameters: a timm model's classifier (its pretrained_cfg names it), a Hugging Face
    classifier's `classifier` or `score`."""
    if family == "timm":
        prefix = model.pretrained_cfg["classifier"]
    elif family == "hf_classifier":
        prefix = "classifier" if hasattr(model, "classifier") else "score"
    else:
        raise ValueError(f"a model of family {family!r} has no new head (a classifier's)")
    return [n for n, _ in model.named_parameters() if n.startswith(prefix + ".")]


def shared_head(group: NodeGroup, steps: int, weights: list[float]) -> bool:
    """Every node probes its head; the driver averages them (node k weighing weights[k], in node order)
    and every node loads the average. False where the nodes restored checkpoints: they hold it already."""
    heads = group.call("probe", steps, phase="setup", what="probe_heads")
    if all(h is None for h in heads):
        return False
    average = StreamingAverage()
    for k, head in enumerate(heads):
        average.add(head, weights[k])
    group.call("load_head", group.put(average.result(), "setup", "shared_head", copies=len(group)), phase="setup")
    return True
