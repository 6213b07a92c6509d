"""Estimators (what a node measures per step) and step rules (how a step's decoded projected
gradients scale the update), kept to what one byte per perturbation allows.

* `two_point` (MeZO): g_s = (L(θ+εz_s) − L(θ−εz_s)) / 2ε, 2 forward passes per perturbation.
* `one_sided_batch` (FZOO): one unperturbed L(θ) shared by the node's batch of perturbations,
  g_s = (L(θ+εz_s) − L(θ)) / ε: samples + 1 forward passes per node per step.

Step rules turn the step's decoded (seed, g) list, in (node, sample) order, into what
`apply_step_` applies:

* `plain`: as decoded, θ ← θ − lr·(1/M) Σ g_m z_m;
* `normalised`: every g divided by σ, the sample standard deviation of the step's M decoded g
  (all publishers'): θ ← θ − lr·(1/M) Σ (g_m/σ) z_m. With `one_sided_batch` on one node this is
  FZOO's step, lr/(M·σ_L) Σ (L_m − L(θ)) z_m with σ_L the spread of the perturbed losses (ε
  cancels). σ is computed from the decoded bytes, which every replica and every joiner replaying
  the log has, with Python floats in a fixed order and a correctly rounded square root: the same
  bits everywhere. σ = 0 (all g equal: no spread to scale by) applies no gradient part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ESTIMATORS = ("two_point", "one_sided_batch")
STEP_RULES = ("plain", "normalised")


def check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")


def check_step_rule(rule: str, samples: int | None = None) -> None:
    """`rule` is known; with `samples` (per node per step), `normalised` has a spread to divide by."""
    if rule not in STEP_RULES:
        raise ValueError(f"unknown step rule {rule!r}; expected one of {STEP_RULES}")
    if rule == "normalised" and samples is not None and samples < 2:
        raise ValueError(
            f"the normalised step divides by the spread of each node's projected gradients: "
            f"it needs samples >= 2, got {samples}"
        )


def forwards_per_step(estimator: str, samples: int) -> int:
    """Forward passes one node runs per step: 2·samples (two_point) or samples + 1 (one_sided_batch)."""
    check_estimator(estimator)
    return 2 * samples if estimator == "two_point" else samples + 1


def projected_grads(estimator: str, pairs: Sequence[tuple[float, float]], eps: float) -> list[float]:
    """g per perturbation from what the node measured: (L+, L−) pairs for two_point
    (`spsa_losses`), (L(θ+εz), L(θ)) pairs for one_sided_batch (`one_sided_losses`)."""
    check_estimator(estimator)
    if estimator == "two_point":
        return [(lp - lm) / (2 * eps) for lp, lm in pairs]
    return [(lp - base) / eps for lp, base in pairs]


def measured_loss(estimator: str, pairs: Sequence[tuple[float, float]]) -> float:
    """The training loss a node reports for its step: the mean of (L+ + L−)/2 (two_point), or the
    unperturbed L(θ) it measured (one_sided_batch)."""
    check_estimator(estimator)
    if estimator == "two_point":
        return sum(lp + lm for lp, lm in pairs) / (2 * len(pairs))
    return pairs[0][1]


def spread(gs: Sequence[float]) -> float:
    """Sample standard deviation of `gs` (at least two), in Python floats summed in the given order:
    bitwise the same on every IEEE machine (math.sqrt is correctly rounded)."""
    if len(gs) < 2:
        raise ValueError(f"a spread needs at least two values, got {len(gs)}")
    mean = sum(gs) / len(gs)
    return math.sqrt(sum((g - mean) * (g - mean) for g in gs) / (len(gs) - 1))


def rule_updates(updates: Sequence[tuple[int, float]], rule: str) -> list[tuple[int, float]]:
    """The step's decoded (seed, g), in (node, sample) order, as the step rule scales them."""
    check_step_rule(rule)
    if rule == "plain":
        return list(updates)
    sigma = spread([g for _, g in updates])
    return [(seed, g / sigma if sigma > 0 else 0.0) for seed, g in updates]
