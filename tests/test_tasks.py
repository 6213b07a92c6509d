"""Tasks: a padded text batch cut to its longest row scores what the full-width batch scores."""

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from raylowcomm.tasks import TextClassification, trim_padding


def tiny_bert(layers: int, labels: int) -> BertForSequenceClassification:
    """A small random BERT classifier in eval mode (the caller seeds torch first)."""
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=labels,
    )
    return BertForSequenceClassification(config).eval()


FLOAT64_FORWARD = 1e-10
"""Two float64 forwards of one model that add the same nonzero terms (a padded key's attention weight is
exactly 0: its exp underflows) in another order (the kernels block other widths differently): each reordered
sum of n ≤ 64 terms moves by ≤ 2(n − 1)·2^-53·Σ|terms| ≈ 1.4e-14·Σ|terms|, so 1e-10 on logits of magnitude < 1
leaves the layers a gain of 10^3 on terms ≤ 10 (observed: 1e-18). In float32 the same reordering moves logits by
~1e-9, which no tolerance picked on one CPU bounds on another."""


def test_trimmed_padding_gives_the_full_width_logits():
    torch.manual_seed(0)
    model = tiny_bert(layers=2, labels=2).double()
    lengths = [5, 9, 3, 7]
    ids = torch.zeros(4, 32, dtype=torch.long)
    mask = torch.zeros(4, 32, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.randint(1, 100, (n,)), 1
    trimmed_ids, trimmed_mask = trim_padding(ids, mask)
    assert trimmed_ids.shape == (4, 9) and torch.equal(trimmed_mask.sum(1), mask.sum(1))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        got = TextClassification().forward(model, {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(4)})
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, full, rtol=0, atol=FLOAT64_FORWARD)  # equal up to float summation order


def test_text_is_scored_shortest_first_with_the_same_metrics():
    torch.manual_seed(1)
    model = tiny_bert(layers=1, labels=2).double()
    n, width = 40, 24
    lengths = torch.randint(2, width, (n,))
    mask = (torch.arange(width) < lengths[:, None]).long()
    split = {
        "input_ids": torch.randint(1, 100, (n, width)) * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, 2, (n,)),
    }
    task = TextClassification()
    with torch.no_grad():
        logits = model(input_ids=split["input_ids"], attention_mask=mask).logits
    expected = task.summarize(task.sums(logits, split["labels"]))
    got = task.evaluate(model, split, batch_size=8)
    # The accuracy: a row's argmax in its batch of 8 is the full batch's wherever its two logits lie more than
    # 2·FLOAT64_FORWARD apart (each moves by at most FLOAT64_FORWARD), as every row's do here
    assert ((logits[:, 0] - logits[:, 1]).abs() > 2 * FLOAT64_FORWARD).all()
    assert got["accuracy"] == expected["accuracy"]
    # The loss: in float64 a row's logits in its batch of 8 are the full batch's to FLOAT64_FORWARD, so after the
    # float32 cast of `sums` at most one rounding apart, 2^-23·max|z|, which moves the row's cross-entropy
    # (2-Lipschitz in the max norm) by ≤ 2^-22·max|z|; each float32 evaluation of a row's cross-entropy errs by
    # ≤ 2^-19·(1 + max|z|) (generous: max, exp, sum, log, pick); the float32 sums over the rows (reduction
    # "sum") by ≤ (m − 1)·2^-24·Σ|ℓ| for m = 40 rows at once and 8 per batch; the batches add in float64.
    z = logits.float().double()
    rows = F.cross_entropy(z, split["labels"], reduction="none")
    per_row = 2.0**-22 * z.abs().amax(1) + 2 * 2.0**-19 * (1 + z.abs().amax(1))
    bound = (per_row.sum() + (n - 1 + 7) * 2.0**-24 * (rows + per_row).sum() + 2.0**-50 * rows.sum()) / n
    assert abs(got["loss"] - expected["loss"]) <= bound


def test_metric_names_per_set_and_the_mean_over_shift_sets():
    from raylowcomm.tasks import metric_names

    named = metric_names(
        {
            "test": {"accuracy": 0.9},
            "val": {"accuracy": 0.8},
            "shift/a": {"accuracy": 0.5, "loss": 1.0},
            "shift/b": {"accuracy": 0.25, "loss": 3.0},
        }
    )
    assert named == {
        "id_accuracy": 0.9,
        "val_accuracy": 0.8,
        "shift/a_accuracy": 0.5,
        "shift/a_loss": 1.0,
        "shift/b_accuracy": 0.25,
        "shift/b_loss": 3.0,
        "shift_accuracy": 0.375,
        "shift_loss": 2.0,
    }
    one = metric_names({"test": {"loss": 2.0}, "shift/uci_digits": {"loss": 0.7}})
    assert one["shift_loss"] == one["shift/uci_digits_loss"] == 0.7


def test_images_are_normalised_with_the_models_mean_and_std():
    from raylowcomm.catalog import TaskSpec
    from raylowcomm.tasks import ImageClassification, make_task

    grey = torch.randint(0, 256, (4, 8, 8), dtype=torch.uint8)
    fast = ImageClassification(12).inputs({"pixels": grey})  # mean = std = 0.5: normalised once, then repeated
    general = ImageClassification(12, mean=(0.5, 0.5, 0.5 + 1e-9), std=(0.5,) * 3).inputs({"pixels": grey})
    assert fast.shape == (4, 3, 12, 12)
    # 0.5 + 1e-9 is 0.5 in float32: both paths compute (x − 0.5)/0.5 on the same resized pixels, the same bits
    assert torch.equal(fast, general)
    colour = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    x = make_task(TaskSpec("image_classification", 5, mean, std)).inputs({"pixels": colour})
    # resized, then normalised per channel with the model's mean and std, in that order: the same bits
    resized = torch.nn.functional.interpolate(colour.float() / 255, size=(5, 5), mode="bilinear", align_corners=False)
    expected = (resized - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert x.shape == (2, 3, 5, 5)
    assert torch.equal(x, expected)


def test_text_pairs_are_scored_with_their_token_types():
    torch.manual_seed(2)
    model = tiny_bert(layers=1, labels=3).double()
    ids = torch.randint(1, 100, (3, 10))
    mask = torch.tensor([[1] * 6 + [0] * 4, [1] * 8 + [0] * 2, [1] * 5 + [0] * 5])
    types = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]]
    )
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = TextClassification().forward(model, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        without = TextClassification().forward(model, {"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(got, full, rtol=0, atol=FLOAT64_FORWARD)
    assert not torch.allclose(without, full), "the token types matter: dropping them changes the logits"


def test_make_task_builds_each_task_from_its_spec():
    from raylowcomm.catalog import TaskSpec
    from raylowcomm.tasks import CausalLM, ImageClassification, PromptClassification, make_task

    assert type(make_task(TaskSpec("text_classification"))) is TextClassification
    assert type(make_task(TaskSpec("prompt_classification"))) is PromptClassification
    assert type(make_task(TaskSpec("causal_lm"))) is CausalLM
    image = make_task(TaskSpec("image_classification", 20, (0.1, 0.2, 0.3), (1.0, 2.0, 3.0)), "cpu")
    assert type(image) is ImageClassification and image.image_size == 20 and image.uniform is None
