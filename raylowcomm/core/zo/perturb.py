"""Seeded perturbations z and the SPSA measurement and update: z drawn from a CPU generator in
fixed chunks, θ parked by a storage swap, updates applied in one fixed order, so every node gets
the same bits (the rules in `raylowcomm.core.zo`)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

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


def trainable_parameters(model: nn.Module, include: Sequence[str] | None = None) -> list[tuple[str, nn.Parameter]]:
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


@functools.cache
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
        self.mask_words = torch.empty(CHUNK // 8, dtype=torch.int64)  # one random byte per element
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


def mask_threshold(density: float) -> int:
    """The byte threshold of a sparse mask: an element is perturbed iff its random byte is below
    round(256·density), so densities are multiples of 1/256 and density 1 draws no mask at all."""
    if not 1 / 256 <= density <= 1:
        raise ValueError(f"density must be in [1/256, 1], got {density}")
    return round(256 * density)


def _masked_(z: torch.Tensor, keep: int, gen: torch.Generator, scratch: _Scratch) -> torch.Tensor:
    # Sparse perturbations (Sparse MeZO, with a random mask): one random byte per element from the
    # seed's own generator, right after the chunk's z; z is zeroed where the byte is ≥ keep. Integer
    # draws and compares: the mask is the same on every machine, so every replica perturbs and
    # updates the same elements.
    n = z.numel()
    words = scratch.mask_words[: (n + 7) // 8].random_(-(1 << 63), None, generator=gen)
    return z.masked_fill_(words.view(torch.uint8)[:n] >= keep, 0)


def _slices(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Flat views of at most CHUNK elements of every tensor, in order: the unit z is drawn in."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("SPSA needs contiguous parameters")
        flat = t.detach().view(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield flat[start : start + CHUNK]


def _z_chunks(
    tensors: Iterable[torch.Tensor], seed: int, kind: str, scratch: _Scratch | None = None, density: float = 1.0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(flat slice of a tensor, its z) for every CHUNK of every tensor, in order. The z is drawn
    into `scratch` (streams may share one if each z is used before the next is drawn). With
    density < 1 each chunk's z is followed in the stream by its mask (`_masked_`)."""
    if kind not in _DRAW:
        raise ValueError(f"unknown perturbation kind {kind!r}; expected one of {KINDS}")
    keep = mask_threshold(density)
    draw, gen, scratch = _DRAW[kind], torch.Generator().manual_seed(seed), scratch or _Scratch()
    for part in _slices(tensors):
        z = draw(part.numel(), part.dtype, gen, scratch)
        yield part, (z if keep == 256 else _masked_(z, keep, gen, scratch)).to(part.device)


