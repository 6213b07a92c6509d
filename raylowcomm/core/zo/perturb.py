"""Zeroth-order fine-tuning with shared randomness: SPSA (MeZO) whose updates are replayed
from (seed, one byte) on every node (Just One Byte).

A node never sends weights or gradients: it sends one projected gradient g per perturbation,
quantised to a byte. The perturbation z is regenerated from a seed that every node derives
from (run seed, step, node, sample), so every node applies the same update θ ← θ − lr·g·z and
the replicas stay bit-identical. Plain torch: nothing here knows about Ray.

Bit-identity rests on three rules kept throughout this module:
  * z comes from a CPU `torch.Generator` seeded once per seed, parameters in a fixed order,
    drawn in fixed-size chunks (`CHUNK`), so the stream does not depend on the device;
  * θ is parked while θ ± εz is measured and comes back by a storage swap, never arithmetically;
  * every node, including the one that measured g, applies the DECODED g, in (node, sample)
    order, with the same sequence of tensor ops.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import math
import re
import struct
import sys
import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

if sys.byteorder != "little":  # Rademacher signs are unpacked from the bytes of int64 words.
    raise ImportError("raylowcomm.core.zo assumes a little-endian machine")

NamedParams = Sequence[tuple[str, torch.Tensor]]
Updates = Sequence[tuple[int, float]]  # (seed, decoded g), in (node, sample) order

KINDS = ("rademacher", "gaussian")
# Elements drawn per generator call. Part of the random stream's definition (Gaussian draws
# depend on it), so it must be the same on every node; it also caps the temporary memory.
CHUNK = 1 << 18

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


def trainable_parameters(
    model: nn.Module, include: Sequence[str] | None = None
) -> list[tuple[str, nn.Parameter]]:
    """The parameters SPSA perturbs, in `named_parameters()` order (tied weights once).

    `include` restricts them to names matching any of the given regular expressions
    (`re.search`, so a plain substring works). The order is part of the random stream, so
    every node must use the same model class and the same `include`.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a LoRA model: adapters and head
    if include is None:
        return named
    patterns = [re.compile(p) for p in include]
    chosen = [(n, p) for n, p in named if any(pat.search(n) for pat in patterns)]
    if not chosen:
        raise ValueError(f"no parameter matches {list(include)}")
    return chosen


def decay_mask(params: NamedParams) -> list[bool]:
    """Weight decay only on matrices/kernels: not on biases and norm weights.

    Rule: decay iff the tensor has ≥ 2 dimensions and no dotted component of its name
    contains "norm" or starts with "ln"/"bn" (LayerNorm, ln_f, bn1, RMSNorm, ...).
    """

    def is_norm(name: str) -> bool:
        return any("norm" in c or c.startswith(("ln", "bn")) for c in name.lower().split("."))

    return [p.dim() >= 2 and not is_norm(n) for n, p in params]


# ---------------------------------------------------------------------------------------------
# Perturbations


