"""Your own data through the real `datasets` loaders: every source kind, labels mapped by name the
same way everywhere, clear errors naming the field, training data that each node loads itself,
and the bundled presets giving exactly the tensors the driver-side loader gave before."""

import csv
import hashlib
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from raylowcomm import assets
from raylowcomm.common.batches import num_examples, take
from raylowcomm.config import ConfigError, RunConfig, build_dataclass, validate
from raylowcomm.data import describe_data, prepare_data
from raylowcomm.models import image_preprocessing
from raylowcomm.tasks import make_task

LABELS = ["pos", "neg", "meh"]


def config(**data) -> RunConfig:
    raw = {
        "model": {"family": data.pop("family", "hf_classifier")},
        "nodes": {"count": data.pop("nodes", 2)},
        "data": data,
    }
    cfg = build_dataclass(RunConfig, raw, "")
    validate(cfg, fp32_updating=cfg.strategies)  # lofi and ddp by default: both step every weight
    return cfg


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets.require("all-MiniLM-L6-v2")))


@pytest.fixture(scope="module")
def causal_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.require("SmolLM2-135M")))
    tok.pad_token = tok.eos_token
    return tok


def reviews(n: int, offset: int = 0) -> list[dict]:
    """Rows whose text says their label, so a decoded example shows whether its label travelled with it."""
    return [{"review": f"review {i} says {LABELS[i % 3]}", "stars": LABELS[i % 3]} for i in range(offset, offset + n)]


def write(path, rows: list[dict]):
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def decoded(split, tokenizer, classes) -> list[tuple[str, str]]:
    """(text, label name) of every example of a text split."""
    texts = tokenizer.batch_decode(split["input_ids"], skip_special_tokens=True)
    return [(t, classes[int(y)]) for t, y in zip(texts, split["labels"])]


def assert_labels_follow_rows(split, tokenizer, classes):
    pairs = decoded(split, tokenizer, classes)
    assert pairs and all(text.endswith(label) for text, label in pairs), pairs[:3]


@pytest.mark.parametrize(
    "suffix,source", [(".csv", "csv"), (".jsonl", "json"), (".parquet", "parquet"), (".csv", "folder")]
)
def test_labelled_text_from_each_file_kind(tmp_path, tokenizer, suffix, source):
    (tmp_path / "folder").mkdir()
    path = write(tmp_path / "folder" / f"reviews{suffix}", reviews(60))
    where = {"source": str(tmp_path / "folder")} if source == "folder" else {"source": source, "files": str(path)}
    cfg = config(
        name="mine", **where, columns={"text": "review", "label": "stars"}, test_size=12, val_size=6, shift="none"
    )
    prepared = prepare_data(cfg, tokenizer)
    assert prepared.classes == ["meh", "neg", "pos"], "string labels: sorted distinct names"
    train = prepared.train.load_all()
    assert [num_examples(prepared.eval_sets[k]) for k in ("test", "val")] + [num_examples(train)] == [12, 6, 42]
    for split in (prepared.eval_sets["test"], prepared.eval_sets["val"], train):
        assert_labels_follow_rows(split, tokenizer, prepared.classes)
    texts = {
        t
        for s in (prepared.eval_sets["test"], prepared.eval_sets["val"], train)
        for t, _ in decoded(s, tokenizer, prepared.classes)
    }
    assert texts == {r["review"] for r in reviews(60)}, "every row lands in exactly one split"


def test_text_pairs_keep_which_text_each_token_is(tmp_path, tokenizer):
    rows = [{"premise": f"a cat sat {i}", "hypothesis": f"an animal sat {i}", "label": i % 2} for i in range(20)]
    cfg = config(
        name="pairs",
        source="csv",
        files=str(write(tmp_path / "pairs.csv", rows)),
        columns={"text": "premise", "text_pair": "hypothesis"},
        test_size=4,
        shift="none",
    )
    split = prepare_data(cfg, tokenizer).eval_sets["test"]
    assert "token_type_ids" in split and split["token_type_ids"].max() == 1
    first = tokenizer.decode(split["input_ids"][0], skip_special_tokens=False)
    assert first.count("[SEP]") == 2 and "animal" in first.split("[SEP]")[1]


