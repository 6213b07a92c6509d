"""Your own model, data and task, end to end: a CSV whose columns are not called text / label
and whose labels are strings, and a folder of PNGs, through `runner.run` with every strategy the
model family allows; training data that never leaves its node (data.node_files); string labels
numbered the same way on every node and in every shift set; and bad input stopped by the CLI
with one `error:` line naming the field before Ray starts.

The data are real: Rotten Tomatoes reviews, Amazon review snippets, MNIST and UCI digits from the
bundled assets (raylowcomm.assets), written as the files a user would bring."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from raylowcomm import assets, runner
from raylowcomm.common.batches import num_examples
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import ConfigError
from raylowcomm.data import SourceSpec, TrainSource, prepare_data
from raylowcomm.strategies import from_dict

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = {"1": "fresh", "0": "rotten"}


# --- the user's files, made from the bundled assets ---------------------------------------------


def read_asset(name: str) -> list[dict]:
    with open(assets.require(name), newline="") as f:
        return list(csv.DictReader(f))


def reviews(start: int, n: int, marker: str = "") -> list[dict]:
    """Rotten Tomatoes rows as a user's CSV: columns review / verdict, labels fresh / rotten; each
    text starts with its label (and `marker`), so a decoded example shows the label it was given."""
    rows = read_asset("rotten_tomatoes")[start : start + n]
    return [
        {"review": f"{marker}{VERDICTS[r['label']]} says: {r['text']}", "verdict": VERDICTS[r["label"]]} for r in rows
    ]


def snippets(n: int) -> list[dict]:
    """Amazon snippets as a shift set with its own column names (snippet / opinion), labelled with
    the training names, rotten rows first (the training file's first row is fresh)."""
    rows = sorted(read_asset("amazon_reviews")[:n], key=lambda r: r["label"])
    return [{"opinion": VERDICTS[r["label"]], "snippet": f"{VERDICTS[r['label']]} says: {r['text']}"} for r in rows]


def write_csv(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


DIGIT_NAMES = ["zero", "one", "two"]


def digit_folders(root: Path, asset: str, per_class: dict[str, int]) -> Path:
    """Real digits 0-2 as PNG class folders named zero / one / two: `per_class` {split: count}."""
    rows = read_asset(asset)
    taken = {c: 0 for c in range(len(DIGIT_NAMES))}
    for row in rows:
        c = int(row["label"])
        if c not in taken:
            continue
        k = taken[c]
        split = next((s for s, lo in _bounds(per_class) if lo <= k < lo + per_class[s]), None)
        if split is None:
            continue
        pixels = np.array(row["pixels"].split(), dtype=np.uint8)
        side = int(round(len(pixels) ** 0.5))
        folder = root / split / DIGIT_NAMES[c]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.reshape(side, side)).save(folder / f"{k}.png")
        taken[c] += 1
    return root


def _bounds(per_class: dict[str, int]):
    lo = 0
    for split, n in per_class.items():
        yield split, lo
        lo += n


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets.require("all-MiniLM-L6-v2")))


def decoded(split, tokenizer, classes) -> list[tuple[str, str]]:
    texts = tokenizer.batch_decode(split["input_ids"], skip_special_tokens=True)
    return [(t, classes[int(y)]) for t, y in zip(texts, split["labels"])]


def assert_labels_follow_rows(split, tokenizer, classes, where: str) -> None:
    pairs = decoded(split, tokenizer, classes)
    assert pairs, f"{where}: no rows"
    wrong = [(t[:40], y) for t, y in pairs if not t.split(" says")[0].endswith(y)]
    assert not wrong, f"{where}: rows whose label index names another class: {wrong[:3]}"


