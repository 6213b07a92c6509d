"""Models: pretrained weights through the ordinary loaders (timm, transformers) on the driver,
and a file-free `ModelSpec` from which any actor rebuilds the same architecture. A timm
checkpoint's loading and fit check are `timm_checkpoints`'s."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylowcomm import assets
from raylowcomm.config import ConfigError, LoraConfig, ModelConfig
from raylowcomm.model_overrides import apply_overrides
from raylowcomm.storage import Storage, storage_problem
from raylowcomm.timm_checkpoints import check_fits, timm_field, timm_model

ASSET_TIMM_ARCH = {"efficientnet_lite0": "tf_efficientnet_lite0"}


@dataclass
class ModelSpec:
    """Everything needed to rebuild the architecture; the weights travel separately."""

    family: str
    num_classes: int | None = None
    timm_arch: str | None = None
    hf_config: object | None = None
    lora: LoraConfig | None = None
    """Train these LoRA adapters on the frozen architecture (`finetune.fine_tune_for` wraps it)."""
    dtype: torch.dtype = torch.float32
    """The weights' dtype (model.dtype); under LoRA the frozen base's only."""
    memory_format: str = "auto"
    """model.memory_format: resolved on each actor's device by `place`."""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_source(cfg: ModelConfig) -> str:
    """Where the model's weights come from (a bundled asset is materialised): a cheap check that
    they exist and hold a model (`check_model_files`), for callers that do not load the model themselves."""
    check_model_files(cfg)
    return _resolve(cfg)


HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
"""Weight files `from_pretrained` loads from a folder (one file, or the index of a sharded set)."""


MODEL_CACHE = Path(os.environ.get("RAYLOWCOMM_MODEL_CACHE", "~/.cache/raylowcomm/models")).expanduser()
"""Where a host keeps the models it copied from a storage URI (model.path: s3://…, gs://…, file://…)."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


def is_uri(path: str | None) -> bool:
    return path is not None and "://" in path


def fetch_model(uri: str, weights: bool = True, field: str = "model.path") -> tuple[Path, set[str]]:
    """A model at a storage URI copied into this host's cache (MODEL_CACHE/<hash of the URI>), file by
    file, once (a file already there at its size is kept): (its local path, the names the URI's
    folder holds). `weights=False` copies all but the weight files: what the driver plans with
    (config, tokenizer). Storage reads, like the data's: outside the ledger, which counts what
    crosses between the run's processes."""
    from pyarrow import fs

    problem = storage_problem(uri)
    if problem is not None:
        raise ConfigError(field, uri, problem)
    storage = Storage(uri)
    base = storage.path("")
    info = storage.fs.get_file_info(base)
    if info.type == fs.FileType.NotFound:
        raise ConfigError(field, uri, "nothing is at this URI: point it at your model's folder or checkpoint")
    local = MODEL_CACHE / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if info.type == fs.FileType.File:
        files, root = [info], base.rsplit("/", 1)[0]
    else:
        files, root = (
            [i for i in storage.fs.get_file_info(fs.FileSelector(base, recursive=True)) if i.type == fs.FileType.File],
            base,
        )
    names = {f.path[len(root) :].lstrip("/") for f in files}
    for f in files:
        name = f.path[len(root) :].lstrip("/")
        if weights or not name.endswith(WEIGHT_SUFFIXES):
            _copy(storage.fs, f, local / name)
    return (local / next(iter(names)) if info.type == fs.FileType.File else local), names


def _copy(filesystem, info, dest: Path) -> None:
    """One file from `filesystem` to `dest`, written beside it and renamed, so that two nodes on one
    host copying at once never see half a file."""
    if dest.is_file() and dest.stat().st_size == info.size:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    with filesystem.open_input_stream(info.path) as src, open(tmp, "wb") as out:
        while chunk := src.read(1 << 24):
            out.write(chunk)
    tmp.replace(dest)


def local_config(cfg: ModelConfig, weights: bool = True) -> ModelConfig:
    """`cfg` with a storage-URI model.path replaced by this host's copy of it (`fetch_model`)."""
    if not is_uri(cfg.path):
        return cfg
    return dataclasses.replace(cfg, path=str(fetch_model(cfg.path, weights or cfg.family == "timm")[0]))


