"""SPSA with shared randomness (MeZO + Just One Byte) on Ray: after the initial broadcast, a
node sends one byte per perturbation per step; no weights or gradients ever move.

Each step every node measures g = (L(θ+εz) − L(θ−εz)) / 2ε on its own batch, for `samples`
seeds derived from (run seed, step, node, sample), and quantises g to a byte. Its step message,
the codes plus its mean loss as a float32 (for progress reports), returns inline in the task's
reply; the driver relays to every node the other nodes' codes, inline in the `apply` call. Each
node replays all updates in (node, sample) order with the DECODED values, so every replica (the
publisher too) holds the same weights, checked every `verify_every` steps by an exact hash.
Payloads travel inline rather than through the object store because an ObjectRef costs ~250 B
of wire metadata, where Ray frames raw bytes with 3 B; and the driver holding the bytes means no
payload can be lost with its publisher.

Membership: nodes leave (removed, or their actor dies) and join at step boundaries. A joiner
starts from the latest safetensors checkpoint (written by the lowest-id live node every
`checkpoint_every` steps, and at step 0) plus the (step, node, sample, byte) log since it.

Data rule: the train set is split into one shard per node slot, `nodes.count + len(join)`
slots; node ids are slots (initial nodes 0..count−1, the i-th joiner count+i), so a joiner
brings fresh data and no two nodes ever share a seed. Without joins the shards are exactly
`RunContext.shards()`.

Curve: every `eval_every` steps (and at the end) the lowest-id running node scores its replica
(they are bit-identical) on the evaluation sets, which it fetched once; the metrics come back.

Bytes (ledger): `train/projected_grads` counts what the nodes publish, N·samples·codec bytes per
step; `train/projected_grads_relay` what the driver forwards, each payload to the N−1 other
nodes; `train/train_loss` the 4-byte losses; `train/control` the publisher lists (nodes count
their own steps). `details` gives the wire bytes per step beside the payload bytes, measured
with Ray's serialiser: the messages that carry codes (up and down), and apart the publisher
lists (task envelopes, a few hundred bytes per call, are not counted, as elsewhere).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import ray

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.core import zo
from raylowcomm.data import num_examples, shard_indices, take
from raylowcomm.ledger import Ledger
from raylowcomm.models import ModelSpec, build_model, state_dict_of
from raylowcomm.runtime import actor_options, device_for, setup_threads
from raylowcomm.strategies.base import RunContext, RunRecord, Stopwatch, curve_point, eval_points, node_bundle
from raylowcomm.strategies.lofi import node_seed
from raylowcomm.tasks import score_model, task_for
from raylowcomm.training import batch_at, load_checkpoint, peak_rss_bytes, save_checkpoint, save_weights, total_steps

LOSS_FORMAT = "<f"  # a format, not a struct.Struct: Ray pickles the globals the actor's methods use
"""The mean loss closing a node's step message: a float32, enough for a progress report."""
LOSS_BYTES = struct.calcsize(LOSS_FORMAT)


@dataclass
class LeaveEvent:
    node: int
    step: int
    """The node takes no part in this step or later ones."""
    how: Literal["remove", "kill"] = "remove"
    """remove: the driver drops the node and ends its actor; kill: the actor process exits
    abruptly (a crash) and the driver finds out when its next call fails."""


@dataclass
class JoinEvent:
    step: int
    """A new node (id nodes.count + i for the i-th join) takes part from this step on."""


@dataclass
class SpsaConfig:
    """SPSA is plain SGD on the zeroth-order estimate: optim.name and optim.momentum are not
    used; optim.batch_size (per node), optim.weight_decay and the step count are."""

    codec: Literal["log", "linear", "float32"] = "log"
    """log/linear: one byte per projected gradient; float32: four, for comparison."""
    g_min: float = 1e-3
    """log codec: smallest nonzero |g|."""
    g_max: float = 1e3
    """log codec: largest |g| (larger values clip)."""
    scale: float = 1 / 16
    """linear codec: grid step."""
    perturbation: Literal["rademacher", "gaussian"] = "rademacher"
    eps: float = 1e-3
    samples: int = 1
    """Perturbations (bytes) per node per step, all on the node's same batch."""
    lr: float | None = None
    """None: optim.lr. Zeroth-order steps usually want a smaller lr than backprop."""
    steps: int | None = None
    """None: the same number of steps as the other strategies (optim.epochs / max_steps)."""
    include: list[str] | None = None
    """Regexes of the parameters to tune (None: all)."""
    verify_every: int = 10
    """Compare the replicas' exact parameter hashes every this many steps (and at the end)."""
    leave: list[LeaveEvent] = field(default_factory=list)
    join: list[JoinEvent] = field(default_factory=list)


