"""What a model is trained and scored on: its inputs and targets, the loss, and the metrics.

Inputs arrive as dicts of tensors (see data.py); image preprocessing happens here, on the node,
so only the compact uint8 pixels cross the network. Scoring has one path for every strategy:
per-batch sums (`sums`) added up and turned into metrics (`summarize`), so a model split over
stage actors (interlocking) scores exactly what the whole model scores in one process.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raylowcomm import catalog
from raylowcomm.data import Split, eval_batches, take

SET_PREFIX = {"test": "id", "shift": "shift", "val": "val"}
"""Evaluation set name -> the prefix of its metrics in a record (id_accuracy, shift_loss, ...)."""


def trim_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch cut to its longest row: the columns past it are padding in every row,
    so the model computes the same outputs on fewer positions (reviews average 27 of 64 tokens)."""
    width = int(mask.sum(1).max())
    return ids[:, :width], mask[:, :width]


class ImageClassification:
    metric = "accuracy"

    def __init__(self, image_size: int, device: str = "cpu"):
        self.image_size = image_size
        self.device = device

    def inputs(self, batch) -> torch.Tensor:
        """uint8 grey digits -> the pretrained net's input: 3 channels, resized, mean = std = 0.5."""
        x = batch["pixels"].to(self.device, torch.float32).div_(255.0).unsqueeze(1)
        x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return x.sub_(0.5).div_(0.5).expand(-1, 3, -1, -1)

    def targets(self, batch) -> torch.Tensor:
        return batch["labels"].to(self.device)

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        return model(self.inputs(batch))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(self.forward(model, batch), self.targets(batch))

    @staticmethod
    def sums(logits: torch.Tensor, targets: torch.Tensor) -> dict:
        """Additive statistics of one evaluation batch."""
        return {"loss_sum": F.cross_entropy(logits.float(), targets, reduction="sum").item(), "count": len(targets),
                "correct": int((logits.argmax(-1) == targets).sum())}

    @staticmethod
    def summarize(sums: dict) -> dict:
        return {"accuracy": sums["correct"] / sums["count"], "loss": sums["loss_sum"] / sums["count"]}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: Split, batch_size: int) -> dict:
        """Metrics of `model` on `split`; padded text is scored shortest first, so that each
        batch, cut to its longest row, carries little padding (the sums do not depend on order)."""
        if "attention_mask" in split:
            split = take(split, split["attention_mask"].sum(1).argsort(stable=True))
        was = model.training
        model.eval()
        parts = [self.sums(self.forward(model, batch), self.targets(batch)) for batch in eval_batches(split, batch_size)]
        model.train(was)
        return self.summarize(add_sums(parts))


class TextClassification(ImageClassification):
    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        ids, mask = trim_padding(batch["input_ids"], batch["attention_mask"])
        return model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits


class PromptClassification(ImageClassification):
    """A causal LM as a classifier, MeZO style: score each class's label word as the next
    token after the prompt (see data.PROMPT_TEMPLATE); accuracy is the argmax of the label
    words' logits, the loss their cross-entropy. Only the last real token's hidden state meets
    the label words' output embeddings, so no full-vocabulary logits are built."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        ids, mask = (t.to(self.device) for t in trim_padding(batch["input_ids"], batch["attention_mask"]))
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        # right padding: the prompt ends at the last attended position of each row
        last = hidden[torch.arange(len(ids), device=hidden.device), mask.sum(1) - 1]
        head = model.get_output_embeddings()
        choices = batch["choice_ids"].to(self.device)
        logits = torch.einsum("bh,bch->bc", last, head.weight[choices])
        return logits + head.bias[choices] if head.bias is not None else logits


class CausalLM:
    metric = "loss"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def inputs(self, batch) -> torch.Tensor:
        return batch["input_ids"].to(self.device)

    targets = inputs
    """Next-token prediction: the targets are the inputs, shifted inside the loss."""

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        return model(input_ids=self.inputs(batch)).logits

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        if "choice_ids" in batch:
            raise ValueError("labelled prompts need PromptClassification: task_for(..., data=cfg.data.name)")
        ids = self.inputs(batch)
        return model(input_ids=ids, labels=ids).loss

    @staticmethod
    def sums(logits: torch.Tensor, targets: torch.Tensor) -> dict:
        """Summed next-token cross-entropy (targets shifted, -100 ignored) and the tokens counted."""
        count = int((targets[:, 1:] != -100).sum())
        flat = logits[:, :-1].flatten(0, 1)
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
        return {"loss_sum": F.cross_entropy(flat, targets[:, 1:].flatten(), ignore_index=-100, reduction="sum").item(),
                "count": count}

    @staticmethod
    def summarize(sums: dict) -> dict:
        mean = sums["loss_sum"] / sums["count"]
        return {"loss": mean, "perplexity": math.exp(mean)}

    evaluate = ImageClassification.evaluate


def add_sums(parts: list[dict]) -> dict:
    return {key: sum(p[key] for p in parts) for key in parts[0]}


TASK_CLASSES = {"text_classification": TextClassification, "prompt_classification": PromptClassification,
                "causal_lm": CausalLM}


def task_for(family: str, image_size: int, device: str = "cpu", data: str | None = None):
    """The task a `family` model trains on dataset `data` (catalog.TASKS); without `data`, the
    family's plain task (a causal LM models text)."""
    name = catalog.task_name(family, data) if data else {"timm": "image_classification", "hf_classifier": "text_classification"}.get(family, "causal_lm")
    if name == "image_classification":
        return ImageClassification(image_size, device)
    return TASK_CLASSES[name](device)


def score_sets(task, model: nn.Module, sets: dict[str, Split], batch_size: int) -> dict:
    """Every metric of `model` on every evaluation set, prefixed per SET_PREFIX (id_accuracy, ...)."""
    return {f"{SET_PREFIX[name]}_{k}": v for name, split in sets.items() if split is not None
            for k, v in task.evaluate(model, split, batch_size).items()}