def iter_z(params: NamedParams, seed: int, kind: str = "rademacher", density: float = 1.0) -> Iterator[torch.Tensor]:
    """z for each parameter in order, one parameter materialised at a time."""
    tensors = [p for _, p in params]
    chunks = _z_chunks(tensors, seed, kind, density=density)
    for t in tensors:
        parts = [z.clone() for _, z in itertools.islice(chunks, -(-t.numel() // CHUNK))]
        yield torch.cat(parts).view(t.shape) if parts else torch.empty_like(t)


def apply_update_(params: NamedParams, seed: int, coeff: float, kind: str = "rademacher", density: float = 1.0) -> None:
    """θ ← θ − coeff·z(seed): one pass, z regenerated chunk by chunk, no copy of θ."""
    apply_step_(params, [(seed, coeff)], 1.0, kind=kind, density=density)


def apply_step_(
    params: NamedParams,
    updates: Updates,
    lr: float,
    weight_decay: float = 0.0,
    decay: Sequence[bool] | None = None,
    kind: str = "rademacher",
    density: float = 1.0,
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
    streams = [(_z_chunks(tensors, seed, kind, scratch, density), lr * g / len(updates)) for seed, g in updates]
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
def timed(times: dict[str, float] | None, key: str) -> Iterator[None]:
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


def _perturbed_(
    out: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], seed: int, alpha: float, kind: str, density: float = 1.0
) -> None:
    """out ← θ + alpha·z(seed): written from θ, so no restore is needed after the forward."""
    with torch.no_grad():
        for (part, z), dst in zip(_z_chunks(theta, seed, kind, density=density), _slices(out), strict=True):
            torch.add(part, z, alpha=alpha, out=dst)


def _mirrored_(out: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> None:
    """out, holding θ + εz, ← θ − (out − θ): its reflection through θ (lerp with weight 2), which is
    θ − εz up to a rounding, without drawing z again. Exactness is not needed here: perturbed
    weights never leave the node, only g does."""
    with torch.no_grad():
        for t, th in zip(out, theta, strict=True):
            t.lerp_(th, 2.0)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Forward passes in eval mode (no dropout noise in the differences); each module's train/eval
    flag is put back afterwards, even if a forward fails."""
    modes = [m.training for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode


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
    density: float = 1.0,
) -> list[tuple[float, float]]:
    """(L(θ+εz_s), L(θ−εz_s)) for each seed, on the same batch (n-SPSA); kept apart from
    `spsa_projected_grads` so a node can log the loss it measured for free.

    Forward passes run in eval mode (`_eval_mode`) under inference mode; θ is parked (`_parked`);
    θ + εz is written from θ into `spare`'s storage, then mirrored through θ into θ − εz: two
    passes over θ per sample, one draw of z (the update draws it again), and none to restore θ,
    which comes back bitwise (the MeZO +ε/−2ε/+ε walk is not exact). Memory: `spare`, one copy
    of the trainable parameters (allocated here if None; a `Replica` keeps its own), plus
    O(CHUNK) for z. `times`, if given, accumulates seconds under perturb_s, forward_plus_s and
    forward_minus_s. `density` < 1 perturbs a seeded random subset of the weights (`_masked_`).
    """
    tensors = [p for _, p in params]
    spare = [torch.empty_like(t) for t in tensors] if spare is None else spare
    with _eval_mode(model), _parked(tensors, spare) as theta, torch.inference_mode():
        pairs = []
        for seed in seeds:
            with timed(times, "perturb_s"):
                _perturbed_(tensors, theta, seed, eps, kind, density)
            with timed(times, "forward_plus_s"):
                plus = float(loss_fn(model, batch))
            with timed(times, "perturb_s"):
                _mirrored_(tensors, theta)
            with timed(times, "forward_minus_s"):
                pairs.append((plus, float(loss_fn(model, batch))))
        return pairs


def one_sided_losses(
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
    density: float = 1.0,
) -> list[tuple[float, float]]:
    """(L(θ+εz_s), L(θ)) for each seed, on the same batch: one unperturbed forward shared by the
    batch of one-sided perturbed ones (FZOO), so len(seeds) + 1 forward passes where
    `spsa_losses` takes 2·len(seeds). L(θ) is repeated in every pair.

    Measured as in `spsa_losses`: L(θ) first, then each θ + εz written from the parked θ into
    `spare`'s storage (one pass over θ and one draw of z per sample, nothing to restore). `times`,
    if given, accumulates seconds under forward_base_s, perturb_s and forward_plus_s; `density` as
    in `spsa_losses`.
    """
    tensors = [p for _, p in params]
    spare = [torch.empty_like(t) for t in tensors] if spare is None else spare
    with _eval_mode(model):
        with timed(times, "forward_base_s"), torch.inference_mode():
            base = float(loss_fn(model, batch))
        with _parked(tensors, spare) as theta, torch.inference_mode():
            pairs = []
            for seed in seeds:
                with timed(times, "perturb_s"):
                    _perturbed_(tensors, theta, seed, eps, kind, density)
                with timed(times, "forward_plus_s"):
                    pairs.append((float(loss_fn(model, batch)), base))
    return pairs


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
