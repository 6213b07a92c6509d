"""Secure rounds through the driver (`lofi.exchange: driver` with `lofi.secure`): a star for masked codes.
Every node masks its payload as in secure peer rounds; the driver fetches the N masked payloads, adds them
(each is uniform on its own, and their sum is the round's sum of codes: nothing of one node), and sends
every node the sum, from which it lands the round as a peer would. N payloads up and N sums down a round,
where peer rounds move N·(N − 1) payloads. The nodes keep their global models, as in peer rounds."""

from __future__ import annotations

from typing import ClassVar

from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.payload import DeltaCodec, dense_names
from raylowcomm.strategies.lofi.peers import PeerExchange


class SecureStarExchange(PeerExchange):
    name: ClassVar[str] = "driver"

    def __init__(self, ctx: RunContext, o: LofiConfig, start: dict | None):
        """A codec of the nodes' layout on the driver (shapes and dtypes: the model may be on the meta device)."""
        super().__init__(ctx, o, start)
        model = ctx.architecture
        params = {k for k, _ in model.named_parameters()}
        codec = DeltaCodec(o, model.state_dict(), params, dense_names(model, ctx.spec.family, o.dense))
        nodes = ctx.cfg.nodes.count
        self.adder = lambda final: lambda payloads: codec.add_masked(payloads, final, nodes)
