"""Checking a typed config before anything starts: the fields every strategy shares (each
strategy's `validate` checks its own options after)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from raylowcomm import catalog
from raylowcomm.common.cpu_quota import quota_unavailable
from raylowcomm.config.schema import ConfigError, DataConfig, RunConfig

if TYPE_CHECKING:
    from raylowcomm.storage import Storage

SEED_LIMIT = 2**31
"""Seeds (`seed`, `--seeds`) are integers in [0, 2**31): a node's per-step seed is (seed * 1000 + node)
* 1_000_003 + step (raylowcomm.common.seeding), which torch.manual_seed takes only below 2**64;
2**31 keeps it there for any node count and step count a run can have (past about 1.8e10 it overflows)."""
SEED_RULE = (
    f"seeds are integers in [0, 2**31 = {SEED_LIMIT}): each node's per-step seed, (seed * 1000 + node)"
    " * 1000003 + step, must fit the 64 bits torch.manual_seed takes"
)


def _positive(name, value, allow_zero=False):
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(name, value, "must be >= 0" if allow_zero else "must be > 0")


def check_seed(name: str, seed) -> None:
    """`seed`, or one seed of a multi-seed run: an integer in [0, SEED_LIMIT)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(name, seed, SEED_RULE)


def own_data_name(data: DataConfig) -> str:
    """Your own data's name in messages and reports when data.name is not given: the name of its
    first file (data.files, else data.node_files), else of its folder or hub dataset (data.source)."""
    path = data.files if data.files is not None else data.node_files
    while isinstance(path, (dict, list)):
        path = next(iter(path.values() if isinstance(path, dict) else path), None)
    parts = [p for p in Path(str(path or data.source)).parts if not any(c in p for c in "*?[{")]  # not a glob's
    return Path(parts[-1]).stem if parts else str(data.source)


def kind_mismatch(data: DataConfig, family: str, kind: str, columns: dict[str, str]) -> ConfigError:
    """model.family cannot train on this kind of data; for your own data the message names the
    column role that makes it that kind."""
    role = "image" if kind == "image" else "text"
    because = f" (data.columns.{role} = {columns[role]!r})" if data.source is not None and role in columns else ""
    fix = f", or give {columns[role]!r} its right role in data.columns" if because else ""
    return ConfigError(
        "model.family",
        family,
        f"data '{data.name}' is {kind.replace('_', ' ')}{because}: "
        f"use {' or '.join(catalog.FAMILIES_FOR_KIND[kind])}{fix}",
    )


def _check_locations(cfg: RunConfig) -> None:
    """model.path exists (what it holds: models.check_model_files) and `storage` is a place
    pyarrow.fs opens: an error naming the field now, not a traceback on a node later."""
    if cfg.model.path is not None and "://" not in cfg.model.path and not Path(cfg.model.path).exists():
        raise ConfigError(
            "model.path", cfg.model.path, "no such file or folder; point it at your local weights or remove it"
        )
    if cfg.storage is not None:
        from raylowcomm.storage import storage_problem

        problem = storage_problem(cfg.storage)
        if problem is not None:
            raise ConfigError("storage", cfg.storage, problem)


def check_storage(cfg: RunConfig, out_dir: str | Path) -> Storage:
    """The run's `storage` (else OUT/state), written and deleted once (`Storage.probe`): one that
    cannot be written is a ConfigError naming the field now, before Ray or any actor starts, not a
    pyarrow traceback at the first checkpoint. Returns the `Storage`."""
    from raylowcomm.storage import Storage

    storage = Storage(cfg.storage or Path(out_dir) / "state")
    problem = storage.probe()
    if problem is not None and cfg.storage is not None:
        raise ConfigError("storage", cfg.storage, problem)
    if problem is not None:
        raise ConfigError("out_dir", str(out_dir), f"its state folder {storage.uri} (the default `storage`) {problem}")
    return storage