TEXT_MODEL = {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"}
IMAGE_MODEL = {"name": "test_efficientnet", "family": "timm", "pretrained": False}
SMALL = {
    "optim": {"name": "sgd", "lr": 0.01, "batch_size": 8, "epochs": 1, "max_steps": 2, "eval_batch_size": 64},
    "nodes": {"count": 2, "cpus": 1},
    "log_every": 1000,
    "spsa": {"steps": 2, "verify_every": 1},
}


def run_config(raw: dict, out: Path, monkeypatch) -> tuple[list[dict], object]:
    """`runner.run` on `raw` (as a YAML file gives it); returns the records and the RunContext."""
    seen = {}
    real = runner.prepare

    def prepare(*args, **kwargs):
        seen["ctx"] = real(*args, **kwargs)
        return seen["ctx"]

    monkeypatch.setattr(runner, "prepare", prepare)
    records = runner.run(from_dict(raw), out)
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(records, default=str))
    return records, seen["ctx"]


def assert_ran(record: dict, metric: str = "accuracy", shift: bool = True) -> None:
    assert "error" not in record, f"{record['strategy']} failed: {record.get('error')}"
    keys = {f"id_{metric}"} | ({f"shift_{metric}"} if shift else set())
    assert keys <= record["metrics"].keys(), (record["strategy"], record["metrics"])
    assert all(0 <= record["metrics"][k] <= 1 for k in keys)


TRAINING_DATA_KINDS = ("data_shard", "train_data", "training_data", "shards")


def training_bytes(record: dict) -> dict:
    """Ledger kinds that carry training rows."""
    return {k: v for k, v in record["comm"]["by_kind"].items() if any(w in k for w in TRAINING_DATA_KINDS)}


# --- string labels: one class map everywhere ----------------------------------------------------


@pytest.mark.parametrize("classes", [None, ["rotten", "fresh"]])
def test_string_labels_map_by_name_on_every_node_and_in_every_shift_set(ray_session, tmp_path, tokenizer, classes):
    """The eval file starts with a fresh row, node 0's file with a rotten one, node 1 holds fresh
    rows only and the shift set lists rotten rows first under other column names: 'fresh' has one
    index in all of them (the sorted names, or data.classes' order), read in Ray worker processes."""
    evalrows = reviews(0, 30)
    assert evalrows[0]["verdict"] == "fresh"
    node0 = [r for r in reviews(100, 40) if r["verdict"] == "rotten"][:4] + reviews(200, 20)
    node1 = [r for r in reviews(300, 60) if r["verdict"] == "fresh"][:16]
    shift = snippets(40)
    assert shift[0]["opinion"] == "rotten" and {r["opinion"] for r in shift} == {"fresh", "rotten"}
    cfg = from_dict(
        {
            "model": TEXT_MODEL,
            "strategies": ["lofi"],
            "data": {
                "name": "mine",
                "source": "csv",
                "files": str(write_csv(tmp_path / "eval.csv", evalrows)),
                "node_files": [
                    str(write_csv(tmp_path / "a" / "mine.csv", node0)),
                    str(write_csv(tmp_path / "b" / "mine.csv", node1)),
                ],
                "columns": {"text": "review", "label": "verdict"},
                "classes": classes,
                "test_size": 10,
                "max_length": 24,
                "shift": {
                    "amazon": {
                        "files": str(write_csv(tmp_path / "shift.csv", shift)),
                        "columns": {"text": "snippet", "label": "opinion"},
                    }
                },
            },
        }
    )
    prepared = prepare_data(cfg, tokenizer)
    assert prepared.classes == (classes or ["fresh", "rotten"])
    for name in ("test", "shift/amazon"):
        assert_labels_follow_rows(prepared.eval_sets[name], tokenizer, prepared.classes, name)
    assert set(prepared.eval_sets["shift/amazon"]["labels"].tolist()) == {0, 1}
    load = ray_session.remote(lambda train, k: train.load(k, 2))
    shards = ray_session.get([load.remote(prepared.train, k) for k in range(2)])
    for k, (shard, rows) in enumerate(zip(shards, (node0, node1))):
        assert num_examples(shard) == len(rows)
        assert_labels_follow_rows(shard, tokenizer, prepared.classes, f"node {k}")
        want = [prepared.classes.index(r["verdict"]) for r in rows]
        assert shard["labels"].tolist() == want, f"node {k}: labels by name, in file order"


