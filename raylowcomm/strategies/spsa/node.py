"""SPSA's node actor: one replica on its own shard, publishing its step's bytes and replaying everyone's."""

from __future__ import annotations

import logging
import struct
import time

import ray

from raylowcomm.actors import Node
from raylowcomm.common.batches import num_examples
from raylowcomm.config import RunConfig
from raylowcomm.core.zo.estimators import measured_loss
from raylowcomm.data import TrainSource
from raylowcomm.execution.churn import Churn
from raylowcomm.storage import Storage
from raylowcomm.strategies.spsa.config import NAME, SpsaConfig
from raylowcomm.strategies.spsa.inprocess import node_batch
from raylowcomm.training import autocast, load_checkpoint, save_checkpoint

logger = logging.getLogger(__name__)

LOSS_FORMAT = "<f"  # the mean loss closing a step message; a format, not a Struct: Ray pickles an actor's globals
LOSS_BYTES = struct.calcsize(LOSS_FORMAT)
CHECKPOINT, REPLAY_LOG = "spsa/checkpoint.safetensors", "spsa/replay_log.bin"
"""In storage: θ at the last checkpoint step, and the log a joiner replays from it."""


@ray.remote
class SpsaNode(Node):
    """One replica (`Replica`) on its shard: it publishes its step's bytes and replays everyone's."""

    label = "spsa node"
    keeps_contiguous = True  # perturbations walk each weight in memory order (core/zo/perturb.py)

    def __init__(
        self,
        node: int,
        spec,
        task,
        data: TrainSource,
        slots: int,
        cfg: RunConfig,
        o: SpsaConfig,
        storage: Storage,
        weights: dict | None = None,
        until: int | None = None,
    ):
        super().__init__(node, cfg, spec, task, weights)
        self.storage, self.shard = storage, data.load(node, slots)  # read on the node's host
        self.hold_out(data, slots)
        self.losses = []
        self.replica = o.make_replica(self.model, node, cfg.seed, cfg.optim, step=until or 0)
        self.times = {"compute_s": 0.0, "replay_s": 0.0}
        self.churn = Churn.for_node(cfg, node, slots, storage, NAME)
        if until is not None:  # a joiner, or a resumed run: the checkpoint, then the replay log, from storage
            t0 = time.perf_counter()
            start = load_checkpoint(storage, CHECKPOINT, self.model, None)["step"]
            log = storage.read_bytes(REPLAY_LOG) if start < until else b""
            replayed = self.replica.catch_up(start, log)
            self.log(
                f"started at step {until}: checkpoint of step {start} + {replayed} replayed steps "
                f"({len(log)} log bytes from {storage.uri}) in {time.perf_counter() - t0:.2f}s"
            )

    def compute(self) -> bytes:
        """This node's step message: its codes, then its mean loss. The node keeps its own step
        count, so no step number needs to travel."""
        t0, step = time.perf_counter(), self.replica.step
        with autocast(self.cfg.optim.precision, self.device):  # the losses only: replicas apply fp32 updates
            batch = node_batch(self.shard, step, self.cfg, self.replica.node)
            payload, pairs = self.replica.compute(self.task.loss, batch)
        self.losses.append(measured_loss(self.replica.estimator, pairs))
        if self.churn is not None:
            self.churn(step + 1, time.perf_counter() - t0)
        self.times["compute_s"] += time.perf_counter() - t0
        every = self.cfg.log_every
        if (step + 1) % every == 0:
            decoded = ", ".join(f"{g:+.4g}" for g in self.replica.codec.from_bytes(payload))
            other = "L-" if self.replica.estimator == "two_point" else "L0"
            self.log(
                f"step {step + 1} loss {sum(self.losses[-every:]) / len(self.losses[-every:]):.4f} "
                f"(L+ {pairs[0][0]:.4f} {other} {pairs[0][1]:.4f}) g {decoded}"
            )
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
        return save_checkpoint(
            self.storage,
            CHECKPOINT,
            self.model,
            None,
            self.replica.step,
            extra={"node": self.rank},
            trainable_only=self.fine_tune.trainable_only(),
        )  # LoRA: the adapters SPSA tunes

    def examples(self) -> int:
        return num_examples(self.shard)

    def extra_info(self) -> dict:
        return {
            "examples": num_examples(self.shard),
            "steps_computed": len(self.losses),
            "forwards": self.replica.forwards,
            "mean_loss": sum(self.losses) / len(self.losses) if self.losses else None,
            **{k: round(v, 3) for k, v in self.times.items()},
            **{f"replica_{k}": round(v, 3) for k, v in self.replica.times.items()},
        }  # perturb, forwards, replay