def make_codec(opts: SpsaConfig) -> zo.Codec:
    params = {"log": {"g_min": opts.g_min, "g_max": opts.g_max}, "linear": {"scale": opts.scale}, "float32": {}}
    return zo.codec_for(opts.codec, **params[opts.codec])


def _membership_errors(count: int, opts: SpsaConfig) -> None:
    """Walk the schedule: every leave names a node running then, and one node always remains."""
    alive, next_id = set(range(count)), count
    for i, ev in enumerate(opts.join):
        if ev.step < 1:
            raise ConfigError(f"spsa.join[{i}].step", ev.step, "must be >= 1 (step 0 starts with nodes.count nodes)")
    for i, ev in enumerate(opts.leave):
        if ev.step < 1:
            raise ConfigError(f"spsa.leave[{i}].step", ev.step, "must be >= 1")
    if any(b.step < a.step for a, b in zip(opts.join, opts.join[1:])):
        raise ConfigError("spsa.join", [e.step for e in opts.join], "list joins in step order (they get node ids in that order)")
    for step in sorted({e.step for e in opts.leave} | {e.step for e in opts.join}):
        for i, ev in enumerate(opts.leave):
            if ev.step == step:
                if ev.node not in alive:
                    raise ConfigError(f"spsa.leave[{i}].node", ev.node, f"no such node is running at step {step} (running: {sorted(alive)})")
                alive.discard(ev.node)
                if not alive:
                    raise ConfigError(f"spsa.leave[{i}]", {"node": ev.node, "step": step}, "would leave no node running")
        for ev in opts.join:
            if ev.step == step:
                alive.add(next_id)
                next_id += 1


