"""What a model is trained and scored on: its inputs and targets, the loss, and the metrics.

Inputs arrive as dicts of tensors (see data.py); image preprocessing happens here, on the node,
so only the compact uint8 pixels cross the network: resized and normalised as the model was
pretrained (its mean / std, catalog.TaskSpec). Scoring has one path for every strategy:
per-batch sums (`sums`) added up and turned into metrics (`summarize`), so a model split over
stage actors (interlocking) scores exactly what the whole model scores in one process on as many
threads in the same memory format: oneDNN picks a convolution's kernel, and so its rounding, by
both. Node processes run nodes.cpus threads (`runtime.setup_threads`); SPSA's nodes stay contiguous
where the others follow model.memory_format, so across strategies one model's scores agree to float
rounding, not bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raylowcomm import catalog
from raylowcomm.catalog import TaskSpec
from raylowcomm.common.batches import Split, eval_batches, take

SET_PREFIX = {"test": "id", "shift": "shift", "val": "val"}
"""Evaluation set name -> the prefix of its metrics in a record (id_accuracy, val_loss, ...); any
other set is its own prefix (shift/uci_digits_accuracy)."""
SHIFT_SET = "shift/"
"""Shift sets are named shift/<name>; shift_* is their mean."""


def trim_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch cut to its longest row: the columns past it are padding in every row,
    so the model computes the same outputs on fewer positions (reviews average 27 of 64 tokens)."""
    width = int(mask.sum(1).max())
    return ids[:, :width], mask[:, :width]


class ImageClassification:
    metric = "accuracy"

    def __init__(
        self,
        image_size: int,
        device: str = "cpu",
        mean: tuple[float, ...] = (0.5,) * 3,
        std: tuple[float, ...] = (0.5,) * 3,
    ):
        self.image_size, self.device = image_size, device
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.uniform = (mean[0], std[0]) if len(set(mean)) == 1 and len(set(std)) == 1 else None
        """Channel-uniform mean / std: a grey image is normalised once, then repeated (3 x less work)."""

    def inputs(self, batch) -> torch.Tensor:
        """uint8 pixels, grey (N, H, W) or colour (N, 3, H, W) -> the pretrained net's input: 3
        channels, resized, normalised with the model's mean / std."""
        x = batch["pixels"].to(self.device, torch.float32).div_(255.0)
        x = x.unsqueeze(1) if x.dim() == 3 else x
        x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        if x.shape[1] == 1 and self.uniform is not None:
            return x.sub_(self.uniform[0]).div_(self.uniform[1]).expand(-1, 3, -1, -1)
        x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    def targets(self, batch) -> torch.Tensor:
        return batch["labels"].to(self.device)

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        """Images in the weights' dtype (model.dtype), logits in fp32."""
        return model(self.inputs(batch).to(next(model.parameters()).dtype)).float()

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(self.forward(model, batch), self.targets(batch))

    @staticmethod
    def sums(logits: torch.Tensor, targets: torch.Tensor) -> dict:
        """Additive statistics of one evaluation batch."""
        return {
            "loss_sum": F.cross_entropy(logits.float(), targets, reduction="sum").item(),
            "count": len(targets),
            "correct": int((logits.argmax(-1) == targets).sum()),
        }

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
        parts = [
            self.sums(self.forward(model, batch), self.targets(batch)) for batch in eval_batches(split, batch_size)
        ]
        model.train(was)
        return self.summarize(add_sums(parts))


class TextClassification(ImageClassification):
    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        """Text pairs also carry token_type_ids (which text each token belongs to), trimmed alike."""
        ids, mask = trim_padding(batch["input_ids"], batch["attention_mask"])
        extra = (
            {"token_type_ids": batch["token_type_ids"][:, : ids.shape[1]].to(self.device)}
            if "token_type_ids" in batch
            else {}
        )
        return model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra).logits


