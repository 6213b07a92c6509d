"""The local training loop every data-parallel strategy shares (lo-fi nodes, DDP workers),
and checkpoints that a restarted node resumes from, bit for bit."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from raylowcomm.common.batches import Split, batch_at, steps_per_epoch
from raylowcomm.common.layout import laid_out_like
from raylowcomm.common.seeding import step_seed
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import ConfigError, OptimConfig
from raylowcomm.storage import Storage


def make_optimizer(cfg: OptimConfig, model: nn.Module | list[nn.Parameter]) -> torch.optim.Optimizer:
    """The run's optimizer over a model's trainable parameters (or a given list of them). Fused
    (one kernel over all parameters) on CPU and CUDA: the same update, in a fraction of the time of
    one kernel per parameter, where a step over a whole model is a visible share of a CPU node's
    step (docs/benchmarks.md has the measurement)."""
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    devices = {p.device.type for p in params}
    fused = len(devices) == 1 and devices <= {"cpu", "cuda"}
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


BUDGET_EPOCHS = 1000
"""With optim.budget_s, the run's steps are a cap this many times the epochs' (time stops it first)."""


def total_steps(cfg: OptimConfig, smallest_shard: int) -> int:
    """Steps every node (and DDP worker) takes, so all strategies see the same samples."""
    per_epoch = steps_per_epoch(smallest_shard, cfg.batch_size)
    if per_epoch == 0:
        raise ConfigError(
            "optim.batch_size",
            cfg.batch_size,
            f"larger than a node's shard ({smallest_shard} examples): lower it or raise data.train_size",
        )
    steps = per_epoch * cfg.epochs * (BUDGET_EPOCHS if cfg.budget_s else 1)
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def autocast(precision: str, device: str = "cpu"):
    """optim.precision: bf16 runs forward (and so backward) in bfloat16 where autocast allows;
    parameters and optimizer state stay fp32."""
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")


@dataclass
class StepHooks:
    """What a caller of `train_steps` does after each step besides training (lo-fi nodes checkpoint
    and snapshot, DDP ranks meet for their curve and checkpoints, both log and post progress)."""

    on_step: Callable[[int], None] | None = None
    """Called with the number of steps done: checkpoints, snapshots, curve points."""
    log: Callable[[str], None] | None = None
    """Gets the mean loss every `log_every` steps and at the last."""
    log_every: int = 0
    progress: Callable[..., None] | None = None
    """`progress(step, loss, last)` (a progress.ProgressPoster) sees every step's loss."""
    clock: TrainClock = field(default_factory=TrainClock)
    """The loop's `train_s`: what `on_step` does inside `clock.paused()` is not counted."""
    stop_after_s: float | None = None
    """Stop after the step at which `clock` reaches this many seconds (a budget: never short of it), or at
    `stop`, whichever comes first."""
    stop_nearest: bool = False
    """With `stop_after_s`: stop at the step end nearest to it instead, judging the next step by the last
    one's time on `clock` (a segment synced by time: nodes of every pace end within half a step of it, so
    a slow node's long step does not make it the late one)."""
    stop: Callable[[], bool] | None = None
    """Asked after each step (after `on_step`): True stops the loop there (DDP's ranks vote on their
    budget, so that every rank stops at the same step)."""
    pace: Callable[[int, float], None] | None = None
    """Called first with the number of steps done and how long that step took (`execution.churn.Churn`:
    a slow node sleeps, a preempted one exits before the step's checkpoint)."""

    def after(self, done: int, stop: int, losses: list[float], step_s: float = 0.0) -> None:
        if self.pace is not None:
            self.pace(done, step_s)
        if self.log and self.log_every and (done % self.log_every == 0 or done == stop):
            recent = losses[-self.log_every :]
            self.log(f"step {done}/{stop} loss {sum(recent) / len(recent):.4f}")
        if self.progress is not None:
            self.progress(done, losses[-1], last=done == stop)
        if self.on_step is not None:
            self.on_step(done)