def test_language_modelling_on_a_text_file_and_a_text_column(tmp_path, causal_tokenizer):
    lines = [f"line {i} of a long poem about the sea" for i in range(200)]
    (tmp_path / "poem.txt").write_text("\n".join(lines) + "\n")
    write(tmp_path / "poem.csv", [{"body": line} for line in lines])
    by_file = prepare_data(
        config(
            name="poem",
            source="text",
            files=str(tmp_path / "poem.txt"),
            family="hf_causal_lm",
            max_length=16,
            test_size=10,
            shift="none",
        ),
        causal_tokenizer,
    )
    by_column = prepare_data(
        config(
            name="poem",
            source="csv",
            files=str(tmp_path / "poem.csv"),
            columns={"text": "body"},
            family="hf_causal_lm",
            max_length=16,
            test_size=10,
            shift="none",
        ),
        causal_tokenizer,
    )
    assert by_file.task.name == "causal_lm" and by_file.classes is None
    for prepared in (by_file, by_column):
        blocks = torch.cat([prepared.eval_sets["test"]["input_ids"], prepared.train.load_all()["input_ids"]])
        assert blocks.shape[1] == 16
        assert len(causal_tokenizer("\n".join(lines))["input_ids"]) // 16 == len(blocks)
    assert torch.equal(by_file.eval_sets["test"]["input_ids"], by_column.eval_sets["test"]["input_ids"])