def validate_lora(cfg: RunConfig) -> None:
    """`model.lora` and `model.merge`, before any model is loaded or actor started: numbers only,
    so a config is checked without importing peft."""
    model = cfg.model
    if model.lora is None:
        if model.merge:
            raise ConfigError(
                "model.merge", model.merge, "only applies to LoRA runs: set model.lora or remove model.merge"
            )
        return
    lora = model.lora
    if lora.r <= 0:
        raise ConfigError("model.lora.r", lora.r, "must be > 0")
    if lora.alpha <= 0:
        raise ConfigError("model.lora.alpha", lora.alpha, "must be > 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    targets = lora.target_modules
    if targets is not None and (not targets or not all(t.strip() for t in targets)):
        raise ConfigError(
            "model.lora.target_modules",
            targets,
            "a non-empty list of module names, or null for peft's default for the architecture",
        )


def validate_dtype(cfg: RunConfig, updating: list[str]) -> None:
    """model.dtype: bf16/fp16 weights under LoRA (the base is frozen; adapters and head stay fp32),
    or where no strategy of the run is `updating` (stepping every weight it trains with an
    optimizer, `Strategy.fp32_updates`). A gradient step on bf16/fp16 weights loses updates below
    their resolution, and no fp32 master copy is kept."""
    if cfg.model.dtype == "fp32" or cfg.model.lora is not None:
        return
    if updating:
        raise ConfigError(
            "model.dtype",
            cfg.model.dtype,
            f"{', '.join(updating)} full fine-tuning updates every weight, which needs fp32 weights "
            "(steps smaller than a bf16/fp16 weight's resolution are lost): set model.lora to keep a "
            f"{cfg.model.dtype} base under fp32 adapters, or model.dtype: fp32 with "
            "optim.precision: bf16 for bf16 compute",
        )


def validate(cfg: RunConfig, fp32_updating: list[str]) -> None:
    """Fields every strategy shares; each strategy's `validate` checks its own options after.
    `fp32_updating`: the run's strategies whose optimizer steps every weight (`validate_dtype`). Your
    own data left unnamed is named after its source (data.name)."""
    validate_lora(cfg)
    validate_dtype(cfg, fp32_updating)
    if cfg.model.config_overrides and (cfg.model.pretrained or cfg.model.family == "timm"):
        raise ConfigError(
            "model.config_overrides",
            cfg.model.config_overrides,
            "changes a Hugging Face model's architecture before a random initialisation: "
            "set model.pretrained: false (the pretrained weights fit only their own config)",
        )
    _check_numbers(cfg)
    _check_data(cfg)
    _check_churn(cfg)


def _check_numbers(cfg: RunConfig) -> None:
    """Counts, sizes and rates: in range before anything reads them."""
    _positive("nodes.count", cfg.nodes.count)
    if cfg.nodes.count != int(cfg.nodes.count):
        raise ConfigError("nodes.count", cfg.nodes.count, "must be a whole number")
    _positive("nodes.cpus", cfg.nodes.cpus)
    _positive("nodes.gpus", cfg.nodes.gpus, allow_zero=True)
    _positive("nodes.max_restarts", cfg.nodes.max_restarts, allow_zero=True)
    timeout = cfg.nodes.start_timeout_s
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(
            "nodes.start_timeout_s",
            timeout,
            "seconds, a finite number > 0, or null (120 locally, no limit on a cluster)",
        )
    for key, amount in cfg.nodes.resources.items():
        if key.upper() in ("CPU", "GPU", "MEMORY"):
            raise ConfigError(f"nodes.resources.{key}", amount, "set CPUs and GPUs with nodes.cpus / nodes.gpus")
        _positive(f"nodes.resources.{key}", amount)
    _positive("optim.lr", cfg.optim.lr)
    _positive("optim.batch_size", cfg.optim.batch_size)
    _positive("optim.epochs", cfg.optim.epochs)
    _positive("optim.max_steps", cfg.optim.max_steps)
    _positive("optim.budget_s", cfg.optim.budget_s)
    _positive("optim.eval_batch_size", cfg.optim.eval_batch_size)
    _positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    if not 0 <= cfg.optim.momentum < 1:
        raise ConfigError("optim.momentum", cfg.optim.momentum, "must be in [0, 1)")
    _positive("data.test_size", cfg.data.test_size)
    _positive("data.val_size", cfg.data.val_size, allow_zero=True)
    _positive("data.train_size", cfg.data.train_size)
    _positive("data.shift_size", cfg.data.shift_size)
    _positive("data.image_size", cfg.data.image_size)
    _positive("data.max_length", cfg.data.max_length)
    _positive("log_every", cfg.log_every)
    check_seed("seed", cfg.seed)
    _positive("checkpoint_every", cfg.checkpoint_every)
    if cfg.eval_every < 0:
        raise ConfigError("eval_every", cfg.eval_every, "an integer >= 0 (0: evaluate at the end only)")


def _check_data(cfg: RunConfig) -> None:
    """What the data is and where it lies, against the model family and the nodes."""
    if cfg.data.source is not None and cfg.data.name == DataConfig.name:
        cfg.data.name = own_data_name(cfg.data)  # your own data, left unnamed, is not called after the default preset
    if cfg.data.source is None and cfg.data.name not in catalog.DATASETS:
        raise ConfigError(
            "data.name",
            cfg.data.name,
            f"expected one of {', '.join(map(repr, catalog.DATASETS))}, or set data.source to your own data",
        )
    kind = catalog.declared_kind(cfg.data.name, cfg.data.source, cfg.data.columns)
    if kind is not None and catalog.task_of(cfg.model.family, kind) is None:
        raise kind_mismatch(cfg.data, cfg.model.family, kind, cfg.data.columns)
    if cfg.optim.group_by_length and cfg.model.family == "timm":
        raise ConfigError(
            "optim.group_by_length", True, "groups text rows by length; images are all one size: remove it"
        )
    _check_locations(cfg)
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", cfg.data.path, "no such file; point it at your local data or remove it")
    if cfg.data.path is not None and (cfg.data.files is not None or cfg.data.source is not None):
        raise ConfigError("data.path", cfg.data.path, "give your files as data.files only")
    shifts = cfg.data.shift if isinstance(cfg.data.shift, dict) else {}
    for prefix, columns in [("data", cfg.data.columns), *((f"data.shift.{n}", s.columns) for n, s in shifts.items())]:
        for role, column in columns.items():
            if role not in catalog.ROLES:
                raise ConfigError(f"{prefix}.columns.{role}", column, f"roles are {', '.join(catalog.ROLES)}")
    if isinstance(cfg.data.node_files, list) and len(cfg.data.node_files) < cfg.nodes.count:
        raise ConfigError(
            "data.node_files",
            cfg.data.node_files,
            f"one entry per node: {cfg.nodes.count} nodes, {len(cfg.data.node_files)} entries",
        )
    if isinstance(cfg.data.node_files, str) and "{node}" not in cfg.data.node_files:
        raise ConfigError(
            "data.node_files", cfg.data.node_files, "a single pattern must contain {node}, e.g. shards/node_{node}.csv"
        )
    if cfg.data.node_files is not None and cfg.data.train_size is not None:
        raise ConfigError(
            "data.train_size",
            cfg.data.train_size,
            "with data.node_files each node trains on all its own rows: remove it",
        )


def _check_churn(cfg: RunConfig) -> None:
    """churn: nodes that exist, factors that slow, steps and periods that come."""
    churn, count = cfg.churn, cfg.nodes.count
    if churn.cpu_quota and (why := quota_unavailable()) is not None:
        raise ConfigError("churn.cpu_quota", True, f"{why}: set it to false")
    for kind, events in (("slow", churn.slow), ("kill", churn.kill)):
        for i, ev in enumerate(events):
            if not 0 <= ev.node < count:
                raise ConfigError(f"churn.{kind}[{i}].node", ev.node, f"name one of the nodes 0..{count - 1}")
    for i, ev in enumerate(churn.slow):
        if not ev.factor >= 1:
            raise ConfigError(f"churn.slow[{i}].factor", ev.factor, "must be >= 1 (1: as fast as it is)")
    if len({ev.node for ev in churn.slow}) != len(churn.slow):
        raise ConfigError("churn.slow", [ev.node for ev in churn.slow], "name each slow node once")
    for i, ev in enumerate(churn.kill):
        if ev.at_step < 1:
            raise ConfigError(f"churn.kill[{i}].at_step", ev.at_step, "must be >= 1 (a step the node finishes)")
    _positive("churn.kill_every_s", churn.kill_every_s)
    if churn.seed is not None:
        check_seed("churn.seed", churn.seed)


def check_kills(cfg: RunConfig, steps: int | None, left_at: dict[int, int], leave_field: str) -> None:
    """churn.kill against the run's `steps` per node (None: not known before the nodes start) and the
    step at which each node leaves (`left_at`, from `leave_field`): a kill that would never fire is
    refused, not booked as a churn run that had none."""
    if cfg.optim.budget_s is not None:
        steps = None  # a budget's step count is the clock's
    for i, ev in enumerate(cfg.churn.kill):
        if steps is not None and ev.at_step > steps:
            raise ConfigError(
                f"churn.kill[{i}].at_step",
                ev.at_step,
                f"the run takes {steps} steps per node, so this kill would never fire: "
                f"set at_step to at most {steps}, or remove it",
            )
        if ev.node in left_at and ev.at_step > left_at[ev.node]:
            raise ConfigError(
                f"churn.kill[{i}].at_step",
                ev.at_step,
                f"node {ev.node} leaves after its step {left_at[ev.node]} ({leave_field}), so this kill would "
                f"never fire: kill it by step {left_at[ev.node]}, or remove it",
            )


def check_kills_restarted(cfg: RunConfig, per_node: bool, why: str) -> None:
    """Where the run cannot go on without a killed node (`why` says so), each kill must be met by a
    restart (nodes.max_restarts): per node where each restarts alone, else for the whole group."""
    kills = Counter(f"node {ev.node}" if per_node else "the group" for ev in cfg.churn.kill)
    for who, count in kills.items():
        if count > cfg.restarts:
            raise ConfigError(
                "churn.kill",
                [{"node": ev.node, "at_step": ev.at_step} for ev in cfg.churn.kill],
                f"kills {who} {count} time(s) and nodes.max_restarts is {cfg.restarts}, but {why}: "
                f"set nodes.max_restarts to at least {count}, or kill less",
            )
    if cfg.churn.kill_every_s is not None and cfg.restarts == 0:
        raise ConfigError(
            "churn.kill_every_s",
            cfg.churn.kill_every_s,
            f"nodes.max_restarts is 0, but {why}: the first kill would end the run; set nodes.max_restarts > 0",
        )