# --- bad input: one error line, before any actor ------------------------------------------------


def _bad_input(tmp_path: Path, case: str) -> dict:
    write_csv(tmp_path / "reviews.csv", reviews(0, 40))
    write_csv(tmp_path / "node_0.csv", reviews(100, 20))
    data = {
        "name": "mine",
        "source": "csv",
        "files": str(tmp_path / "reviews.csv"),
        "columns": {"text": "review", "label": "verdict"},
        "test_size": 8,
        "shift": "none",
    }
    if case == "text_column":
        data["columns"] = {"text": "reveiw", "label": "verdict"}
    elif case == "label_column":
        data["columns"] = {"text": "review", "label": "label"}
    elif case == "missing_file":
        data["files"] = str(tmp_path / "no_such_reviews.csv")
    elif case == "missing_node_file":
        data["node_files"] = [str(tmp_path / "node_0.csv"), str(tmp_path / "node_1.csv")]
    elif case == "empty_label":  # once an extra class "None", trained on
        rows = reviews(0, 40)
        rows[5]["verdict"] = ""
        write_csv(tmp_path / "reviews.csv", rows)
    return {
        "model": TEXT_MODEL,
        "data": data,
        "strategies": ["lofi", "spsa"],
        "out_dir": str(tmp_path / "out"),
        **SMALL,
    }


@pytest.mark.parametrize(
    "case,field",
    [
        ("text_column", "data.columns.text"),
        ("label_column", "data.columns.label"),
        ("missing_file", "data.files"),
        ("missing_node_file", "data.node_files[1]"),
        ("empty_label", "data.columns.label"),
    ],
)
def test_bad_data_stops_the_cli_with_one_line_before_ray_starts(tmp_path, case, field):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_bad_input(tmp_path, case)))
    ray_tmp = tmp_path / "raytmp"  # Ray creates its session folder here the moment it starts
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(ray_tmp)}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "raylowcomm.cli", "run", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    took = time.perf_counter() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert f"'{field}'" in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not ray_tmp.exists(), "Ray started"
    out = tmp_path / "out"
    assert not (out / "results.json").exists() and not (out / "config.yaml").exists(), "the run got past prepare"
    assert took < 120, f"{took:.0f} s: an error in the data should not wait for a model or a cluster"


def test_a_config_error_raised_on_a_node_reaches_the_driver_intact():
    """What a node raises about its own file (data.node_files[k]: an unknown label, a file that
    is not there on its host) comes back through Ray's pickling with its field and message."""
    err = ConfigError("data.node_files[1]", ["meh"], "labels not among the training classes ['fresh', 'rotten']")
    back = pickle.loads(pickle.dumps(err))
    assert back.field_name == "data.node_files[1]" and str(back) == str(err)


def test_interlocking_and_node_files_refuse_what_they_cannot_split():
    """Why the text runs below leave interlocking out, said as errors naming the field."""
    base = {
        "data": {"name": "mine", "source": "csv", "files": "x.csv", "columns": {"text": "review", "label": "verdict"}},
        "strategies": ["interlocking"],
    }
    with pytest.raises(ConfigError) as err:
        from_dict({**base, "model": TEXT_MODEL})
    assert err.value.field_name == "model.family"
    with pytest.raises(ConfigError) as err:
        from_dict({**base, "model": {"name": "SmolLM2-135M", "family": "hf_causal_lm"}})
    assert err.value.field_name == "data.name", "a causal LM interlocks on plain text only, not labelled reviews"
    with pytest.raises(ConfigError) as err:
        from_dict(
            {
                **base,
                "model": IMAGE_MODEL,
                "data": {
                    "name": "mine",
                    "source": "imagefolder",
                    "files": "x",
                    "node_files": "n_{node}",
                    "columns": {"image": "image", "label": "label"},
                },
            }
        )
    assert err.value.field_name == "data.node_files"


