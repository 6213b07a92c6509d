"""What a model is trained and scored on: the loss, the forward pass, and the metrics.

Inputs arrive as dicts of tensors (see data.py); image preprocessing happens here, on the node,
so only the compact uint8 pixels cross the network.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raylowcomm.data import LABELLED_TEXT, Split, eval_batches


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

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        return model(self.inputs(batch))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(self.forward(model, batch), batch["labels"].to(self.device))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: Split, batch_size: int) -> dict:
        was = model.training
        model.eval()
        correct, total, loss = 0, 0, 0.0
        for batch in eval_batches(split, batch_size):
            logits = self.forward(model, batch)
            labels = batch["labels"].to(self.device)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
            total += len(labels)
        model.train(was)
        return {"accuracy": correct / total, "loss": loss / total}


class TextClassification(ImageClassification):
    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)).logits


class PromptClassification(ImageClassification):
    """A causal LM as a classifier, MeZO style: score each class's label word as the next
    token after the prompt (see data.PROMPT_TEMPLATE); accuracy is the argmax of the label
    words' logits, the loss their cross-entropy. Only the last real token's hidden state meets
    the label words' output embeddings, so no full-vocabulary logits are built."""

    metric = "accuracy"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        width = int(batch["attention_mask"].sum(1).max())  # right padding: columns past it are all padding
        ids, mask = batch["input_ids"][:, :width].to(self.device), batch["attention_mask"][:, :width].to(self.device)
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

    def forward(self, model: nn.Module, batch):
        return model(input_ids=batch["input_ids"].to(self.device))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        if "choice_ids" in batch:
            raise ValueError("labelled prompts need PromptClassification: task_for(..., data=cfg.data.name)")
        ids = batch["input_ids"].to(self.device)
        return model(input_ids=ids, labels=ids).loss

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: Split, batch_size: int) -> dict:
        was = model.training
        model.eval()
        loss, tokens = 0.0, 0
        for batch in eval_batches(split, batch_size):
            n = batch["input_ids"].numel() - len(batch["input_ids"])
            loss += self.loss(model, batch).item() * n
            tokens += n
        model.train(was)
        return {"loss": loss / tokens, "perplexity": math.exp(loss / tokens)}


def task_for(family: str, image_size: int, device: str = "cpu", data: str | None = None):
    """`data` picks prompt classification for a causal LM on labelled text (rotten_tomatoes)."""
    if family == "timm":
        return ImageClassification(image_size, device)
    if family == "hf_classifier":
        return TextClassification(device)
    if data in LABELLED_TEXT:
        return PromptClassification(device)
    return CausalLM(device)


def score_model(task, model: nn.Module, test: Split, shift: Split | None, batch_size: int) -> dict:
    """In-distribution metrics as id_*, and shift_* where the data has a real shift set."""
    out = {f"id_{k}": v for k, v in task.evaluate(model, test, batch_size).items()}
    if shift is not None:
        out.update({f"shift_{k}": v for k, v in task.evaluate(model, shift, batch_size).items()})
    return out
