"""Interlocking backpropagation on Ray: the model is split depth-wise into K stages, one
`StageActor` per stage (its module, its aux head, its own optimizer), with several
micro-batches in flight so that all stages compute at once.

Update rule (``interlocking.rule``, width ``interlocking.n``; see raylowcomm/core/interlock.py):
stage k's parameters are trained by ``farthest``: the loss of head f(k) = min(k + n - 1, K - 1)
only, or ``sum``: the sum of the losses of heads k .. min(k + n - 1, K - 1); every aux head by
its own loss alone. n = 1 is local learning (nothing flows backwards), ``farthest`` with
n = K is end-to-end backprop of the final loss. A head's gradient crosses at most n - 1 stages.

Data flow. Stage 0 holds the training split and builds each micro-batch itself. A stage's
``forward`` puts (h, targets) into the object store and returns only the ObjectRef; the driver
hands that ref, unread, to stage k + 1, which fetches the tensors from stage k's store. Gradient
messages ({head: dL/dx}) travel back the same way. So the driver only ever holds refs and small
stats dicts (``details.driver_fetched`` counts every byte it read, and every tensor).

Schedule. The driver submits each batch's calls in a fixed per-actor order (all forwards, then
each backward message in arrival order) and never waits on a batch as a whole: a stage steps its
optimizer inside the call that completes its last micro-batch, then starts the next batch while
later stages are still busy. The driver only keeps at most ``max_batches_ahead`` batches in
flight (it waits for every stage's report of batch t - max_batches_ahead before submitting t).

Curve: after every ``eval_every`` batches the driver lets the pipeline drain and scores every head
on the test/shift sets through the chained stages; that time is not training time, and the
activations those evaluations send are counted in the final phase, not the curve's bytes.

Bytes (train phase): every activation, target and gradient tensor one stage sends another, by
nbytes, counted in the sending actor. Not counted: the driver's control calls and the ObjectRef
handles (tens of bytes each).
"""

from __future__ import annotations

import copy
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import ray
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raylowcomm.config import ConfigError, OptimConfig, RunConfig
from raylowcomm.core.interlock import (InterlockStage, causal_lm_loss, decoder_aux_heads, measure_unit_costs,
                                       resnet_aux_heads, split_hf_decoder, split_timm_cnn, timm_cnn_units, untie_lm_head,
                                       upstream_heads)
from raylowcomm.data import Split, num_examples
from raylowcomm.ledger import Ledger
from raylowcomm.models import ASSET_TIMM_ARCH, state_dict_of
from raylowcomm.runtime import actor_options, device_for, setup_threads
from raylowcomm.strategies.base import curve_point, eval_points, node_bundle, RunContext, RunRecord, Stopwatch
from raylowcomm.tasks import ImageClassification
from raylowcomm.training import batch_at, peak_rss_bytes, save_weights, total_steps


@dataclass
class InterlockingConfig:
    stages: int = 2
    """K: depth-wise stages, one actor each (nodes.cpus / nodes.gpus per stage)."""
    n: int = 1
    """Communication width, 1..stages: a head's loss trains at most n stages."""
    rule: Literal["farthest", "sum"] = "farthest"
    micro_batches: int = 4
    """Micro-batches per optimizer step, in flight together; optim.batch_size is split evenly."""
    balance: Literal["blocks", "params", "measured"] = "blocks"
    """How units (stem + ResNet blocks / decoder layers) are grouped into stages; measured:
    by timed forward + backward of each unit on one micro-batch."""
    aux_widths: list[int] = field(default_factory=lambda: [128, 64])
    """ResNet aux heads: (3x3 conv, BN, ReLU) widths before pool + linear."""
    aux_init_from_lm_head: bool = True
    """Decoder aux heads start as a copy of the final norm + lm_head (else random)."""
    time_budget_s: float | None = None
    """Stop submitting batches after this many seconds of training (in-flight ones finish)."""
    max_batches_ahead: int = 2
    """Batches in flight beyond the oldest unreported one (bounds memory, not a barrier)."""


LOSSES = {"cross_entropy": F.cross_entropy, "causal_lm": causal_lm_loss}