def digit_images(root, grey: bool = True, sizes=(8,)):
    """Real digits (UCI, scikit-learn) as PNG class folders, train/ and test/."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    names = ["zero", "one", "two"]
    written = {}
    for i in range(60):
        label = int(digits.target[i]) % 3
        pixels = np.round(digits.images[i] * (255 / 16)).astype(np.uint8)
        image = Image.fromarray(pixels) if grey else Image.fromarray(np.stack([pixels, 255 - pixels, pixels // 2], -1))
        image = image.resize((sizes[i % len(sizes)],) * 2)
        folder = root / ("test" if i % 5 == 0 else "train") / names[label]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i}.png")
        written[i] = (names[label], np.asarray(image))
    return written


def test_imagefolder_of_real_digits_keeps_pixels_and_class_names(tmp_path):
    written = digit_images(tmp_path / "digits")
    cfg = config(
        name="digits", source="imagefolder", files=str(tmp_path / "digits"), family="timm", test_size=5, shift="none"
    )
    prepared = prepare_data(cfg, None, {"input_size": (3, 224, 224), "mean": (0.5,) * 3, "std": (0.5,) * 3})
    assert prepared.classes == ["one", "two", "zero"], "ClassLabel names, in the dataset's order"
    test = prepared.eval_sets["test"]
    assert num_examples(test) == 12, "the folder's own test/ split is the test set"
    assert test["pixels"].dtype == torch.uint8 and test["pixels"].shape[1:] == (8, 8), (
        "grey digits cross the network as uint8"
    )
    expected = {(name, arr.tobytes()) for i, (name, arr) in written.items() if i % 5 == 0}
    got = {(prepared.classes[int(y)], x.numpy().tobytes()) for x, y in zip(test["pixels"], test["labels"])}
    assert got == expected
    assert num_examples(prepared.train.load_all()) == 48


def test_colour_images_of_mixed_sizes_become_normalised_rgb(tmp_path):
    digit_images(tmp_path / "digits", grey=False, sizes=(8, 12))
    cfg = config(
        name="digits",
        source="imagefolder",
        files=str(tmp_path / "digits"),
        family="timm",
        test_size=5,
        shift="none",
        image_size=None,
    )
    imagenet = {"input_size": (3, 20, 20), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    prepared = prepare_data(cfg, None, imagenet)
    test = prepared.eval_sets["test"]
    assert test["pixels"].shape[1:] == (3, 20, 20), "mixed sizes resized to the model's input size to stack"
    x = make_task(prepared.task).inputs(test)
    assert x.shape[1:] == (3, 20, 20)
    # Means in float64 (error ≤ (n−1)·2^-53·Σ|x|/n, n = 2000: below 1e-12 here). Each x is float32's
    # ((p/255) − mean)/std, three roundings of unit roundoff u = 2^-24 with |p/255| ≤ 1 and |p/255 − mean| ≤ 1:
    # |x − exact| ≤ (u + u + u·(1 + u))/std < 4u/std per element (resizing to the same size copies), and so
    # for the mean; the float32 mean and std the task holds are the reference's too.
    mean, std = torch.tensor(imagenet["mean"]), torch.tensor(imagenet["std"])
    channel_means = x.double().mean((0, 2, 3))
    raw = test["pixels"].double().div(255).mean((0, 2, 3))
    normalised = (raw - mean.double()) / std.double()
    assert ((channel_means - normalised).abs() <= 4 * 2.0**-24 / std.double() + 1e-12).all()


def test_save_to_disk_folder_with_classlabel_and_test_split(tmp_path, tokenizer):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["sad", "glad"])})

    def part(lo, hi):
        return Dataset.from_dict(
            {
                "sentence": [f"i am {'glad' if i % 2 else 'sad'} {i}" for i in range(lo, hi)],
                "label": [i % 2 for i in range(lo, hi)],
            },
            features=features,
        )

    DatasetDict({"train": part(0, 30), "test": part(30, 40)}).save_to_disk(str(tmp_path / "saved"))
    prepared = prepare_data(config(name="saved", source=str(tmp_path / "saved"), shift="none", test_size=3), tokenizer)
    assert prepared.classes == ["sad", "glad"]
    assert num_examples(prepared.eval_sets["test"]) == 10 and num_examples(prepared.train.load_all()) == 30
    for split in (prepared.eval_sets["test"], prepared.train.load_all()):
        assert all(f"{label} " in text for text, label in decoded(split, tokenizer, prepared.classes))


def shifted(tmp_path, labels, name="other.csv"):
    rows = [
        {"words": f"elsewhere {i} says {labels[i % len(labels)]}", "verdict": labels[i % len(labels)]}
        for i in range(12)
    ]
    return write(tmp_path / name, rows)


def node_config(tmp_path, **extra):
    for k, (lo, n) in enumerate([(0, 30), (30, 24)]):
        rows = [r for r in reviews(n, lo) if k == 0 or r["stars"] != "meh"]  # node 1 never sees "meh"
        write(tmp_path / f"node_{k}.csv", rows)
    write(tmp_path / "eval.csv", reviews(15, 100))
    data = {
        "name": "mine",
        "source": "csv",
        "files": str(tmp_path / "eval.csv"),
        "node_files": str(tmp_path / "node_{node}.csv"),
        "columns": {"text": "review", "label": "stars"},
        "test_size": 9,
        "val_size": 3,
        **extra,
    }
    return config(**data)


def test_labels_map_by_name_on_every_node_and_in_every_shift_set(tmp_path, tokenizer):
    columns = {"text": "words", "label": "verdict"}
    shift = {
        "flipped": {"files": str(shifted(tmp_path, ["neg", "pos"])), "columns": columns},
        "subset": {"files": str(shifted(tmp_path, ["meh"], "meh.csv")), "columns": columns},
    }
    prepared = prepare_data(node_config(tmp_path, shift=shift), tokenizer)
    classes = prepared.classes
    assert classes == ["meh", "neg", "pos"]
    assert set(prepared.eval_sets) == {"test", "val", "shift/flipped", "shift/subset"}
    for name in ("shift/flipped", "shift/subset"):
        assert_labels_follow_rows(prepared.eval_sets[name], tokenizer, classes)
    assert set(prepared.eval_sets["shift/subset"]["labels"].tolist()) == {classes.index("meh")}
    for k in range(2):
        shard = prepared.train.load(k, 2)
        assert_labels_follow_rows(shard, tokenizer, classes)
        assert classes.index("pos") in shard["labels"].tolist(), (
            "'pos' has one index on both nodes, whatever each node holds"
        )


def test_a_shift_label_that_is_not_a_training_class_is_named(tmp_path, tokenizer):
    shift = {
        "stars": {
            "source": "csv",
            "files": str(shifted(tmp_path, ["pos", "five stars", "zero stars"])),
            "columns": {"text": "words", "label": "verdict"},
        }
    }
    with pytest.raises(ConfigError) as err:
        describe_data(node_config(tmp_path, shift=shift))
    assert err.value.field_name == "data.shift.stars"
    assert "five stars" in str(err.value) and "zero stars" in str(err.value)
    assert "'pos'" not in str(err.value).split("invalid")[0]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"columns": {"text": "reviw", "label": "stars"}}, "data.columns.text"),
        ({"columns": {"text": "review", "label": "star"}}, "data.columns.label"),
        ({"files": "no/such/file.csv"}, "data.files"),
        ({"files": {"train": "reviews.csv", "test": "missing_*.csv"}}, "data.files"),
        ({"source": "./no_such_folder", "files": None}, "data.source"),
        (
            {"shift": {"other": {"files": "other.csv", "columns": {"text": "words", "label": "verdct"}}}},
            "data.shift.other.columns.label",
        ),
        ({"shift": {"other": {"files": "gone.csv"}}}, "data.shift.other.files"),
        ({"columns": {"txt": "review"}}, "data.columns.txt"),
        ({"split": "validation"}, "data.split"),
        ({"node_files": ["node_0.csv", "gone.csv"], "files": "reviews.csv"}, "data.node_files[1]"),
        ({"node_files": ["node_0.csv"], "files": "reviews.csv"}, "data.node_files"),
        ({"node_files": "node.csv"}, "data.node_files"),
        ({"family": "hf_causal_lm", "label_words": [" good"]}, "data.label_words"),
        ({"family": "hf_causal_lm"}, "data.label_words"),
        ({"family": "timm"}, "model.family"),
        ({"files": None, "node_files": "node_{node}.csv"}, "data.files"),
        ({"node_files": "node_{node}.csv", "train_size": 5}, "data.train_size"),
        ({"source": "nobody/no-such-dataset", "files": None}, "data.source"),  # a hub id, offline in tests
    ],
)
def test_bad_data_input_names_the_field_before_anything_starts(tmp_path, monkeypatch, change, field):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "reviews.csv", reviews(30))
    write(tmp_path / "node_0.csv", reviews(10))
    shifted(tmp_path, ["pos", "neg"])
    data = {
        "name": "mine",
        "source": "csv",
        "files": "reviews.csv",
        "columns": {"text": "review", "label": "stars"},
        "test_size": 5,
        "shift": "none",
        **change,
    }
    with pytest.raises(ConfigError) as err:
        describe_data(config(**data))
    assert err.value.field_name == field, str(err.value)


def test_an_unreadable_value_names_its_column_and_row(tmp_path, tokenizer):
    """A stray letter among pixels, a corrupt image file, a number where text belongs: a ConfigError
    naming the column and the row, whether the driver (test rows) or a node (training rows) reads it."""
    grey = {"input_size": (3, 4, 4), "mean": (0.5,) * 3, "std": (0.5,) * 3}

    def failure(cfg, image_cfg=None, node=None):
        with pytest.raises(ConfigError) as err:
            train = prepare_data(cfg, tokenizer if image_cfg is None else None, image_cfg).train
            train.load(node, 2) if node is not None else train.load_all()
        return err.value

    rows = [{"pixels": " ".join(["7"] * 16), "digit": i % 2} for i in range(20)]
    rows[13]["pixels"] = "7 7 x 7"
    write(tmp_path / "flat.csv", rows)
    err = failure(
        config(
            name="flat",
            source="csv",
            files=str(tmp_path / "flat.csv"),
            family="timm",
            image_size=4,
            columns={"image": "pixels", "label": "digit"},
            test_size=4,
            shift="none",
        ),
        grey,
    )
    assert err.field_name == "data.columns.image" and "row 13 of data.files" in str(err) and "'x'" in str(err), str(err)

    digit_images(tmp_path / "digits")
    (tmp_path / "digits" / "train" / "one" / "1.png").write_bytes(b"not a png")
    err = failure(
        config(
            name="digits",
            source="imagefolder",
            files=str(tmp_path / "digits"),
            family="timm",
            test_size=5,
            shift="none",
        ),
        grey,
    )
    assert err.field_name == "data.columns.image" and "is unreadable as an image" in str(err), str(err)

    write(tmp_path / "counted.csv", [{"review": len(r["review"]), "stars": r["stars"]} for r in reviews(30)])
    err = failure(
        config(
            name="mine",
            source="csv",
            files=str(tmp_path / "counted.csv"),
            test_size=5,
            shift="none",
            columns={"text": "review", "label": "stars"},
        )
    )
    assert err.field_name == "data.columns.text" and "int" in str(err) and "is not text" in str(err), str(err)

    odd = write(tmp_path / "odd.jsonl", [{"words": i, "verdict": "pos"} for i in range(4)])
    shifts = {"odd": {"source": "json", "files": str(odd), "columns": {"text": "words", "label": "verdict"}}}
    err = failure(node_config(tmp_path, shift=shifts))
    assert err.field_name == "data.shift.odd.columns.text" and "row 0 of data.shift.odd.files" in str(err), str(err)

    cfg = node_config(tmp_path)
    # written after the driver's checks
    write(tmp_path / "node_1.csv", [{"review": i, "stars": "pos"} for i in range(8)])
    err = failure(cfg, node=1)
    assert err.field_name == "data.columns.text" and "row 0 of data.node_files[1]" in str(err), str(err)


def test_an_empty_cell_only_a_node_can_read_is_named_with_its_file_and_row(tmp_path, tokenizer):
    """Node files the driver cannot read: the node meets the empty cell itself and raises the error
    naming the column, its file and the row (the strategy's one-line error), for its training rows
    and its held-out rows alike; an empty label never becomes a class."""
    from raylowcomm.data import SplitRule

    cfg = config(
        name="remote",
        source="csv",
        node_files=str(tmp_path / "far_{node}.csv"),
        node_files_on_driver=False,
        eval_on_nodes=True,
        columns={"text": "review", "label": "stars"},
        classes=LABELS,
        test_size=4,
        shift="none",
    )
    train = pickle.loads(pickle.dumps(prepare_data(cfg, tokenizer).train))
    parts = SplitRule(cfg.data.shuffle_seed, 4, 0, None).parts(20)
    trained, held = int(parts["train"][5]), int(parts["test"][1])
    rows = reviews(20)
    rows[trained]["stars"], rows[held]["review"] = "", ""
    write(tmp_path / "far_1.csv", rows)
    for load, role, row in ((train.load, "label", trained), (train.load_holdout, "text", held)):
        with pytest.raises(ConfigError) as err:
            load(1, 2)
        assert err.value.field_name == f"data.columns.{role}", str(err.value)
        assert f"row {row} of data.node_files[1] ({tmp_path / 'far_1.csv'})" in str(err.value)
        assert "its cell is empty" in str(err.value)


def test_node_files_load_on_the_node_only_and_the_recipe_holds_no_rows(tmp_path, tokenizer):
    cfg = node_config(tmp_path)
    prepared = prepare_data(cfg, tokenizer)
    blob = pickle.dumps(prepared.train)
    assert b"review 3 says" not in blob and b"review 40" not in blob, "no training text in what travels to the nodes"
    assert prepared.train.sizes(2) is None, "only a node knows its own size"
    for k, lo in ((0, 0), (1, 30)):
        node_texts = [t for t, _ in decoded(prepared.train.load(k, 2), tokenizer, prepared.classes)]
        own = [r["review"] for r in reviews(30 if k == 0 else 24, lo) if k == 0 or r["stars"] != "meh"]
        assert node_texts == own, f"node {k} trains on its own file, all of it, in order"
    tested = {t for t, _ in decoded(prepared.eval_sets["test"], tokenizer, prepared.classes)}
    assert tested <= {r["review"] for r in reviews(15, 100)}


def test_the_driver_never_opens_node_files_it_is_told_are_remote(tmp_path, tokenizer):
    """Node files that do not exist on the driver: prepare works from the config alone; a node
    (here: later, once its file exists) loads and holds out its own rows."""
    cfg = config(
        name="remote",
        source="csv",
        node_files=str(tmp_path / "far_{node}.csv"),
        node_files_on_driver=False,
        eval_on_nodes=True,
        columns={"text": "review", "label": "stars"},
        classes=LABELS,
        test_size=4,
        shift="none",
    )
    prepared = prepare_data(cfg, tokenizer)
    assert prepared.eval_sets == {} and prepared.classes == LABELS
    blob = pickle.dumps(prepared.train)
    write(tmp_path / "far_1.csv", reviews(20, 500))
    train = pickle.loads(blob)
    held, own = train.load_holdout(1, 2), train.load(1, 2)
    assert num_examples(held) == 4 and num_examples(own) == 16
    texts = [t for s in (held, own) for t, _ in decoded(s, tokenizer, LABELS)]
    assert sorted(texts) == sorted(r["review"] for r in reviews(20, 500)), (
        "held-out and training rows split the node's file"
    )
    assert_labels_follow_rows(own, tokenizer, LABELS)


def test_the_driver_needs_classes_when_it_can_read_no_labels(tmp_path):
    cfg = config(
        name="remote",
        source="csv",
        node_files=str(tmp_path / "far_{node}.csv"),
        node_files_on_driver=False,
        eval_on_nodes=True,
        columns={"text": "review", "label": "stars"},
        shift="none",
    )
    with pytest.raises(ConfigError) as err:
        describe_data(cfg)
    assert err.value.field_name == "data.classes"


def test_shared_source_shards_are_disjoint_and_make_the_train_split(tmp_path, tokenizer):
    write(tmp_path / "reviews.csv", reviews(101))
    cfg = config(
        name="mine",
        source="csv",
        files=str(tmp_path / "reviews.csv"),
        columns={"text": "review", "label": "stars"},
        test_size=10,
        val_size=5,
        shift="none",
        eval_on_nodes=False,
    )
    prepared = prepare_data(cfg, tokenizer)
    everything = decoded(prepared.train.load_all(), tokenizer, prepared.classes)
    for count in (1, 3, 4):
        shards = [decoded(prepared.train.load(k, count), tokenizer, prepared.classes) for k in range(count)]
        assert [len(s) for s in shards] == prepared.train.sizes(count)
        joined = [row for shard in shards for row in shard]
        assert len(joined) == len(set(joined)) == len(everything) == 86 and set(joined) == set(everything)
    assert b"review 7 says" not in pickle.dumps(prepared.train)


def test_eval_on_nodes_with_a_shared_source_shards_the_test_rows(tmp_path, tokenizer):
    write(tmp_path / "reviews.csv", reviews(60))
    base = {
        "name": "mine",
        "source": "csv",
        "files": str(tmp_path / "reviews.csv"),
        "columns": {"text": "review", "label": "stars"},
        "test_size": 9,
        "shift": "none",
    }
    central = prepare_data(config(**base), tokenizer)
    on_nodes = prepare_data(config(**base, eval_on_nodes=True), tokenizer)
    assert "test" not in on_nodes.eval_sets
    held = [decoded(on_nodes.train.load_holdout(k, 2), tokenizer, on_nodes.classes) for k in range(2)]
    assert sorted(held[0] + held[1]) == sorted(decoded(central.eval_sets["test"], tokenizer, central.classes))
    assert not set(held[0]) & set(held[1])


def test_shards_load_inside_ray_workers(ray_session, tmp_path, tokenizer):
    """The recipe crosses to another process and reads the same rows there."""
    write(tmp_path / "reviews.csv", reviews(40))
    cfg = config(
        name="mine",
        source="csv",
        files=str(tmp_path / "reviews.csv"),
        columns={"text": "review", "label": "stars"},
        test_size=8,
        shift="none",
    )
    prepared = prepare_data(cfg, tokenizer)
    load = ray_session.remote(lambda train, k: train.load(k, 2))
    remote = ray_session.get([load.remote(prepared.train, k) for k in range(2)])
    for k in range(2):
        local = prepared.train.load(k, 2)
        assert all(torch.equal(remote[k][key], local[key]) for key in local)


# --- presets: exactly the tensors of the loader before nodes loaded their own data -------------


def fingerprint(split) -> str:
    """sha256 of a Split's tensors, text cut to its longest row (padding width is not content)."""
    h = hashlib.sha256()
    width = int(split["attention_mask"].sum(1).max()) if "attention_mask" in split else None
    for key in sorted(split):
        t = split[key]
        if width is not None and key in ("input_ids", "attention_mask", "token_type_ids"):
            t = t[:, :width]
        t = t.contiguous()
        h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


OLD = {  # recorded from raylowcomm/data.py's load_datasets + RunContext.shards before this change (seed 0, 2 nodes)
    "mnist": {
        "test": "38431593bb354cb8",
        "val": "6e1b0cde9bd223c3",
        "shift/uci_digits": "5e9d65d737a637b5",
        "train": "08c9656ae48e4514",
        "shards": ["5e20849724a17209", "550a480c96305825"],
    },
    "rotten_tomatoes": {
        "test": "9eda3e8b1b500e60",
        "val": "b85d8cc9206bb3e2",
        "train": "1db96ac322b0ad83",
        "shards": ["5f6ceeddd0c84d7a", "7d062c7540d3ad10"],
    },
}


@pytest.mark.parametrize(
    "preset,data,family",
    [
        ("mnist", {"train_size": 512, "test_size": 200, "val_size": 100, "image_size": 16}, "timm"),
        ("rotten_tomatoes", {"train_size": 2000, "test_size": 500, "val_size": 100, "shift": "none"}, "hf_classifier"),
    ],
)
def test_presets_give_the_old_eval_sets_and_shards(tokenizer, preset, data, family):
    prepared = prepare_data(config(name=preset, family=family, **data), tokenizer if family != "timm" else None)
    old = OLD[preset]
    assert {k: fingerprint(v) for k, v in prepared.eval_sets.items()} == {
        k: v for k, v in old.items() if k not in ("train", "shards")
    }
    assert fingerprint(prepared.train.load_all()) == old["train"]
    assert [fingerprint(prepared.train.load(k, 2)) for k in range(2)] == old["shards"]


def test_mnist_reaches_the_model_exactly_as_before():
    import timm

    model = timm.create_model("tf_efficientnet_lite0", pretrained=False, num_classes=10)
    pre = image_preprocessing(model)
    assert pre["mean"] == pre["std"] == (0.5, 0.5, 0.5)
    prepared = prepare_data(config(name="mnist", family="timm"), None, pre)
    assert prepared.task.image_size == 32, "data.image_size (32) still sets the size"
    batch = take(prepared.train.load(0, 1), torch.arange(32))
    assert hashlib.sha256(batch["pixels"].numpy().tobytes()).hexdigest()[:16] == "b83a577f906f2a4c"  # the old batch
    # and the old task's arithmetic on it, computed here: a hash of the floats holds one CPU's kernels' bits (the
    # old 08829105b50f9dc9 with ATen's AVX2 and AVX-512 kernels; its bilinear resizing rounds otherwise without)
    resized = torch.nn.functional.interpolate(
        batch["pixels"].float().unsqueeze(1) / 255, size=(32, 32), mode="bilinear", align_corners=False
    )
    assert torch.equal(make_task(prepared.task).inputs(batch), ((resized - 0.5) / 0.5).expand(-1, 3, -1, -1))
    assert set(prepared.eval_sets) == {"test", "shift/uci_digits"}
    assert len(pickle.dumps(prepared.train)) < 5_000, "the recipe for 4,000 training images is a few hundred bytes"


def test_rotten_tomatoes_gets_the_amazon_reviews_shift(tokenizer, causal_tokenizer):
    prepared = prepare_data(config(name="rotten_tomatoes", test_size=50, train_size=100), tokenizer)
    amazon = prepared.eval_sets["shift/amazon_reviews"]
    assert num_examples(amazon) == 2985 and int(amazon["labels"].sum()) == 1750, (
        "1,750 positive (fresh) / 1,235 negative"
    )
    prompted = prepare_data(
        config(name="rotten_tomatoes", family="hf_causal_lm", test_size=50, train_size=100), causal_tokenizer
    )
    row = prompted.eval_sets["test"]
    words = [causal_tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" terrible", " great")]
    assert row["choice_ids"][0].tolist() == words
    template = causal_tokenizer(" It was", add_special_tokens=False)["input_ids"]
    last = int(row["attention_mask"][0].sum())
    assert row["input_ids"][0, last - len(template) : last].tolist() == template, "the default prompt is kept"


