"""Tasks: a padded text batch cut to its longest row scores what the full-width batch scores."""

import torch
from transformers import BertConfig, BertForSequenceClassification

from raylowcomm.tasks import TextClassification, trim_padding


def tiny_bert(layers: int, labels: int) -> BertForSequenceClassification:
    """A small random BERT classifier in eval mode (the caller seeds torch first)."""
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=labels)
    return BertForSequenceClassification(config).eval()


def test_trimmed_padding_gives_the_full_width_logits():
    torch.manual_seed(0)
    model = tiny_bert(layers=2, labels=2)
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
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)  # equal up to float summation order


def test_text_is_scored_shortest_first_with_the_same_metrics():
    torch.manual_seed(1)
    model = tiny_bert(layers=1, labels=2)
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
    assert got["accuracy"] == expected["accuracy"]
    assert abs(got["loss"] - expected["loss"]) < 1e-6


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
    torch.testing.assert_close(fast, general)
    colour = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    x = make_task(TaskSpec("image_classification", 5, mean, std)).inputs({"pixels": colour})
    expected = (colour.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert x.shape == (2, 3, 5, 5)
    torch.testing.assert_close(
        x, torch.nn.functional.interpolate(expected, size=(5, 5), mode="bilinear", align_corners=False)
    )


def test_text_pairs_are_scored_with_their_token_types():
    torch.manual_seed(2)
    model = tiny_bert(layers=1, labels=3)
    ids = torch.randint(1, 100, (3, 10))
    mask = torch.tensor([[1] * 6 + [0] * 4, [1] * 8 + [0] * 2, [1] * 5 + [0] * 5])
    types = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]]
    )
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = TextClassification().forward(model, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        without = TextClassification().forward(model, {"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(without, full), "the token types matter: dropping them changes the logits"


def test_make_task_builds_each_task_from_its_spec():
    from raylowcomm.catalog import TaskSpec
    from raylowcomm.tasks import CausalLM, ImageClassification, PromptClassification, make_task

    assert type(make_task(TaskSpec("text_classification"))) is TextClassification
    assert type(make_task(TaskSpec("prompt_classification"))) is PromptClassification
    assert type(make_task(TaskSpec("causal_lm"))) is CausalLM
    image = make_task(TaskSpec("image_classification", 20, (0.1, 0.2, 0.3), (1.0, 2.0, 3.0)), "cpu")
    assert type(image) is ImageClassification and image.image_size == 20 and image.uniform is None