def _optimizer(cfg: OptimConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _count_tensors(obj) -> int:
    if isinstance(obj, Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0


@dataclass
class Source:
    """What stage 0 builds micro-batches from: ``kind`` "image" (uint8 pixels -> the net's
    input, labels as targets) or "tokens" (input_ids are inputs and targets)."""

    kind: Literal["image", "tokens"]
    train: Split
    eval_sets: dict[str, Split]
    batch_size: int
    seed: int
    image_size: int = 32
    eval_batch_size: int = 256


@ray.remote
class StageActor:
    """One stage: an :class:`InterlockStage` (module, aux head, own optimizer) plus the Ray
    plumbing: tensors in and out through the object store, bytes and busy time counted."""

    def __init__(self, cpus: float, gpus: float):
        setup_threads(cpus)
        self.device = device_for(gpus)
        self.stage = None

    def load(self, index: int, num_stages: int, n: int, rule: str, payload: tuple, loss: str, optim: OptimConfig,
             micro_batches: int, source: Source | None = None) -> None:
        """(Re)build the stage: module and aux head (``payload``), routing, a fresh optimizer.
        Separate from __init__ so one process can be reused, e.g. across a sweep over n."""
        module, head = payload
        module.to(self.device)
        if head is not None:
            head.to(self.device)
        self.stage = InterlockStage(index, num_stages, n, rule, module, head, LOSSES[loss],
                                    lambda params: _optimizer(optim, params), micro_batches)
        self.index, self.last = index, index == num_stages - 1
        self.loss, self.micro_batches, self.source = loss, micro_batches, source
        self.dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        self.images = ImageClassification(source.image_size, self.device) if source and source.kind == "image" else None
        self._reset_report()
        self.steps_done, self.step_times = 0, []

    def _reset_report(self) -> None:
        self.busy_s = 0.0
        self.sent = {"activations": [], "targets": [], "gradients": []}

    def _inputs(self, batch: Split) -> tuple[Tensor, Tensor]:
        if self.images is not None:
            return self.images.inputs(batch).to(self.dtype), batch["labels"].to(self.device)
        ids = batch["input_ids"].to(self.device)
        return ids, ids

    def _received(self, ref) -> object:
        value = ray.get(ref)
        return tuple(v.to(self.device) for v in value) if isinstance(value, tuple) else \
            {j: g.to(self.device) for j, g in value.items()}

    def _send(self, what: str, value) -> ray.ObjectRef:
        self.sent[what].append(_tensor_bytes(value))
        return ray.put(value)

    def _maybe_step(self) -> None:
        if self.stage.ready_to_step:
            self.stage.step()
            self.steps_done += 1
            self.step_times.append(time.perf_counter())

    @ray.method(num_returns=2)
    def forward(self, step: int, mb: int, x_ref=None):
        """Forward micro-batch ``mb`` of batch ``step``; returns (ref of (h, targets) for stage
        k + 1, ref of the early upstream message {k: dL_k/dx_k} or None)."""
        if self.index == 0:
            s = self.source
            batch = batch_at(s.train, step, s.batch_size, s.seed)
            size = s.batch_size // self.micro_batches
            x, y = self._inputs({k: v[mb * size:(mb + 1) * size] for k, v in batch.items()})
        else:
            x, y = self._received(x_ref)
        start = time.perf_counter()
        h = self.stage.forward(step * self.micro_batches + mb, x, y)
        early = self.stage.backward(step * self.micro_batches + mb, {})
        self._maybe_step()
        self.busy_s += time.perf_counter() - start
        h_ref = None
        if not self.last:
            self.sent["activations"].append(_tensor_bytes(h))
            self.sent["targets"].append(_tensor_bytes(y))
            h_ref = ray.put((h.cpu(), y.cpu()))
        return h_ref, self._send("gradients", {j: g.cpu() for j, g in early.items()}) if early else None

    def backward(self, step: int, mb: int, msg_ref):
        """Use one downstream message {j: dL_j/dh_k}; returns the ref of the message for
        stage k - 1 ({j: dL_j/dx_k}) or None."""
        if msg_ref is None:
            return None
        msg = self._received(msg_ref)
        start = time.perf_counter()
        up = self.stage.backward(step * self.micro_batches + mb, msg)
        self._maybe_step()
        self.busy_s += time.perf_counter() - start
        return self._send("gradients", {j: g.cpu() for j, g in up.items()}) if up else None

    def report(self) -> dict:
        """Since the last report: own-head losses, busy seconds, sizes of every message sent."""
        out = {"stage": self.index, "losses": list(self.stage.pop_losses().values()), "busy_s": self.busy_s,
               "sent": self.sent, "steps_done": self.steps_done}
        self._reset_report()
        return out

    @ray.method(num_returns=2)
    def evaluate(self, name: str, chunk: int, x_ref=None):
        """Eval-mode forward of eval chunk ``chunk``; returns (ref of (h, targets) for stage
        k + 1 or None, this head's summed metrics)."""
        modules = [m for m in (self.stage.module, self.stage.head) if m is not None]
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        if self.index == 0:
            s = self.source
            split = s.eval_sets[name]
            start = chunk * s.eval_batch_size
            x, y = self._inputs({k: v[start:start + s.eval_batch_size] for k, v in split.items()})
        else:
            x, y = self._received(x_ref)
        with torch.no_grad():
            h = self.stage.module(x)
            logits = self.stage.head(h) if self.stage.head is not None else h
            if self.loss == "causal_lm":
                count = int((y[:, 1:] != -100).sum())
                metrics = {"loss_sum": float(causal_lm_loss(logits, y)) * count, "count": count}
            else:
                metrics = {"loss_sum": float(F.cross_entropy(logits.float(), y, reduction="sum")), "count": len(y),
                           "correct": int((logits.argmax(-1) == y).sum())}
        for m, w in zip(modules, was):
            m.train(w)
        metrics["sent_bytes"] = 0 if self.last else _tensor_bytes((h, y))
        return (None if self.last else ray.put((h.cpu(), y.cpu()))), metrics

    def state(self) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """(stage module weights, aux head weights or None)."""
        head = self.stage.head
        return state_dict_of(self.stage.module), (state_dict_of(head) if head is not None else None)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:])]
        return {"stage": self.index, "host": socket.gethostname(), "ray_node_id": ctx.get_node_id(), "pid": os.getpid(),
                "peak_rss_bytes": peak_rss_bytes(), "steps": self.steps_done,
                "median_step_interval_s": statistics.median(gaps) if gaps else None}


