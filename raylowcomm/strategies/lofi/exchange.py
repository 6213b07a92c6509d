"""How lo-fi's nodes meet: the averaging topology, chosen once from the options (`exchange_for`)
into an object that owns its rounds, its final average, its resume path and where the result
lives. The strategy's loop only trains to each boundary and asks its exchange for the round.

- `StarExchange` (`lofi.exchange: driver`, or `auto` without a codec): every node sends its state
  to the driver, which averages (and takes the outer step) and sends the global model back.
- `PeerExchange` (`lofi.exchange: peers`, or `auto` with `lofi.compress`): the nodes exchange
  compressed outer gradients among themselves and every node lands the same global model,
  hash-checked; the driver only passes references on.
- `QuorumExchange` (`lofi.quorum`): peer rounds that land on a quorum of nodes, each node training at
  its own pace (`quorum`).

`options.exchange_for` is the one place that picks one; the options refused on a topology are
checked by the option groups, given the exchange (`options.LofiOptions.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from raylowcomm.actors import NodeGroup
    from raylowcomm.config import RunConfig
    from raylowcomm.strategies.base import RunContext
    from raylowcomm.strategies.lofi.config import LofiConfig
    from raylowcomm.strategies.lofi.plan import Plan


@dataclass
class FinalModel:
    """lo-fi's result and where it lives."""

    nodes: list[int]
    """The nodes in the average (a greedy soup keeps some)."""
    on_nodes: bool
    """The nodes hold the average (after peer rounds): they recalibrate, score and save it in place."""
    weights: dict | None = None
    """The average as plain weights on the driver, saved with the record; None where the driver holds
    no model of it (node 0 saves it)."""
    to_score: object = None
    """What the nodes are sent to score it when they do not hold it (a `NodeAverage`'s output), and
    what node 0 merges and saves where the driver holds no base."""


@dataclass
class Trained:
    """What lo-fi's training loop hands the end of the run: every node's reports (the record's
    `nodes[k].train`: each call's, or each quorum segment's, wire dict), the training seconds, the
    snapshots of the curve ((step, training seconds at it, bytes sent by then)) and the goodput."""

    nodes: list[list[dict]]
    train_s: float
    snapshots: list[tuple[int, float, int]]
    goodput: dict
    samples: int
    """Examples trained on, by every node (quorum rounds: those that left too)."""
    last_step_s: float = 0.0
    """The slowest node's last step (and a round after it): what a budget's overshoot is measured by."""


class Exchange(Protocol):
    """One averaging topology: what a lo-fi run asks of it, in the order it asks."""

    name: ClassVar[str]
    """The record's `details.exchange`."""
    nodes_keep_rounds: ClassVar[bool]
    """Whether every node keeps a global model of its own between rounds (`node_rounds.NodeRounds`)."""
    paced: ClassVar[bool]
    """Whether the exchange runs the training loop itself (`train`, quorum rounds) instead of the strategy
    stepping every node to each boundary in lockstep."""

    def __init__(self, ctx: RunContext, opts: LofiConfig, start: dict | None):
        """`start`: the pretrained weights, where the driver holds them (None: the nodes load them)."""

    @staticmethod
    def driver_weights(cfg: RunConfig, opts: LofiConfig) -> str | None:
        """Why this topology needs the pretrained weights on the driver, or None."""

    def resume(self, ctx: RunContext, group: NodeGroup, plan: Plan) -> int:
        """The averaging rounds a resumed run has behind it (0: none); the nodes then hold their global model."""

    def landed(self, group: NodeGroup, step: int, phase: str) -> None:
        """After a `train` call that landed a round: check that every node landed the same model."""

    def round(self, group: NodeGroup, plan: Plan, round_: int, until: int) -> None:
        """Averaging round `round_`, at step `until` of every node."""

    def train(self, ctx: RunContext, group: NodeGroup, plan: Plan, launch) -> Trained:
        """Where `paced`: the whole training loop (`launch(k)` starts node k's actor, a joiner's)."""

    def finish(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str, node_metrics: list[dict]
    ) -> FinalModel:
        """The final average, and where it lives."""

    def details(self) -> dict:
        """What the record says of the exchange."""