def check_model_files(cfg: ModelConfig) -> None:
    """A local model (model.path, or a folder as model.name) holds what its family loads (timm: one
    checkpoint file; Hugging Face: a folder with config.json, weights and a tokenizer), checked from
    the files alone before anything loads: an error naming the field and what is missing, not a
    loader's traceback, nor a tokenizer of special tokens only (transformers' answer to a folder
    without vocabulary)."""
    local = cfg.family != "timm" and cfg.name not in assets.ASSETS and Path(cfg.name).expanduser().is_dir()
    if cfg.path is None and not local:
        return  # a timm architecture, a bundled asset or a hub id: no local files to look at
    field, value = ("model.path", cfg.path) if cfg.path is not None else ("model.name", cfg.name)
    listed = None  # a storage URI: the names its folder holds (weights not copied here)
    if is_uri(value):
        path, listed = fetch_model(value, weights=cfg.family == "timm", field=field)
    else:
        path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(field, value, "no such file or folder; point it at your local weights or remove it")
    if cfg.family == "timm":
        if path.is_dir():
            raise ConfigError(
                field, value, "is a folder; a timm checkpoint is one file (.safetensors, .pth or .bin): give the file"
            )
        _check_weights(field, value, path)
        return
    if not path.is_dir():
        raise ConfigError(
            field,
            value,
            "is a file; a Hugging Face model is a folder (config.json, weights, tokenizer): give the folder",
        )
    names = listed if listed is not None else {p.name for p in path.iterdir()}
    tokenizer = {"tokenizer.json", "vocab.txt", "vocab.json"} & names or {n for n in names if n.endswith(".model")}
    parts = {
        "config.json": "config.json" in names,
        "weights (model.safetensors or pytorch_model.bin)": set(HF_WEIGHTS) & names,
        "a tokenizer (tokenizer.json, vocab.txt, vocab.json or a .model file)": tokenizer,
    }
    missing = [what for what, found in parts.items() if not found]
    if missing:
        raise ConfigError(
            field,
            value,
            f"is not a Hugging Face model folder: it lacks {', '.join(missing)} "
            f"(it holds {', '.join(sorted(names)[:8]) or 'nothing'})",
        )
    try:
        json.loads((path / "config.json").read_text())
    except (ValueError, OSError) as err:
        raise ConfigError(field, value, f"its config.json cannot be read ({type(err).__name__}: {err})") from None
    for name in HF_WEIGHTS[:2]:
        if name in names and (path / name).exists():  # a URI's weights: checked where a node copies them
            _check_weights(field, value, path / name)


def _check_weights(field: str, value: str, file: Path) -> None:
    """`file` begins as its format does: a safetensors header (a .safetensors file), else a torch
    checkpoint (a zip archive or a pickle)."""
    with open(file, "rb") as f:
        head = f.read(9)
    if file.suffix == ".safetensors":
        if len(head) < 9 or head[8:9] != b"{" or int.from_bytes(head[:8], "little") > file.stat().st_size:
            raise ConfigError(field, value, f"{file.name} is not a safetensors file: give the model's weights")
    elif not head.startswith((b"PK\x03\x04", b"\x80")):
        raise ConfigError(
            field,
            value,
            f"{file.name} is not a torch checkpoint (.pth, .bin) nor a .safetensors file: give the model's weights",
        )


def _resolve(cfg: ModelConfig) -> str:
    if cfg.path:
        return cfg.path
    if cfg.name in assets.ASSETS:
        return str(assets.require(cfg.name))
    return cfg.name


def load_base(cfg: ModelConfig, num_classes: int | None, seed: int, meta: bool = False):
    """(model, spec, tokenizer): the pretrained architecture as loaded, a new head drawn from `seed`
    (the same on every node); `finetune.load_pretrained` turns it into the model as it trains.
    `meta`: the architecture on the meta device, from the config alone: names, shapes and dtypes
    for the driver to plan with, no weight read or allocated."""
    check_model_files(cfg)
    cfg = local_config(cfg, weights=not meta)
    torch.manual_seed(seed)
    dtype = DTYPES[cfg.dtype]
    if cfg.family == "timm":
        return _load_timm(cfg, num_classes, dtype, meta)
    return _load_hf(cfg, num_classes, dtype, meta)


def _load_timm(cfg: ModelConfig, num_classes: int | None, dtype: torch.dtype, meta: bool):
    """`load_base` for a timm model: its architecture, with the checkpoint's weights where pretrained."""
    import timm

    arch = cfg.timm_arch or ASSET_TIMM_ARCH.get(cfg.name, cfg.name)
    if arch not in timm.list_models():
        raise ConfigError("model.timm_arch", arch, "not a timm architecture (see timm.list_models())")
    source = None
    if cfg.pretrained:
        source = _resolve(cfg) if (cfg.path or cfg.name in assets.ASSETS) else None
        if source is None:
            raise ConfigError(
                "model.path",
                None,
                f"pretrained '{arch}' needs local weights: set model.path to a "
                "checkpoint file, or model.pretrained=false",
            )
    if meta:  # the checkpoint's tensor names still checked here, before any node starts
        if source is not None and Path(source).exists():
            check_fits(arch, num_classes, source, *timm_field(cfg))
        with torch.device("meta"):
            model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    else:
        model = timm_model(cfg, arch, num_classes, source)
    spec = ModelSpec(
        "timm", num_classes=num_classes, timm_arch=arch, lora=cfg.lora, dtype=dtype, memory_format=cfg.memory_format
    )
    return model.to(dtype), spec, None