# ----------------------------------------------------------------------------- driver


class DriverFetches:
    """Everything the driver reads back from the actors: bytes (pickled size) and tensors."""

    def __init__(self, ledger: Ledger):
        self.ledger, self.bytes, self.tensors = ledger, 0, 0

    def get(self, refs: list, phase: str, what: str) -> list:
        values = ray.get(refs)
        for v in values:
            self.bytes += self.ledger.send(phase, what, v)
            self.tensors += _count_tensors(v)
        return values


def message_plan(num_stages: int, n: int, rule: str) -> list[list[frozenset[int]]]:
    """For each stage k, the heads carried by each upstream message it emits per micro-batch,
    in emission order: first its forward's early message, then one per backward call (one
    backward call per message stage k + 1 emits). Empty sets are messages never sent."""
    plan: list[list[frozenset[int]]] = [[] for _ in range(num_stages)]
    for k in reversed(range(num_stages)):
        up = upstream_heads(k, num_stages, n, rule)
        incoming = [h for h in plan[k + 1] if h] if k + 1 < num_stages else []
        plan[k] = [frozenset({k}) & up] + [h & up for h in incoming]
    return plan


def submit_batch(actors: list, plan: list[list[frozenset[int]]], step: int, micro_batches: int) -> list:
    """Submit every call of batch ``step`` in each actor's execution order (all forwards, then
    one backward per incoming message kind); returns the report refs. Only refs change hands."""
    K = len(actors)
    emitted: list[list[list]] = [[[] for _ in range(micro_batches)] for _ in range(K)]  # [k][mb] -> refs
    for mb in range(micro_batches):
        x = None
        for k, actor in enumerate(actors):
            x, early = actor.forward.remote(step, mb, x)
            emitted[k][mb].append(early)
    for k in reversed(range(K - 1)):
        kinds = [i for i, heads in enumerate(plan[k + 1]) if heads]
        for i in kinds:
            for mb in range(micro_batches):
                emitted[k][mb].append(actors[k].backward.remote(step, mb, emitted[k + 1][mb][i]))
    return [actor.report.remote() for actor in actors]


