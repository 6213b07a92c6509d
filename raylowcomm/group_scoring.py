"""Scoring on the nodes, the driver's side: the evaluation sets shared once through the object
store (each actor's fetch of them booked once), and models scored where they live or weights the
driver holds scored on a node, never on the driver. A part of `node_group.NodeGroup`."""

from __future__ import annotations

import ray

from raylowcomm.common.ledger import Ledger, payload_nbytes
from raylowcomm.failures import NodeFailed


class GroupScoring:
    """`NodeGroup`'s evaluation methods. They use the group's `ledger`, `fetch`, `actors`, `label`,
    `keys` and `call`, and its evaluation sets: `_eval_sets` ({name: split}), `_eval_ref` (their
    ref in the store) and `_holding_eval_sets` (the keys whose fetch of them is booked)."""

    def share_eval_sets(self, sets: dict, keys: list[int] | None = None, phase: str = "setup") -> None:
        """Make the evaluation sets available; each actor's fetch of them is booked once, here
        for `keys`, or at its first `evaluate`."""
        self._eval_sets = {k: v for k, v in sets.items() if v is not None}
        self._eval_ref = ray.put(self._eval_sets)
        for k in keys or []:
            self._book_eval_sets(k, phase)

    def _book_eval_sets(self, key: int, phase: str) -> None:
        if key not in self._holding_eval_sets:
            for split in self._eval_sets.values():
                self.ledger.send(phase, "eval_sets", split)
            self._holding_eval_sets.add(key)

    def evaluate_on(self, key: int, phase: str = "final", sets_phase: str = "setup") -> dict:
        """Metrics of actor `key`'s model, scored where it lives."""
        self._book_eval_sets(key, sets_phase)
        try:
            return self.fetch.get([self.actors[key].evaluate.remote([self._eval_ref])], phase, "eval_metrics")[0]
        except ray.exceptions.RayTaskError as err:
            raise NodeFailed.of(err, self.label, key, "evaluate") from err

    def score_weights(
        self,
        state: dict,
        phase: str,
        on_all: bool = False,
        val: bool = False,
        ledger: Ledger | None = None,
        sent: tuple[str, int] | None = None,
    ) -> list[dict]:
        """Metrics of weights the driver holds, scored on the lowest node (or, `on_all`, on every
        node, each on its own held-out rows: data.eval_on_nodes); the weights sent are booked in
        `ledger` (the group's, or a scratch one for measurement) as `sent` says, (what, bytes), or
        as weights_to_score of their size."""
        keys = self.keys() if on_all else self.keys()[:1]
        what, nbytes = sent or ("weights_to_score", payload_nbytes(state))
        (ledger or self.ledger).record(phase, what, nbytes, copies=len(keys))
        for k in keys:
            self._book_eval_sets(k, "setup")
        ref = ray.put(state)
        return self.call(
            "score_weights",
            ref,
            [self._eval_ref],
            val,
            phase=phase,
            keys=keys,
            what="eval_metrics" if ledger is None else None,
        )

    def evaluate_all(self, phase: str = "final") -> list[dict]:
        return self.evaluate_nodes(self.keys(), phase, "node_metrics")

    def evaluate_nodes(self, keys: list[int], phase: str = "final", what: str = "eval_metrics") -> list[dict]:
        """Metrics of the models actors `keys` hold, scored where they live, in key order."""
        for k in keys:
            self._book_eval_sets(k, "setup")
        return self.call("evaluate", [self._eval_ref], phase=phase, what=what, keys=keys)