# --- end to end through runner.run --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.heavy
def test_a_user_csv_with_string_labels_runs_every_text_strategy(ray_session, tmp_path, monkeypatch):
    """review / verdict columns, fresh / rotten labels, an Amazon shift set with its own column
    names: lofi, spsa and ddp (interlocking does not split hf_classifier) with no code change."""
    raw = {
        "model": TEXT_MODEL,
        "strategies": ["lofi", "spsa", "ddp"],
        **SMALL,
        "data": {
            "name": "my_reviews",
            "source": "csv",
            "files": str(write_csv(tmp_path / "reviews.csv", reviews(0, 56))),
            "columns": {"text": "review", "label": "verdict"},
            "test_size": 16,
            "max_length": 32,
            "shift": {
                "amazon": {
                    "files": str(write_csv(tmp_path / "amazon.csv", snippets(24))),
                    "columns": {"text": "snippet", "label": "opinion"},
                }
            },
        },
    }
    records, ctx = run_config(raw, tmp_path / "out", monkeypatch)
    assert [r["strategy"] for r in records] == ["lofi", "spsa", "ddp"]
    assert ctx.data.classes == ["fresh", "rotten"] and ctx.spec.num_classes == 2
    assert set(ctx.data.eval_sets) == {"test", "shift/amazon"}
    for record in records:
        assert_ran(record)
        assert {"id_accuracy", "shift/amazon_accuracy"} <= record["metrics"].keys()
        assert not training_bytes(record), f"{record['strategy']}: {training_bytes(record)}"
        assert record["comm"]["by_kind"]["setup/data_recipe"] == 2 * payload_nbytes(ctx.data.train)
        assert sum(n["examples"] for n in record["nodes"]) == 40, "56 rows - 16 test, split over the nodes"


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategies",
    [
        ["lofi", "interlocking"],  # rows read on the nodes, and by interlocking's stage 0
        pytest.param(["lofi", "spsa", "ddp", "interlocking"], marks=pytest.mark.heavy, id="every"),
    ],
)
def test_a_user_imagefolder_runs_on_the_nodes(ray_session, tmp_path, monkeypatch, strategies):
    """PNG class folders (train/ and test/) of real MNIST digits named zero / one / two, a UCI
    digits folder as the shift set: the strategies run with no code change (SPSA nodes and DDP
    workers read their rows through the same `Node` as lo-fi's: every strategy in the heavy tier)."""
    folder = digit_folders(tmp_path / "digits", "mnist", {"train": 16, "test": 4})
    shift = digit_folders(tmp_path / "uci", "uci_digits", {"test": 8})
    raw = {
        "model": IMAGE_MODEL,
        "strategies": strategies,
        **SMALL,
        "interlocking": {"stages": 2, "micro_batches": 2, "balance": "blocks"},
        "data": {
            "name": "my_digits",
            "source": "imagefolder",
            "files": str(folder),
            "image_size": 16,
            "shift": {"uci": {"source": "imagefolder", "files": str(shift)}},
        },
    }
    records, ctx = run_config(raw, tmp_path / "out", monkeypatch)
    assert [r["strategy"] for r in records] == strategies
    assert ctx.data.classes == ["one", "two", "zero"], "the folder names, in the order imagefolder numbers them"
    assert ctx.data.plan.columns == {"image": "image", "label": "label"}
    assert num_examples(ctx.data.eval_sets["test"]) == 12 and num_examples(ctx.data.eval_sets["shift/uci"]) == 24
    for record in records:
        assert_ran(record)
    by_name = {r["strategy"]: r for r in records}
    for record in records:  # interlocking's stage 0 reads its rows too
        assert not training_bytes(record), f"{record['strategy']}: {training_bytes(record)}"
    for name in ("lofi", "spsa", "ddp"):
        if name in by_name:
            assert [n["examples"] for n in by_name[name]["nodes"]] == [24, 24]
    lofi, inter = by_name["lofi"], by_name["interlocking"]
    assert lofi["comm"]["by_kind"]["setup/data_recipe"] < 2 * 2048, "the image recipe is a few hundred bytes per node"
    assert inter["details"]["stages"] == 2 and set(inter["details"]["heads"]) == {"test", "shift/uci"}


