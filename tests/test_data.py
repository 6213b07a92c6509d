import torch

from raylowcomm.common.batches import batch_at, epoch_permutation, shard_indices


def test_shards_are_disjoint_and_complete():
    for n, k in [(10, 3), (4000, 2), (101, 7)]:
        shards = shard_indices(n, k, seed=3)
        joined = torch.cat(shards)
        assert len(joined) == n
        assert torch.equal(joined.sort().values, torch.arange(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shards_depend_on_seed_only():
    assert all(torch.equal(a, b) for a, b in zip(shard_indices(50, 2, 1), shard_indices(50, 2, 1)))
    assert not all(torch.equal(a, b) for a, b in zip(shard_indices(50, 2, 1), shard_indices(50, 2, 2)))


def test_batch_at_is_a_pure_function_of_step():
    shard = {"x": torch.arange(20)}
    epoch0 = torch.cat([batch_at(shard, s, 5, seed=1)["x"] for s in range(4)])
    assert torch.equal(epoch0.sort().values, torch.arange(20))
    assert torch.equal(epoch0, epoch_permutation(20, 1, 0)), "an epoch's batches are its permutation, in order"
    assert torch.equal(batch_at(shard, 6, 5, seed=1)["x"], batch_at(shard, 6, 5, seed=1)["x"])
    assert not torch.equal(batch_at(shard, 0, 5, seed=1)["x"], batch_at(shard, 4, 5, seed=1)["x"])


def _padded_rows(lengths: list[int], width: int = 64) -> dict:
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return {"input_ids": mask * 7, "attention_mask": mask, "row": torch.arange(len(lengths))}


def test_length_grouped_batches_cover_the_epoch_cut_padding_and_line_up_across_nodes():
    gen = torch.Generator().manual_seed(0)
    shards = [_padded_rows(torch.randint(3, 64, (1000,), generator=gen).tolist()) for _ in range(2)]
    per_epoch, batch = 1000 // 16, 16

    def batches(shard, seed, group):
        return [batch_at(shard, s, batch, seed, group) for s in range(per_epoch)]

    plain, grouped = batches(shards[0], 1, None), batches(shards[0], 1, 5)
    rows = torch.cat([b["row"] for b in grouped])
    assert len(rows) == per_epoch * batch and len(set(rows.tolist())) == len(rows), "each row at most once an epoch"
    assert set(rows.tolist()) == set(torch.cat([b["row"] for b in plain]).tolist()), "the same rows as the plain epoch"

    def padded(bs):
        return sum(int(b["attention_mask"].sum(1).max()) * batch for b in bs)

    real = sum(int(b["attention_mask"].sum()) for b in grouped)
    assert real / padded(grouped) > 0.85 > 0.6 > real / padded(plain)
    # a resumed node sees the same batch; the second epoch is another order
    assert torch.equal(batch_at(shards[0], 70, batch, 1, 5)["row"], batch_at(shards[0], 70, batch, 1, 5)["row"])
    assert not torch.equal(batch_at(shards[0], 70, batch, 1, 5)["row"], grouped[70 - per_epoch]["row"])
    # nodes share the group seed: at each step their batches have similar lengths (DDP waits for the longest)
    other = batches(shards[1], 2, 5)
    ddp_padded = sum(
        2 * batch * max(int(a["attention_mask"].sum(1).max()), int(b["attention_mask"].sum(1).max()))
        for a, b in zip(grouped, other)
    )
    both_real = real + sum(int(b["attention_mask"].sum()) for b in other)
    assert both_real / ddp_padded > 0.8
    # rows without padding (images, packed text) keep the plain order
    rows = {"x": torch.arange(40)}
    assert torch.equal(batch_at(rows, 3, 8, 1, 5)["x"], batch_at(rows, 3, 8, 1)["x"])


def test_split_rule_parts_are_disjoint_and_too_few_examples_name_the_field():
    import pytest

    from raylowcomm.config import ConfigError
    from raylowcomm.data import SplitRule

    parts = SplitRule(shuffle_seed=5, test_size=10, val_size=5, train_size=20).parts(50)
    assert [len(parts[k]) for k in ("test", "val", "train")] == [10, 5, 20]
    assert len(set(torch.cat(list(parts.values())).tolist())) == 35
    whole = SplitRule(5, 10, 5, None).parts(50)["train"]
    assert torch.equal(parts["train"], whole[:20]), "train_size cuts the same order"
    with pytest.raises(ConfigError) as err:
        SplitRule(5, 10, 5, 40).parts(50)
    assert err.value.field_name == "data.train_size"


def test_labels_sort_as_numbers_or_names():
    from raylowcomm.data import sorted_labels

    assert sorted_labels([10, 2, 1, 2]) == ["1", "2", "10"]
    assert sorted_labels(["pos", "neg", "pos"]) == ["neg", "pos"]


def test_pixels_stay_uint8_and_stack_across_formats():
    import numpy as np
    from PIL import Image

    from raylowcomm.data import pixels

    flat = " ".join(str(v) for v in range(16))
    assert torch.equal(pixels([flat], 32), torch.arange(16, dtype=torch.uint8).view(1, 4, 4))
    grey, colour = Image.new("L", (6, 6), 200), Image.new("RGB", (9, 9), (10, 20, 30))
    mixed = pixels([grey, colour], 8)
    assert mixed.dtype == torch.uint8 and mixed.shape == (2, 3, 8, 8), (
        "a colour image makes every image RGB; sizes differ: resized"
    )
    assert mixed[0].unique().tolist() == [200] and mixed[1, :, 0, 0].tolist() == [10, 20, 30]
    assert pixels([np.zeros((5, 5, 1), np.uint8)], 8).shape == (1, 5, 5)


def test_empty_cells_are_found_in_the_arrow_data_and_refused_by_every_reader():
    """None (a CSV, JSON or Parquet null), NaN, a blank label and a ClassLabel's -1 are empty; an
    empty string is text (a blank line of a text file), a 0 label is a label."""
    import pytest
    from datasets import ClassLabel, Dataset, Features, Value

    from raylowcomm.data.rows import Encoder, UnreadableValue, _texts, first_empty, pixels

    features = Features(
        {
            "text": Value("string"),
            "score": Value("float64"),
            "word": Value("string"),
            "id": Value("int64"),
            "class": ClassLabel(names=["a", "b"]),
        }
    )
    ds = Dataset.from_dict(
        {
            "text": ["a", "", None],
            "score": [0.0, 1.0, float("nan")],
            "word": ["x", " ", "y"],
            "id": [0, 1, 2],
            "class": [1, 0, -1],
        },
        features=features,
    )
    assert first_empty(ds, "text", label=False) == 2 and first_empty(ds, "text", label=True) == 1
    assert first_empty(ds, "score", label=True) == 2
    assert first_empty(ds, "word", label=False) is None and first_empty(ds, "word", label=True) == 1
    assert first_empty(ds, "id", label=True) is None and first_empty(ds, "class", label=True) == 2
    assert first_empty(ds.select([1, 0]), "text", label=True) == 0, "rows as the split numbers them"
    encoder = Encoder("text_classification", ("a", "b"))
    for read, values, role in [
        (_texts, ["a", None], "text"),
        (_texts, ["a", float("nan")], "text"),
        (lambda v: pixels(v, 4), [" ".join(["1"] * 16), None], "image"),
        (lambda v: encoder.labels(v, None, "data.classes"), ["a", " "], "label"),
    ]:
        with pytest.raises(UnreadableValue) as err:
            read(values)
        assert (err.value.role, err.value.position, err.value.reason) == (role, 1, "its cell is empty")
    assert encoder.labels([1, 0], ds.features["class"], "x").tolist() == [1, 0]
    with pytest.raises(UnreadableValue):
        encoder.labels([1, -1], ds.features["class"], "x")


def test_shift_size_scores_a_fixed_sample_of_each_shift_set():
    from raylowcomm.data import prepare_data
    from raylowcomm.strategies import from_dict

    def shift(size):
        data = {"name": "mnist", "train_size": 64, "test_size": 32, "shift_size": size}
        cfg = from_dict({"model": {"family": "timm"}, "data": data})
        return prepare_data(cfg).eval_sets["shift/uci_digits"]

    full, a, b = shift(None), shift(100), shift(100)
    assert len(full["labels"]) == 1797 and len(a["labels"]) == 100
    assert all(torch.equal(a[k], b[k]) for k in a), "the sample is fixed"
    rows = {tuple(r.flatten().tolist()) for r in full["pixels"]}
    assert all(tuple(r.flatten().tolist()) in rows for r in a["pixels"])