def _load_hf(cfg: ModelConfig, num_classes: int | None, dtype: torch.dtype, meta: bool):
    """`load_base` for a Hugging Face model: its tokenizer (a pad token set) and the model from the
    bundled asset, local folder or hub id, pretrained or drawn from the seed set by `load_base`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    source = _resolve(cfg)
    if not Path(source).exists() and "/" not in source:
        bundled = ", ".join(a for a, v in assets.ASSETS.items() if v.kind == "model")
        raise ConfigError("model.name", cfg.name, f"not a bundled asset ({bundled}), a local folder or a hub id")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    auto = AutoModelForSequenceClassification if cfg.family == "hf_classifier" else AutoModelForCausalLM
    labels = {"num_labels": num_classes} if cfg.family == "hf_classifier" else {}
    config = AutoConfig.from_pretrained(source, **labels)
    apply_overrides(cfg, config)  # checked against the tokenizer and data by `check_overrides`
    if meta:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype)
    elif not cfg.pretrained:  # from scratch: drawn from the seed `load_base` set, the same on every host
        model = auto.from_config(config, dtype=dtype)
    else:
        model = auto.from_pretrained(source, dtype=dtype, **labels)
    model.config.pad_token_id = tokenizer.pad_token_id
    spec = ModelSpec(
        cfg.family,
        num_classes=num_classes,
        hf_config=model.config,
        lora=cfg.lora,
        dtype=dtype,
        memory_format=cfg.memory_format,
    )
    return model, spec, tokenizer


def weights_readable(cfg: ModelConfig) -> bool:
    """Whether this host holds the weights `load_base` would read: model.path or a local folder,
    a bundled asset already unpacked here, or a hub id in this host's hub cache (nodes stay off
    the hub); timm without pretrained weights reads nothing."""
    if is_uri(cfg.path):
        from pyarrow import fs

        try:
            storage = Storage(cfg.path)
            return storage.fs.get_file_info(storage.path("")).type != fs.FileType.NotFound
        except Exception:  # unreachable storage, no credentials, a scheme pyarrow lacks: not readable here
            return False
    if cfg.path is not None or (cfg.name not in assets.ASSETS and Path(cfg.name).expanduser().exists()):
        return Path(cfg.path or cfg.name).expanduser().exists()
    if cfg.name in assets.ASSETS:
        return assets.ASSETS[cfg.name].ready()
    if cfg.family == "timm":
        return not cfg.pretrained
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(cfg.name, "config.json"), str)


def build_architecture(spec: ModelSpec) -> nn.Module:
    """The architecture alone (random weights), with no adapters: the plain model a merged or full
    state dict loads into (`finetune.build_model` builds the model as it trains)."""
    if spec.family == "timm":
        import timm

        model = timm.create_model(spec.timm_arch, pretrained=False, num_classes=spec.num_classes)
    else:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if spec.family == "hf_classifier" else AutoModelForCausalLM
        model = auto.from_config(spec.hf_config, dtype=spec.dtype)
    return model.to(spec.dtype)


def channels_last(spec: ModelSpec, device: str) -> bool:
    """Whether a model of `spec` computes in channels_last on `device` (model.memory_format)."""
    if spec.memory_format == "auto":
        return spec.family == "timm" and device == "cpu"
    return spec.memory_format == "channels_last"


def place(model: nn.Module, spec: ModelSpec, device: str, keep_contiguous: bool = False) -> nn.Module:
    """`model` on `device` in the memory format it computes fastest in there (`channels_last`);
    `keep_contiguous` keeps torch's default (for code that walks weights in memory order).
    Only 4-D tensors change layout; their values, and every state dict taken from them, do not."""
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if not keep_contiguous and channels_last(spec, device) else model


def state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, with tied weights stored once per name as torch does."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def image_preprocessing(model: nn.Module) -> dict | None:
    """How a timm model's pretrained weights expect images: {input_size, mean, std, ...} from its
    pretrained config (timm.data.resolve_data_config); None for a model that takes no images. A
    model wrapped in adapters answers for the model it wraps."""
    if not hasattr(model, "pretrained_cfg"):
        return None
    from timm.data import resolve_data_config

    return resolve_data_config({}, model=model)
