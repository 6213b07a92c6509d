"""Seeded perturbations z and the SPSA measurement and update: z drawn from a CPU generator in
fixed chunks (`draws`, whose names are importable from here too), θ parked by a storage swap,
updates applied in one fixed order, so every node gets the same bits (the rules in
`raylowcomm.core.zo`)."""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from raylowcomm.core.zo.draws import CHUNK as CHUNK
from raylowcomm.core.zo.draws import KINDS as KINDS
from raylowcomm.core.zo.draws import _Scratch, _slices, z_chunks
from raylowcomm.core.zo.draws import mask_threshold as mask_threshold

NamedParams = Sequence[tuple[str, torch.Tensor]]
Updates = Sequence[tuple[int, float]]  # (seed, decoded g), in (node, sample) order


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


def iter_z(params: NamedParams, seed: int, kind: str = "rademacher", density: float = 1.0) -> Iterator[torch.Tensor]:
    """z for each parameter in order, one parameter materialised at a time."""
    tensors = [p for _, p in params]
    chunks = z_chunks(tensors, seed, kind, density=density)
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
    streams = [(z_chunks(tensors, seed, kind, scratch, density), lr * g / len(updates)) for seed, g in updates]
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
def parked(tensors: Sequence[torch.Tensor], spare: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
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
        for (part, z), dst in zip(z_chunks(theta, seed, kind, density=density), _slices(out), strict=True):
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

    Forward passes run in eval mode (`_eval_mode`) under inference mode; θ is parked (`parked`);
    θ + εz is written from θ into `spare`'s storage, then mirrored through θ into θ − εz: two
    passes over θ per sample, one draw of z (the update draws it again), and none to restore θ,
    which comes back bitwise (the MeZO +ε/−2ε/+ε walk is not exact). Memory: `spare`, one copy
    of the trainable parameters (allocated here if None; a `Replica` keeps its own), plus
    O(CHUNK) for z. `times`, if given, accumulates seconds under perturb_s, forward_plus_s and
    forward_minus_s. `density` < 1 perturbs a seeded random subset of the weights (`_masked_`).
    """
    tensors = [p for _, p in params]
    spare = [torch.empty_like(t) for t in tensors] if spare is None else spare
    with _eval_mode(model), parked(tensors, spare) as theta, torch.inference_mode():
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
        with parked(tensors, spare) as theta, torch.inference_mode():
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
