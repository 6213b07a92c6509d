"""A lo-fi node's round file and what it reads it back for (`RoundCatchUp`, mixed into
`node_rounds.NodeRounds`): writing the round file as a round lands, restoring from it after a restart
(merging again a round whose checkpoint died with the node), landing the quorum rounds a node missed
(`catch_up`), and taking a resumed or joining node onto another node's global model (`adopt`)."""

from __future__ import annotations

import ray

from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.payload import floats
from raylowcomm.strategies.lofi.round_file import (
    GLOBAL,
    node_states,
    read_round,
    round_meta,
    round_path,
    sent_weights,
    write_round,
)


class RoundCatchUp:
    """The round-file side of `NodeRounds`: it reads and moves `NodeRounds`' state (node, codec,
    global_state, outer, pending, payload, sent_from, merging) and lands through its steps
    (`_step_global`, `_merge`, `_merge_nodes`), exactly as a round lands on every other node."""

    def _restore_round(self) -> None:
        storage, path = self.node.storage, round_path(self.node.rank)
        state, momentum, residual, round_ = read_round(storage, path)
        self._set_global(state, momentum)
        self.codec.load_residual(residual)
        if round_ > self.node.rounds:  # died after writing its round file, before its checkpoint: merge again
            meta = round_meta(storage, path)
            self.sent_from = sent_weights(storage, path) or None
            if self.merging.merges_rounds:
                self._merge_nodes(node_states(storage, path), meta["weights"], round_)
            else:
                self._merge(meta["fragment"], meta["mix"], round_)
            self.node.rounds = round_
            self.node.save_state(self.node.step)
        self.node.log(f"round state restored at averaging round {round_}")

    def _set_global(self, state: dict, momentum: dict) -> None:
        self.global_state.update(state)
        if self.outer is not None:
            self.outer.state = self.global_state
            self.outer.buf.update(momentum)

    def catch_up(
        self, rounds: list[tuple[int, list[list], list[float]]], reset: bool = False, merged: list[str] = ()
    ) -> int:
        """Quorum rounds: land the rounds this node has not, in order, each (round, [[ref]] of its payloads
        in the round's order, their weights), exactly as every other node lands them; then its model
        becomes the latest global model (what it trained since its last payload is in that payload).
        `reset`: the model becomes the global model even where no round lands (a restarted node drops
        what it trained since its last round: that segment's payload was lost with it). Returns how
        many rounds it landed."""
        landed, latest = 0, None
        keep = self.pending is not None and not reset
        before = {k: v.clone() for k, v in self.global_state.items()} if keep and rounds else None
        for round_, refs, weights in rounds:
            if round_ <= self.node.rounds:
                continue
            payloads = [ray.get(ref[0]) for ref in refs]
            self._step_global(self.codec.average(payloads, weights, round_=round_))
            landed += 1
            self.node.rounds = latest = round_
        if latest is not None:
            self.payload = None
            self._save_round(latest, streaming.ALL, 0.0)
        if keep and latest is not None:  # trained on: onto the new global model, with what is unmerged on top
            moved = self.pending.rebase(floats(self.node.weights()), before, self.global_state, list(merged))
            self.node.load_global({**self.node.weights(), **moved}, self.node.rounds)
            self.node.save_state(self.node.step)
        elif latest is not None or reset:
            if self.pending is not None:
                self.pending.clear()
            self._merge(streaming.ALL, 0.0, self.node.rounds)
            if latest is None or self.node.saved_step != self.node.step:
                self.node.save_state(self.node.step)  # else its checkpoint here and the round file restore this
        return landed

    def adopt(self, path: str) -> int:
        """A resumed quorum run: the global model of the round file at `path` (the node that had landed
        the most rounds) becomes this node's global model and its model; what it trained since its last
        payload was sent is dropped (that payload died with the driver). Its error feedback stays its own."""
        state, momentum, _, round_ = read_round(self.node.storage, path)
        self._set_global(state, momentum)
        self.node.rounds = round_
        self.payload = None
        if self.pending is not None:
            self.pending.clear()
        self._save_round(round_, streaming.ALL, 0.0)
        self._merge(streaming.ALL, 0.0, round_)
        self.node.save_state(self.node.step)
        return round_

    def _save_round(
        self,
        round_: int,
        fragment: int,
        mix: float,
        nodes: list[dict] | None = None,
        weights: list[float] | None = None,
    ) -> None:
        momentum = self.outer.buf if self.outer is not None else None
        storage, rank = self.node.storage, self.node.rank
        if rank == 0:
            write_round(storage, GLOBAL, round_, self.global_state, momentum)
        write_round(
            storage,
            round_path(rank),
            round_,
            self.global_state,
            momentum,
            self.codec.residual(),
            nodes,
            fragment=fragment,
            mix=mix,
            sent=self.sent_from,
            **({"weights": weights} if weights else {}),
        )