def test_a_user_prompt_and_label_words(tmp_path, causal_tokenizer):
    write(tmp_path / "reviews.csv", reviews(30))
    cfg = config(
        name="mine",
        source="csv",
        files=str(tmp_path / "reviews.csv"),
        columns={"text": "review", "label": "stars"},
        family="hf_causal_lm",
        template=" Verdict:",
        label_words=[" so", " bad", " good"],
        test_size=6,
        shift="none",
    )
    prepared = prepare_data(cfg, causal_tokenizer)
    assert prepared.task.name == "prompt_classification" and prepared.plan.num_classes is None, (
        "the LM keeps its own head"
    )
    test = prepared.eval_sets["test"]
    last = int(test["attention_mask"][0].sum())
    assert causal_tokenizer.decode(test["input_ids"][0, :last]).endswith(" Verdict:")
    with pytest.raises(ConfigError) as err:
        prepare_data(
            config(
                **{
                    **cfg.data.__dict__,
                    "label_words": [" so", " bad", " xqzzyv"],
                    "family": "hf_causal_lm",
                    "shift": "none",
                }
            ),
            causal_tokenizer,
        )
    assert err.value.field_name == "data.label_words"


def test_a_bundled_shift_set_that_cannot_be_fetched_is_skipped_with_a_warning(tokenizer, monkeypatch, caplog):
    real = assets.require

    def offline(name):
        if name == "amazon_reviews":
            raise assets.AssetError("no package index here")
        return real(name)

    monkeypatch.setattr(assets, "require", offline)
    prepared = prepare_data(config(name="rotten_tomatoes", test_size=20, train_size=40), tokenizer)
    assert set(prepared.eval_sets) == {"test"}
    assert "amazon_reviews skipped" in caplog.text