def train_steps(
    model,
    task,
    optimizer,
    shard: Split,
    start: int,
    stop: int,
    batch_size: int,
    seed: int,
    hooks: StepHooks | None = None,
    precision: str = "fp32",
    device: str = "cpu",
    group_seed: int | None = None,
) -> dict:
    """Steps [start, stop) (fewer where `hooks.stop_after_s` comes first): per-step seeding makes
    dropout identical on a resumed run. `train_s` is `hooks.clock`'s time. `group_seed`: batches
    grouped by length (see `batch_at`)."""
    hooks = hooks or StepHooks()
    model.train()
    losses, step_s, before = [], 0.0, hooks.clock.elapsed()
    for step in range(start, stop):
        began = time.perf_counter()
        torch.manual_seed(step_seed(seed, step))
        batch = batch_at(shard, step, batch_size, seed, group_seed)
        with autocast(precision, device):
            loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_s = time.perf_counter() - began
        hooks.after(step + 1, stop, losses, step_s)
        if hooks.stop_after_s is not None:
            elapsed = hooks.clock.elapsed()
            if elapsed >= hooks.stop_after_s or (
                hooks.stop_nearest and elapsed + (elapsed - before) / 2 > hooks.stop_after_s
            ):
                break
            before = elapsed
        if hooks.stop is not None and hooks.stop():
            break
    return {
        "steps": len(losses),
        "samples": len(losses) * batch_size,
        "train_s": hooks.clock.elapsed(),
        "last_step_s": step_s,
        "mean_loss": sum(losses) / len(losses) if losses else None,
    }


def save_checkpoint(
    storage: Storage,
    rel: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict | None = None,
    trainable_only: bool = False,
) -> int:
    """Model + optimizer state as one safetensors file in `storage` (atomic); returns its size.
    `trainable_only`: the parameters that train (a LoRA model's adapters and head), for a model
    whose frozen rest every reader has already (`FineTune.trainable_only` says when)."""
    state = {k: p for k, p in model.named_parameters() if p.requires_grad} if trainable_only else model.state_dict()
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    meta = {"step": step, "extra": extra or {}}
    if optimizer is not None:
        state = optimizer.state_dict()
        scalars = {}
        for pid, pstate in state["state"].items():
            for key, value in pstate.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{pid}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{pid}.{key}"] = value
        meta["optim_scalars"] = scalars
        meta["param_groups"] = state["param_groups"]
    return storage.save_tensors(rel, dedupe_shared(tensors), meta)


def dedupe_shared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): store copies."""
    seen, out = set(), {}
    for k, v in tensors.items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def load_checkpoint(storage: Storage, rel: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Restore what `save_checkpoint` wrote onto `model` (on its device) and `optimizer`; returns the metadata."""
    tensors, meta = storage.load_tensors(rel)
    state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    result = model.load_state_dict(state, strict=False)  # a trainable_only checkpoint leaves the frozen rest as it is
    lacking = {k for k, p in model.named_parameters() if p.requires_grad} & set(result.missing_keys)
    if lacking or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {rel} does not fit the model: missing {sorted(lacking)[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    if optimizer is not None and "param_groups" in meta:
        state: dict[int, dict] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, pid, key = k.split(".", 2)
                state.setdefault(int(pid), {})[key] = v
        for k, v in meta["optim_scalars"].items():
            pid, key = k.split(".", 1)
            state.setdefault(int(pid), {})[key] = v
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        for param, state in optimizer.state.items():  # the file's contiguous buffers, as their weights lie
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    state[key] = laid_out_like(param, value)
    return meta


def save_weights(path: Path, state: dict) -> str:
    """Final weights: safetensors only, so loading them never runs code."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dedupe_shared({k: v.contiguous() for k, v in state.items()}), str(path))
    return str(path)
