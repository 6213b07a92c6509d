"""SPSA with shared randomness (MeZO + Just One Byte) on Ray: after the initial broadcast a node
sends one byte per perturbation per step; no weights or gradients ever move. Each step every node
measures g = (L(θ+εz) − L(θ−εz)) / 2ε (or, `estimator: one_sided_batch`, (L(θ+εz) − L(θ)) / ε with
one L(θ) shared) on its own batch for `samples` seeds of (run seed, step, node, sample) and returns
g as a byte inline in its reply (an ObjectRef would cost ~250 B); the
driver relays every node the others' codes inline in `apply`, and each node replays all updates
in (node, sample) order with the DECODED values (`Replica`; `step: normalised` divides them by
their spread, computed from the same decoded values): replicas stay bit-identical,
checked every `verify_every` steps. Nodes leave, die and join at step boundaries (core/membership)
from the latest checkpoint plus the replay log; one shard per slot, `nodes.count + len(join)`.
Bytes: `train/projected_grads` (N·samples·codec B a step), `train/projected_grads_relay` (to the
N−1 others), `train/train_loss` (4 B), `train/control` (publisher lists); `details`: wire bytes and
the forward passes run (`forwards`, also on every curve point).
"""

from __future__ import annotations

import logging
import math
import re
import struct
import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import ray

from raylowcomm.actors import Node, NodeGroup, check_replicas
from raylowcomm.common.batches import batch_at, group_seed, num_examples
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.seeding import node_seed
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core.membership import JoinEvent, LeaveEvent, ScheduleError, check_schedule
from raylowcomm.core.zo.codec import Codec, codec_for
from raylowcomm.core.zo.estimators import check_step_rule, forwards_per_step, measured_loss
from raylowcomm.core.zo.perturb import mask_threshold, trainable_parameters
from raylowcomm.core.zo.replay import Replica
from raylowcomm.data import TrainSource
from raylowcomm.execution import node_bundle
from raylowcomm.runtime import wire_nbytes
from raylowcomm.storage import Storage
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    Strategy,
    curve_point,
    eval_points,
    finish_record,
    warn_unused,
)
from raylowcomm.tasks import mean_metrics
from raylowcomm.training import autocast, load_checkpoint, save_checkpoint, total_steps

logger = logging.getLogger(__name__)

LOSS_FORMAT = "<f"  # the mean loss closing a step message; a format, not a Struct: Ray pickles an actor's globals
LOSS_BYTES = struct.calcsize(LOSS_FORMAT)
CHECKPOINT, REPLAY_LOG, DRIVER_STATE = "spsa/checkpoint.safetensors", "spsa/replay_log.bin", "spsa/driver.json"
"""In storage: θ at the last checkpoint step, the log a joiner replays from it, and the driver's
counts at that checkpoint (what `--resume` continues from)."""
DRIVER_COUNTS = ("samples", "forwards", "curve", "verified", "per_step", "step0", "ckpt_step", "ckpt_size")
"""The driver's counts (SpsaRun attributes) kept in DRIVER_STATE beside the step, nodes, ledger and records."""


