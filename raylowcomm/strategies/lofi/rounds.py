"""Averaging rounds that travel node to node (`lofi.exchange: peers`): outer gradients, compressed.

At a round's boundary node k encodes Δ_k = θ_global − θ_k over what it sends (its floating-point
state: weights and BatchNorm statistics) with `lofi.compress` and its error feedback, and `ray.put`s
the payload itself. The driver passes the N ObjectRefs on (it never fetches a payload during
training); every node fetches its peers' payloads, decodes and averages them in node order
(`core.compression.average_decoded`: the same bits on every node), applies the outer step (plain:
θ_global − Δ̄; or `OuterNesterov`) and loads the new global model. The driver then checks the
replicas' exact parameter hash. Integer tensors (BatchNorm's `num_batches_tracked`) do not cross:
each node keeps its own count (the same on every node, as every node runs the same steps).

What a node keeps for its rounds is checkpointed beside its model checkpoint (`round_path`), written
before it: the last global model, the outer momentum and the error-feedback residual (float64). A
node restarted from its checkpoints continues exactly; one that died between the two writes finds
the newer round in its round file and loads that round's global model. Node 0 also writes the global
model and momentum to `lofi/global.safetensors`, the run's result so far. One format for both
(`write_round` / `read_round`), which the driver's star rounds use for the global file too. A node
that dies between putting its payload and applying the round takes the payload with it: the round
ends with `ActorDied` naming the node and the round (`died_during`).

The final average is one more round (`final_round`): the nodes exchange their last Δ (with their
residuals) as in training and every node ends holding the average, hash-checked; the driver fetches
the same N payloads and decodes them from the shared start (the last round's global model, read
once from `storage`, or the pretrained weights where no round ran) into the result, and checks that
its hash is the nodes'. BatchNorm recalibration and scoring then run on the model the nodes hold:
no model crosses for them.
"""

from __future__ import annotations

import logging

import ray
import torch

from raylowcomm.actors import ActorDied, ReplicaMismatch, check_replicas, count_tensors
from raylowcomm.common.ledger import Ledger, payload_nbytes
from raylowcomm.core.averaging import OuterNesterov
from raylowcomm.core.compression import ErrorFeedback, NoCompression, Payload, average_decoded, layout_of, make_codec
from raylowcomm.core.zo.replay import parameter_hash

logger = logging.getLogger(__name__)

GLOBAL = "lofi/global.safetensors"
"""The last averaging round's global model (and outer momentum): what a resumed run starts from."""


def uses_peers(opts) -> bool:
    """Whether rounds (and the final average) go node to node: `exchange: peers`, or `auto` with a codec."""
    return opts.exchange == "peers" or (opts.exchange == "auto" and opts.compress != "none")


def floats(state: dict) -> dict:
    """The tensors that cross in a round: the floating-point ones."""
    return {k: v for k, v in state.items() if v.is_floating_point()}


class DeltaCodec:
    """How Δ crosses: the parameters with `lofi.compress`, each part with its own error feedback; the
    floating-point buffers (BatchNorm statistics, a few kB) uncompressed, since a quantised running
    variance can go below zero. One flat payload (name → bytes) holds both; every node and the driver
    build the same parts from their own model."""

    def __init__(self, opts, state: dict, params: set[str]):
        fl = floats(state)
        codec = make_codec(opts.compress, opts.compress_block, opts.topk_fraction)
        self.parts = [(codec, layout_of({k: v for k, v in fl.items() if k in params})),
                      (NoCompression(), layout_of({k: v for k, v in fl.items() if k not in params}))]
        self.feedback = [ErrorFeedback(c) for c, _ in self.parts] if opts.error_feedback else None

    @property
    def nbytes(self) -> int:
        return sum(codec.payload_nbytes(layout) for codec, layout in self.parts)

    def encode(self, delta: dict) -> Payload:
        """Δ (float64) → payload; the none codec sends Δ in the weights' own dtype, rounded here."""
        payload = Payload()
        for i, (codec, layout) in enumerate(self.parts):
            part = {k: delta[k].to(spec.dtype) if codec.name == "none" else delta[k] for k, spec in layout.items()}
            if part:
                payload.update(self.feedback[i].encode(part) if self.feedback else codec.encode(part))
        return payload

    def average(self, payloads: list[Payload], weights: list[float]) -> dict:
        """Δ̄ in float64, each part decoded and averaged in the payloads' (node) order."""
        mean = {}
        for codec, layout in self.parts:
            if layout:
                parts = [Payload({k: p[k] for k in layout}) for p in payloads]
                mean.update(average_decoded(codec, parts, layout, weights, dtype=torch.float64))
        return mean

    def residual(self) -> dict:
        return {k: v for fb in self.feedback or [] for k, v in fb.state_dict().items()}

    def load_residual(self, state: dict) -> None:
        for fb, (_, layout) in zip(self.feedback or [], self.parts):
            fb.load_state_dict({k: v for k, v in state.items() if k in layout})


