"""lo-fi's star (`lofi.exchange: driver`): every averaging round the nodes send their states to the
driver, which fetches them at once and sums them one at a time, takes the outer step where there is
one, writes the global model to storage (`round_file.GLOBAL`, what a resumed run starts from) and
sends it back to every node (a copy to each other host, over the driver's link). The final average
is gathered the same way, or as a greedy soup."""

from __future__ import annotations

from typing import ClassVar

from raylowcomm.actors import NodeGroup
from raylowcomm.config import RunConfig
from raylowcomm.core.averaging import OuterNesterov, greedy_soup
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.exchange import FinalModel
from raylowcomm.strategies.lofi.plan import Plan, average_nodes, gather_nodes
from raylowcomm.strategies.lofi.round_file import GLOBAL, read_round, write_round


def curve_needs_driver_weights(cfg: RunConfig) -> str | None:
    """Either topology: a curve under LoRA merges snapshot averages into the base on the driver."""
    if cfg.model.lora is not None and cfg.eval_every:
        return "eval_every with model.lora: lo-fi's curve merges snapshot averages into the base on the driver"
    return None


class StarExchange:
    name: ClassVar[str] = "driver"
    nodes_keep_rounds: ClassVar[bool] = False
    paced: ClassVar[bool] = False

    def __init__(self, ctx: RunContext, o: LofiConfig, start: dict | None):
        """`start`: the pretrained weights on the driver, where it holds them (an outer step moves them)."""
        self.opts = o
        params = {k for k, _ in ctx.architecture.named_parameters()}
        self.storage = ctx.storage
        self.outer = (
            OuterNesterov(start, params, o.outer_lr, o.outer_momentum) if o.outer_optimizer == "nesterov" else None
        )

    @staticmethod
    def driver_weights(cfg: RunConfig, o: LofiConfig) -> str | None:
        adapters = cfg.model.lora is not None
        if o.outer_optimizer != "none":
            return "lofi.outer_optimizer steps the global model on the driver"
        if adapters and o.average_every is not None:
            return "lofi.average_every with model.lora merges each round's average into the base on the driver"
        curve = curve_needs_driver_weights(cfg)
        if curve:
            return curve
        if adapters and cfg.model.family == "timm" and o.bn_recalibrate:
            return "lofi.bn_recalibrate with model.lora recalibrates the merged average on the driver"
        return None

    def resume(self, ctx: RunContext, group: NodeGroup, plan: Plan) -> int:
        """Nodes whose checkpoint is older than the last global model saved in storage load it (the others
        have it already)."""
        if not self.storage.exists(GLOBAL):
            return 0
        state, momentum, _, done = read_round(self.storage, GLOBAL)
        if self.outer is not None:
            self.outer.state, self.outer.buf = state, momentum
        plan.average.rebase(state)
        group.call("load_round", group.put(state, "train", "resume_global_weights", copies=len(group)), done)
        return done

    def landed(self, group: NodeGroup, step: int, phase: str) -> None:
        """Nothing lands during training."""

    def round(self, group: NodeGroup, plan: Plan, round_: int, until: int) -> None:
        average = average_nodes(group, plan, "train")
        average = self.outer.step(average) if self.outer is not None else average
        plan.average.rebase(average)
        write_round(self.storage, GLOBAL, round_, average, self.outer.buf if self.outer is not None else None)
        group.call("load_round", group.put(average, "train", "global_weights", copies=len(group)), round_)

    def finish(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str, node_metrics: list[dict]
    ) -> FinalModel:
        """Full weights: the average itself; adapters: the nodes', merged where they are scored (and,
        where the driver holds no base, merged and saved by node 0). The outer step, where there is one,
        moves the average the driver scores and saves."""
        o, n = self.opts, len(group)
        if o.soup == "greedy":
            average, kept = self._greedy_soup(group, metric, node_metrics)
            final = FinalModel(kept, on_nodes=False, weights=average, to_score=average)
        else:
            to_score = gather_nodes(group, plan, "final")
            merge_on_node = plan.average.what == "node_adapters" and ctx.probe_nodes_load_weights()
            final = FinalModel(
                list(range(n)),
                on_nodes=False,
                weights=None if merge_on_node else plan.average.combine(to_score),
                to_score=to_score,
            )
        if self.outer is not None:  # full weights only (not offered with model.lora): what is scored is saved
            final.weights = final.to_score = self.outer.step(final.weights)
        return final

    @staticmethod
    def _greedy_soup(group: NodeGroup, metric: str, node_metrics: list[dict]) -> tuple[dict, list[int]]:
        """Add nodes' models best first while the held-out score (on a node) does not drop."""
        sign = 1 if metric == "accuracy" else -1
        order = sorted(range(len(group)), key=lambda k: node_metrics[k]["val_" + metric], reverse=sign > 0)

        def score(state):
            return group.score_weights(state, "final", val=True)[0]["val_" + metric] * sign

        fetches = [lambda k=k: group.call("weights", what="node_weights", keys=[k])[0] for k in order]
        average, kept, _ = greedy_soup(fetches, score)
        return average, [order[j] for j in kept]

    def details(self) -> dict:
        return {}