@dataclass
class SpsaConfig:
    """Plain SGD on the zeroth-order estimate: uses optim.batch_size (per node) and weight_decay, not name or
    momentum."""

    codec: Literal["log", "linear", "float32"] = "log"
    """log/linear: one byte per projected gradient; float32: four, for comparison."""
    g_min: float = 1e-3
    """log codec: the smallest nonzero |g| it codes (|g| < g_min/2 codes as 0)."""
    g_max: float = 1e3
    """log codec: the largest |g| it codes (larger values clip)."""
    scale: float = 1 / 16
    """linear codec: grid step."""
    perturbation: Literal["rademacher", "gaussian"] = "rademacher"
    """rademacher: z = +-1 from random bits (about 10x cheaper to draw); gaussian: z ~ N(0, 1), as MeZO."""
    eps: float = 1e-3
    """epsilon: each node scores its batch at theta + eps*z and theta - eps*z."""
    samples: int = 1
    """Perturbations (bytes) per node per step, all on the node's same batch."""
    estimator: Literal["two_point", "one_sided_batch"] = "two_point"
    """two_point (MeZO): g = (L(theta+eps*z) - L(theta-eps*z)) / 2eps, 2*samples forward passes per node per step;
    one_sided_batch (FZOO): g = (L(theta+eps*z) - L(theta)) / eps with one unperturbed L(theta) shared by the
    node's samples, samples + 1 forward passes. One byte per perturbation either way."""
    step: Literal["plain", "normalised"] = "plain"
    """plain: theta -= lr * mean(g*z); normalised: each g divided by the sample std of the step's decoded g (all
    nodes'; computed from the bytes every replica has, so replicas and joiners apply the same bits; needs
    samples >= 2). Normalised steps move about lr per weight whatever the loss scale: they want their own lr."""
    lr: float | None = None
    """SPSA's learning rate; None: optim.lr (zeroth-order steps usually want a smaller lr than backprop)."""
    steps: int | None = None
    """Steps to take; None: as many as the other strategies (optim.epochs / max_steps)."""
    density: float = 1.0
    """Fraction of the tuned weights each perturbation touches (Sparse MeZO, random mask): a multiple of 1/256 in
    [1/256, 1], drawn per perturbation from its seed, so every replica and joiner perturbs and updates the same
    weights; 1: all (no mask drawn)."""
    include: list[str] | None = None
    """Regexes of the parameters to tune (None: all)."""
    verify_every: int = 10
    """Compare the replicas' exact parameter hashes every this many steps (and at the end)."""
    leave: list[LeaveEvent] = field(default_factory=list)
    """Nodes that leave the run, [{node, step, how}] (an actor that dies leaves too)."""
    join: list[JoinEvent] = field(default_factory=list)
    """Nodes that join, [{step}]: from the latest checkpoint plus the replay log since it, no peer copy.
    The training set has one shard per node slot (nodes.count + len(join))."""

    def make_codec(self) -> Codec:
        params = {"log": {"g_min": self.g_min, "g_max": self.g_max}, "linear": {"scale": self.scale}, "float32": {}}
        return codec_for(self.codec, **params[self.codec])


@ray.remote
class SpsaNode(Node):
    """One replica (`Replica`) on its shard: it publishes its step's bytes and replays everyone's."""

    label = "spsa node"

    def __init__(self, node: int, spec, task, data: TrainSource, slots: int, cfg: RunConfig, storage: Storage,
                 weights: dict | None = None, until: int | None = None):
        super().__init__(node, cfg, spec, task, weights)
        self.storage, self.shard = storage, data.load(node, slots)  # read on the node's host
        self.hold_out(data, slots)
        o = Spsa.opts(cfg)
        self.seed, self.losses = node_seed(cfg.seed, node), []
        self.replica = Replica(self.model, node, cfg.seed, o.make_codec(), eps=o.eps, samples=o.samples,
                                  lr=o.lr if o.lr is not None else cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  kind=o.perturbation, include=o.include, step=until or 0, estimator=o.estimator,
                                  rule=o.step, density=o.density)
        self.times = {"compute_s": 0.0, "replay_s": 0.0}
        if until is not None:  # a joiner, or a resumed run: the checkpoint, then the replay log, from storage
            t0 = time.perf_counter()
            start = load_checkpoint(storage, CHECKPOINT, self.model, None)["step"]
            log = storage.read_bytes(REPLAY_LOG) if start < until else b""
            replayed = self.replica.catch_up(start, log)
            self.log(f"started at step {until}: checkpoint of step {start} + {replayed} replayed steps "
                     f"({len(log)} log bytes from {storage.uri}) in {time.perf_counter() - t0:.2f}s")

    def compute(self) -> bytes:
        """This node's step message: its codes, then its mean loss. The node keeps its own step
        count, so no step number needs to travel."""
        t0, step = time.perf_counter(), self.replica.step
        with autocast(self.cfg.optim.precision, self.device):  # the losses only: replicas apply fp32 updates
            batch = batch_at(self.shard, step, self.cfg.optim.batch_size, self.seed, group_seed(self.cfg))
            payload, pairs = self.replica.compute(self.task.loss, batch)
        self.losses.append(measured_loss(self.replica.estimator, pairs))
        self.times["compute_s"] += time.perf_counter() - t0
        every = self.cfg.log_every
        if (step + 1) % every == 0:
            decoded = ", ".join(f"{g:+.4g}" for g in self.replica.codec.from_bytes(payload))
            other = "L-" if self.replica.estimator == "two_point" else "L0"
            self.log(f"step {step + 1} loss {sum(self.losses[-every:]) / len(self.losses[-every:]):.4f} "
                     f"(L+ {pairs[0][0]:.4f} {other} {pairs[0][1]:.4f}) g {decoded}")
        return payload + struct.pack(LOSS_FORMAT, self.losses[-1])

    def apply(self, publishers: list[int], others: bytes) -> None:
        t0 = time.perf_counter()
        self.replica.apply(publishers, others)
        self.times["replay_s"] += time.perf_counter() - t0

    def save_log(self, from_step: int) -> int:
        """The replay log since `from_step` into storage, for a joiner; returns its size."""
        return self.storage.write_bytes(REPLAY_LOG, self.replica.log.to_bytes(from_step))

    def save(self) -> int:
        """Checkpoint θ at the start of the node's step into storage; returns its size."""
        return save_checkpoint(self.storage, CHECKPOINT, self.model, None, self.replica.step, extra={"node": self.rank},
                               trainable_only=self.fine_tune.trainable_only())  # LoRA: the adapters SPSA tunes

    def examples(self) -> int:
        return num_examples(self.shard)

    def extra_info(self) -> dict:
        return {"examples": num_examples(self.shard), "steps_computed": len(self.losses),
                "forwards": self.replica.forwards,
                "mean_loss": sum(self.losses) / len(self.losses) if self.losses else None,
                **{k: round(v, 3) for k, v in self.times.items()},
                **{f"replica_{k}": round(v, 3) for k, v in self.replica.times.items()}}  # perturb, forwards, replay