def train_interlocked(actors: list, num_stages: int, n: int, rule: str, micro_batches: int, steps: int,
                      fetch: DriverFetches, time_budget_s: float | None = None, max_ahead: int = 2,
                      on_reports=None, eval_at: frozenset[int] = frozenset(), evaluate=None) -> dict:
    """Run up to ``steps`` batches (or until ``time_budget_s`` of training); returns per-stage
    losses per batch, busy seconds, message sizes, the batches run and the training time.
    ``on_reports(batch_reports)`` sees each batch's stage reports as they arrive. After batch b in
    ``eval_at`` the pipeline drains and ``evaluate(b, train_s_so_far)`` runs off the clock."""
    plan = message_plan(num_stages, n, rule)
    clock, pending, reports = Stopwatch(), [], []
    batches, evaluating_s = 0, 0.0

    def drain(keep: int) -> None:
        while len(pending) > keep:
            reports.append(fetch.get(pending.pop(0), "train", "stage_reports"))
            if on_reports is not None:
                on_reports(reports[-1])

    for step in range(steps):
        if time_budget_s is not None and clock.elapsed() - evaluating_s >= time_budget_s:
            break
        drain(max_ahead)
        pending.append(submit_batch(actors, plan, step, micro_batches))
        batches += 1
        if evaluate is not None and batches in eval_at:
            drain(0)
            started = time.perf_counter()
            evaluate(batches, clock.elapsed() - evaluating_s)
            evaluating_s += time.perf_counter() - started
    drain(0)
    return {"reports": reports, "batches": batches, "train_s": clock.elapsed() - evaluating_s}


