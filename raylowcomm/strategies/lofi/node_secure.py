"""A lo-fi node's side of secure rounds (`lofi.secure`, `NodeSecure`): its X25519 key for the run, its
payload masked among the round's members, its peers' masked payloads fetched, and the round landed from
their sum. The driver's side, which decides the members: `secure_rounds`.

A round goes in three calls, so that every member lands the same sum: `send` (encode Δ as in the clear,
keep that payload, return it masked: the driver owns it, so it outlives a node killed after masking),
`fetch` (every member's masked payload; which it could not fetch, and which it holds), and `land` (the
members' sum decoded, the outer step). A payload one member could not fetch but another holds is
forwarded by a holder (`forward`). A payload nobody holds (its node died before it was made, or its host
went with the only copy before anyone fetched it) leaves the others to mask the same payload again among
themselves (`send` with `again`): fresh masks, since the members are part of every mask's key; nobody
held the lost payload, so nobody holds a first sum to subtract the second from. The key pair lives in
this process only: a restarted node has none for the run's roster until the driver gathers a new one,
and lands the round it missed from another node's round file."""

from __future__ import annotations

import ray

from raylowcomm.core.compression import Payload
from raylowcomm.core.secagg import Roster, SecAggNode


def slot_of(round_: int, fragment: int, final: bool) -> str:
    """What a round's masks are made for: the same label on every member."""
    return f"round={round_}|fragment={fragment}|final={int(final)}"


class NodeSecure:
    """Held by a node's `NodeRounds` (`rounds`) as `rounds.secure`: the key pair, what this node sent for the
    round it is in (`sent`: its payload masked, by members) and the members' masked payloads it fetched."""

    def __init__(self, rounds, rank: int, nodes: int):
        self.rounds, self.rank, self.nodes = rounds, rank, nodes
        self.keys = SecAggNode(rank)
        self.round: tuple | None = None
        """(round, fragment, final) of the payload this node holds, in the clear (`rounds.payload`)."""
        self.masked: Payload | None = None
        self.fetched: dict[int, Payload] = {}

    def __reduce__(self):
        raise TypeError("a node's secure-aggregation keys stay on the node")

    def public(self) -> bytes:
        return self.keys.public

    def join(self, name: str, publics: dict[int, bytes]) -> None:
        """Join the driver's roster; one gathered before this process started (it restarted meanwhile) does not
        carry its key: it stays out of the rounds until the driver gathers the next."""
        if publics.get(self.rank) == self.public():
            self.keys.join(Roster(name, publics))

    def send(self, round_: int, fragment: int, final: bool, members: list[int], again: bool) -> tuple:
        """(bytes of masked codes and of masked magnitudes, this node's payload for the round masked among
        `members`): returned, so that the driver owns the payload and it outlives this process. `again`: the
        payload it encoded for this round, masked among fewer members. (None, None) where it holds no payload
        of the round to mask again, or no key of the run's roster (a node restarted since): it is not among
        the members."""
        place = (round_, fragment, final)
        if self.keys.roster is None or (again and (self.round != place or self.rounds.payload is None)):
            return None, None
        if not again:
            self.rounds.encode_delta(fragment, final)
            self.round = place
        codec = self.rounds.codec
        self.masked = codec.mask(self.rounds.payload, final, self.keys, slot_of(*place), members, self.nodes)
        self.fetched = {}
        return codec.masked_nbytes(self.rounds.payload, final, self.nodes), self.masked

    def fetch(self, round_: int, refs: dict[int, list]) -> tuple[list[int], list[int]]:
        """Every member's masked payload it does not hold yet (`refs`: member → [its ref]); returns (the members
        whose payloads it could not fetch, the members whose payloads it holds). A node restarted since it sent
        fetches nothing: its payload is the driver's, and it adopts the round (`land`)."""
        if self.masked is None or self.round is None or self.round[0] != round_:
            return [], []
        lost = []
        for k, ref in refs.items():
            if k == self.rank:
                self.fetched[k] = self.masked
            elif k not in self.fetched:
                try:
                    self.fetched[k] = ray.get(ref[0])
                except ray.exceptions.ObjectLostError:  # OwnerDiedError among them: lost with its node
                    lost.append(k)
        return lost, sorted(self.fetched)

    def forward(self, round_: int, member: int) -> Payload:
        """A member's masked payload this node holds, for the members that could not fetch it: uniform bytes on
        their own, and the round's members fetch every one of them anyway."""
        if self.round is None or self.round[0] != round_:
            raise RuntimeError(f"node {self.rank} holds no payload of round {round_} to forward")
        return self.fetched[member]

    def land_sum(self, round_: int, members: list[int], total: list) -> bool:
        """As `land`, from the members' payloads added on the driver (`lofi.exchange: driver`; `total`: [its
        ref]) instead of fetched here."""
        if round_ <= self.rounds.node.rounds:
            return True
        if self.round is None or self.round[0] != round_ or self.rank not in members:
            return False
        self.fetched = {}
        return self._land(round_, len(members), ray.get(total[0]))

    def land(self, round_: int, members: list[int]) -> bool:
        """The round from the members' sum: Δ̄ decoded, this node's residual settled, the outer step taken
        (`NodeRounds.land_mean`). False where this node cannot: it holds not every member's payload (it was
        restarted, or was not a member): the driver has it adopt another node's round file."""
        if round_ <= self.rounds.node.rounds:
            return True
        if self.round is None or self.round[0] != round_ or set(self.fetched) != set(members):
            return False
        final = self.round[2]
        total = self.rounds.codec.add_masked([self.fetched[k] for k in sorted(members)], final, self.nodes)
        return self._land(round_, len(members), total)

    def _land(self, round_: int, members: int, total) -> bool:
        """Δ̄ from the sum of `members` masked payloads, this node's residual settled, the round landed."""
        _, fragment, final = self.round
        codec, own = self.rounds.codec, self.rounds.payload
        mean = codec.average_of_sum(total, members, final, self.nodes, own=own)
        self.round, self.masked, self.fetched = None, None, {}
        self.keys.forget(slot_of(round_, fragment, final))
        self.rounds.land_mean(round_, fragment, mean)
        return True