@pytest.mark.slow
def test_node_local_files_never_reach_the_driver(ray_session, tmp_path, monkeypatch, tokenizer):
    """Two nodes, each with its own CSV (40 and 56 rows, every text marked "nodeonly"); the driver
    scores on a separate file. The driver's TrainSource cannot load and it cannot open a node
    file: lo-fi and SPSA still train, only the recipe crosses, and each node reports its own rows."""
    node_rows = [reviews(1000, 40, "nodeonly zero "), reviews(2000, 56, "nodeonly one ")]
    for k, rows in enumerate(node_rows):
        write_csv(tmp_path / f"node_{k}" / "mine.csv", rows)
    evalrows = reviews(0, 30)  # test_size 30: an evaluation-only file is scored whole

    def refuse(*args, **kwargs):
        raise AssertionError("the driver read training rows")

    real_open = SourceSpec.open

    def open_on_driver(self):
        if (self.files_field or "").startswith("data.node_files"):
            raise AssertionError(f"the driver opened {self.files_field}")
        return real_open(self)

    for name in ("load", "load_all", "load_holdout"):
        monkeypatch.setattr(TrainSource, name, refuse)
    monkeypatch.setattr(SourceSpec, "open", open_on_driver)
    raw = {
        "model": TEXT_MODEL,
        "strategies": ["lofi", "spsa"],
        **SMALL,
        "data": {
            "name": "mine",
            "source": "csv",
            "files": str(write_csv(tmp_path / "eval.csv", evalrows)),
            "node_files": str(tmp_path / "node_{node}" / "mine.csv"),
            "columns": {"text": "review", "label": "verdict"},
            "test_size": 30,
            "max_length": 32,
            "shift": "none",
        },
    }
    records, ctx = run_config(raw, tmp_path / "out", monkeypatch)
    with pytest.raises(AssertionError, match="read training rows"):
        ctx.data.train.load(0, 2)  # the guard was in place all along

    recipe = pickle.dumps(ctx.data.train)
    assert not any(r["review"][:60].encode() in recipe for rows in node_rows for r in rows), (
        "a training text in the recipe"
    )
    without_tokenizer = dataclasses.replace(ctx.data.train.encoder, tokenizer=None)
    bare = pickle.dumps(dataclasses.replace(ctx.data.train, encoder=without_tokenizer))
    assert len(bare) < 2048, f"the recipe without its tokenizer is {len(bare)} B"
    texts = [t for t, _ in decoded(ctx.data.eval_sets["test"], tokenizer, ctx.data.classes)]
    assert len(texts) == 30 and not any("nodeonly" in t for t in texts), "a training row in the driver's eval set"
    setup_kinds = {"setup/model_recipe", "setup/eval_sets", "setup/data_recipe", "setup/control", "setup/shard_sizes"}
    for record in records:
        assert_ran(record, shift=False)
        kinds = record["comm"]["by_kind"]
        assert not training_bytes(record), f"{record['strategy']}: {training_bytes(record)}"
        assert {k for k in kinds if k.startswith("setup/")} <= setup_kinds, sorted(kinds)
        assert kinds["setup/data_recipe"] == 2 * payload_nbytes(ctx.data.train)
        assert kinds.get("setup/shard_sizes", 0) < 64, "the nodes tell their sizes (two ints), nothing more"
        assert [n["examples"] for n in record["nodes"]] == [40, 56], "each node trains on all of its own file"
    assert records[0]["comm"]["by_phase"]["train"] == 0, "lo-fi sends nothing while training"
