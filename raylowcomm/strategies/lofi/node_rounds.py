"""A lo-fi node's side of peer rounds (`NodeRounds`): at a round's boundary it encodes its Δ and puts the payload in the
object store itself; given its peers' refs it fetches their payloads, decodes and averages them in node order (the same
bits on every node), takes the outer step (plain: θ_global − Δ̄; or `OuterNesterov`), loads the new global model and
checkpoints it (round file first). Integer tensors (BatchNorm's `num_batches_tracked`) do not cross: each node keeps its
own count, the same on every node. A node that dies between putting its payload and applying the round takes the payload
with it: the round ends with `ActorDied` naming the node and the round (`died_during`)."""

from __future__ import annotations

import time
import uuid
from typing import Protocol

import ray
import torch
from torch import nn

from raylowcomm.actors import ActorDied
from raylowcomm.common.hashing import parameter_hash
from raylowcomm.common.seeding import epoch_seed
from raylowcomm.core.averaging import OuterNesterov
from raylowcomm.core.bad_updates import bad_update
from raylowcomm.core.compression import Payload
from raylowcomm.storage import Storage
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.merging import RoundMerging
from raylowcomm.strategies.lofi.node_catch_up import RoundCatchUp
from raylowcomm.strategies.lofi.node_secure import NodeSecure
from raylowcomm.strategies.lofi.payload import DeltaCodec, crossing, floats
from raylowcomm.strategies.lofi.privacy import NodeNoise
from raylowcomm.strategies.lofi.round_file import round_path


class RoundHost(Protocol):
    """What a node offers its side of peer rounds: who it is, where it keeps its state, its model and
    optimizer, the step it has trained to and the rounds it has landed (`LofiNode`)."""

    rank: int
    storage: Storage
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int
    rounds: int
    saved_step: int | None

    def weights(self) -> dict:
        """What the node sends of what it has learned (`Node.weights`)."""

    def load_global(self, state: dict, round_: int) -> None:
        """A global model into the node's model (under LoRA a new base and fresh adapters)."""

    def save_state(self, step: int) -> None:
        """The node's checkpoint, model and optimizer, at `step`."""

    def log(self, msg: str) -> None: ...


class PendingProgress:
    """`lofi.keep_training`: what a node trained that no landed round holds yet. Each payload it sends
    moved its model from `base` (where its Δ is measured from: the global model, or where it last sent)
    to its weights at the send; that move stays here until a round merges the payload (by its token).
    When rounds land, the model moves onto the new global model G' with everything unmerged on top:
    θ ← G' + (θ − base) + Σ unmerged, and base ← G' + Σ unmerged, in float64. The global model, the
    only thing every node must agree on, is untouched."""

    def __init__(self) -> None:
        self.base: dict | None = None
        """None: the global model."""
        self.unmerged: dict[str, dict] = {}

    def sent(self, weights: dict, global_state: dict) -> str:
        """A payload Δ = base − θ left: keep its move and make θ the base; returns its token."""
        base = self.base or global_state
        token = uuid.uuid4().hex
        self.unmerged[token] = {k: weights[k].to(torch.float64) - base[k].to(torch.float64) for k in global_state}
        self.base = {k: weights[k].detach().clone() for k in global_state}
        return token

    def rebase(self, weights: dict, old_global: dict, new_global: dict, merged: list[str]) -> dict:
        """The model's tensors on the new global model (see the class), the merged payloads forgotten."""
        for token in merged:
            self.unmerged.pop(token, None)  # a token of an earlier process (restarted) is not here
        base = self.base or old_global
        on_top = {k: sum(m[k] for m in self.unmerged.values()) for k in new_global} if self.unmerged else {}
        moved = {}
        for k, g in new_global.items():
            top = g.to(torch.float64) + on_top[k] if on_top else g.to(torch.float64)
            moved[k] = (top + (weights[k].to(torch.float64) - base[k].to(torch.float64))).to(weights[k].dtype)
        self.base = {k: (new_global[k].to(torch.float64) + on_top[k]).to(new_global[k].dtype) for k in on_top} or None
        return moved

    def clear(self) -> None:
        """A restarted or adopting node starts from the global model: nothing of its own is on top."""
        self.base, self.unmerged = None, {}


