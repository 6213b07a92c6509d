"""SPSA's options (the `spsa:` section) and the codec they make."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raylowcomm.config import ConfigError, OptimConfig
from raylowcomm.config.applicability import always, needs
from raylowcomm.core.membership import JoinEvent, LeaveEvent, ScheduleError, check_schedule
from raylowcomm.core.zo.codec import Codec, codec_for
from raylowcomm.core.zo.replay import Replica

NAME = "spsa"
"""The strategy's name: its config section, and its folder in storage."""


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

    def make_replica(self, model, node: int, seed: int, optim: OptimConfig, step: int = 0) -> Replica:
        """Node `node`'s replica of `model` under these options (the run's `optim` for the lr, unless
        spsa.lr is set, and the weight decay), at `step`."""
        return Replica(
            model,
            node,
            seed,
            self.make_codec(),
            eps=self.eps,
            samples=self.samples,
            lr=self.lr if self.lr is not None else optim.lr,
            weight_decay=optim.weight_decay,
            kind=self.perturbation,
            include=self.include,
            step=step,
            estimator=self.estimator,
            rule=self.step,
            density=self.density,
        )


OPTION_RULES = {
    "codec": always,
    "g_min": needs(lambda cfg, o: o.codec == "log", "is the log codec's: set spsa.codec: log"),
    "g_max": needs(lambda cfg, o: o.codec == "log", "is the log codec's: set spsa.codec: log"),
    "scale": needs(lambda cfg, o: o.codec == "linear", "is the linear codec's step: set spsa.codec: linear"),
    "perturbation": always,
    "eps": always,
    "samples": always,
    "estimator": always,
    "step": always,
    "lr": always,
    "steps": always,
    "density": always,
    "include": always,
    "verify_every": always,
    "leave": always,
    "leave.node": always,
    "leave.step": always,
    "leave.how": always,
    "join": always,
    "join.step": always,
}
"""When each SPSA option can take effect (`config.applicability`)."""


def check_membership(count: int, o: SpsaConfig, steps: int | None) -> None:
    """spsa.leave and spsa.join against the `count` first nodes and, once known, the run's `steps`."""
    try:
        check_schedule(count, o.leave, o.join, steps)
    except ScheduleError as err:
        raise ConfigError(f"spsa.{err.field}", err.value, err.allowed) from None