@functools.lru_cache(maxsize=None)
def _sign_words() -> torch.Tensor:
    """Entry b holds the 8 signs of byte b as int8 (+1 where bit i is set, −1 elsewhere) packed
    in one int64: unpacking gathers one 8-byte word per byte, 40% faster than 8-float rows."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (bits * 2 - 1).to(torch.int8).view(torch.int64).view(-1)


class _Scratch:
    """The buffers one pass draws every chunk's z into. Allocating ~1 MiB per chunk instead costs
    page faults that doubled the time of a draw; a z therefore lives only until the next draw."""

    def __init__(self) -> None:
        self.words = torch.empty(CHUNK // 64, dtype=torch.int64)
        self.index = torch.empty(CHUNK // 8, dtype=torch.int64)
        self.signs = torch.empty(CHUNK // 8, dtype=torch.int64)
        self._z: dict[torch.dtype, torch.Tensor] = {}

    def z(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._z:
            self._z[dtype] = torch.empty(CHUNK, dtype=dtype)
        return self._z[dtype]


def _rademacher(n: int, dtype: torch.dtype, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # One 64-bit draw gives 64 signs (z_k = +1 iff bit k of its word is set); a byte-indexed
    # table unpacks them. With z = ±1, c·z is exact, so θ + c·z rounds the same with or
    # without fused multiply-add: updates agree across CPU instruction sets.
    words = scratch.words[: (n + 63) // 64].random_(-(1 << 63), None, generator=gen)
    index, signs = scratch.index[: 8 * words.numel()], scratch.signs[: 8 * words.numel()]
    index.copy_(words.view(torch.uint8))
    torch.index_select(_sign_words(), 0, index, out=signs)
    return scratch.z(dtype)[:n].copy_(signs.view(torch.int8)[:n])


def _gaussian(n: int, dtype: torch.dtype, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # MeZO's z (the values of torch.randn(n)). Vectorised CPU kernels differ between instruction
    # sets, so Gaussian streams are only guaranteed identical between machines with the same CPU
    # capability and torch.
    return scratch.z(dtype)[:n].normal_(generator=gen)


_DRAW = {"rademacher": _rademacher, "gaussian": _gaussian}


def _slices(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Flat views of at most CHUNK elements of every tensor, in order: the unit z is drawn in."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("SPSA needs contiguous parameters")
        flat = t.detach().view(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield flat[start : start + CHUNK]


def _z_chunks(
    tensors: Iterable[torch.Tensor], seed: int, kind: str, scratch: _Scratch | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(flat slice of a tensor, its z) for every CHUNK of every tensor, in order. The z is drawn
    into `scratch` (streams may share one if each z is used before the next is drawn)."""
    if kind not in _DRAW:
        raise ValueError(f"unknown perturbation kind {kind!r}; expected one of {KINDS}")
    draw, gen, scratch = _DRAW[kind], torch.Generator().manual_seed(seed), scratch or _Scratch()
    for part in _slices(tensors):
        yield part, draw(part.numel(), part.dtype, gen, scratch).to(part.device)