@ray.remote
class SpsaNode:
    """One replica: its model, its shard, the replay log; it computes and publishes its bytes
    and replays everyone's."""

    def __init__(self, node: int, spec: ModelSpec, shard: dict, cfg: RunConfig, weights: dict | None = None,
                 checkpoint: str | None = None, log: bytes = b"", until: int = 0):
        setup_threads(cfg.nodes.cpus)
        opts = cfg.options["spsa"]
        self.node, self.cfg, self.opts, self.shard = node, cfg, opts, shard
        self.seed = node_seed(cfg.seed, node)
        self.model = build_model(spec).to(device_for(cfg.nodes.gpus))
        self.task = task_for(spec.family, cfg.data.image_size, device_for(cfg.nodes.gpus), data=cfg.data.name)
        self.params = zo.trainable_parameters(self.model, opts.include)
        self.decay = zo.decay_mask(self.params)
        self.schedule, self.codec = zo.SeedSchedule(cfg.seed), make_codec(opts)
        self.lr = opts.lr if opts.lr is not None else cfg.optim.lr
        self.log = zo.ReplayLog()
        self.step, self.joined, self.losses = until, until, []
        self.published: tuple[int, bytes] | None = None
        self.eval_sets: tuple | None = None
        self.times = {"compute_s": 0.0, "replay_s": 0.0}
        if checkpoint is None:
            self.model.load_state_dict(weights)
        else:
            t0 = time.perf_counter()
            start = load_checkpoint(Path(checkpoint), self.model, None)["step"]
            self.log = zo.ReplayLog.from_bytes(log)
            replayed = self.log.replay_(self.params, start, until, schedule=self.schedule, codec=self.codec, lr=self.lr,
                                        weight_decay=cfg.optim.weight_decay, decay=self.decay, kind=opts.perturbation)
            self._log(f"joined at step {until}: checkpoint of step {start} + {replayed} replayed steps "
                      f"({len(log)} log bytes) in {time.perf_counter() - t0:.2f}s")

    def _log(self, msg: str) -> None:
        print(f"[spsa node {self.node}] {msg}", flush=True)

    def compute(self) -> bytes:
        """Measure this node's projected gradients at its current step; returns the step message
        (codes, then the mean loss) and keeps the codes to replay with the others'. The node
        keeps its own step count, so no step number needs to travel."""
        t0, step = time.perf_counter(), self.step
        batch = batch_at(self.shard, step, self.cfg.optim.batch_size, self.seed)
        seeds = zo.step_seeds(self.schedule, step, self.node, self.opts.samples)
        pairs = zo.spsa_losses(self.model, self.params, self.task.loss, batch, seeds, self.opts.eps, self.opts.perturbation)
        grads = [(lp - lm) / (2 * self.opts.eps) for lp, lm in pairs]
        payload = self.codec.to_bytes(grads)
        self.published = (step, payload)
        self.losses.append(sum(lp + lm for lp, lm in pairs) / (2 * len(pairs)))
        self.times["compute_s"] += time.perf_counter() - t0
        every = self.cfg.log_every
        if (step + 1) % every == 0:
            decoded = ", ".join(f"{g:+.4g}" for g in self.codec.from_bytes(payload))
            self._log(f"step {step + 1} loss {sum(self.losses[-every:]) / len(self.losses[-every:]):.4f} "
                      f"(L+ {pairs[0][0]:.4f} L- {pairs[0][1]:.4f}) g {decoded}")
        return payload + struct.pack(LOSS_FORMAT, self.losses[-1])

    def apply(self, publishers: list[int], others: bytes) -> None:
        """Replay the step's codes in (node, sample) order: ours kept by `compute`, the other
        publishers' concatenated in publisher order (every message has the same length)."""
        t0, step = time.perf_counter(), self.step
        if self.published is None or self.published[0] != step or self.node not in publishers:
            raise RuntimeError(f"node {self.node} did not publish step {step}, asked to apply it")
        own, size = self.published[1], len(self.published[1])
        parts = iter(others[i : i + size] for i in range(0, len(others), size))
        rows = [(step, node, sample, code) for node in publishers
                for sample, code in enumerate(self.codec.unpack(own if node == self.node else next(parts)))]
        self._replay(step, rows)
        self.times["replay_s"] += time.perf_counter() - t0

    def evaluate(self, sets: list) -> dict:
        """Score this replica; `sets` = [ref to (test, shift)], nested so that it is fetched once."""
        if self.eval_sets is None:
            self.eval_sets = ray.get(sets[0])
        test, shift = self.eval_sets
        return score_model(self.task, self.model, test, shift, self.cfg.optim.eval_batch_size)

    def _replay(self, step: int, rows: list) -> None:
        if step != self.step:
            raise RuntimeError(f"node {self.node} is at step {self.step}, asked to apply step {step}")
        self.log.extend(rows)
        zo.apply_step_(self.params, self.log.step_updates(step, self.schedule, self.codec), self.lr,
                       self.cfg.optim.weight_decay, self.decay, self.opts.perturbation)
        self.step = step + 1

    def log_bytes(self, from_step: int) -> bytes:
        return self.log.to_bytes(from_step)

    def save(self, path: str) -> int:
        """Checkpoint θ at the start of step `self.step` (safetensors, atomic); returns its size."""
        save_checkpoint(Path(path), self.model, None, self.step, extra={"node": self.node})
        return os.path.getsize(path)

    def hash(self) -> str:
        return zo.parameter_hash(list(self.model.named_parameters()))

    def weights(self) -> dict:
        return state_dict_of(self.model)

    def crash(self) -> None:
        os._exit(1)

    def info(self) -> dict:
        return {"node": self.node, "host": socket.gethostname(), "ray_node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes(), "examples": num_examples(self.shard),
                "steps_computed": len(self.losses), "mean_loss": sum(self.losses) / len(self.losses) if self.losses else None,
                **{k: round(v, 3) for k, v in self.times.items()}}


class ReplicaMismatch(RuntimeError):
    pass


