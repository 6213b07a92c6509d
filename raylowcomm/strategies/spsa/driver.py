"""The driver's side of one SPSA run: membership, the byte exchange, replica checks and the curve."""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import asdict

import ray

from raylowcomm.actors import NodeGroup, check_replicas
from raylowcomm.common.ledger import Ledger
from raylowcomm.common.timing import TrainClock
from raylowcomm.core.zo.estimators import forwards_per_step
from raylowcomm.failures import all_left, cause_of
from raylowcomm.runtime import wire_nbytes
from raylowcomm.strategies.base import (
    RunContext,
    RunRecord,
    budget_details,
    curve_point,
    eval_points,
    finish_record,
)
from raylowcomm.strategies.spsa.config import NAME, SpsaConfig, check_membership
from raylowcomm.strategies.spsa.counts import DRIVER_STATE, DriverCounts
from raylowcomm.strategies.spsa.membership import NodeMembership
from raylowcomm.strategies.spsa.node import CHECKPOINT, LOSS_BYTES, LOSS_FORMAT
from raylowcomm.strategies.spsa.record import run_details
from raylowcomm.tasks import mean_metrics
from raylowcomm.training import total_steps

logger = logging.getLogger(__name__)


class SpsaRun(NodeMembership):
    """The driver's side of one SPSA run: membership, the byte exchange, checks and the curve."""

    def __init__(self, ctx: RunContext, group: NodeGroup, steps: int | None, opts: SpsaConfig):
        self.ctx, self.cfg, self.opts, self.group = ctx, ctx.cfg, opts, group
        self.ledger, self.steps, self.codec = group.ledger, steps, self.opts.make_codec()
        self.slots = self.cfg.nodes.count + len(self.opts.join)
        self.clock, self.train_clock, self.storage, self.resumed_train_s = TrainClock(), TrainClock(), ctx.storage, 0.0
        self.budget: dict | None = None
        """Where a run on optim.budget_s stopped (`budget_details`)."""
        self.weights_ref, self.start = None, None
        self.records, self.infos, self.counts = {}, {}, DriverCounts()
        self.node_forwards = forwards_per_step(self.opts.estimator, self.opts.samples)

    def start_nodes(self) -> int:
        """The first nodes, or (resuming) the nodes running at the last checkpoint, from it; the step to start at."""
        group, count, state = self.group, self.cfg.nodes.count, None
        if self.ctx.resume and self.storage.exists(DRIVER_STATE):
            state = self.storage.read_json(DRIVER_STATE)
            self.ledger.merge(Ledger.from_dict(state["ledger"]))
            # a state written before forwards were counted: every node-step published made node_forwards
            state.setdefault("forwards", state["samples"] // self.cfg.optim.batch_size * self.node_forwards)
            self.counts = DriverCounts.restored(state)
            self.records = {int(k): v for k, v in state["records"].items()}
            self.resumed_train_s = state["train_s"]
            logger.info("[spsa] resuming at step %d from %s", state["step"], self.storage.uri_of(CHECKPOINT))
        else:
            self.ctx.fresh_state(NAME)
        for k in state["running"] if state else range(count):
            self.start_node(k, "train" if state else "setup", until=state["step"] if state else None)
            self.records.setdefault(
                k, {"node": k, "joined_step": 0, "left_step": None, "left_how": None, "joined_at_s": 0.0}
            )
        group.share_eval_sets(self.ctx.eval_sets(val=False))
        group.ready()
        if self.steps is None:  # node files: each node knows its own size
            self.steps = total_steps(self.cfg.optim, min(group.call("examples", phase="setup", what="shard_sizes")))
            check_membership(count, self.opts, self.steps)
        return state["step"] if state else 0

    def checkpoint(self, step: int) -> None:
        """θ at `step` (from the lowest running node) and the driver's counts, into storage."""
        self.counts.ckpt_step, self.counts.ckpt_size = step, ray.get(self.group[min(self.group.keys())].save.remote())
        self.storage.write_json(
            DRIVER_STATE,
            {
                "step": step,
                "running": self.group.keys(),
                "ledger": self.ledger.to_dict(),
                "train_s": self.train_clock.elapsed(),
                "records": self.records,
                **asdict(self.counts),
            },
        )

    def run(self) -> RunRecord:
        cfg = self.cfg
        start = self.start_nodes()
        if start == 0:
            self.counts.step0 = self.evaluate(0)
        logger.info(
            "[spsa] %d nodes x %d steps, %d x %d B per node per step (%s, %s, %s, %s step, %d forwards), "
            "verify every %d",
            len(self.group),
            self.steps,
            self.opts.samples,
            self.codec.nbytes,
            self.opts.codec,
            self.opts.perturbation,
            self.opts.estimator,
            self.opts.step,
            self.node_forwards,
            self.opts.verify_every,
        )
        self.train_clock = TrainClock()
        self.train_clock.start -= self.resumed_train_s
        if start == 0:
            with self.train_clock.paused():
                self.checkpoint(0)
        points, budget = set(eval_points(cfg, self.steps)), cfg.optim.budget_s
        checked = self.train_clock.elapsed()
        for step in range(start, self.steps):
            self.membership(step)
            progress = self.exchange(step)
            previous, checked = checked, self.train_clock.elapsed()
            if budget is not None and checked >= budget:  # this step ends the run: verified, scored, finished
                self.budget = budget_details(budget, checked, step + 1, checked - previous)
                self.steps = step + 1
            if (step + 1) % self.opts.verify_every == 0 or step + 1 == self.steps:
                self.verify(step + 1)
            if (step + 1) % cfg.checkpoint_steps == 0 and step + 1 < self.steps:
                self.checkpoint(step + 1)
            if step + 1 in points:
                with self.train_clock.paused():
                    metrics = self.evaluate(step + 1)
                self.counts.curve.append(
                    {
                        **curve_point(
                            step + 1, self.train_clock.elapsed(), self.counts.samples, self.ledger.total_bytes, metrics
                        ),
                        "forwards": self.counts.forwards,
                    }
                )
                progress.update(metrics)
            self.ctx.report(progress)
            if step + 1 == self.steps:
                break
        return self.finish(self.counts.step0)

    def exchange(self, step: int) -> dict:
        """Every node's step message up, the others' codes down; returns the step's progress."""
        t0, group, ledger = time.perf_counter(), self.group, self.ledger
        calls = {k: group[k].compute.remote() for k in group.keys()}
        messages, dead, computing = group.gather_timed(calls, t0, "compute")
        for k in dead:
            self.leave(k, step, "died")
        if not (pubs := sorted(messages)):
            raise all_left(step, "spsa node", group.died_of)
        codes = {k: m[:-LOSS_BYTES] for k, m in messages.items()}
        wire, control, applies = sum(wire_nbytes(m) for m in messages.values()), 0, {}
        for k in pubs:
            ledger.record("train", "projected_grads", len(codes[k]))
            ledger.record("train", "train_loss", LOSS_BYTES)
            others = b"".join(codes[j] for j in pubs if j != k)
            ledger.record("train", "projected_grads_relay", len(others))
            wire, control = wire + wire_nbytes(others), control + wire_nbytes(pubs)
            applies[k] = group[k].apply.remote(pubs, others)
        sent = time.perf_counter()
        ledger.send("train", "control", pubs, copies=len(applies))
        _, dead, replaying = group.gather_timed(applies, sent, "apply")
        for k in dead:
            self.leave(k, step + 1, "died")  # its codes are in the others' replicas all the same
        self.counts.book_node_time(pubs, computing, {k: s for k, s in replaying.items() if k not in dead})
        self.counts.samples += len(pubs) * self.cfg.optim.batch_size
        self.counts.forwards += len(pubs) * self.node_forwards
        for key, value in (
            ("payload", sum(map(len, codes.values()))),
            ("wire", wire),
            ("control", control),
            ("wall", time.perf_counter() - t0),
        ):
            self.counts.per_step[key].append(value)
        losses = [struct.unpack(LOSS_FORMAT, m[-LOSS_BYTES:])[0] for m in messages.values()]
        return {
            "step": step + 1,
            "steps": self.steps,
            "bytes": ledger.total_bytes,
            "train_loss": sum(losses) / len(pubs),
        }

    def verify(self, step: int) -> None:
        digest = check_replicas(self.group.actors, step, self.ledger)
        self.counts.verified.append({"step": step, "nodes": self.group.keys(), "hash": digest})
        logger.info("[spsa] step %d: %d replicas bit-identical (%s)", step, len(self.group), digest[:16])

    def evaluate(self, step: int) -> dict:
        """Metrics of the lowest-id running replica (they are bit-identical), scored where it lives."""
        while self.group.keys():
            k = min(self.group.keys())
            try:
                metrics = self.group.evaluate_on(k)
                logger.info("[spsa] step %d: %s (node %d)", step, metrics, k)
                return metrics
            except ray.exceptions.RayActorError as err:
                self.group.died_of[k] = cause_of(err)
                self.leave(k, step, "died")
        raise all_left(step, "spsa node", self.group.died_of)

    def save_result(self, k: int) -> dict | None:
        """The replicas are bit-identical, so node k saves its own model where it is and nothing crosses
        (None); under LoRA the driver takes node k's adapters and head (small) to save them in the
        fine-tune's forms as well."""
        if self.cfg.model.lora is None:
            rel = f"{NAME}/model.safetensors"
            self.group.call("save_plain", None, self.ctx.storage, rel, phase="final", keys=[k])
            return None
        return self.group.fetch.get([self.group[k].weights.remote()], "final", "model_weights")[0]

    def finish(self, step0: dict) -> RunRecord:
        group, steps = self.group, self.steps
        train_s = self.train_clock.elapsed()
        metrics = self.evaluate(steps)
        if self.cfg.data.eval_on_nodes:  # identical replicas, each scored on its own held-out rows
            metrics = mean_metrics(group.evaluate_all())
        refs = [group[k].hash.remote() for k in group.keys()]  # each node's own, for its record: booked as fetched
        hashes = dict(zip(group.keys(), group.fetch.get(refs, "final", "final_hash")))
        self.infos.update(zip(group.keys(), group.call("info", phase="final", what="node_info")))
        state = self.save_result(min(group.keys()))
        nodes = [
            {**self.records[k], **self.infos.get(k, {}), "final_hash": hashes.get(k)} for k in sorted(self.records)
        ]
        infos = list(self.infos.values())
        details = run_details(
            self.cfg,
            self.opts,
            self.counts,
            steps,
            infos,
            step0=step0,
            budget=self.budget,
            codec_bytes=self.codec.nbytes,
            node_forwards=self.node_forwards,
            slots=self.slots,
            relay_bytes=self.ledger.bytes_by_kind.get("train/projected_grads_relay", 0),
            curve_eval_s=self.train_clock.paused_s,
        )
        return finish_record(
            NAME,
            self.ctx,
            self.ledger,
            self.clock,
            metrics=metrics,
            step=steps,
            samples=self.counts.samples,
            train_s=train_s,
            infos=infos,
            weights=state,
            curve=self.counts.curve,
            nodes=nodes,
            details=details,
            final_point={"forwards": self.counts.forwards},
            goodput=self.counts.goodput(self.records, train_s),
        )
