"""Bad input, all of it: every malformed input to the `raylowcomm` CLI ends with exit code 2 and
exactly one stderr line, `error: ...`, naming the field, flag or path — before Ray starts and,
unless only the loaded model or data can tell, before any model or dataset loads (no Ray, no
weights: these tests are fast)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylowcomm.cli import main

# A config that validates (most cases fail before `prepare` builds the model).
GOOD = {
    "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
    "data": {"name": "mnist", "train_size": 64, "test_size": 32, "image_size": 16},
    "optim": {"name": "sgd", "lr": 0.05, "batch_size": 8, "epochs": 1},
    "nodes": {"count": 2, "cpus": 1},
    "strategies": ["lofi"],
}


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _config(tmp: Path, **changes) -> str:
    raw = {**GOOD, "out_dir": str(tmp / "out"), **changes}
    for dotted in [k for k in raw if "." in k]:  # model.path=... -> nested
        section, key = dotted.split(".", 1)
        raw[section] = {**raw.get(section, {}), key: raw.pop(dotted)}
    return str(_write(tmp / "cfg.yaml", raw))


LORA_DECODER = {"model.family": "hf_causal_lm", "model.name": "SmolLM2-135M", "model.lora": {}, "data.name": "hamlet"}


def _interlocking(tmp: Path, **options) -> str:
    """GOOD run by interlocking alone; `options` are interlocking's, dotted keys (model.name) the config's."""
    changes = {k: options.pop(k) for k in [k for k in options if "." in k]}
    return _config(tmp, strategies=["interlocking"], interlocking=options, **changes)


def _sweep(tmp: Path, **changes) -> str:
    _write(tmp / "base.yaml", GOOD)
    sweep = {
        "base": "base.yaml",
        "space": {"optim.lr": {"grid": [0.01, 0.1]}},
        "metric": "id_accuracy",
        "mode": "max",
        "storage_path": str(tmp / "store"),
        **changes,
    }
    return str(_write(tmp / "sweep.yaml", sweep))


def _sweep_with_bad_base(tmp: Path) -> str:
    sweep = _sweep(tmp)
    _write(tmp / "base.yaml", "optim: [\n")
    return sweep


def _damaged_run(tmp: Path, saved: str = "model:\n  name: test_efficientnet\n  fam") -> str:
    """A run folder whose config.yaml was cut off (mid-key, by default)."""
    (tmp / "run").mkdir()
    _write(tmp / "run" / "config.yaml", saved)
    return str(tmp / "run")


def _file(tmp: Path) -> str:
    return str(_write(tmp / "a_file", "not a folder\n"))


def _binary(tmp: Path) -> str:
    path = tmp / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81 not text")
    return str(path)


TEXT_MODEL = {"name": "all-MiniLM-L6-v2", "family": "hf_classifier"}


def _reviews(
    tmp: Path, name: str = "reviews.csv", blank: str | None = None, at: int = 3, labels=("fresh", "rotten")
) -> str:
    """A user's 12 reviews as a CSV (review, verdict), with the cell of column `blank` in row `at` left empty."""
    rows = [{"review": f"review {i} says {labels[i % 2]}", "verdict": labels[i % 2]} for i in range(12)]
    if blank is not None:
        rows[at][blank] = ""
    return str(_write(tmp / name, "review,verdict\n" + "".join(f"{r['review']},{r['verdict']}\n" for r in rows)))


def _own(tmp: Path, model=TEXT_MODEL, **data) -> str:
    """A config on the user's reviews.csv (every cell filled unless `data` says otherwise)."""
    mine = {"source": "csv", "columns": {"text": "review", "label": "verdict"}, "test_size": 4, "shift": "none", **data}
    if "files" not in mine:
        mine["files"] = _reviews(tmp)
    return _config(tmp, model=model, data=mine)


def _pairs(tmp: Path, blank_at: int) -> str:
    """Premise / hypothesis pairs with a verdict; the hypothesis of row `blank_at` left empty."""
    rows = [f"premise {i},{'' if i == blank_at else f'hypothesis {i}'},{'yes' if i % 2 else 'no'}\n" for i in range(12)]
    return str(_write(tmp / "pairs.csv", "premise,hypothesis,verdict\n" + "".join(rows)))


