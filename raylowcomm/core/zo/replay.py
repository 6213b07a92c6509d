"""Seeds every node derives without talking, the log of every published code (with a checkpoint,
enough to rebuild θ), and `Replica`: one node's side of SPSA with shared randomness."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from raylowcomm.core.zo.codec import Codec
from raylowcomm.core.zo.estimators import (
    check_estimator,
    check_step_rule,
    forwards_per_step,
    projected_grads,
    rule_updates,
)
from raylowcomm.core.zo.perturb import (
    NamedParams,
    apply_step_,
    decay_mask,
    mask_threshold,
    one_sided_losses,
    spsa_losses,
    timed,
    trainable_parameters,
)

_MASK63 = (1 << 63) - 1


class SeedSchedule:
    """Seeds that every node computes identically, without talking.

    blake2b of the little-endian packed (run seed, step, node, sample): unlike Python's
    `hash()`, it is the same in every process and on every machine.
    """

    def __init__(self, run_seed: int) -> None:
        self.run_seed = int(run_seed)

    def seed(self, step: int, node: int, sample: int = 0) -> int:
        packed = struct.pack("<4q", self.run_seed, step, node, sample)
        digest = hashlib.blake2b(packed, digest_size=8, person=b"raylowcomm-zo").digest()
        return int.from_bytes(digest, "little") & _MASK63


def step_seeds(schedule: SeedSchedule, step: int, node: int, num_samples: int) -> list[int]:
    """The seeds of a node's samples 0..num_samples−1 at a step."""
    return [schedule.seed(step, node, s) for s in range(num_samples)]


class ReplayLog:
    """Every (step, node, sample, code) of a run: with a checkpoint, enough to rebuild θ.

    A node joining at step k loads a checkpoint taken after step k−1 and replays steps ≥ k;
    its weights then hash equal to the others'. The codes mean nothing without the run's
    codec, seed schedule, lr, weight decay, perturbation kind, density and step rule, which
    travel in the config.
    """

    _DTYPE = np.dtype([("step", "<i8"), ("node", "<i4"), ("sample", "<i4"), ("code", "<u4")])

    def __init__(self) -> None:
        self._steps: dict[int, dict[tuple[int, int], int]] = {}

    def append(self, step: int, node: int, sample: int, code: int) -> None:
        entries = self._steps.setdefault(int(step), {})
        key = (int(node), int(sample))
        if key in entries:  # a repeated message would apply an update twice
            raise ValueError(f"step {step} already has node {node} sample {sample}")
        entries[key] = int(code)

    def __len__(self) -> int:
        return sum(len(e) for e in self._steps.values())

    @property
    def steps(self) -> list[int]:
        return sorted(self._steps)

    def step_updates(self, step: int, schedule: SeedSchedule, codec: Codec) -> list[tuple[int, float]]:
        """(seed, decoded g) of a step in (node, sample) order: what `apply_step_` takes."""
        entries = self._steps[step]
        return [(schedule.seed(step, n, s), codec.decode(entries[n, s])) for n, s in sorted(entries)]

    def replay_(
        self,
        params: NamedParams,
        from_step: int,
        to_step: int,
        *,
        schedule: SeedSchedule,
        codec: Codec,
        lr: float | Callable[[int], float],
        weight_decay: float = 0.0,
        decay: Sequence[bool] | None = None,
        kind: str = "rademacher",
        rule: str = "plain",
        density: float = 1.0,
    ) -> int:
        """Apply the logged steps from_step ≤ step < to_step in order; returns how many.
        `lr` may be a function of the step (a schedule); `rule` is the step rule (`rule_updates`)."""
        done = 0
        for step in self.steps:
            if from_step <= step < to_step:
                step_lr = lr(step) if callable(lr) else lr
                updates = rule_updates(self.step_updates(step, schedule, codec), rule)
                apply_step_(params, updates, step_lr, weight_decay, decay, kind, density)
                done += 1
        return done

    def rows(self, from_step: int = 0) -> Iterator[tuple[int, int, int, int]]:
        """(step, node, sample, code) of the steps ≥ from_step, in replay order."""
        for st in self.steps:
            if st >= from_step:
                for (n, s), c in sorted(self._steps[st].items()):
                    yield st, n, s, c

    def extend(self, rows: Iterable[tuple[int, int, int, int]]) -> None:
        for row in rows:
            self.append(*row)

    def to_bytes(self, from_step: int = 0) -> bytes:
        """The steps ≥ from_step: what a node joining from a checkpoint at from_step needs."""
        return np.array(list(self.rows(from_step)), dtype=self._DTYPE).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReplayLog:
        log = cls()
        log.extend(np.frombuffer(data, dtype=cls._DTYPE).tolist())
        return log


