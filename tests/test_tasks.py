"""Tasks: a padded text batch cut to its longest row scores what the full-width batch scores."""

import torch
from transformers import BertConfig, BertForSequenceClassification

from raylowcomm.tasks import TextClassification, trim_padding


def test_trimmed_padding_gives_the_full_width_logits():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, max_position_embeddings=64, num_labels=2)).eval()
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
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                     intermediate_size=64, max_position_embeddings=64, num_labels=2)).eval()
    n, width = 40, 24
    lengths = torch.randint(2, width, (n,))
    mask = (torch.arange(width) < lengths[:, None]).long()
    split = {"input_ids": torch.randint(1, 100, (n, width)) * mask, "attention_mask": mask, "labels": torch.randint(0, 2, (n,))}
    task = TextClassification()
    with torch.no_grad():
        logits = model(input_ids=split["input_ids"], attention_mask=mask).logits
    expected = task.summarize(task.sums(logits, split["labels"]))
    got = task.evaluate(model, split, batch_size=8)
    assert got["accuracy"] == expected["accuracy"]
    assert abs(got["loss"] - expected["loss"]) < 1e-6
