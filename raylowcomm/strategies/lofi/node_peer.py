"""What the driver calls on a lo-fi node for rounds that travel node to node (`PeerRoundCalls`, mixed
into `node.LofiNode`): peer rounds' send, apply, begin and land, quorum rounds' segment, catch-up,
adoption and joining, secure rounds' keys, send, fetch and landing (`node_secure`). Each hands over to
the node's side of the rounds (`node_rounds.NodeRounds`, `self.peer`); the methods are on the actor
class, so `group.call` and `.remote` find them by name."""

from __future__ import annotations

import time

import ray

from raylowcomm.strategies.lofi.messages import ResumePoint, SegmentResult, TrainReport
from raylowcomm.strategies.lofi.streaming import ALL


class PeerRoundCalls:
    """The remote face of `NodeRounds` on `LofiNode`: it reads the node's `peer`, `rounds` and `step`,
    and trains through its `train` and lands a round in flight through its `_land_at`."""

    def send_delta(self, fragment: int = ALL, final: bool = False) -> tuple[list, int]:
        return self.peer.send_delta(fragment, final)

    def apply_round(
        self, round_: int, refs: list[list], weights: list[float], fragment: int = ALL, final: bool = False
    ) -> None:
        self.peer.apply_round(round_, refs, weights, fragment, final)

    @ray.method(num_returns=2)
    def segment(
        self, rounds: list, until: int, seconds: float | None = None, reset: bool = False, merged: list[str] = ()
    ) -> tuple[dict, object]:
        """Quorum rounds: land the rounds this node missed (`NodeRounds.catch_up`), train to `until` (or for
        `seconds` of training, `lofi.sync: time`), and return what it did (a `SegmentResult`'s wire dict) and
        its payload, Δ from the global model it started from (`reset`: a restarted node starts from it again;
        `lofi.keep_training`: Δ from where it last sent, `merged` the tokens of its payloads that `rounds`
        hold). The payload is this call's second return value: the driver owns it, so it outlives this
        process, and nobody fetches it but the nodes that land it."""
        t0 = time.perf_counter()
        landed = self.peer.catch_up(rounds, reset, merged)
        t1 = time.perf_counter()
        trained = TrainReport.from_wire(self.train(until, [], seconds=seconds, nearest=True))
        t2 = time.perf_counter()
        payload = self.peer.encode_delta()
        hashed, token = self.peer.global_hash(), self.peer.sent()
        parts = {"land_s": t1 - t0, "train_call_s": t2 - t1, "encode_s": time.perf_counter() - t2}
        return SegmentResult(trained, self.rounds, hashed, payload.nbytes, token, landed, parts).wire(), payload

    def catch_up(self, rounds: list, reset: bool = False, merged: list[str] = ()) -> int:
        return self.peer.catch_up(rounds, reset, merged)

    def adopt_round(self, path: str) -> int:
        return self.peer.adopt(path)

    def land_round(self, round_: int) -> float:
        """The exchange in flight lands where the node stands, with no step after it (`optim.budget_s`
        spent by the round that sent it); returns how long it waited for it."""
        if round_ <= self.rounds:
            return 0.0
        self.peer.expect_landing([round_, self.step])
        return self._land_at(round_, self.step)

    def begin_round(self, round_: int, refs: list[list], weights: list[float], fragment: int = ALL) -> None:
        self.peer.begin_round(round_, refs, weights, fragment)

    def secure_public(self) -> bytes:
        """lofi.secure: this node's X25519 public key for the driver's roster (`NodeSecure`)."""
        return self.peer.secure.public()

    def secure_join(self, name: str, publics: dict[int, bytes]) -> None:
        self.peer.secure.join(name, publics)

    @ray.method(num_returns=2)
    def secure_send(self, round_: int, fragment: int, final: bool, members: list[int], again: bool) -> tuple:
        """(sizes, masked payload): the payload a return value the driver owns (`NodeSecure.send`)."""
        return self.peer.secure.send(round_, fragment, final, members, again)

    def secure_fetch(self, round_: int, refs: dict[int, list]) -> tuple[list[int], list[int]]:
        return self.peer.secure.fetch(round_, refs)

    def secure_forward(self, round_: int, member: int):
        return self.peer.secure.forward(round_, member)

    def secure_land(self, round_: int, members: list[int]) -> bool:
        return self.peer.secure.land(round_, members)

    def secure_land_sum(self, round_: int, members: list[int], total: list) -> bool:
        return self.peer.secure.land_sum(round_, members, total)

    def global_hash(self) -> str:
        return self.peer.global_hash()

    def join(self, path: str | None) -> ResumePoint:
        """A node joining quorum rounds (`lofi.join`): the global model of the round file at `path` (the
        member that had landed the most rounds; None before the first round: it holds the start) becomes
        its own; returns `round_of`."""
        if path is not None:
            self.peer.adopt(path)
        return self.round_of()