def round_path(rank: int) -> str:
    return f"lofi/checkpoints/node{rank}_round.safetensors"


def write_round(storage, path: str, round_: int, state: dict, momentum: dict | None = None,
                residual: dict | None = None) -> None:
    """A round's state as one safetensors file: `global.*`, `momentum.*` (with an outer step) and
    `residual.*` (a node's error feedback), with the round number; `read_round` reads it back."""
    parts = {"global": state, "momentum": momentum or {}, "residual": residual or {}}
    tensors = {f"{part}.{k}": v for part, values in parts.items() for k, v in values.items()}
    storage.save_tensors(path, tensors, {"round": round_})


def read_round(storage, path: str) -> tuple[dict, dict, dict, int]:
    """(global, momentum, residual, round) as `write_round` wrote them (empty parts where it had none)."""
    tensors, meta = storage.load_tensors(path)
    parts = {p: {k[len(p) + 1:]: v for k, v in tensors.items() if k.startswith(p + ".")}
             for p in ("global", "momentum", "residual")}
    return parts["global"], parts["momentum"], parts["residual"], meta["round"]


class PeerRounds:
    """A lo-fi node's side of peer rounds (mixed into `LofiNode`; it has `model`, `rank`, `cfg`,
    `storage`, `rounds`, `weights()`, `_load` and `_save`)."""

    def init_rounds(self, initial: dict) -> None:
        """Codec, error feedback, the global model (`initial` to begin with) and outer step; then what
        this node's round file holds, if it has one (a restart, or a resumed run)."""
        opts = self.cfg.options["lofi"]
        params = {k for k, _ in self.model.named_parameters()}
        self.codec = DeltaCodec(opts, initial, params)
        self.global_state = {k: v.detach().cpu().clone() for k, v in floats(initial).items()}
        self.outer = OuterNesterov(self.global_state, params, opts.outer_lr, opts.outer_momentum) \
            if opts.outer_optimizer == "nesterov" else None
        if self.outer is not None:
            self.global_state = self.outer.state  # one copy, moved by the outer step
        self.payload: Payload | None = None
        if self.storage.exists(round_path(self.rank)):
            self._restore_round()

    def _restore_round(self) -> None:
        state, momentum, residual, round_ = read_round(self.storage, round_path(self.rank))
        self._set_global(state, momentum)
        self.codec.load_residual(residual)
        if round_ > self.rounds:  # died after writing its round file, before its checkpoint
            self._load({**self.weights(), **self.global_state}, round_)
            self.rounds = round_
            self._save(self.step)
        self.log(f"round state restored at averaging round {round_}")

    def _set_global(self, state: dict, momentum: dict) -> None:
        self.global_state.update(state)
        if self.outer is not None:
            self.outer.state = self.global_state
            self.outer.buf.update(momentum)

    def _delta(self) -> dict:
        """Δ = θ_global − θ_k in float64 over the floating-point tensors (exact for float32 weights)."""
        mine = floats(self.weights())
        return {k: g.to(torch.float64) - mine[k].to(torch.float64) for k, g in self.global_state.items()}

    def encode_delta(self) -> Payload:
        """This node's payload: Δ plus what compression dropped before (error feedback)."""
        self.payload = self.codec.encode(self._delta())
        return self.payload

    def send_delta(self) -> tuple[list, int]:
        """Encode Δ and put it in the object store from here: ([its ObjectRef], its packed bytes); the
        ref travels in a list so that nobody resolves it on the way."""
        payload = self.encode_delta()
        return [ray.put(payload)], payload.nbytes

    def apply_round(self, round_: int, refs: list[list], weights: list[float]) -> None:
        """Fetch the peers' payloads, average them in node order, take the outer step and load the new
        global model; checkpoint it (round file first). A node that has this round already keeps it.
        A node restarted since it sent its payload, or a peer's payload lost with its owner, ends the
        round with ActorDied naming the node: the payload died with it."""
        if round_ <= self.rounds:
            return
        payloads = [self._payload_of(k, ref[0], round_) for k, ref in enumerate(refs)]
        mean = self.codec.average(payloads, weights)
        if self.outer is not None:
            self.global_state = self.outer.step_delta(mean)
        else:
            for k, g in self.global_state.items():
                self.global_state[k] = (g.to(torch.float64) - mean[k]).to(g.dtype)
        self.payload = None
        self._save_round(round_)
        self._load({**self.weights(), **self.global_state}, round_)
        self.rounds = round_
        self._save(self.step)

    def _payload_of(self, k: int, ref, round_: int) -> Payload:
        if k == self.rank and self.payload is None:
            raise ActorDied(died_during(k, round_))
        if k == self.rank:
            return self.payload
        try:
            return ray.get(ref)
        except ray.exceptions.ObjectLostError as err:  # OwnerDiedError among them
            raise ActorDied(died_during(k, round_)) from err

    def _save_round(self, round_: int) -> None:
        momentum = self.outer.buf if self.outer is not None else None
        if self.rank == 0:
            write_round(self.storage, GLOBAL, round_, self.global_state, momentum)
        write_round(self.storage, round_path(self.rank), round_, self.global_state, momentum, self.codec.residual())

    def round_of(self) -> int:
        return self.rounds