def iter_z(params: NamedParams, seed: int, kind: str = "rademacher") -> Iterator[torch.Tensor]:
    """z for each parameter in order, one parameter materialised at a time."""
    tensors = [p for _, p in params]
    chunks = _z_chunks(tensors, seed, kind)
    for t in tensors:
        parts = [z.clone() for _, z in itertools.islice(chunks, -(-t.numel() // CHUNK))]
        yield torch.cat(parts).view(t.shape) if parts else torch.empty_like(t)


def apply_update_(params: NamedParams, seed: int, coeff: float, kind: str = "rademacher") -> None:
    """θ ← θ − coeff·z(seed): one pass, z regenerated chunk by chunk, no copy of θ."""
    apply_step_(params, [(seed, coeff)], 1.0, kind=kind)


def apply_step_(
    params: NamedParams,
    updates: Updates,
    lr: float,
    weight_decay: float = 0.0,
    decay: Sequence[bool] | None = None,
    kind: str = "rademacher",
) -> None:
    """θ ← θ − lr·((1/M) Σ_m g_m z_m + wd·θ) for the step's M updates (seed, decoded g).

    Decay uses θ at the start of the step and is applied once; then each update in the given
    order. Every node calls this with the same arguments, so replicas stay bit-identical.
    One pass over θ: each chunk gets its decay and then the M updates while it is in cache; an
    element sees the same ops in the same order as in M whole passes, so the bits are theirs.
    `decay` defaults to `decay_mask(params)`.
    """
    if not updates:
        raise ValueError("a step needs at least one (seed, g) update")
    tensors = [p for _, p in params]
    mask = (decay_mask(params) if decay is None else decay) if weight_decay else [False] * len(tensors)
    scratch = _Scratch()
    streams = [(_z_chunks(tensors, seed, kind, scratch), lr * g / len(updates)) for seed, g in updates]
    with torch.no_grad():
        for t, decayed in zip(tensors, mask, strict=True):
            for part in _slices([t]):
                if decayed:
                    part.mul_(1.0 - lr * weight_decay)
                for chunks, coeff in streams:
                    part.add_(next(chunks)[1], alpha=-coeff)


# ---------------------------------------------------------------------------------------------
# SPSA


@contextlib.contextmanager
def _timed(times: dict[str, float] | None, key: str) -> Iterator[None]:
    """Adds the block's wall time to times[key], where `times` is given."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if times is not None:
            times[key] = times.get(key, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def _parked(tensors: Sequence[torch.Tensor], spare: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Yields θ, parked in its own storage while the parameters use `spare`'s: they can hold
    θ ± εz, and θ comes back bitwise, even if a forward fails, by swapping storages again
    (no copy; a model that caches its weights' addresses, as CUDA graphs do, would not see it)."""
    theta = [t.data for t in tensors]
    for t, s in zip(tensors, spare, strict=True):
        t.data = s
    try:
        yield theta
    finally:
        for t, th in zip(tensors, theta):
            t.data = th


def _perturbed_(out: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], seed: int, alpha: float, kind: str) -> None:
    """out ← θ + alpha·z(seed): written from θ, so no restore is needed after the forward."""
    with torch.no_grad():
        for (part, z), dst in zip(_z_chunks(theta, seed, kind), _slices(out), strict=True):
            torch.add(part, z, alpha=alpha, out=dst)


def _mirrored_(out: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> None:
    """out, holding θ + εz, ← θ − (out − θ): its reflection through θ (lerp with weight 2), which is
    θ − εz up to a rounding, without drawing z again. Exactness is not needed here: perturbed
    weights never leave the node, only g does."""
    with torch.no_grad():
        for t, th in zip(out, theta, strict=True):
            t.lerp_(th, 2.0)


def spsa_losses(
    model: nn.Module,
    params: NamedParams,
    loss_fn: Callable[[nn.Module, object], torch.Tensor | float],
    batch: object,
    seeds: Sequence[int],
    eps: float = 1e-3,
    kind: str = "rademacher",
    *,
    spare: Sequence[torch.Tensor] | None = None,
    times: dict[str, float] | None = None,
) -> list[tuple[float, float]]:
    """(L(θ+εz_s), L(θ−εz_s)) for each seed, on the same batch (n-SPSA); kept apart from
    `spsa_projected_grads` so a node can log the loss it measured for free.

    Forward passes run in eval mode (no dropout noise in L+ − L−) under inference mode; each
    module's train/eval flag is put back afterwards. θ is parked (`_parked`); θ + εz is written
    from it into `spare`'s storage, then mirrored through θ into θ − εz: two passes over θ per
    sample, one draw of z (the update draws it again), and none to restore θ, which comes back
    bitwise (the MeZO +ε/−2ε/+ε walk is not exact). Memory: `spare`, one copy of the trainable
    parameters (allocated here if None; a `Replica` keeps its own), plus O(CHUNK) for z. `times`,
    if given, accumulates seconds under perturb_s, forward_plus_s and forward_minus_s.
    """
    tensors = [p for _, p in params]
    spare = [torch.empty_like(t) for t in tensors] if spare is None else spare
    modes = [m.training for m in model.modules()]
    model.eval()
    try:
        with _parked(tensors, spare) as theta, torch.inference_mode():
            pairs = []
            for seed in seeds:
                with _timed(times, "perturb_s"):
                    _perturbed_(tensors, theta, seed, eps, kind)
                with _timed(times, "forward_plus_s"):
                    plus = float(loss_fn(model, batch))
                with _timed(times, "perturb_s"):
                    _mirrored_(tensors, theta)
                with _timed(times, "forward_minus_s"):
                    pairs.append((plus, float(loss_fn(model, batch))))
            return pairs
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode


def spsa_projected_grads(
    model: nn.Module,
    params: NamedParams,
    loss_fn: Callable[[nn.Module, object], torch.Tensor | float],
    batch: object,
    seeds: Sequence[int],
    eps: float = 1e-3,
    kind: str = "rademacher",
) -> list[float]:
    """g_s = (L(θ+εz_s) − L(θ−εz_s)) / 2ε for each seed, on the same batch (n-SPSA)."""
    return [(lp - lm) / (2 * eps) for lp, lm in spsa_losses(model, params, loss_fn, batch, seeds, eps, kind)]


def spsa_projected_grad(
    model: nn.Module,
    params: NamedParams,
    loss_fn: Callable[[nn.Module, object], torch.Tensor | float],
    batch: object,
    seed: int,
    eps: float = 1e-3,
    kind: str = "rademacher",
) -> float:
    """One-sample SPSA estimate of ∇L·z(seed); see `spsa_projected_grads`."""
    return spsa_projected_grads(model, params, loss_fn, batch, [seed], eps, kind)[0]


def step_seeds(schedule: SeedSchedule, step: int, node: int, num_samples: int) -> list[int]:
    """The seeds of a node's samples 0..num_samples−1 at a step."""
    return [schedule.seed(step, node, s) for s in range(num_samples)]


# ---------------------------------------------------------------------------------------------
# Codecs: what crosses the network per sample


class Codec:
    """g ↔ an unsigned code of `nbytes` bytes. Decoding is the same on every node; the
    sender must apply decode(encode(g)), like everyone else."""

    nbytes: int
    _fmt: str

    def encode(self, g: float) -> int:
        raise NotImplementedError

    def decode(self, code: int) -> float:
        raise NotImplementedError

    def _check(self, g: float) -> float:
        g = float(g)
        if not math.isfinite(g):
            raise ValueError(f"projected gradient is not finite: {g}")
        return g

    def pack(self, codes: Sequence[int]) -> bytes:
        return struct.pack(f"<{len(codes)}{self._fmt}", *codes)

    def unpack(self, data: bytes) -> list[int]:
        return list(struct.unpack(f"<{len(data) // self.nbytes}{self._fmt}", data))

    def to_bytes(self, gs: Sequence[float]) -> bytes:
        return self.pack([self.encode(g) for g in gs])

    def from_bytes(self, data: bytes) -> list[float]:
        return [self.decode(c) for c in self.unpack(data)]


def _nth_root(x: float, n: int) -> float:
    """x^(1/n) for x > 1 by bisection with only correctly rounded ops (×, +, /2), so the result is
    bitwise the same on every machine, which libm's exp/log/pow do not promise."""

    def power(b: float) -> float:
        result, e = 1.0, n
        while e:
            if e & 1:
                result *= b
            b *= b
            e >>= 1
        return result

    lo, hi = 1.0, x
    while True:
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            return lo
        if power(mid) < x:
            lo = mid
        else:
            hi = mid


class LogCodec(Codec):
    """Sign bit + 7-bit log-magnitude index: code = sign·128 + k.

    k = 0 is zero; k = 1..127 decode to m_k = g_min·r^(k−1), r = (g_max/g_min)^(1/126), so
    m_127 ≈ g_max. Encoding picks the nearest level in log scale (|g| < g_min/2 → 0), clipping
    |g| > g_max to g_max. For g_min ≤ |g| ≤ g_max the relative error is ≤ √r − 1
    (`max_rel_error`, 5.6% for the default 1e-3..1e3); below g_min the absolute error is
    ≤ g_min/2. Levels are built by repeated multiplication from an exactly computed r, so
    every node decodes a byte to the same float.
    """

    nbytes = 1
    _fmt = "B"

    def __init__(self, g_min: float = 1e-3, g_max: float = 1e3) -> None:
        if not 0 < g_min < g_max:
            raise ValueError(f"need 0 < g_min < g_max, got {g_min}, {g_max}")
        r = _nth_root(g_max / g_min, 126)
        self.levels = [float(g_min)]
        for _ in range(126):
            self.levels.append(self.levels[-1] * r)
        self._bounds = [g_min / 2] + [math.sqrt(a * b) for a, b in zip(self.levels, self.levels[1:])]
        self.max_rel_error = math.sqrt(r) - 1

    def encode(self, g: float) -> int:
        g = self._check(g)
        k = bisect.bisect_right(self._bounds, abs(g))
        return k | (128 if g < 0 and k else 0)

    def decode(self, code: int) -> float:
        k = code & 127
        value = self.levels[k - 1] if k else 0.0
        return -value if code & 128 else value


class LinearCodec(Codec):
    """Clipped uniform grid: code = 128 + clamp(round(g/scale), −127, 127), value = (code−128)·scale.

    Absolute error ≤ scale/2 (`max_abs_error`) for |g| ≤ 127.5·scale; beyond, g clips to
    ±127·scale. Code 0 is never produced.
    """

    nbytes = 1
    _fmt = "B"

    def __init__(self, scale: float = 1 / 16) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.max_abs_error = self.scale / 2

    def encode(self, g: float) -> int:
        g = self._check(g)
        return 128 + max(-127, min(127, round(g / self.scale)))

    def decode(self, code: int) -> float:
        return (code - 128) * self.scale


class Float32Codec(Codec):
    """The IEEE float32 bit pattern (4 bytes): the uncompressed reference."""

    nbytes = 4
    _fmt = "I"

    def encode(self, g: float) -> int:
        g = self._check(g)
        try:
            return struct.unpack("<I", struct.pack("<f", g))[0]
        except OverflowError:
            raise ValueError(f"projected gradient {g} overflows float32") from None

    def decode(self, code: int) -> float:
        return struct.unpack("<f", struct.pack("<I", code))[0]


_CODECS = {"log": LogCodec, "linear": LinearCodec, "float32": Float32Codec}


def codec_for(name: str, **params: float) -> Codec:
    """"log" (g_min, g_max), "linear" (scale) or "float32"."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(_CODECS)}")
    return _CODECS[name](**params)


# ---------------------------------------------------------------------------------------------
# Replay


class ReplayLog:
    """Every (step, node, sample, code) of a run: with a checkpoint, enough to rebuild θ.

    A node joining at step k loads a checkpoint taken after step k−1 and replays steps ≥ k;
    its weights then hash equal to the others'. The codes mean nothing without the run's
    codec, seed schedule, lr, weight decay and perturbation kind, which travel in the config.
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
    ) -> int:
        """Apply the logged steps from_step ≤ step < to_step in order; returns how many.
        `lr` may be a function of the step (a schedule)."""
        done = 0
        for step in self.steps:
            if from_step <= step < to_step:
                step_lr = lr(step) if callable(lr) else lr
                updates = self.step_updates(step, schedule, codec)
                apply_step_(params, updates, step_lr, weight_decay, decay, kind)
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


def parameter_hash(params: NamedParams) -> str:
    """sha256 of names, dtypes, shapes and exact bytes, in order: equal iff replicas agree bitwise."""
    h = hashlib.sha256()
    for name, p in params:
        t = p.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(p.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


class Replica:
    """One node's side of SPSA with shared randomness, without Ray: at its step it measures its
    projected gradients and publishes them as codes; it then applies the step's codes of every
    publisher, its own included, by replaying them in (node, sample) order. Replicas that start
    equal and apply the same codes stay bit-identical.

    It keeps, between steps, the storage θ is parked in while θ ± εz is measured (one copy of the
    trainable parameters: allocating it per step costs page faults), and in `times` the seconds
    spent per part of its steps: perturb_s, forward_plus_s, forward_minus_s, replay_s."""

    def __init__(self, model: nn.Module, node: int, run_seed: int, codec: Codec, *, eps: float, samples: int, lr: float,
                 weight_decay: float = 0.0, kind: str = "rademacher", include: Sequence[str] | None = None, step: int = 0):
        self.model, self.node, self.codec, self.eps, self.samples = model, node, codec, eps, samples
        self.lr, self.weight_decay, self.kind = lr, weight_decay, kind
        self.params = trainable_parameters(model, include)
        self.decay = decay_mask(self.params)
        self.schedule, self.log, self.step = SeedSchedule(run_seed), ReplayLog(), step
        self.published: tuple[int, bytes] | None = None
        self.spare = [torch.empty_like(p) for _, p in self.params]
        self.times = dict.fromkeys(("perturb_s", "forward_plus_s", "forward_minus_s", "replay_s"), 0.0)

    def catch_up(self, checkpoint_step: int, log: bytes) -> int:
        """A joiner: weights loaded from the checkpoint of `checkpoint_step`; replay the log up to
        its own step. Returns the steps replayed."""
        self.log = ReplayLog.from_bytes(log)
        return self.log.replay_(self.params, checkpoint_step, self.step, schedule=self.schedule, codec=self.codec, lr=self.lr,
                                weight_decay=self.weight_decay, decay=self.decay, kind=self.kind)

    def compute(self, loss_fn: Callable, batch: object) -> tuple[bytes, list[tuple[float, float]]]:
        """(this step's codes, the (L+, L−) pairs measured); the codes are kept to apply."""
        seeds = step_seeds(self.schedule, self.step, self.node, self.samples)
        pairs = spsa_losses(self.model, self.params, loss_fn, batch, seeds, self.eps, self.kind, spare=self.spare,
                            times=self.times)
        if not all(math.isfinite(lp) and math.isfinite(lm) for lp, lm in pairs):
            raise FloatingPointError(f"node {self.node}, step {self.step}: the loss is not finite ({pairs[0]}): the weights "
                                     f"diverged; lower the learning rate (spsa.lr) or eps (spsa.eps)")
        payload = self.codec.to_bytes([(lp - lm) / (2 * self.eps) for lp, lm in pairs])
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
        self.log.extend((step, node, sample, code) for node in publishers
                        for sample, code in enumerate(self.codec.unpack(own if node == self.node else next(parts))))
        with _timed(self.times, "replay_s"):
            apply_step_(self.params, self.log.step_updates(step, self.schedule, self.codec), self.lr, self.weight_decay,
                        self.decay, self.kind)
        self.step = step + 1