class Replica:
    """One node's side of SPSA with shared randomness, without Ray: at its step it measures its
    projected gradients with its `estimator` and publishes them as codes; it then applies the
    step's codes of every publisher, its own included, by replaying them in (node, sample) order
    under the step `rule` (`raylowcomm.core.zo.estimators`), perturbing a seeded `density` of the
    weights (all by default). Replicas that start equal and apply
    the same codes stay bit-identical.

    It keeps, between steps, the storage θ is parked in while θ ± εz is measured (one copy of the
    trainable parameters: allocating it per step costs page faults), the forward passes it ran
    (`forwards`), and in `times` the seconds spent per part of its steps: perturb_s, the forwards
    (forward_plus_s and forward_minus_s for two_point, forward_base_s and forward_plus_s for
    one_sided_batch) and replay_s."""

    def __init__(
        self,
        model: nn.Module,
        node: int,
        run_seed: int,
        codec: Codec,
        *,
        eps: float,
        samples: int,
        lr: float,
        weight_decay: float = 0.0,
        kind: str = "rademacher",
        include: Sequence[str] | None = None,
        step: int = 0,
        estimator: str = "two_point",
        rule: str = "plain",
        density: float = 1.0,
    ):
        check_estimator(estimator)
        check_step_rule(rule, samples)
        mask_threshold(density)
        self.model, self.node, self.codec, self.eps, self.samples = model, node, codec, eps, samples
        self.lr, self.weight_decay, self.kind, self.estimator, self.rule = lr, weight_decay, kind, estimator, rule
        self.density = density
        self.params = trainable_parameters(model, include)
        self.decay = decay_mask(self.params)
        self.schedule, self.log, self.step, self.forwards = SeedSchedule(run_seed), ReplayLog(), step, 0
        self.published: tuple[int, bytes] | None = None
        self.spare = [torch.empty_like(p) for _, p in self.params]
        parts = (
            ("forward_plus_s", "forward_minus_s") if estimator == "two_point" else ("forward_base_s", "forward_plus_s")
        )
        self.times = dict.fromkeys(("perturb_s", *parts, "replay_s"), 0.0)

    def catch_up(self, checkpoint_step: int, log: bytes) -> int:
        """A joiner: weights loaded from the checkpoint of `checkpoint_step`; replay the log up to
        its own step. Returns the steps replayed."""
        self.log = ReplayLog.from_bytes(log)
        return self.log.replay_(
            self.params,
            checkpoint_step,
            self.step,
            schedule=self.schedule,
            codec=self.codec,
            lr=self.lr,
            weight_decay=self.weight_decay,
            decay=self.decay,
            kind=self.kind,
            rule=self.rule,
            density=self.density,
        )

    def compute(self, loss_fn: Callable, batch: object) -> tuple[bytes, list[tuple[float, float]]]:
        """(this step's codes, the loss pairs measured: (L+, L−) for two_point, (L(θ+εz), L(θ)) for
        one_sided_batch); the codes are kept to apply."""
        seeds = step_seeds(self.schedule, self.step, self.node, self.samples)
        measure = spsa_losses if self.estimator == "two_point" else one_sided_losses
        pairs = measure(
            self.model,
            self.params,
            loss_fn,
            batch,
            seeds,
            self.eps,
            self.kind,
            spare=self.spare,
            times=self.times,
            density=self.density,
        )
        self.forwards += forwards_per_step(self.estimator, self.samples)
        if not all(math.isfinite(lp) and math.isfinite(lm) for lp, lm in pairs):
            raise FloatingPointError(
                f"node {self.node}, step {self.step}: the loss is not finite ({pairs[0]}): "
                f"the weights diverged; lower the learning rate (spsa.lr) or eps (spsa.eps)"
            )
        payload = self.codec.to_bytes(projected_grads(self.estimator, pairs, self.eps))
        self.published = (self.step, payload)
        return payload, pairs

    def apply(self, publishers: Sequence[int], others: bytes) -> None:
        """Apply the step: our codes kept by `compute`, the other publishers' concatenated in
        publisher order (every node's codes have the same length)."""
        step = self.step
        if self.published is None or self.published[0] != step or self.node not in publishers:
            raise RuntimeError(f"node {self.node} did not publish step {step}, asked to apply it")
        own, size = self.published[1], len(self.published[1])
        parts = iter(others[i : i + size] for i in range(0, len(others), size))
        self.log.extend(
            (step, node, sample, code)
            for node in publishers
            for sample, code in enumerate(self.codec.unpack(own if node == self.node else next(parts)))
        )
        with timed(self.times, "replay_s"):
            updates = rule_updates(self.log.step_updates(step, self.schedule, self.codec), self.rule)
            apply_step_(self.params, updates, self.lr, self.weight_decay, self.decay, self.kind, self.density)
        self.step = step + 1