class Spsa(Strategy[SpsaConfig]):
    name: ClassVar[str] = "spsa"
    Config: ClassVar[type] = SpsaConfig
    fp32_updates: ClassVar[bool] = False  # every replica applies the same seeded update, bf16/fp16 weights alike

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """Joiners may be alive beside the first nodes: reserve a slot for each."""
        return [node_bundle(cfg)] * (cfg.nodes.count + len(Spsa.opts(cfg).join))

    @staticmethod
    def validate(cfg: RunConfig, steps: int | None = None) -> None:
        o = Spsa.opts(cfg)
        codec_field = "scale" if o.codec == "linear" else "g_min"
        try:
            o.make_codec()
        except ValueError as err:
            raise ConfigError(f"spsa.{codec_field}", getattr(o, codec_field), str(err)) from None
        for name in ("eps", "samples", "verify_every", "lr", "steps"):
            if getattr(o, name) is not None and not getattr(o, name) > 0:
                raise ConfigError(f"spsa.{name}", getattr(o, name), "must be > 0")
        try:
            check_step_rule(o.step, o.samples)
        except ValueError as err:
            raise ConfigError("spsa.samples", o.samples, f"with spsa.step: {o.step}: {err}") from None
        try:
            keep = mask_threshold(o.density)
        except ValueError as err:
            raise ConfigError("spsa.density", o.density, str(err)) from None
        if keep != 256 * o.density:  # the mask keeps round(256 * density) / 256 of the weights
            low, high = math.floor(256 * o.density), math.ceil(256 * o.density)
            raise ConfigError("spsa.density", o.density, f"a multiple of 1/256 in [1/256, 1]: the nearest are "
                                                         f"{low / 256} ({low}/256) and {high / 256} ({high}/256)")
        for i, pattern in enumerate(o.include or []):
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"spsa.include[{i}]", pattern, f"not a regular expression: {err}") from None
        try:
            check_schedule(cfg.nodes.count, o.leave, o.join, steps)
        except ScheduleError as err:
            raise ConfigError(f"spsa.{err.field}", err.value, err.allowed) from None
        warn_unused(cfg, "spsa", restarts="a node that dies leaves the run; new ones join with spsa.join")

    @staticmethod
    def check(ctx: RunContext) -> None:
        """spsa.include must match a weight SPSA tunes: the names come from the driver's architecture
        (weights or not), so a pattern that matches none stops the run before Ray starts."""
        include = Spsa.opts(ctx.cfg).include
        if not include:
            return
        try:
            trainable_parameters(ctx.architecture, include)
        except ValueError:
            names = [n for n, _ in trainable_parameters(ctx.architecture)]
            some = names[:: max(1, len(names) // 4)][:4]
            raise ConfigError("spsa.include", include, f"matches none of the {len(names)} weights SPSA would tune "
                                                       f"(e.g. {', '.join(some)}): give regexes (re.search) of their "
                                                       "names, or null for all") from None

    def run(self, ctx: RunContext) -> RunRecord:
        cfg, opts = ctx.cfg, Spsa.opts(ctx.cfg)
        sizes = ctx.data.train.sizes(cfg.nodes.count + len(opts.join))  # one shard per slot; None: the nodes know
        steps = opts.steps or (total_steps(cfg.optim, min(sizes)) if sizes else None)
        self.validate(cfg, steps)
        with NodeGroup(SpsaNode, cfg, Ledger(), bundles=self.bundles(cfg)) as group:  # joiners' slots too
            return SpsaRun(ctx, group, steps).run()


class SpsaRun:
    """The driver's side of one SPSA run: membership, the byte exchange, checks and the curve."""

    def __init__(self, ctx: RunContext, group: NodeGroup, steps: int | None):
        self.ctx, self.cfg, self.opts, self.group = ctx, ctx.cfg, Spsa.opts(ctx.cfg), group
        self.ledger, self.steps, self.codec = group.ledger, steps, self.opts.make_codec()
        self.slots = self.cfg.nodes.count + len(self.opts.join)
        self.clock, self.train_clock, self.storage, self.resumed_train_s = TrainClock(), TrainClock(), ctx.storage, 0.0
        self.weights_ref, self.start = None, None
        self.records, self.infos, self.verified, self.curve, self.samples, self.step0 = {}, {}, [], [], 0, {}
        self.forwards, self.node_forwards = 0, forwards_per_step(self.opts.estimator, self.opts.samples)
        self.per_step = {"payload": [], "wire": [], "control": [], "wall": []}

    def start_nodes(self) -> int:
        """The first nodes, or (resuming) the nodes running at the last checkpoint, from it; the step to start at."""
        group, count, state = self.group, self.cfg.nodes.count, None
        if self.ctx.resume and self.storage.exists(DRIVER_STATE):
            state = self.storage.read_json(DRIVER_STATE)
            self.ledger.merge(Ledger.from_dict(state["ledger"]))
            # a state written before forwards were counted: every node-step published made node_forwards
            state.setdefault("forwards", state["samples"] // self.cfg.optim.batch_size * self.node_forwards)
            for key in DRIVER_COUNTS:
                setattr(self, key, state[key])
            self.records = {int(k): v for k, v in state["records"].items()}
            self.resumed_train_s = state["train_s"]
            logger.info("[spsa] resuming at step %d from %s", state["step"], self.storage.uri_of(CHECKPOINT))
        else:
            self.ctx.fresh_state(Spsa.name)
        for k in state["running"] if state else range(count):
            self.start_node(k, "train" if state else "setup", until=state["step"] if state else None)
            self.records.setdefault(k, {"node": k, "joined_step": 0, "left_step": None, "left_how": None})
        group.share_eval_sets(self.ctx.eval_sets(val=False))
        group.ready()
        if self.steps is None:  # node files: each node knows its own size
            self.steps = total_steps(self.cfg.optim, min(group.call("examples", phase="setup", what="shard_sizes")))
            Spsa.validate(self.cfg, self.steps)
        return state["step"] if state else 0

    def start_node(self, k: int, phase: str, until: int | None) -> None:
        """Node `k`: the initial weights, or (`until`) the checkpoint and log in storage, on top of
        the initial weights where the checkpoint holds only what SPSA tunes (LoRA). It reads its
        own shard (of `slots`) where it runs: only the recipe crosses."""
        initial = until is None or self.ctx.fine_tune.trainable_only()
        if initial:
            if self.weights_ref is None:  # the driver's weights, or the recipe the node loads them by
                self.start = self.ctx.initial_model()
                self.weights_ref = ray.put(self.start[1])
            self.ledger.send(phase, *self.start)
        recipe = self.group.put(self.ctx.data.train, phase, "data_recipe")
        self.group.start(k, k, self.ctx.spec, self.ctx.data.task, recipe, self.slots, self.cfg, self.storage,
                         weights=self.weights_ref if initial else None, until=until)

    def checkpoint(self, step: int) -> None:
        """θ at `step` (from the lowest running node) and the driver's counts, into storage."""
        self.ckpt_step, self.ckpt_size = step, ray.get(self.group[min(self.group.keys())].save.remote())
        self.storage.write_json(DRIVER_STATE, {
            "step": step, "running": self.group.keys(), "ledger": self.ledger.to_dict(),
            "train_s": self.train_clock.elapsed(), "records": self.records,
            **{k: getattr(self, k) for k in DRIVER_COUNTS}})

    def run(self) -> RunRecord:
        cfg = self.cfg
        start = self.start_nodes()
        if start == 0:
            self.step0 = self.evaluate(0)
        logger.info("[spsa] %d nodes x %d steps, %d x %d B per node per step (%s, %s, %s, %s step, %d forwards), "
                    "verify every %d", len(self.group), self.steps, self.opts.samples, self.codec.nbytes,
                    self.opts.codec, self.opts.perturbation, self.opts.estimator, self.opts.step, self.node_forwards,
                    self.opts.verify_every)
        self.train_clock = TrainClock()
        self.train_clock.start -= self.resumed_train_s
        if start == 0:
            with self.train_clock.paused():
                self.checkpoint(0)
        points = set(eval_points(cfg, self.steps))
        for step in range(start, self.steps):
            self.membership(step)
            progress = self.exchange(step)
            if (step + 1) % self.opts.verify_every == 0 or step + 1 == self.steps:
                self.verify(step + 1)
            if (step + 1) % cfg.checkpoint_steps == 0 and step + 1 < self.steps:
                self.checkpoint(step + 1)
            if step + 1 in points:
                with self.train_clock.paused():
                    metrics = self.evaluate(step + 1)
                self.curve.append({**curve_point(step + 1, self.train_clock.elapsed(), self.samples,
                                                 self.ledger.total_bytes, metrics), "forwards": self.forwards})
                progress.update(metrics)
            self.ctx.report(progress)
        return self.finish(self.step0)

    def leave(self, k: int, step: int, how: str) -> None:
        if how == "remove":
            self.infos[k] = self.group.fetch.get([self.group[k].info.remote()], "final", "node_info")[0]
        self.group.remove(k, kill=how == "remove")
        self.records[k].update(left_step=step, left_how=how)
        logger.info("[spsa] step %d: node %d left (%s); running: %s", step, k, how, self.group.keys())

    def membership(self, step: int) -> None:
        for ev in self.opts.leave:
            if ev.step == step and ev.how == "kill":
                self.group[ev.node].crash.remote()  # found dead by the compute call that follows
            elif ev.step == step:
                self.leave(ev.node, step, "remove")
        for i, ev in enumerate(self.opts.join):
            if ev.step == step:
                k, group = self.cfg.nodes.count + i, self.group
                # a node writes it, the joiner reads it
                log_size = ray.get(group[min(group.keys())].save_log.remote(self.ckpt_step))
                self.ledger.record("train", "join_log", log_size)
                self.ledger.record("train", "join_checkpoint", self.ckpt_size)
                self.start_node(k, "train", step)
                self.records[k] = {"node": k, "joined_step": step, "left_step": None, "left_how": None,
                                   "joined_from_checkpoint_step": self.ckpt_step, "join_log_bytes": log_size}
                self.verify(step)

    def exchange(self, step: int) -> dict:
        """Every node's step message up, the others' codes down; returns the step's progress."""
        t0, group, ledger = time.perf_counter(), self.group, self.ledger
        messages, dead = group.gather({k: group[k].compute.remote() for k in group.keys()})
        for k in dead:
            self.leave(k, step, "died")
        if not (pubs := sorted(messages)):
            raise RuntimeError(f"step {step}: every node has left")
        codes = {k: m[:-LOSS_BYTES] for k, m in messages.items()}
        wire, control, applies = sum(wire_nbytes(m) for m in messages.values()), 0, {}
        for k in pubs:
            ledger.record("train", "projected_grads", len(codes[k]))
            ledger.record("train", "train_loss", LOSS_BYTES)
            others = b"".join(codes[j] for j in pubs if j != k)
            ledger.record("train", "projected_grads_relay", len(others))
            wire, control = wire + wire_nbytes(others), control + wire_nbytes(pubs)
            applies[k] = group[k].apply.remote(pubs, others)
        ledger.send("train", "control", pubs, copies=len(applies))
        for k in group.gather(applies)[1]:
            self.leave(k, step + 1, "died")  # its codes are in the others' replicas all the same
        self.samples += len(pubs) * self.cfg.optim.batch_size
        self.forwards += len(pubs) * self.node_forwards
        for key, value in (("payload", sum(map(len, codes.values()))), ("wire", wire), ("control", control),
                           ("wall", time.perf_counter() - t0)):
            self.per_step[key].append(value)
        losses = [struct.unpack(LOSS_FORMAT, m[-LOSS_BYTES:])[0] for m in messages.values()]
        return {"step": step + 1, "steps": self.steps, "bytes": ledger.total_bytes,
                "train_loss": sum(losses) / len(pubs)}

    def verify(self, step: int) -> None:
        digest = check_replicas(self.group.actors, step, self.ledger)
        self.verified.append({"step": step, "nodes": self.group.keys(), "hash": digest})
        logger.info("[spsa] step %d: %d replicas bit-identical (%s)", step, len(self.group), digest[:16])

    def evaluate(self, step: int) -> dict:
        """Metrics of the lowest-id running replica (they are bit-identical), scored where it lives."""
        while self.group.keys():
            k = min(self.group.keys())
            try:
                metrics = self.group.evaluate_on(k)
                logger.info("[spsa] step %d: %s (node %d)", step, metrics, k)
                return metrics
            except ray.exceptions.RayActorError:
                self.leave(k, step, "died")
        raise RuntimeError(f"step {step}: every node has left")

    def finish(self, step0: dict) -> RunRecord:
        group, steps, opts = self.group, self.steps, self.opts
        train_s = self.train_clock.elapsed()
        metrics = self.evaluate(steps)
        if self.cfg.data.eval_on_nodes:  # identical replicas, each scored on its own held-out rows
            metrics = mean_metrics(group.evaluate_all())
        hashes = dict(zip(group.keys(), ray.get([group[k].hash.remote() for k in group.keys()])))
        self.infos.update(zip(group.keys(), group.call("info", phase="final", what="node_info")))
        state = group.fetch.get([group[min(group.keys())].weights.remote()], "final", "model_weights")[0]
        nodes = [{**self.records[k], **self.infos.get(k, {}), "final_hash": hashes.get(k)}
                 for k in sorted(self.records)]
        infos = list(self.infos.values())
        compute, replay = (max((i[key] for i in infos), default=0.0) for key in ("compute_s", "replay_s"))
        total = {key: sum(values) for key, values in self.per_step.items()}
        details = {
            "step0_metrics": step0, "steps": steps, "codec": opts.codec, "codec_bytes": self.codec.nbytes,
            "perturbation": opts.perturbation, "samples_per_node_step": opts.samples, "estimator": opts.estimator,
            "step_rule": opts.step, "density": opts.density, "forwards": self.forwards,
            "forwards_per_node_step": self.node_forwards,
            "lr": opts.lr or self.cfg.optim.lr, "eps": opts.eps, "shard_slots": self.slots, "verified": self.verified,
            "grad_bytes": total["payload"], "grad_wire_bytes": total["wire"],
            "grad_relay_bytes": self.ledger.bytes_by_kind.get("train/projected_grads_relay", 0),
            "payload_bytes_per_step": total["payload"] / steps, "wire_bytes_per_step": total["wire"] / steps,
            "control_wire_bytes_per_step": total["control"] / steps, "mean_step_s": total["wall"] / steps,
            "curve_eval_s": self.train_clock.paused_s, "mean_compute_s": compute / steps,
            "mean_replay_s": replay / steps,
            "mean_exchange_s": max(0.0, (total["wall"] - compute - replay) / steps)}
        return finish_record(Spsa.name, self.ctx, self.ledger, self.clock, metrics=metrics, step=steps,
                             samples=self.samples, train_s=train_s, infos=infos, weights=state, curve=self.curve,
                             nodes=nodes, details=details, final_point={"forwards": self.forwards})
