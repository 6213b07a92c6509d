"""How lo-fi's averages meet what trains, chosen from the model spec as the fine-tune is
(`merging_for`): with every weight training, an average is the new weights; with LoRA adapters it is
merged exactly into the frozen base and the adapters restart. The fine-tune itself (`finetune.FineTune`)
knows nothing of rounds; this is lo-fi's adapter over it, and the only place lo-fi asks which it is."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from torch import nn

from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.averaging import StreamingAverage
from raylowcomm.finetune import State
from raylowcomm.models import ModelSpec


class NodeAverage(Protocol):
    """lo-fi's average of the nodes' states: how they are gathered as they arrive, combined into one
    model, and sent to the nodes to be scored."""

    what: str
    """The ledger's name for one node's state."""

    def gather(self, states: Iterable[tuple[int, State]], weights: list[float]) -> object:
        """The nodes' (key, state) pairs as they arrive, node k weighing weights[k]: what `combine` takes."""

    def combine(self, gathered: object) -> State:
        """The average, as plain weights (the architecture's own names)."""

    def rebase(self, state: State) -> None:
        """After an averaging round: the global model the nodes start the next round from."""

    def sent(self, payload: object) -> tuple[str, int]:
        """How `gather`'s or `combine`'s output crosses to be scored: the ledger's name and bytes."""


class RoundMerging(Protocol):
    """What lo-fi needs of the fine-tune to average nodes and land rounds."""

    merges_rounds: bool
    """Whether an averaging round's result is merged into frozen weights, restarting what trains (LoRA),
    instead of being loaded as what trains: peer rounds then decode each node's payload (`merge_nodes`)."""

    def sync_unit(self, name: str) -> str:
        """The group a tensor syncs with in a fragment of a round (lofi.fragments): its module, or for an
        adapter factor its adapted layer, so that B and A land together."""

    def node_average(self, base: State, model: nn.Module, how: str) -> NodeAverage:
        """The average of the nodes' states, which all started from `model`'s weights `base` (None: the
        nodes loaded them); `how`: lofi.lora_average."""

    def load_global(self, model: nn.Module, state: State, seed: int) -> bool:
        """Load an averaging round's global model (plain weights) into a node's model, `seed` drawing
        what restarts (the same on every node). True where the tensors that train are new ones, so the
        optimizer's state no longer fits them."""


class WeightAverage:
    """The nodes' full weights, streamed into one running sum as they arrive: one incoming copy at a time."""

    what = "node_weights"

    def gather(self, states: Iterable[tuple[int, State]], weights: list[float]) -> State:
        avg = StreamingAverage()
        for k, state in states:
            avg.add(state, weights[k])
            del state
        return avg.result()

    def combine(self, gathered: State) -> State:
        return gathered

    def rebase(self, state: State) -> None:
        """Full weights are averaged from the nodes' states alone."""

    def sent(self, payload: State) -> tuple[str, int]:
        return "weights_to_score", payload_nbytes(payload)


class WeightMerging:
    """Every weight trains: a round's average is loaded as the new weights, nothing is merged."""

    merges_rounds = False

    def sync_unit(self, name: str) -> str:
        return name.rsplit(".", 1)[0]

    def node_average(self, base: State, model: nn.Module, how: str) -> WeightAverage:
        return WeightAverage()

    def load_global(self, model: nn.Module, state: State, seed: int) -> bool:
        model.load_state_dict(state)
        return False


class AdapterMerging:
    """LoRA adapters: averages are exact (`lora.average_delta`), merged into the frozen base, and each
    merge restarts the adapters it consumed from a seed every node shares (`lora.merge_nodes`)."""

    merges_rounds = True

    def sync_unit(self, name: str) -> str:
        """An adapter factor's adapted layer; any other tensor's module."""
        return name.rsplit(".lora_", 1)[0] if ".lora_" in name else name.rsplit(".", 1)[0]

    def merge_nodes(
        self, model: nn.Module, node_states: list[State], weights: list[float], how: str, seed: int
    ) -> list[str]:
        """A peer round's landing: the nodes' states of some tensors (decoded from their payloads) averaged
        into `model` (`how`: lofi.lora_average), what the merge consumed restarted from `seed`; returns the
        names restarted."""
        from raylowcomm.lora import merge_nodes

        return merge_nodes(model, node_states, weights, how, seed)

    def node_average(self, base: State, model: nn.Module, how: str):
        from raylowcomm.lora import AdapterAverage, lora_layers

        return AdapterAverage(base, lora_layers(model), how)

    def load_global(self, model: nn.Module, state: State, seed: int) -> bool:
        """The merged average becomes the frozen base under fresh adapters (`lora.merge_and_reset`)."""
        from raylowcomm.lora import merge_and_reset

        merge_and_reset(model, state, seed)
        return True


def merging_for(spec: ModelSpec) -> WeightMerging | AdapterMerging:
    """lo-fi's merging for the run's model, as `finetune.fine_tune_for` makes its fine-tune."""
    return WeightMerging() if spec.lora is None else AdapterMerging()