class NodeRounds(RoundCatchUp):
    """A lo-fi node's side of peer rounds, held by the node (`LofiNode.peer`): its global model, the
    codec with its error feedback, its fragments and outer step, the payload it sent and the round in
    flight. It reads and moves the node's model through `RoundHost`. Here: the payload and a round's
    landing; its round file, a restart's restore, quorum rounds' catch-up and adopting another node's
    global model: `RoundCatchUp` (node_catch_up.py).

    Where rounds are merged (`RoundMerging.merges_rounds`: LoRA), what crosses is the adapters and head:
    a node decodes every peer's Δ, and the round merges the nodes' exact average into the frozen base
    and restarts the adapters from the round's seed (`AdapterMerging.merge_nodes`), as the driver's rounds do."""

    def __init__(
        self, node: RoundHost, opts: LofiConfig, seed: int, initial: dict, merging: RoundMerging, dense: set[str]
    ):
        """Codec, error feedback (`dense`: the parameters that cross whole, `lofi.dense`), the global model
        (`initial`: what this node sends, as it started), its fragments and outer step (`merging`: how a
        round lands in what trains); then what this node's round file holds, if it has one (a restart, or
        a resumed run)."""
        self.node, self.opts, self.seed, self.merging = node, opts, seed, merging
        self.params = params = {k for k, _ in node.model.named_parameters()}
        self.codec = DeltaCodec(opts, initial, params, dense, node)
        self.global_state = crossing(initial, opts)  # the caller's copy, kept
        sizes = self.codec.sizes()
        self.fragments = streaming.split(
            {k: sizes[k] for k in self.global_state}, opts.fragments, self.merging.sync_unit
        )
        self.mix = opts.mix if opts.overlap else 0.0  # with nothing in flight, nothing to mix
        self.outer = (
            OuterNesterov(self.global_state, params, opts.outer_lr, opts.outer_momentum)
            if opts.outer_optimizer == "nesterov"
            else None
        )
        if self.outer is not None:
            self.global_state = self.outer.state  # one copy, moved by the outer step
        self.payload: Payload | None = None
        self.in_flight: streaming.InFlightRound | None = None
        self.pending = PendingProgress() if opts.keep_training and not opts.overlap else None
        self.keep_in_flight = opts.keep_training and opts.overlap > 0
        self.sent_from: dict | None = None
        """With `keep_in_flight`: the parameters this node sent its payload from, until its round lands."""
        self.noise = NodeNoise(opts.privacy_plan, node.storage, node.rank) if opts.privacy is not None else None
        """lofi.privacy: this node's clipping and noise, its secret made at its first start and kept in storage."""
        self.secure = NodeSecure(self, node.rank, node.cfg.nodes.count) if opts.secure else None
        """lofi.secure: this node's keys and its side of masked rounds."""
        if node.storage.exists(round_path(node.rank)):
            self._restore_round()

    def _names(self, fragment: int) -> list[str]:
        return list(self.global_state) if fragment == streaming.ALL else self.fragments[fragment]

    def _delta(self, fragment: int = streaming.ALL, final: bool = False) -> dict:
        """Δ = θ_global − θ_k in float64 (exact for float32 weights); with lofi.privacy clipped and noised (for the
        round, step and `final` it is sent at); or a bad node's update for the round it is sent for (`bad_nodes`).
        All before the codec: error feedback only ever holds what the noised Δ leaves, and what compression drops
        of a bad update stays in the bad node's own residual."""
        mine = floats(self.node.weights())
        base = self.pending.base if self.pending is not None and self.pending.base is not None else self.global_state
        delta = {k: base[k].to(torch.float64, copy=True).sub_(mine[k]) for k in self._names(fragment)}  # one pass less
        if self.noise is not None:
            delta = self.noise.apply(delta, (self.node.rounds + 1, self.node.step, int(final)))
        return bad_update(self.node.cfg.bad_nodes, self.node.rank, self.node.rounds + 1, self.seed, delta)

    def encode_delta(self, fragment: int = streaming.ALL, final: bool = False) -> Payload:
        """This node's payload: Δ plus what compression dropped before (error feedback); `final`: in the
        final round's codec (`lofi.final_round`)."""
        self.payload = self.codec.encode(self._delta(fragment, final), final)
        return self.payload

    def send_delta(self, fragment: int = streaming.ALL, final: bool = False) -> tuple[list, int]:
        """Encode Δ (of one fragment, or all) and put it in the object store from here: ([its
        ObjectRef], its packed bytes); the ref travels in a list so that nobody resolves it on the way."""
        payload = self.encode_delta(fragment, final)
        if self.keep_in_flight:
            mine = self.node.weights()
            self.sent_from = {k: mine[k].detach().clone() for k in self._names(fragment) if k in self.params}
        return [ray.put(payload)], payload.nbytes

    def apply_round(
        self, round_: int, refs: list[list], weights: list[float], fragment: int = streaming.ALL, final: bool = False
    ) -> None:
        """Fetch the peers' payloads, average them in node order, take the outer step and load the new
        global fragment; checkpoint it (round file first). A node that has this round already keeps it.
        A node restarted since it sent its payload, or a peer's payload lost with its owner, ends the
        round with ActorDied naming the node: the payload died with it."""
        if round_ > self.node.rounds:
            mean = self._average(round_, refs, weights, self.payload, final)
            self._land(round_, fragment, mean, 0.0, self.node.step)

    def land_mean(self, round_: int, fragment: int, mean: dict) -> None:
        """A round whose Δ̄ was taken elsewhere (`node_secure`, from the members' masked sum) lands here."""
        self._land(round_, fragment, mean, 0.0, self.node.step)

    def sent(self) -> str | None:
        """After `encode_delta` of a node that keeps training: its payload's token (`PendingProgress.sent`)."""
        return None if self.pending is None else self.pending.sent(floats(self.node.weights()), self.global_state)

    def _step_global(self, mean: dict) -> None:
        """The outer step on the global tensors: plain, θ_global − Δ̄, or `OuterNesterov`."""
        if self.outer is not None:
            self.global_state = self.outer.step_delta(mean)
            return
        for k, d in mean.items():
            g = self.global_state[k]
            self.global_state[k] = g.to(torch.float64, copy=True).sub_(d).to(g.dtype)

    def begin_round(self, round_: int, refs: list[list], weights: list[float], fragment: int = streaming.ALL) -> None:
        """`apply_round` overlapped (lofi.overlap): fetch and average in a thread and return at once;
        `train` lands it at the step the driver names."""
        if round_ > self.node.rounds:
            payload = self.payload
            self.in_flight = streaming.InFlightRound(
                round_, fragment, lambda: self._average(round_, refs, weights, payload)
            )

    def expect_landing(self, landing: list | None) -> None:
        """Before training on: the exchange that lands in this call must be in flight here; a node
        restarted since it began holds none (its payload died with it)."""
        if landing is None or landing[0] <= self.node.rounds:
            return
        if self.in_flight is None or self.in_flight.round != landing[0]:
            raise ActorDied(died_during(self.node.rank, landing[0]))

    def land(self, round_: int, step: int) -> float:
        """The exchange in flight lands (waiting for it if it has not): step and mix (`lofi.mix`).
        Returns how long training waited for it: 0 where the exchange was hidden behind the τ steps."""
        exchange, self.in_flight = self.in_flight, None
        began = time.perf_counter()
        mean = exchange.result()
        waited = time.perf_counter() - began
        self._land(round_, exchange.fragment, mean, self.mix, step)
        return waited

    def _average(self, round_: int, refs: list[list], weights: list[float], mine: Payload | None, final=False):
        """Δ̄; where rounds merge, (each node's state, weights): θ_global − Δ_k per node. With
        `lofi.compress_scale: shared` this node's residual is settled here, on the round's shared scales,
        before `_land` writes it to the round file (overlapped: in the exchange's thread, before `land`)."""
        payloads = [self._payload_of(k, ref[0], round_, mine) for k, ref in enumerate(refs)]
        if self.merging.merges_rounds:
            return [
                {k: self.global_state[k].to(torch.float64) - d for k, d in delta.items()}
                for delta in self.codec.decode_each(payloads, final)
            ], weights
        return self.codec.average(payloads, weights, final, round_, own=self.node.rank)  # settles own residual

    def _land(self, round_: int, fragment: int, mean, mix: float, step: int) -> None:
        """Outer step on the fragment's global tensors (plain: θ_global − Δ̄), round file, merge, checkpoint;
        where rounds merge, `_land_merged`."""
        if self.merging.merges_rounds:
            return self._land_merged(round_, fragment, *mean, step)
        self._step_global(mean)
        self.payload = None
        self._save_round(round_, fragment, mix)
        self._merge(fragment, mix, round_)
        self.node.rounds = round_
        self.node.save_state(step)

    def _land_merged(self, round_: int, fragment: int, states: list[dict], weights: list[float], step: int) -> None:
        """The nodes' states merged into this node's model (`_merge_nodes`), the round file (with those
        states, so a restart merges again), checkpoint."""
        self.payload = None
        self._merge_nodes(states, weights, round_)
        self._save_round(round_, fragment, 0.0, nodes=states, weights=weights)
        self.node.rounds = round_
        self.node.save_state(step)

    def _merge_nodes(self, states: list[dict], weights: list[float], round_: int) -> None:
        """`AdapterMerging.merge_nodes` with the round's seed (the same on every node); the merged tensors'
        optimizer state starts again (zeroed in place: the other fragments' keep theirs), what restarted
        loses its residual, and their new values are the global ones."""
        restarted = self.merging.merge_nodes(
            self.node.model, states, weights, self.opts.lora_average, seed=epoch_seed(self.seed, round_)
        )
        self.codec.forget(restarted)
        params, mine = dict(self.node.model.named_parameters()), floats(self.node.weights())
        for k in states[0]:
            for value in self.node.optimizer.state.get(params[k], {}).values():  # zeros: SGD's and Adam's fresh state
                if isinstance(value, torch.Tensor):
                    value.zero_()
            self.global_state[k] = mine[k].clone()

    def _merge(self, fragment: int, mix: float, round_: int) -> None:
        """The fragment's global tensors into this node's weights: θ ← mix·θ + (1 − mix)·θ_global; where it
        keeps what it trained while the round was in flight, θ ← θ_global + (θ − θ_sent) (`keep_on_top`)."""
        mine = self.node.weights()
        if self.sent_from is not None:
            landed = {k: self.global_state[k] for k in self._names(fragment)}
            new, self.sent_from = streaming.keep_on_top(mine, self.sent_from, landed, self.params), None
        elif mix == 0.0:
            new = {k: self.global_state[k] for k in self._names(fragment)}
        else:
            new = {
                k: (mix * mine[k].to(torch.float64) + (1 - mix) * self.global_state[k].to(torch.float64)).to(
                    mine[k].dtype
                )
                for k in self._names(fragment)
            }
        self.node.load_global({**mine, **new}, round_)

    def _payload_of(self, k: int, ref, round_: int, mine: Payload | None) -> Payload:
        if k == self.node.rank and mine is None:
            raise ActorDied(died_during(k, round_))
        if k == self.node.rank:
            return mine
        try:
            return ray.get(ref)
        except ray.exceptions.ObjectLostError as err:  # OwnerDiedError among them
            raise ActorDied(died_during(k, round_)) from err

    def global_hash(self) -> str:
        """Exact hash of this node's global model and frozen weights: what every replica must agree on
        (its own trained weights differ from its peers' between a fragment's syncs); where rounds merge,
        the frozen base moves with every round."""
        frozen = [(k, p) for k, p in self.node.model.named_parameters() if not p.requires_grad]
        return parameter_hash(list(self.global_state.items()) + frozen)


def died_during(node: int, round_: int) -> str:
    """Why a round cannot finish: the payload a node put in the object store died with the node."""
    return (
        f"lofi node {node} died during averaging round {round_}'s exchange: its payload died with it; "
        "rerun with --resume"
    )