def died_during(node: int, round_: int) -> str:
    """Why a round cannot finish: the payload a node put in the object store died with the node."""
    return (f"lofi node {node} died during averaging round {round_}'s exchange: its payload died with it; "
            "rerun with --resume")


def exchange_round(group, round_: int, until: int, weights: list[float], fetched: dict,
                   phase: str = "train") -> tuple[list, str]:
    """One peer round from the driver: the nodes put their payloads, the driver hands every node the
    refs, the nodes average and step, the driver checks their parameter hashes; returns the refs and
    the common hash. The ledger books each payload's packed bytes once per receiving peer
    (`outer_gradients`), each node's reply (its ref and size, `round_replies`: also counted in
    `fetched`, no tensor) and what every node is sent (round, the N refs and the weights,
    `round_args`). An ObjectRef crosses as its binary id."""
    n, ledger = len(group), group.ledger
    sent = group.call("send_delta", phase=phase)
    refs = [ref for ref, _ in sent]
    replies = sum(len(ref[0].binary()) + payload_nbytes(nbytes) for ref, nbytes in sent)
    fetched["bytes"] += ledger.record(phase, "round_replies", replies)
    fetched["tensors"] += count_tensors(sent)
    for _, nbytes in sent:
        ledger.record(phase, "outer_gradients", nbytes, copies=n - 1)
    args = payload_nbytes(round_) + sum(len(r[0].binary()) for r in refs) + payload_nbytes(weights)
    ledger.record(phase, "round_args", args, copies=n)
    group.call("apply_round", round_, refs, weights, phase=phase)  # a lost payload: ActorDied (`died_during`)
    return refs, check_replicas(dict(zip(group.keys(), group.handles())), until, ledger, phase)


def final_round(group, opts, start: dict, outer: OuterNesterov | None, plan, param_order: list[str],
                fetched: dict) -> dict:
    """The final average, as one more round: every node ends holding it (hash-checked), and the
    driver decodes the same N payloads from `start` (with `outer`, the momentum there) into its own
    copy, start − Δ̄ (or the outer step on Δ̄) over the floating-point tensors, the rest as `start`
    has it. Its parameters must hash as the nodes' do: one average, not two."""
    params = set(param_order)
    refs, nodes_hash = exchange_round(group, len(plan.boundaries), plan.steps, plan.weights, fetched, "final")
    payloads = group.fetch.get([ref[0] for ref in refs], "final", "outer_gradients")
    mean = DeltaCodec(opts, start, params).average(payloads, plan.weights)
    if outer is not None:
        average = dict(outer.step_delta(mean))
    else:
        average = dict(start)
        for k, d in mean.items():
            average[k] = (start[k].to(torch.float64) - d).to(start[k].dtype)
    mine = parameter_hash([(k, average[k]) for k in param_order])
    if mine != nodes_hash:
        raise ReplicaMismatch(f"lo-fi's final average on the driver (hash {mine[:16]}) differs from the nodes' "
                              f"(hash {nodes_hash[:16]})")
    return average


def load_global(storage, ledger: Ledger, initial: dict, params: set[str], opts) -> tuple[dict, OuterNesterov | None]:
    """The shared start of the final average: the last round's global model as node 0 wrote it (read by
    the driver once, after training, and booked), or `initial` where no round ran; with the outer
    momentum where there is an outer step."""
    state, momentum = dict(initial), None
    if storage.exists(GLOBAL):
        last, momentum, _, _ = read_round(storage, GLOBAL)
        state.update(last)
        ledger.send("final", "global_model", floats(state))
    if opts.outer_optimizer != "nesterov":
        return state, None
    outer = OuterNesterov(state, params, opts.outer_lr, opts.outer_momentum)
    outer.buf.update(momentum or {})
    return outer.state, outer