def check_replicas(nodes: dict, step: int, ledger: Ledger) -> str:
    """The replicas' common exact parameter hash; ReplicaMismatch naming the step and the
    nodes of each differing group otherwise."""
    hashes = dict(zip(nodes, ray.get([n.hash.remote() for n in nodes.values()])))
    ledger.record("train", "verify_hash", sum(len(h) for h in hashes.values()))
    groups: dict[str, list[int]] = {}
    for k, h in hashes.items():
        groups.setdefault(h, []).append(k)
    if len(groups) > 1:
        detail = "; ".join(f"nodes {ks} hash {h[:16]}" for h, ks in groups.items())
        raise ReplicaMismatch(f"replicas differ after step {step}: {detail}")
    return next(iter(groups))


def _wire_bytes(obj) -> int:
    """Size Ray's serialiser gives an object (data + metadata): what ray.put stores."""
    ser = ray._private.worker.global_worker.get_serialization_context().serialize(obj)
    return ser.total_bytes + len(ser.metadata or b"")


class Spsa:
    name: ClassVar[str] = "spsa"
    Config: ClassVar[type] = SpsaConfig

    @staticmethod
    def bundles(cfg: RunConfig) -> list[dict[str, float]]:
        """Joiners may be alive beside the first nodes: reserve a slot for each."""
        return [node_bundle(cfg)] * (cfg.nodes.count + len(cfg.options["spsa"].join))

    @staticmethod
    def validate(cfg: RunConfig) -> None:
        o = cfg.options["spsa"]
        try:
            make_codec(o)
        except ValueError as err:
            raise ConfigError(f"spsa.{'scale' if o.codec == 'linear' else 'g_min'}", o.scale if o.codec == "linear" else o.g_min, str(err)) from None
        if not o.eps > 0:
            raise ConfigError("spsa.eps", o.eps, "must be > 0")
        for name in ("samples", "verify_every", "lr", "steps"):
            value = getattr(o, name)
            if value is not None and not value > 0:
                raise ConfigError(f"spsa.{name}", value, "must be > 0")
        for i, pattern in enumerate(o.include or []):
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"spsa.include[{i}]", pattern, f"not a regular expression: {err}") from None
        _membership_errors(cfg.nodes.count, o)

    def run(self, ctx: RunContext) -> RunRecord:
        nodes: dict[int, ray.actor.ActorHandle] = {}
        try:
            return self._run(ctx, nodes)
        finally:  # also on errors (a replica mismatch): free the actors' CPUs
            for n in nodes.values():
                ray.kill(n)

    def _run(self, ctx: RunContext, nodes: dict) -> RunRecord:
        cfg, opts = ctx.cfg, ctx.cfg.options["spsa"]
        clock, ledger, count = Stopwatch(), Ledger(), cfg.nodes.count
        out = ctx.strategy_dir(self.name)
        ckpt = out / "checkpoints" / "latest.safetensors"
        shutil.rmtree(ckpt.parent, ignore_errors=True)
        slots = count + len(opts.join)
        shards = [take(ctx.data.train, i) for i in shard_indices(num_examples(ctx.data.train), slots, cfg.seed)]
        steps = opts.steps or total_steps(cfg.optim, min(num_examples(s) for s in shards))
        for i, ev in enumerate(opts.leave + opts.join):
            if ev.step >= steps:
                kind, j = ("leave", i) if i < len(opts.leave) else ("join", i - len(opts.leave))
                raise ConfigError(f"spsa.{kind}[{j}].step", ev.step, f"the run has {steps} steps (0..{steps - 1})")
        if cfg.log_every > steps:
            print(f"[spsa] log_every={cfg.log_every} > {steps} steps: nodes will log nothing per step", flush=True)
        if opts.include:
            zo.trainable_parameters(ctx.model, opts.include)  # fails here, not in an actor, if nothing matches
        codec = make_codec(opts)

        task = task_for(ctx.spec.family, cfg.data.image_size, data=cfg.data.name)
        t0 = time.perf_counter()
        step0 = score_model(task, ctx.model, ctx.data.test, ctx.data.shift, cfg.optim.eval_batch_size)
        print(f"[spsa] step 0 (before training): {step0} ({time.perf_counter() - t0:.1f}s)", flush=True)

        initial = state_dict_of(ctx.model)
        weights_ref, options = ray.put(initial), actor_options(cfg.nodes.cpus, cfg.nodes.gpus, 0, cfg.nodes.placement, cfg.nodes.resources)
        ledger.send("setup", "initial_weights", initial, copies=count)
        records: dict[int, dict] = {}
        for k in range(count):
            ledger.send("setup", "data_shard", shards[k])
            nodes[k] = SpsaNode.options(**options).remote(k, ctx.spec, ray.put(shards[k]), cfg, weights=weights_ref)
            records[k] = {"node": k, "joined_step": 0, "left_step": None, "left_how": None}
        ray.get([n.__ray_ready__.remote() for n in nodes.values()])
        print(f"[spsa] {count} nodes x {steps} steps, {opts.samples} x {codec.nbytes} B per node per step "
              f"({opts.codec}, {opts.perturbation}), verify every {opts.verify_every}", flush=True)

        ckpt_step, ckpt_size = 0, ray.get(nodes[0].save.remote(str(ckpt)))
        samples_seen, verified, infos, curve = 0, [], {}, []
        payload_steps, wire_steps, control_steps = [], [], []  # per step: codes published; wire bytes of codes, of publisher lists
        eval_ref, has_eval_sets, points = ray.put((ctx.data.test, ctx.data.shift)), set(), set(eval_points(cfg, steps))

        def leave(k: int, step: int, how: str) -> None:
            if how == "remove":
                infos[k] = ray.get(nodes[k].info.remote())
                ledger.send("final", "node_info", infos[k])
                ray.kill(nodes[k])
            del nodes[k]
            records[k].update(left_step=step, left_how=how)
            print(f"[spsa] step {step}: node {k} left ({how}); running: {sorted(nodes)}", flush=True)

        def verify(step: int) -> None:
            digest = check_replicas(nodes, step, ledger)
            verified.append({"step": step, "nodes": sorted(nodes), "hash": digest})
            print(f"[spsa] step {step}: {len(nodes)} replicas bit-identical ({digest[:16]})", flush=True)

        def evaluate(step: int, trained_s: float) -> dict:
            """Score the lowest-id running replica and add the curve point; returns the metrics."""
            while True:
                if not nodes:
                    raise RuntimeError(f"step {step}: every node has left")
                k = min(nodes)
                if k not in has_eval_sets:
                    for split in (ctx.data.test, ctx.data.shift):
                        if split is not None:
                            ledger.send("setup", "eval_sets", split)
                    has_eval_sets.add(k)
                try:
                    metrics = ray.get(nodes[k].evaluate.remote([eval_ref]))
                    break
                except ray.exceptions.RayActorError:
                    leave(k, step, "died")
            ledger.send("final", "eval_metrics", metrics)
            curve.append(curve_point(step, trained_s, samples_seen, ledger.total_bytes, metrics))
            print(f"[spsa] step {step}: {metrics} (node {k}, {trained_s:.1f}s of training)", flush=True)
            return metrics

        train_clock, step_walls, eval_s = Stopwatch(), [], 0.0
        for step in range(steps):
            for ev in opts.leave:
                if ev.step == step:
                    if ev.how == "kill":
                        nodes[ev.node].crash.remote()  # found dead by the compute call below
                    else:
                        leave(ev.node, step, "remove")
            for i, ev in enumerate(opts.join):
                if ev.step == step:
                    k = count + i
                    donor = nodes[min(nodes)]
                    log = ray.get(donor.log_bytes.remote(ckpt_step))
                    ledger.send("train", "join_log", log)
                    ledger.record("train", "join_checkpoint", ckpt_size)
                    ledger.send("train", "data_shard", shards[k])
                    nodes[k] = SpsaNode.options(**options).remote(k, ctx.spec, ray.put(shards[k]), cfg, checkpoint=str(ckpt),
                                                                  log=log, until=step)
                    records[k] = {"node": k, "joined_step": step, "left_step": None, "left_how": None,
                                  "joined_from_checkpoint_step": ckpt_step, "join_log_bytes": len(log)}
                    verify(step)

            t0 = time.perf_counter()
            calls = {k: n.compute.remote() for k, n in nodes.items()}
            messages = {}
            for k, call in calls.items():
                try:
                    messages[k] = ray.get(call)
                except ray.exceptions.RayActorError:
                    leave(k, step, "died")
            if not nodes:
                raise RuntimeError(f"step {step}: every node has left")
            pubs = sorted(messages)  # == sorted(nodes): whoever did not publish has left
            codes = {k: m[:-LOSS_BYTES] for k, m in messages.items()}
            losses = [struct.unpack(LOSS_FORMAT, m[-LOSS_BYTES:])[0] for m in messages.values()]
            wire = sum(_wire_bytes(m) for m in messages.values())
            for k in pubs:
                ledger.record("train", "projected_grads", len(codes[k]))
                ledger.record("train", "train_loss", LOSS_BYTES)
            applies, control = {}, 0
            for k in pubs:
                others = b"".join(codes[j] for j in pubs if j != k)
                ledger.record("train", "projected_grads_relay", len(others))
                wire += _wire_bytes(others)
                control += _wire_bytes(pubs)
                applies[k] = nodes[k].apply.remote(pubs, others)
            ledger.send("train", "control", pubs, copies=len(applies))
            for k, call in applies.items():
                try:
                    ray.get(call)
                except ray.exceptions.RayActorError:
                    leave(k, step + 1, "died")  # its codes are in the others' replicas all the same
            samples_seen += len(pubs) * cfg.optim.batch_size
            payload_steps.append(sum(len(c) for c in codes.values()))
            wire_steps.append(wire)
            control_steps.append(control)
            step_walls.append(time.perf_counter() - t0)
            if (step + 1) % opts.verify_every == 0 or step + 1 == steps:
                verify(step + 1)
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < steps:
                ckpt_step, ckpt_size = step + 1, ray.get(nodes[min(nodes)].save.remote(str(ckpt)))
            progress = {"step": step + 1, "train_loss": sum(losses) / len(losses)}
            if step + 1 in points:
                t1 = time.perf_counter()
                progress.update(evaluate(step + 1, t1 - train_clock.start - eval_s))
                eval_s += time.perf_counter() - t1
            ctx.report(progress)
        train_s = train_clock.elapsed() - eval_s
        metrics = evaluate(steps, train_s)
        print(f"[spsa] after {steps} steps: {metrics} (step 0: {step0})", flush=True)

        final_hashes = dict(zip(nodes, ray.get([n.hash.remote() for n in nodes.values()])))
        for k, info in zip(nodes, ray.get([n.info.remote() for n in nodes.values()])):
            infos[k] = info
            ledger.send("final", "node_info", info)
        state = ray.get(nodes[min(nodes)].weights.remote())
        ledger.send("final", "model_weights", state)
        curve[-1]["bytes"] = ledger.total_bytes  # the final point, like every strategy's, includes collecting the result
        weights_path = save_weights(out / "model.safetensors", state)

        node_records = [{**records[k], **infos.get(k, {}), "final_hash": final_hashes.get(k)} for k in sorted(records)]
        compute = max((i["compute_s"] for i in infos.values()), default=0.0)
        replay = max((i["replay_s"] for i in infos.values()), default=0.0)
        details = {
            "step0_metrics": step0, "steps": steps, "codec": opts.codec, "codec_bytes": codec.nbytes,
            "perturbation": opts.perturbation, "samples_per_node_step": opts.samples, "lr": opts.lr or cfg.optim.lr,
            "eps": opts.eps, "shard_slots": slots, "verified": verified,
            "grad_bytes": sum(payload_steps),
            "grad_relay_bytes": ledger.bytes_by_kind.get("train/projected_grads_relay", 0),
            "grad_wire_bytes": sum(wire_steps),
            "payload_bytes_per_step": sum(payload_steps) / steps, "wire_bytes_per_step": sum(wire_steps) / steps,
            "control_wire_bytes_per_step": sum(control_steps) / steps,
            "mean_step_s": sum(step_walls) / len(step_walls), "curve_eval_s": eval_s,
            "mean_compute_s": compute / steps, "mean_replay_s": replay / steps,
            "mean_exchange_s": max(0.0, (sum(step_walls) - compute - replay) / steps),
        }
        return RunRecord(self.name, metrics, ledger, clock.elapsed(), samples_seen, train_s,
                         max(i["peak_rss_bytes"] for i in infos.values()), node_records, details, weights_path, curve)