def _jsonl(tmp: Path, label) -> str:
    """Reviews as JSON lines, the fourth with `label` as its verdict."""
    rows = [{"review": f"review {i}", "verdict": label if i == 3 else "fresh"} for i in range(12)]
    return str(_write(tmp / "reviews.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))


def _saved_minus_one(tmp: Path) -> str:
    """A save_to_disk folder whose ClassLabel column holds -1 (no label) in row 3."""
    from datasets import ClassLabel, Dataset, Features, Value

    labels = [i % 2 if i != 3 else -1 for i in range(12)]
    features = Features({"review": Value("string"), "verdict": ClassLabel(names=["fresh", "rotten"])})
    saved = Dataset.from_dict({"review": [f"review {i}" for i in range(12)], "verdict": labels}, features=features)
    saved.save_to_disk(tmp / "saved")
    return str(tmp / "saved")


def _digits(tmp: Path, blank_at: int | None = None) -> str:
    """Flat 4x4 grey digits as a CSV (pixels, digit); the pixels of row `blank_at` left empty."""
    rows = ["" if i == blank_at else " ".join(["7"] * 16) for i in range(12)]
    return str(_write(tmp / "digits.csv", "pixels,digit\n" + "".join(f"{p},{i % 2}\n" for i, p in enumerate(rows))))


def _pngs(tmp: Path) -> str:
    """A folder of PNG class folders (imagefolder): digits/zero, digits/one."""
    from PIL import Image

    for name in ("zero", "one"):
        (tmp / "digits" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (4, 4), i).save(tmp / "digits" / name / f"{i}.png")
    return str(tmp / "digits")


def _folder(tmp: Path, files: dict[str, str | bytes]) -> str:
    """A folder holding `files` (name -> content): what model.path may wrongly point at."""
    folder = tmp / "model"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(folder)


def _hf_model(tmp: Path, files: dict[str, str | bytes]) -> list[str]:
    """argv of a text run whose model.path is a folder holding `files`."""
    return ["run", _config(tmp, model={**TEXT_MODEL, "path": _folder(tmp, files)}, data=TEXT_DATA)]


def _wrong_checkpoint(tmp: Path) -> str:
    """test_efficientnet's weights, given as those of another timm architecture (test_byobnet)."""
    import timm
    from safetensors.torch import save_file

    weights = timm.create_model("test_efficientnet", pretrained=False).state_dict()
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "weights.safetensors")
    return _config(tmp, model={"name": "test_byobnet", "family": "timm", "path": str(tmp / "weights.safetensors")})


CONFIG_JSON = json.dumps({"model_type": "bert"})
TEXT_DATA = {"name": "rotten_tomatoes"}
PAIR_COLUMNS = {"text": "premise", "text_pair": "hypothesis", "label": "verdict"}
DIGITS = {"source": "csv", "test_size": 4, "columns": {"image": "pixels", "label": "digit"}, "shift": "none"}

# (id, argv builder from tmp_path, text the error line must contain, or a tuple of them)
CASES = [
    # --- the config file itself
    (
        "malformed-yaml",
        lambda t: ["run", str(_write(t / "bad.yaml", "optim:\n  lr: 0.1\n  momentum: [0.9,\n"))],
        "line 4, column 1",
    ),
    ("malformed-yaml-names-file", lambda t: ["run", str(_write(t / "bad.yaml", "optim: {lr: 0.1\n"))], "bad.yaml"),
    ("yaml-tab-indent", lambda t: ["run", str(_write(t / "tab.yaml", "optim:\n\tlr: 0.1\n"))], "line 2, column 1"),
    ("yaml-list-not-mapping", lambda t: ["run", str(_write(t / "list.yaml", "- lofi\n- ddp\n"))], "mapping"),
    ("yaml-scalar-not-mapping", lambda t: ["run", str(_write(t / "s.yaml", "lofi\n"))], "s.yaml"),
    ("missing-config-file", lambda t: ["run", str(t / "nope.yaml")], "nope.yaml"),
    ("config-is-a-folder", lambda t: ["run", str(t)], "is a folder"),
    ("config-not-text", lambda t: ["run", _binary(t)], "bin.yaml"),
    # --- strategies
    ("empty-strategies", lambda t: ["run", _config(t, strategies=[])], "'strategies'"),
    ("empty-strategies-by-set", lambda t: ["run", _config(t), "--set", "strategies=[]"], "'strategies'"),
    ("unknown-strategy", lambda t: ["run", _config(t, strategies=["lofi", "gossip"])], "strategies[1]"),
    ("duplicate-strategy", lambda t: ["run", _config(t, strategies=["lofi", "lofi"])], "'strategies'"),
    ("strategies-not-a-list", lambda t: ["run", _config(t, strategies={"lofi": 1})], "'strategies'"),
    ("options-section", lambda t: ["run", _config(t, options={"lofi": {}})], "'options'"),
    # --- fields: unknown, wrong type, out of range
    ("unknown-top-level-field", lambda t: ["run", _config(t, epochs=3)], "'epochs'"),
    ("unknown-section-field", lambda t: ["run", _config(t), "--set", "optim.lrr=0.1"], "optim.lrr"),
    ("unknown-strategy-field", lambda t: ["run", _config(t, lofi={"every": 3})], "lofi.every"),
    ("wrong-type", lambda t: ["run", _config(t), "--set", "optim.lr=fast"], "optim.lr"),
    ("section-not-a-mapping", lambda t: ["run", _config(t, optim=3)], "'optim'"),
    ("wrong-literal", lambda t: ["run", _config(t), "--set", "optim.name=adam"], "optim.name"),
    ("out-of-range", lambda t: ["run", _config(t), "--set", "optim.momentum=1.5"], "optim.momentum"),
    (
        "length-groups-of-images",
        lambda t: ["run", _config(t), "--set", "optim.group_by_length=true"],
        "optim.group_by_length",
    ),
    ("zero-nodes", lambda t: ["run", _config(t), "--set", "nodes.count=0"], "nodes.count"),
    ("negative-cpus", lambda t: ["run", _config(t), "--set", "nodes.cpus=-1"], "nodes.cpus"),
    ("bad-placement", lambda t: ["run", _config(t), "--set", "nodes.placement=STRICT"], "nodes.placement"),
    (
        "negative-start-timeout",
        lambda t: ["run", _config(t), "--set", "nodes.start_timeout_s=-1"],
        "nodes.start_timeout_s",
    ),
    ("zero-start-timeout", lambda t: ["run", _config(t), "--set", "nodes.start_timeout_s=0"], "nodes.start_timeout_s"),
    (
        "nan-start-timeout",
        lambda t: ["run", _config(t), "--set", "nodes.start_timeout_s=.nan"],
        "nodes.start_timeout_s",
    ),
    (
        "infinite-start-timeout",
        lambda t: ["run", _config(t), "--set", "nodes.start_timeout_s=.inf"],
        "nodes.start_timeout_s",
    ),
    ("seed-too-big", lambda t: ["run", _config(t), "--set", "seed=2147483648"], ("'seed'", "2**31")),
    ("seed-negative", lambda t: ["run", _config(t), "--set", "seed=-1"], ("'seed'", "2**31")),
    ("strategy-option-range", lambda t: ["run", _config(t), "--set", "lofi.average_every=0"], "lofi.average_every"),
    # an averaging period longer than the run (GOOD: 2 shards of 32, batch 8, 1 epoch = 4 steps per node)
    (
        "lofi-average-every-past-the-steps",
        lambda t: ["run", _config(t, lofi={"average_every": 5})],
        ("lofi.average_every", "4 steps per node", "at most 4"),
    ),
    (
        "lofi-average-every-past-the-epochs",
        lambda t: ["run", _config(t, lofi={"average_every": 2, "average_unit": "epochs"})],
        ("lofi.average_every", "1 epoch of 4 steps", "at most 1 (epochs)"),
    ),
    (
        "lofi-average-every-epochs-past-max-steps",
        lambda t: [
            "run",
            _config(t, lofi={"average_every": 1, "average_unit": "epochs"}),
            "--set",
            "optim.max_steps=2",
        ],
        ("lofi.average_every", "2 steps per node", "lofi.average_unit: steps"),
    ),
    ("greedy-soup-without-val", lambda t: ["run", _config(t), "--set", "lofi.soup=greedy"], "lofi.soup"),
    # Streaming DiLoCo's fragments and overlap: peer rounds every H steps; test_efficientnet has < 96 modules to cut
    (
        "fragments-without-peer-rounds",
        lambda t: ["run", _config(t, lofi={"average_every": 8, "fragments": 2})],
        ("lofi.fragments", "peer rounds"),
    ),
    (
        "fragments-not-dividing-h",
        lambda t: ["run", _config(t, lofi={"average_every": 8, "compress": "int4", "fragments": 3})],
        ("lofi.fragments", "divide"),
    ),
    (
        "overlap-past-the-next-sync",
        lambda t: ["run", _config(t, lofi={"average_every": 8, "compress": "int4", "fragments": 2, "overlap": 5})],
        ("lofi.overlap", "at most"),
    ),
    (
        "overlap-true",
        lambda t: ["run", _config(t, lofi={"average_every": 8, "compress": "int4", "overlap": True})],
        "lofi.overlap",
    ),
    (
        "mix-out-of-range",
        lambda t: ["run", _config(t, lofi={"average_every": 8, "compress": "int4", "overlap": 1, "mix": 1.5})],
        "lofi.mix",
    ),
    (
        "more-fragments-than-tensors",
        lambda t: ["run", _config(t, lofi={"average_every": 96, "compress": "int4", "fragments": 96})],
        ("lofi.fragments", "at most"),
    ),
    (
        "empty-aux-widths",
        lambda t: ["run", _config(t, strategies=["interlocking"], interlocking={"aux_widths": []})],
        "interlocking.aux_widths",
    ),
    # interlocking options the loaded model or data decide (test_efficientnet: 6 units; built without weights, no Ray)
    ("interlocking-split-not-the-units", lambda t: ["run", _interlocking(t, split=[1, 1])], "interlocking.split"),
    ("interlocking-split-wrong-length", lambda t: ["run", _interlocking(t, split=[2, 2, 2])], "interlocking.split"),
    ("interlocking-more-stages-than-units", lambda t: ["run", _interlocking(t, stages=7)], "interlocking.stages"),
    (
        "interlocking-measured-on-tiny-test-set",
        lambda t: ["run", _interlocking(t), "--set", "data.test_size=1"],
        "interlocking.balance",
    ),
    (
        "interlocking-unsplittable-timm-model",
        lambda t: ["run", _interlocking(t), "--set", "model.name=resnetv2_50"],
        "model.name",
    ),
    ("interlocking-lora-decoder", lambda t: ["run", _interlocking(t, **LORA_DECODER)], "model.lora"),
    ("spsa-bad-codec", lambda t: ["run", _config(t, strategies=["spsa"]), "--set", "spsa.codec=zip"], "spsa.codec"),
    (
        "spsa-density-off-the-256ths",
        lambda t: ["run", _config(t, strategies=["spsa"]), "--set", "spsa.density=0.3"],
        ("spsa.density", "76/256", "77/256"),
    ),
    (
        "spsa-include-matches-nothing",
        lambda t: ["run", _config(t, strategies=["spsa"], spsa={"include": ["^head$"]})],
        ("spsa.include", "matches none", "conv_stem.weight"),
    ),
    # --- data and model
    ("bad-data-name", lambda t: ["run", _config(t), "--set", "data.name=cifar"], "data.name"),
    ("family-data-mismatch", lambda t: ["run", _config(t), "--set", "model.family=hf_classifier"], "model.family"),
    ("missing-model-path", lambda t: ["run", _config(t, **{"model.path": str(t / "weights")})], "model.path"),
    ("missing-data-path", lambda t: ["run", _config(t, **{"data.path": str(t / "digits.csv")})], "data.path"),
    # --- empty cells: the file and the row, before anything trains
    (
        "empty-label-cell",
        lambda t: ["run", _own(t, files=_reviews(t, blank="verdict"))],
        ("'data.columns.label' = 'verdict'", "row 3 of data.files", "reviews.csv", "its cell is empty"),
    ),
    (
        "empty-label-cell-with-classes",
        lambda t: ["run", _own(t, files=_reviews(t, blank="verdict", at=9), classes=["fresh", "rotten"])],
        ("'data.columns.label'", "row 9 of data.files"),
    ),
    (
        "nan-label-cell",
        lambda t: ["run", _own(t, files=_reviews(t, blank="verdict", labels=("1", "0")))],
        ("'data.columns.label'", "row 3 of data.files"),
    ),
    (
        "null-label-json",
        lambda t: ["run", _own(t, source="json", files=_jsonl(t, None))],
        ("'data.columns.label'", "reviews.jsonl"),
    ),
    (
        "blank-label-json",
        lambda t: ["run", _own(t, source="json", files=_jsonl(t, "  "))],
        ("'data.columns.label'", "row 3 of"),
    ),
    (
        "classlabel-minus-one",
        lambda t: ["run", _own(t, source=_saved_minus_one(t), files=None)],
        ("'data.columns.label'", "row 3 of data.files", "saved"),
    ),
    (
        "empty-text-cell",
        lambda t: ["run", _own(t, files=_reviews(t, blank="review"))],
        ("'data.columns.text' = 'review'", "row 3 of data.files"),
    ),
    (
        "empty-text-pair-cell",
        lambda t: ["run", _own(t, files=_pairs(t, blank_at=5), columns=PAIR_COLUMNS)],
        ("'data.columns.text_pair'", "row 5 of data.files"),
    ),
    (
        "empty-image-cell",
        lambda t: ["run", _config(t, data={**DIGITS, "files": _digits(t, blank_at=6)})],
        ("'data.columns.image' = 'pixels'", "row 6 of data.files", "digits.csv"),
    ),
    (
        "empty-label-in-test-file",
        lambda t: [
            "run",
            _own(t, files={"train": _reviews(t), "test": _reviews(t, "test.csv", blank="verdict", at=2)}),
        ],
        ("'data.columns.label'", "row 2 of data.files", "test.csv"),
    ),
    (
        "empty-label-in-shift-set",
        lambda t: ["run", _own(t, shift={"amazon": {"files": _reviews(t, "amazon.csv", blank="verdict", at=1)}})],
        ("'data.shift.amazon.columns.label'", "row 1 of data.shift.amazon.files", "amazon.csv"),
    ),
    (
        "empty-text-in-shift-set",
        lambda t: ["run", _own(t, shift={"amazon": {"files": _reviews(t, "amazon.csv", blank="review", at=0)}})],
        ("'data.shift.amazon.columns.text'", "row 0 of data.shift.amazon.files"),
    ),
    (
        "empty-label-in-node-file",
        lambda t: ["run", _own(t, node_files=[_reviews(t, "n0.csv"), _reviews(t, "n1.csv", blank="verdict", at=2)])],
        ("'data.columns.label'", "row 2 of data.node_files[1]", "n1.csv"),
    ),
    (
        "empty-text-in-node-file",
        lambda t: ["run", _own(t, node_files=[_reviews(t, "n0.csv", blank="review", at=4), _reviews(t, "n1.csv")])],
        ("'data.columns.text'", "row 4 of data.node_files[0]"),
    ),
    # --- your own data is named after its source, and the wrong role is named
    (
        "text-column-as-image",
        lambda t: ["run", _own(t, columns={"image": "review", "label": "verdict"})],
        ("data 'reviews' is image", "data.columns.image = 'review'"),
    ),
    (
        "own-text-for-timm",
        lambda t: ["run", _own(t, model=GOOD["model"])],
        ("data 'reviews' is labelled text", "data.columns.text"),
    ),
    (
        "own-images-for-hf",
        lambda t: ["run", _config(t, model=TEXT_MODEL, data={"source": "imagefolder", "files": _pngs(t)})],
        ("data 'digits' is image", "data.columns.image"),
    ),
    # --- storage: what pyarrow.fs cannot open, a file
    ("storage-ftp", lambda t: ["run", _config(t, storage="ftp://host/x")], ("'storage'", "ftp://", "s3://")),
    ("storage-https", lambda t: ["run", _config(t, storage="https://host/x")], "'storage'"),
    ("storage-is-a-file", lambda t: ["run", _config(t, storage=_file(t))], ("'storage'", "is a file")),
    (
        "storage-under-a-file",
        lambda t: ["run", _config(t, storage=_file(t) + "/state")],
        ("'storage'", "which is a file"),
    ),
    # --- storage that cannot be written: a marker written and deleted before Ray (root cannot write procfs either)
    (
        "storage-s3-without-bucket",
        lambda t: ["run", _config(t, storage="s3://")],
        ("'storage'", "names no bucket", "s3://BUCKET/PATH"),
    ),
    ("storage-gs-without-bucket", lambda t: ["run", _config(t, storage="gs:///run")], ("'storage'", "no bucket")),
    (
        "storage-unreachable-endpoint",
        lambda t: ["run", _config(t, storage="s3://bucket/run?endpoint_override=127.0.0.1:1&scheme=http")],
        ("'storage'", "cannot be written", "127.0.0.1:1", "endpoint"),
    ),
    (
        "storage-uncreatable-folder",
        lambda t: ["run", _config(t, storage="/proc/raylowcomm/state")],
        ("'storage'", "cannot be written", "/proc/raylowcomm"),
    ),
    (
        "storage-folder-without-files",
        lambda t: ["run", _config(t, storage="/proc")],
        ("'storage'", "cannot be written", "give a folder"),
    ),
    # --- model folders and files that hold no model
    ("model-path-empty-folder", lambda t: _hf_model(t, {}), ("'model.path'", "lacks config.json")),
    ("model-path-text-only", lambda t: _hf_model(t, {"notes.txt": "my model\n"}), ("'model.path'", "notes.txt")),
    (
        "model-path-no-weights",
        lambda t: _hf_model(t, {"config.json": CONFIG_JSON, "vocab.txt": "[PAD]\n"}),
        ("'model.path'", "lacks weights"),
    ),
    (
        "model-path-no-tokenizer",
        lambda t: _hf_model(t, {"config.json": CONFIG_JSON, "model.safetensors": b""}),
        ("'model.path'", "lacks a tokenizer"),
    ),
    (
        "model-path-bad-config",
        lambda t: _hf_model(t, {"config.json": "{bert", "vocab.txt": "a\n", "model.safetensors": b""}),
        ("'model.path'", "config.json"),
    ),
    (
        "model-path-bad-weights",
        lambda t: _hf_model(t, {"config.json": CONFIG_JSON, "vocab.txt": "a\n", "model.safetensors": "none"}),
        ("'model.path'", "model.safetensors is not a safetensors file"),
    ),
    (
        "model-path-file-for-hf",
        lambda t: ["run", _config(t, model={**TEXT_MODEL, "path": _file(t)}, data=TEXT_DATA)],
        ("'model.path'", "is a folder"),
    ),
    (
        "model-name-empty-folder",
        lambda t: ["run", _config(t, model={"name": _folder(t, {}), "family": "hf_classifier"}, data=TEXT_DATA)],
        ("'model.name'", "lacks config.json"),
    ),
    (
        "timm-path-is-a-folder",
        lambda t: ["run", _config(t, **{"model.path": _folder(t, {}), "model.pretrained": True})],
        ("'model.path'", "one file"),
    ),
    (
        "timm-path-text-file",
        lambda t: ["run", _config(t, **{"model.path": _file(t), "model.pretrained": True})],
        ("'model.path'", "not a torch checkpoint"),
    ),
    (
        "timm-weights-of-another-arch",
        lambda t: ["run", _wrong_checkpoint(t)],
        ("'model.path'", "do not fit timm architecture 'test_byobnet'"),
    ),
    # --- a section's unknown key, inside an optional section
    (
        "lora-unknown-key",
        lambda t: ["run", _config(t, **{"model.lora": {"rank": 8}})],
        ("'model.lora.rank'", "alpha, dropout, r"),
    ),
    (
        "shift-set-unknown-key",
        lambda t: ["run", _own(t, shift={"amazon": {"file": "amazon.csv"}})],
        ("'data.shift.amazon.file'", "files"),
    ),
    ("files-not-text", lambda t: ["run", _own(t, files=[3])], "'data.files[0]'"),
    # --- --set
    ("set-without-equals", lambda t: ["run", _config(t), "--set", "optim.lr"], "--set"),
    ("set-empty-key", lambda t: ["run", _config(t), "--set", "=0.1"], "--set"),
    ("set-into-non-section", lambda t: ["run", _config(t), "--set", "optim.lr.x=1"], "optim.lr"),
    ("set-malformed-value", lambda t: ["run", _config(t), "--set", "strategies=[lofi,"], "strategies"),
    ("set-missing-argument", lambda t: ["run", _config(t), "--set"], "--set"),
    # --- --seeds
    ("seeds-not-integers", lambda t: ["run", _config(t), "--seeds", "0,one"], ("--seeds", "0,one")),
    ("seeds-negative", lambda t: ["run", _config(t), "--seeds", "-1,2"], "--seeds"),
    ("seeds-empty-item", lambda t: ["run", _config(t), "--seeds", "0,,2"], "--seeds"),
    ("seeds-superscript-digit", lambda t: ["run", _config(t), "--seeds", "0,\u00b2"], "--seeds"),
    ("seeds-too-big", lambda t: ["run", _config(t), "--seeds", "0,2147483648"], ("--seeds", "2**31")),
    ("seeds-5000-digits", lambda t: ["run", _config(t), "--seeds", "9" * 5000], ("--seeds", "2**31")),
    ("seeds-repeated", lambda t: ["run", _config(t), "--seeds", "0,1,0"], ("--seeds", "each seed once")),
    ("seeds-and-set-seed", lambda t: ["run", _config(t), "--seeds", "0,1", "--set", "seed=3"], ("--seeds", "seed=")),
    ("seeds-missing-argument", lambda t: ["run", _config(t), "--seeds"], "--seeds"),
    (
        "seeds-resume-not-a-seeds-run",
        lambda t: ["run", _config(t), "--seeds", "0,1", "--resume", str(t)],
        ("--resume", "no seeds.json"),
    ),
    # --- --resume: the run's own config.yaml, damaged
    (
        "resume-truncated-config",
        lambda t: ["run", _config(t), "--resume", _damaged_run(t)],
        ("--resume", "config.yaml", "line 3", "start afresh"),
    ),
    (
        "resume-empty-config",
        lambda t: ["run", _config(t), "--resume", _damaged_run(t, "")],
        ("--resume", "config.yaml", "is empty"),
    ),
    (
        "resume-config-not-a-mapping",
        lambda t: ["run", _config(t), "--resume", _damaged_run(t, "- lofi\n")],
        ("--resume", "holds no config mapping"),
    ),
    # --- output folder
    ("out-is-a-file", lambda t: ["run", _config(t), "--out", _file(t)], "--out"),
    ("out-under-a-file", lambda t: ["run", _config(t), "--out", _file(t) + "/run"], "--out"),
    ("out-dir-field-is-a-file", lambda t: ["run", _config(t, out_dir=_file(t))], "out_dir"),
    # modes stop a user (--out not writable); root, at the probe of OUT/state, the default storage
    (
        "out-uncreatable",
        lambda t: ["run", _config(t), "--out", "/proc/raylowcomm/run"],
        ("/proc/raylowcomm/run", "writ"),
    ),
    # --- the command line
    ("unknown-flag", lambda t: ["run", _config(t), "--bogus"], "--bogus"),
    ("unknown-subcommand", lambda t: ["frobnicate"], "frobnicate"),
    ("no-subcommand", lambda t: [], "command"),
    ("run-without-config", lambda t: ["run"], "config"),
    ("assets-bad-action", lambda t: ["assets", "delete"], "delete"),
    ("assets-unknown-name", lambda t: ["assets", "fetch", "imagenet"], "imagenet"),
    # --- lofi.secure: what it cannot run with, named beside it
    (
        "run-secure-on-two-nodes",
        lambda t: ["run", _config(t, lofi={"compress": "int2", "compress_scale": "shared", "secure": True})],
        ("nodes.count", "lofi.secure", "at least 3 nodes"),
    ),
    (
        "run-secure-on-node-scales",
        lambda t: ["run", _config(t, **{"nodes.count": 3}, lofi={"compress": "int2", "secure": True})],
        ("lofi.compress_scale", "lofi.secure", "set lofi.compress_scale: shared"),
    ),
    (
        "run-secure-with-median",
        lambda t: [
            "run",
            _config(
                t,
                **{"nodes.count": 3},
                lofi={"compress": "int2", "compress_scale": "shared", "secure": True, "aggregate": "median"},
            ),
        ],
        ("lofi.aggregate", "lofi.secure"),
    ),
    (
        "run-secure-with-batchnorm-statistics-in-rounds",
        lambda t: [
            "run",
            _config(
                t,
                **{"nodes.count": 3},
                lofi={"compress": "int2", "compress_scale": "shared", "secure": True, "bn_recalibrate": False},
            ),
        ],
        ("lofi.bn_recalibrate", "in the clear"),
    ),
    # --- bench
    ("bench-bad-mode", lambda t: ["bench", "fast", _config(t)], "fast"),
    ("bench-local-bad-config", lambda t: ["bench", "local", _config(t), "--set", "optim.lr=-1"], "optim.lr"),
    ("bench-local-malformed-yaml", lambda t: ["bench", "local", str(_write(t / "b.yaml", "a: [\n"))], "b.yaml"),
    ("bench-local-with-rate", lambda t: ["bench", "local", _config(t), "--rate", "1gbit"], "--rate"),
    ("bench-local-out-is-a-file", lambda t: ["bench", "local", _config(t), "--out", _file(t)], "--out"),
    ("bench-wan-bad-rate", lambda t: ["bench", "wan", _config(t), "--rate", "fast"], "--rate"),
    # rates tc tbf refuses, before any namespace or cluster is built
    ("bench-wan-zero-rate", lambda t: ["bench", "wan", _config(t), "--rate", "0mbit"], ("--rate", "'0mbit'", "8bit")),
    ("bench-wan-negative-rate", lambda t: ["bench", "wan", _config(t), "--rate=-5mbit"], ("--rate", "positive")),
    ("bench-wan-unknown-unit", lambda t: ["bench", "wan", _config(t), "--rate", "100mbits"], ("--rate", "100mbits")),
    ("bench-wan-rate-without-unit", lambda t: ["bench", "wan", _config(t), "--rate", "100"], ("--rate", "unit")),
    ("bench-wan-rate-below-a-byte", lambda t: ["bench", "wan", _config(t), "--rate", "4bit"], ("--rate", "8bit")),
    (
        "bench-wan-second-rate-bad",
        lambda t: ["bench", "wan", _config(t), "--rate", "1gbit", "--rate", "0.0kbit"],
        ("--rate", "0.0kbit"),
    ),
    # --- tune
    ("tune-missing-sweep", lambda t: ["tune", str(t / "sweep.yaml")], "sweep.yaml"),
    (
        "tune-malformed-sweep",
        lambda t: ["tune", str(_write(t / "sweep.yaml", "space:\n  optim.lr: {grid: [1, 2}\n"))],
        "line 2",
    ),
    ("tune-sweep-not-mapping", lambda t: ["tune", str(_write(t / "sweep.yaml", "- 1\n"))], "sweep.yaml"),
    ("tune-unknown-key", lambda t: ["tune", _sweep(t, spaces={})], "'spaces'"),
    ("tune-bad-space-value", lambda t: ["tune", _sweep(t, space={"optim.lr": {"grid": [0.1, -1]}})], "space.optim.lr"),
    ("tune-bad-set", lambda t: ["tune", _sweep(t), "--set", "optim.lr"], "--set"),
    ("tune-pinned-hosts", lambda t: ["tune", _sweep(t, set={"nodes.hosts": ["10.0.0.2", "10.0.0.3"]})], "nodes.hosts"),
    ("tune-malformed-base", lambda t: ["tune", _sweep_with_bad_base(t)], "base"),
    ("tune-storage-path-is-a-file", lambda t: ["tune", _sweep(t), "--storage-path", _file(t)], "--storage-path"),
    # --- report
    ("report-missing-dir", lambda t: ["report", str(t / "runs")], "runs"),
    ("report-dir-is-a-file", lambda t: ["report", _file(t)], "a_file"),
    ("report-empty-dir", lambda t: ["report", str(t)], "no bench.json"),
    ("report-bad-fraction", lambda t: ["report", str(t), "--target-fraction", "2"], "--target-fraction"),
    ("report-fraction-not-a-number", lambda t: ["report", str(t), "--target-fraction", "most"], "--target-fraction"),
]


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything tries to start or join Ray; restore the environment after."""
    import ray

    import raylowcomm.runner
    import raylowcomm.runtime

    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError("Ray was started on bad input")

    for target in (ray, raylowcomm.runtime, raylowcomm.runner):
        monkeypatch.setattr(target, "init" if target is ray else "init_ray", refuse)
    saved = dict(os.environ)
    yield started  # the test session's own Ray may be up already: what counts is that nothing tried to start one
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, no_ray, argv, expected):
    code = main(argv(tmp_path))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for text in expected if isinstance(expected, tuple) else (expected,):
        assert text in lines[0], lines[0]
    assert not no_ray, "Ray was started on bad input"


def test_enough_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_out_not_writable(tmp_path, capsys, no_ray):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere; the parent-is-a-file cases cover an output that cannot be made")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["run", _config(tmp_path), "--out", str(locked / "run")]) == 2
    finally:
        locked.chmod(0o700)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "not writable" in lines[0]


CHILD_CLI = (
    "import sys, ray; from raylowcomm.cli import main; "
    "code = main(sys.argv[1:]); sys.exit(3 if ray.is_initialized() else code)"
)
"""`raylowcomm` in a child process, exit code 3 if it initialised Ray."""


def test_storage_read_only(tmp_path, capsys, no_ray):
    """A read-only folder as `storage` is refused before Ray starts: mode 0o555 for a user; for root,
    whom modes do not stop, a read-only bind mount in a mount namespace of the child's own."""
    state = tmp_path / "state"
    state.mkdir()
    argv = ["run", _config(tmp_path, storage=str(state))]
    if os.geteuid() != 0:
        state.chmod(0o555)
        try:
            code, err = main(argv), capsys.readouterr().err
        finally:
            state.chmod(0o755)
    else:
        if shutil.which("unshare") is None:
            pytest.skip("root writes through modes, and unshare (util-linux) is missing for a read-only mount")
        folder = shlex.quote(str(state))
        script = (
            f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} || exit 99; "
            f'exec {shlex.quote(sys.executable)} -c {shlex.quote(CHILD_CLI)} "$@"'
        )
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True, timeout=300
        )
        if proc.returncode == 99:
            pytest.skip(f"root writes through modes, and no read-only bind mount can be made here: {proc.stderr}")
        code, err = proc.returncode, proc.stderr
        assert "Read-only file system" in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "'storage'" in lines[0] and "cannot be written" in lines[0], lines[0]
    assert not no_ray and list(state.iterdir()) == []


def test_help_is_not_an_error(capsys):
    assert main(["run", "--help"]) == 0
    assert "--set" in capsys.readouterr().out