class PromptClassification(ImageClassification):
    """A causal LM as a classifier, MeZO style: score each class's label word as the next
    token after the prompt (data.template, data.label_words); accuracy is the argmax of the label
    words' logits, the loss their cross-entropy. Only the last real token's hidden state meets
    the label words' output embeddings, so no full-vocabulary logits are built."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, model: nn.Module, batch) -> torch.Tensor:
        ids, mask = (t.to(self.device) for t in trim_padding(batch["input_ids"], batch["attention_mask"]))
        # The decoder and output embeddings of the LM, asked of the model itself: an adapter wrapper passes both
        # through to the LM it adapts, so this task never needs to know whether one is there.
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model  # older transformers
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        # right padding: the prompt ends at the last attended position of each row
        last = hidden[torch.arange(len(ids), device=hidden.device), mask.sum(1) - 1]
        head = model.get_output_embeddings()
        choices = batch["choice_ids"].to(self.device)
        logits = torch.einsum("bh,bch->bc", last, head.weight[choices]).float()  # fp32 under a bf16 model.dtype
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
            raise ValueError("labelled prompts need PromptClassification (TaskSpec name prompt_classification)")
        ids = self.inputs(batch)
        return model(input_ids=ids, labels=ids).loss

    @staticmethod
    def sums(logits: torch.Tensor, targets: torch.Tensor) -> dict:
        """Summed next-token cross-entropy (targets shifted, -100 ignored) and the tokens counted."""
        count = int((targets[:, 1:] != -100).sum())
        flat = logits[:, :-1].flatten(0, 1)
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
        return {
            "loss_sum": F.cross_entropy(flat, targets[:, 1:].flatten(), ignore_index=-100, reduction="sum").item(),
            "count": count,
        }

    @staticmethod
    def summarize(sums: dict) -> dict:
        mean = sums["loss_sum"] / sums["count"]
        return {"loss": mean, "perplexity": math.exp(mean)}

    evaluate = ImageClassification.evaluate


def add_sums(parts: list[dict]) -> dict:
    return {key: sum(p[key] for p in parts) for key in parts[0]}


def mean_metrics(per_node: list[dict]) -> dict:
    """The mean of each metric over nodes (data.eval_on_nodes: each node scored its own held-out rows)."""
    return {key: sum(m[key] for m in per_node) / len(per_node) for key in per_node[0]}


TASK_CLASSES = {
    "text_classification": TextClassification,
    "prompt_classification": PromptClassification,
    "causal_lm": CausalLM,
}


def make_task(spec: TaskSpec, device: str = "cpu"):
    """The task a node trains and scores with, from the driver's description (data.prepare_data)."""
    if spec.name == "image_classification":
        return ImageClassification(spec.image_size, device, spec.mean, spec.std)
    return TASK_CLASSES[spec.name](device)


def task_for(family: str, image_size: int, device: str = "cpu", data: str | None = None):
    """The task a `family` model trains on the preset `data` (catalog.TASKS); without `data`, the
    family's plain task (a causal LM models text). Images normalised with mean = std = 0.5."""
    name = (
        catalog.task_name(family, data)
        if data
        else {"timm": "image_classification", "hf_classifier": "text_classification"}.get(family, "causal_lm")
    )
    return make_task(TaskSpec(name, image_size), device)


def metric_names(per_set: dict[str, dict]) -> dict:
    """{set: metrics} -> one flat record: test -> id_*, val -> val_*, shift/<name> -> shift/<name>_*,
    and shift_* the mean over the shift sets (a single set's own values)."""
    out = {f"{SET_PREFIX.get(name, name)}_{k}": v for name, metrics in per_set.items() for k, v in metrics.items()}
    shifts = [m for name, m in per_set.items() if name.startswith(SHIFT_SET)]
    for key in shifts[0] if shifts else {}:
        out[f"shift_{key}"] = sum(m[key] for m in shifts) / len(shifts)
    return out


def score_sets(task, model: nn.Module, sets: dict[str, Split], batch_size: int) -> dict:
    """Every metric of `model` on every evaluation set, named by `metric_names`."""
    return metric_names(
        {name: task.evaluate(model, split, batch_size) for name, split in sets.items() if split is not None}
    )