def evaluate_chained(actors: list, eval_sets: dict[str, Split], batch_size: int, fetch: DriverFetches,
                     loss: str) -> tuple[dict[str, list[dict]], int]:
    """Every head's metrics on every eval set, chunks pipelined through the stages; returns
    ({set: [metrics of head k]}, bytes sent between stages)."""
    refs: dict[str, list[list]] = {}
    for name, split in eval_sets.items():
        refs[name] = [[] for _ in actors]
        for chunk in range((num_examples(split) + batch_size - 1) // batch_size):
            x = None
            for k, actor in enumerate(actors):
                x, metrics = actor.evaluate.remote(name, chunk, x)
                refs[name][k].append(metrics)
    out, sent = {}, 0
    for name, per_stage in refs.items():
        out[name] = []
        for stage_refs in per_stage:
            parts = fetch.get(stage_refs, "final", "eval_metrics")
            sent += sum(p["sent_bytes"] for p in parts)
            total = {key: sum(p[key] for p in parts) for key in parts[0] if key != "sent_bytes"}
            if loss == "causal_lm":
                mean = total["loss_sum"] / total["count"]
                out[name].append({"loss": mean, "perplexity": float(torch.tensor(mean).exp())})
            else:
                out[name].append({"accuracy": total["correct"] / total["count"], "loss": total["loss_sum"] / total["count"]})
    return out, sent


_PREFIX = {"test": "id", "shift": "shift"}


def _final_head_metrics(per_set: dict[str, list[dict]]) -> dict[str, float]:
    """The last stage's head on the test (id_*) and shift (shift_*) sets: the model's metrics."""
    return {f"{_PREFIX[name]}_{key}": value for name, heads in per_set.items() if name in _PREFIX
            for key, value in heads[-1].items()}


def _split(model: nn.Module, family: str, num_stages: int, balance) -> list[nn.Module]:
    return split_timm_cnn(model, num_stages, balance) if family == "timm" else split_hf_decoder(model, num_stages, balance)


def _num_units(model: nn.Module, family: str) -> int:
    return timm_cnn_units(model) if family == "timm" else model.config.num_hidden_layers


class Interlocking:
    name: ClassVar[str] = "interlocking"
    Config: ClassVar[type] = InterlockingConfig

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """One actor per stage, whatever nodes.count says."""
        return [node_bundle(cfg)] * cfg.options["interlocking"].stages

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = cfg.options["interlocking"]
        if o.stages < 1:
            raise ConfigError("interlocking.stages", o.stages, "must be >= 1")
        if not 1 <= o.n <= o.stages:
            raise ConfigError("interlocking.n", o.n, f"must be in 1..interlocking.stages ({o.stages})")
        if o.micro_batches < 1:
            raise ConfigError("interlocking.micro_batches", o.micro_batches, "must be >= 1")
        if cfg.optim.batch_size % o.micro_batches:
            raise ConfigError("interlocking.micro_batches", o.micro_batches,
                              f"must divide optim.batch_size ({cfg.optim.batch_size}) evenly")
        if o.time_budget_s is not None and o.time_budget_s <= 0:
            raise ConfigError("interlocking.time_budget_s", o.time_budget_s, "must be > 0, or null for no budget")
        if o.max_batches_ahead < 1:
            raise ConfigError("interlocking.max_batches_ahead", o.max_batches_ahead, "must be >= 1")
        if not o.aux_widths or any(w < 1 for w in o.aux_widths):
            raise ConfigError("interlocking.aux_widths", o.aux_widths, "must be a non-empty list of positive widths")
        if cfg.model.family == "hf_classifier":
            raise ConfigError("model.family", cfg.model.family, "interlocking splits timm CNNs and causal LMs (hf_causal_lm)")
        if cfg.model.family == "hf_causal_lm" and cfg.data.name not in ("hamlet", "speeches"):
            raise ConfigError("data.name", cfg.data.name, "interlocking trains a causal LM on plain text: hamlet or speeches")
        if cfg.model.family == "timm":
            arch = cfg.model.timm_arch or ASSET_TIMM_ARCH.get(cfg.model.name, cfg.model.name)
            if not any(kind in arch for kind in ("resnet", "efficientnet", "mobilenet")):
                raise ConfigError("model.name", cfg.model.name,
                                  "interlocking splits timm ResNets and EfficientNet/MobileNet models (e.g. resnet18, efficientnet_lite0)")

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts = ctx.cfg, ctx.cfg.options["interlocking"]
        K, family, M = opts.stages, ctx.spec.family, opts.micro_batches
        clock, ledger = Stopwatch(), Ledger()
        fetch = DriverFetches(ledger)
        out = ctx.strategy_dir(self.name)

        # The driver's own copy: stages share its modules, so the final weights land in it.
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(ctx.model).float().train()
        untied = family == "hf_causal_lm" and untie_lm_head(model)
        source = Source("image" if family == "timm" else "tokens", ctx.data.train, ctx.eval_sets(), cfg.optim.batch_size,
                        cfg.seed, cfg.data.image_size, cfg.optim.eval_batch_size)
        balance = opts.balance
        if balance == "measured":
            balance = self._measure(model, family, source, M)
        modules = _split(model, family, K, balance)
        if family == "timm":
            heads = resnet_aux_heads(modules, ctx.spec.num_classes, opts.aux_widths)
        else:
            heads = decoder_aux_heads(model, K, opts.aux_init_from_lm_head)
        loss = "cross_entropy" if family == "timm" else "causal_lm"

        actors, loaded = [], []
        for k in range(K):
            payload = (modules[k], heads[k] if k < K - 1 else None)
            ledger.send("setup", "stage_modules", payload)
            src = None
            if k == 0:
                src = source
                ledger.send("setup", "train_data", source.train)
                ledger.send("setup", "eval_data", source.eval_sets)
            actor = StageActor.options(**actor_options(cfg.nodes.cpus, cfg.nodes.gpus, 0, cfg.nodes.placement, cfg.nodes.resources)).remote(cfg.nodes.cpus, cfg.nodes.gpus)
            loaded.append(actor.load.remote(k, K, opts.n, opts.rule, ray.put(payload), loss, cfg.optim, M, src))
            actors.append(actor)
        ray.get(loaded)

        steps = total_steps(cfg.optim, num_examples(ctx.data.train))
        units = [len(m) - (k == K - 1) if family == "timm" else len(m.layers) for k, m in enumerate(modules)]
        print(f"[interlocking] K={K} n={opts.n} rule={opts.rule} units per stage {units}, {steps} steps x {M} micro-batches"
              + (f", budget {opts.time_budget_s}s" if opts.time_budget_s else ""), flush=True)
        stage_losses, busy = [[] for _ in range(K)], [0.0] * K

        def absorb(batch_reports: list[dict]) -> None:
            for r in batch_reports:
                k = r["stage"]
                if r["losses"]:
                    stage_losses[k].append(sum(r["losses"]) / len(r["losses"]))
                busy[k] += r["busy_s"]
                for what, sizes in r["sent"].items():
                    for size in sizes:
                        ledger.record("train", what, size)
            ctx.report({"step": len(stage_losses[K - 1]), "train_loss": stage_losses[K - 1][-1]})

        curve = []
        curve_sets = {name: split for name, split in source.eval_sets.items() if name in _PREFIX}

        def evaluate(batch: int, train_s: float) -> None:
            per_set, sent = evaluate_chained(actors, curve_sets, cfg.optim.eval_batch_size, fetch, loss)
            ledger.record("final", "curve_eval_activations", sent)
            trained_bytes = ledger.bytes_by_phase["setup"] + ledger.bytes_by_phase["train"]
            curve.append(curve_point(batch, train_s, batch * cfg.optim.batch_size, trained_bytes, _final_head_metrics(per_set)))

        trained = train_interlocked(actors, K, opts.n, opts.rule, M, steps, fetch, opts.time_budget_s, opts.max_batches_ahead,
                                    absorb, frozenset(eval_points(cfg, steps)), evaluate)
        train_s, batches = trained["train_s"], trained["batches"]
        for k in range(K):
            if cfg.log_every and stage_losses[k]:
                print(f"[interlocking] stage {k} head loss: first {stage_losses[k][0]:.4f} last {stage_losses[k][-1]:.4f}", flush=True)

        fetched_train = {"bytes": fetch.bytes, "tensors": fetch.tensors}
        per_set, eval_bytes = evaluate_chained(actors, source.eval_sets, cfg.optim.eval_batch_size, fetch, loss)
        ledger.record("final", "eval_activations", eval_bytes)
        fetched_eval = {"bytes": fetch.bytes - fetched_train["bytes"], "tensors": fetch.tensors - fetched_train["tensors"]}
        infos = fetch.get([a.info.remote() for a in actors], "final", "stage_info")
        states = fetch.get([a.state.remote() for a in actors], "final", "stage_weights")
        for module, (state, _) in zip(modules, states):
            module.load_state_dict(state)
        weights_path = save_weights(out / "model.safetensors", state_dict_of(model))
        for a in actors:
            ray.kill(a)

        metrics = _final_head_metrics(per_set)
        curve.append(curve_point(batches, train_s, batches * cfg.optim.batch_size, ledger.total_bytes, metrics))
        steady = [i["median_step_interval_s"] for i in infos if i["median_step_interval_s"] is not None]
        details = {
            "stages": K, "n": opts.n, "rule": opts.rule, "micro_batches": M, "micro_batch_size": cfg.optim.batch_size // M,
            "balance": opts.balance, "units_per_stage": units,
            "batches": batches, "step_time_s": train_s / batches if batches else None,
            "steady_step_time_s": max(steady) if steady else None,
            "busy_fraction": [b / train_s for b in busy] if train_s > 0 else None,
            "heads": {name: {f"head{k}" + ("_final" if k == K - 1 else "_aux"): m for k, m in enumerate(heads_m)}
                      for name, heads_m in per_set.items()},
            "train_head_loss_last": [v[-1] if v else None for v in stage_losses],
            "driver_fetched": {"train": fetched_train, "eval": fetched_eval},
            "lm_head_untied": untied,
        }
        if balance != opts.balance:
            details["measured_unit_costs_s"] = balance
        node_records = [{**i, "busy_s": b} for i, b in zip(infos, busy)]
        return RunRecord(self.name, metrics, ledger, clock.elapsed(), batches * cfg.optim.batch_size, train_s,
                         max(i["peak_rss_bytes"] for i in infos), node_records, details, weights_path, curve)

    @staticmethod
    def _measure(model: nn.Module, family: str, source: Source, micro_batches: int) -> list[float]:
        """Per-unit costs on one training micro-batch, timed on a copy of the model."""
        probe = copy.deepcopy(model)
        units = _split(probe, family, _num_units(probe, family), "blocks")
        batch = batch_at(source.train, 0, source.batch_size // micro_batches, source.seed)
        x = ImageClassification(source.image_size).inputs(batch) if family == "timm" else batch["input_ids"]
        costs = measure_unit_costs(units, x)
        del probe, units
        return costs
