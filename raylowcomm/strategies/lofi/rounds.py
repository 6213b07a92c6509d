"""Averaging rounds that travel node to node (`lofi.exchange: peers`): outer gradients, compressed.

At a round's boundary node k encodes Δ_k = θ_global − θ_k over what it sends (its floating-point
state: weights, and BatchNorm statistics unless the end recalibrates them, `crossing`) with
`lofi.compress` and its error feedback, and `ray.put`s the payload itself. The driver passes the N
ObjectRefs on (it never fetches a payload during training); every node fetches its peers' payloads,
decodes and averages them in node order (`core.compression.average_decoded`: the same bits on
every node), applies the outer step (plain:
θ_global − Δ̄; or `OuterNesterov`) and loads the new global model. The driver then checks the
exact hash of every node's global model (`global_hash`). Integer tensors (BatchNorm's
`num_batches_tracked`) do not cross: each node keeps its own count (the same on every node, as every
node runs the same steps).

What a node keeps for its rounds is checkpointed beside its model checkpoint (`round_path`), written
before it: the last global model, the outer momentum and the error-feedback residual (float64). A
node restarted from its checkpoints continues exactly; one that died between the two writes finds
the newer round in its round file and loads that round's global model. Node 0 also writes the global
model and momentum to `lofi/global.safetensors`, the run's result so far. One format for both
(`write_round` / `read_round`), which the driver's star rounds use for the global file too. A node
that dies between putting its payload and applying the round takes the payload with it: the round
ends with `ActorDied` naming the node and the round (`died_during`).

With `lofi.fragments` a round sends and lands one fragment's tensors only, and with `lofi.overlap` it
lands during the next `train` call (`streaming`): the round file then also records which fragment
its round synced and the mix it was merged with, so a restart merges it again the same way.

The final average is one more round: the nodes exchange their last Δ (with their residuals) as in
training and every node ends holding the average, hash-checked. After averaging rounds (or under
LoRA) its start, the last global model, is on the nodes only: node 0 saves the average it holds and
the driver reads no model (`nodes_hold_result`). Lo-fi's one average starts from the pretrained
weights, which the driver holds: it fetches the same N payloads and decodes them there into the
result (`final_round`), checking that its hash is the nodes'. BatchNorm recalibration and scoring
then run on the model the nodes hold: no model crosses for them.
"""

from __future__ import annotations

import logging
import time

import ray
import torch

from raylowcomm.actors import ActorDied, ReplicaMismatch, check_replicas, count_tensors
from raylowcomm.common.ledger import Ledger, payload_nbytes
from raylowcomm.common.seeding import epoch_seed
from raylowcomm.core.averaging import OuterNesterov
from raylowcomm.core.compression import ErrorFeedback, NoCompression, Payload, average_decoded, layout_of, make_codec
from raylowcomm.core.zo.replay import parameter_hash
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.streaming import ALL

logger = logging.getLogger(__name__)

GLOBAL = "lofi/global.safetensors"
"""The last averaging round's global model (and outer momentum): what a resumed run starts from."""


def uses_peers(opts) -> bool:
    """Whether rounds (and the final average) go node to node: `exchange: peers`, or `auto` with a codec."""
    return opts.exchange == "peers" or (opts.exchange == "auto" and opts.compress != "none")


def floats(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point()}


BN_STATISTICS = (".running_mean", ".running_var")


def crossing(state: dict, opts) -> dict:
    """The tensors that cross in a round: the floating-point ones, but with `lofi.bn_recalibrate` not
    the BatchNorm running statistics, which the end recomputes for the average anyway (training uses
    batch statistics; each node keeps its own meanwhile). Without recalibration they cross, uncompressed."""
    return {k: v for k, v in floats(state).items() if not (opts.bn_recalibrate and k.endswith(BN_STATISTICS))}


class DeltaCodec:
    """How Δ crosses: the parameters with `lofi.compress`, each part with its own error feedback; the
    floating-point buffers that cross (BatchNorm statistics without recalibration) uncompressed, since
    a quantised running variance can go below zero. One flat payload (name → bytes) holds both; every
    node and the driver build the same parts from their own model."""

    def __init__(self, opts, state: dict, params: set[str]):
        fl = crossing(state, opts)
        codec = make_codec(opts.compress, opts.compress_block, opts.topk_fraction)
        self.parts = [(codec, layout_of({k: v for k, v in fl.items() if k in params})),
                      (NoCompression(), layout_of({k: v for k, v in fl.items() if k not in params}))]
        self.feedback = [ErrorFeedback(c) for c, _ in self.parts] if opts.error_feedback else None

    @property
    def nbytes(self) -> int:
        return sum(codec.payload_nbytes(layout) for codec, layout in self.parts)

    def sizes(self) -> dict[str, int]:
        """Each tensor's packed bytes in a payload: what fragments are balanced by."""
        return {k: codec.packed_nbytes(spec) for codec, layout in self.parts for k, spec in layout.items()}

    def encode(self, delta: dict) -> Payload:
        """Δ (float64, over all tensors or one fragment's) → payload; the none codec sends Δ in the
        weights' own dtype, rounded here."""
        payload = Payload()
        for i, (codec, layout) in enumerate(self.parts):
            part = {k: delta[k].to(spec.dtype) if codec.name == "none" else delta[k]
                    for k, spec in layout.items() if k in delta}
            if part:
                payload.update(self.feedback[i].encode(part) if self.feedback else codec.encode(part))
        return payload

    def average(self, payloads: list[Payload], weights: list[float]) -> dict:
        """Δ̄ in float64, each part decoded and averaged in the payloads' (node) order."""
        mean = {}
        for codec, layout in self.parts:
            names = [k for k in layout if k in payloads[0]]  # one fragment's, or all
            if names:
                parts = [Payload({k: p[k] for k in names}) for p in payloads]
                mean.update(average_decoded(codec, parts, layout, weights, dtype=torch.float64))
        return mean

    def decode_each(self, payloads: list[Payload]) -> list[dict]:
        """Each node's Δ in float64, in node order: for a fine-tune that merges rounds (`merges_rounds`,
        LoRA), whose average is not the mean of Δ; small, as what crosses there is adapters."""
        return [{k: v for codec, layout in self.parts
                 for k, v in codec.decode(Payload({k: p[k] for k in layout if k in p}), layout,
                                          dtype=torch.float64).items()} for p in payloads]

    def forget(self, names) -> None:
        """Drop the error-feedback residuals of tensors that restarted (`ErrorFeedback.forget`)."""
        for fb in self.feedback or []:
            fb.forget(names)

    def residual(self) -> dict:
        return {k: v for fb in self.feedback or [] for k, v in fb.state_dict().items()}

    def load_residual(self, state: dict) -> None:
        for fb, (_, layout) in zip(self.feedback or [], self.parts):
            fb.load_state_dict({k: v for k, v in state.items() if k in layout})


def round_path(rank: int) -> str:
    return f"lofi/checkpoints/node{rank}_round.safetensors"


def write_round(storage, path: str, round_: int, state: dict, momentum: dict | None = None,
                residual: dict | None = None, nodes: list[dict] | None = None, **meta) -> None:
    """A round's state as one safetensors file: `global.*`, `momentum.*` (with an outer step) and
    `residual.*` (a node's error feedback), per tensor, so per fragment too; with the round number
    (and `meta`: which fragment the round synced, how it was mixed in); `read_round` reads it back.
    `nodes`: where rounds merge (LoRA), every node's decoded state of the round, `node_states` reads them."""
    parts = {"global": state, "momentum": momentum or {}, "residual": residual or {},
             **{f"node{k}": values for k, values in enumerate(nodes or [])}}
    tensors = {f"{part}.{k}": v for part, values in parts.items() for k, v in values.items()}
    storage.save_tensors(path, tensors, {"round": round_, **meta})


def read_round(storage, path: str) -> tuple[dict, dict, dict, int]:
    """(global, momentum, residual, round) as `write_round` wrote them (empty parts where it had none)."""
    tensors, meta = storage.load_tensors(path)
    parts = {p: {k[len(p) + 1:]: v for k, v in tensors.items() if k.startswith(p + ".")}
             for p in ("global", "momentum", "residual")}
    return parts["global"], parts["momentum"], parts["residual"], meta["round"]


def node_states(storage, path: str) -> list[dict]:
    """The nodes' decoded states a round file holds (`write_round`'s `nodes`), in node order."""
    tensors, parts = storage.load_tensors(path)[0], {}
    for key, v in tensors.items():
        part, name = key.split(".", 1)
        if part.startswith("node") and part[4:].isdigit():
            parts.setdefault(int(part[4:]), {})[name] = v
    return [parts[k] for k in sorted(parts)]


def round_meta(storage, path: str) -> dict:
    """What `write_round` wrote besides the tensors: the round, and the fragment it synced (ALL where
    the file predates fragments) and the mix it was merged with."""
    return {"fragment": ALL, "mix": 0.0, **storage.load_tensors(path)[1]}


class PeerRounds:
    """A lo-fi node's side of peer rounds (mixed into `LofiNode`; it has `model`, `rank`, `cfg`,
    `storage`, `rounds`, `step`, `optimizer`, `fine_tune`, `weights()`, `_load` and `_save`).

    Where the fine-tune merges rounds (`merges_rounds`: LoRA), what crosses is the adapters and head:
    a node decodes every peer's Δ, and the round merges the nodes' exact average into the frozen base
    and restarts the adapters from the round's seed (`FineTune.merge_nodes`), as the driver's rounds do."""

    def init_rounds(self, initial: dict) -> None:
        """Codec, error feedback, the global model (`initial`: what this node sends, as it started),
        its fragments and outer step; then what this node's round file holds, if it has one (a restart,
        or a resumed run)."""
        opts = self.cfg.options["lofi"]
        params = {k for k, _ in self.model.named_parameters()}
        self.codec = DeltaCodec(opts, initial, params)
        self.global_state = crossing(initial, opts)  # the caller's copy, kept
        sizes = self.codec.sizes()
        self.fragments = streaming.split({k: sizes[k] for k in self.global_state}, opts.fragments,
                                         self.fine_tune.sync_unit)
        self.mix = opts.mix if opts.overlap else 0.0  # with nothing in flight, nothing to mix
        self.outer = OuterNesterov(self.global_state, params, opts.outer_lr, opts.outer_momentum) \
            if opts.outer_optimizer == "nesterov" else None
        if self.outer is not None:
            self.global_state = self.outer.state  # one copy, moved by the outer step
        self.payload: Payload | None = None
        self.exchange: streaming.Exchange | None = None
        if self.storage.exists(round_path(self.rank)):
            self._restore_round()

    def _restore_round(self) -> None:
        state, momentum, residual, round_ = read_round(self.storage, round_path(self.rank))
        self._set_global(state, momentum)
        self.codec.load_residual(residual)
        if round_ > self.rounds:  # died after writing its round file, before its checkpoint: merge again
            meta = round_meta(self.storage, round_path(self.rank))
            if self.fine_tune.merges_rounds:
                self._merge_nodes(node_states(self.storage, round_path(self.rank)), meta["weights"], round_)
            else:
                self._merge(meta["fragment"], meta["mix"], round_)
            self.rounds = round_
            self._save(self.step)
        self.log(f"round state restored at averaging round {round_}")

    def _set_global(self, state: dict, momentum: dict) -> None:
        self.global_state.update(state)
        if self.outer is not None:
            self.outer.state = self.global_state
            self.outer.buf.update(momentum)

    def _names(self, fragment: int) -> list[str]:
        return list(self.global_state) if fragment == streaming.ALL else self.fragments[fragment]

    def _delta(self, fragment: int = streaming.ALL) -> dict:
        """Δ = θ_global − θ_k in float64 over the fragment's floating-point tensors (exact for float32 weights)."""
        mine = floats(self.weights())
        return {k: self.global_state[k].to(torch.float64) - mine[k].to(torch.float64) for k in self._names(fragment)}

    def encode_delta(self, fragment: int = streaming.ALL) -> Payload:
        """This node's payload: Δ plus what compression dropped before (error feedback)."""
        self.payload = self.codec.encode(self._delta(fragment))
        return self.payload

    def send_delta(self, fragment: int = streaming.ALL) -> tuple[list, int]:
        """Encode Δ (of one fragment, or all) and put it in the object store from here: ([its
        ObjectRef], its packed bytes); the ref travels in a list so that nobody resolves it on the way."""
        payload = self.encode_delta(fragment)
        return [ray.put(payload)], payload.nbytes

    def apply_round(self, round_: int, refs: list[list], weights: list[float], fragment: int = streaming.ALL) -> None:
        """Fetch the peers' payloads, average them in node order, take the outer step and load the new
        global fragment; checkpoint it (round file first). A node that has this round already keeps it.
        A node restarted since it sent its payload, or a peer's payload lost with its owner, ends the
        round with ActorDied naming the node: the payload died with it."""
        if round_ > self.rounds:
            self._land(round_, fragment, self._average(round_, refs, weights, self.payload), 0.0, self.step)

    def begin_round(self, round_: int, refs: list[list], weights: list[float], fragment: int = streaming.ALL) -> None:
        """`apply_round` overlapped (lofi.overlap): fetch and average in a thread and return at once;
        `train` lands it at the step the driver names."""
        if round_ > self.rounds:
            payload = self.payload
            self.exchange = streaming.Exchange(round_, fragment, lambda: self._average(round_, refs, weights, payload))

    def expect_landing(self, landing: list | None) -> None:
        """Before training on: the exchange that lands in this call must be in flight here; a node
        restarted since it began holds none (its payload died with it)."""
        if landing is not None and landing[0] > self.rounds and (self.exchange is None
                                                                  or self.exchange.round != landing[0]):
            raise ActorDied(died_during(self.rank, landing[0]))

    def land(self, round_: int, step: int) -> float:
        """The exchange in flight lands (waiting for it if it has not): step and mix (`lofi.mix`).
        Returns how long training waited for it: 0 where the exchange was hidden behind the τ steps."""
        exchange, self.exchange = self.exchange, None
        began = time.perf_counter()
        mean = exchange.result()
        waited = time.perf_counter() - began
        self._land(round_, exchange.fragment, mean, self.mix, step)
        return waited

    def _average(self, round_: int, refs: list[list], weights: list[float], mine: Payload | None):
        """Δ̄; where rounds merge, (each node's state, weights): θ_global − Δ_k per node."""
        payloads = [self._payload_of(k, ref[0], round_, mine) for k, ref in enumerate(refs)]
        if self.fine_tune.merges_rounds:
            return [{k: self.global_state[k].to(torch.float64) - d for k, d in delta.items()}
                    for delta in self.codec.decode_each(payloads)], weights
        return self.codec.average(payloads, weights)

    def _land(self, round_: int, fragment: int, mean, mix: float, step: int) -> None:
        """Outer step on the fragment's global tensors (plain: θ_global − Δ̄), round file, merge, checkpoint;
        where rounds merge, `_land_merged`."""
        if self.fine_tune.merges_rounds:
            return self._land_merged(round_, fragment, *mean, step)
        if self.outer is not None:
            self.global_state = self.outer.step_delta(mean)
        else:
            for k, d in mean.items():
                g = self.global_state[k]
                self.global_state[k] = (g.to(torch.float64) - d).to(g.dtype)
        self.payload = None
        self._save_round(round_, fragment, mix)
        self._merge(fragment, mix, round_)
        self.rounds = round_
        self._save(step)

    def _land_merged(self, round_: int, fragment: int, states: list[dict], weights: list[float], step: int) -> None:
        """The nodes' states merged into this node's model (`_merge_nodes`), the round file (with those
        states, so a restart merges again), checkpoint."""
        self.payload = None
        self._merge_nodes(states, weights, round_)
        self._save_round(round_, fragment, 0.0, nodes=states, weights=weights)
        self.rounds = round_
        self._save(step)

    def _merge_nodes(self, states: list[dict], weights: list[float], round_: int) -> None:
        """`FineTune.merge_nodes` with the round's seed (the same on every node); the merged tensors'
        optimizer state starts again (zeroed in place: the other fragments' keep theirs), what restarted
        loses its residual, and their new values are the global ones."""
        restarted = self.fine_tune.merge_nodes(self.model, states, weights, self.cfg.options["lofi"].lora_average,
                                               seed=epoch_seed(self.cfg.seed, round_))
        self.codec.forget(restarted)
        params, mine = dict(self.model.named_parameters()), floats(self.weights())
        for k in states[0]:
            for value in self.optimizer.state.get(params[k], {}).values():  # zeros: SGD's and Adam's fresh state
                if isinstance(value, torch.Tensor):
                    value.zero_()
            self.global_state[k] = mine[k].clone()

    def _merge(self, fragment: int, mix: float, round_: int) -> None:
        """The fragment's global tensors into this node's weights: θ ← mix·θ + (1 − mix)·θ_global."""
        mine = self.weights()
        if mix == 0.0:
            new = {k: self.global_state[k] for k in self._names(fragment)}
        else:
            new = {k: (mix * mine[k].to(torch.float64) + (1 - mix) * self.global_state[k].to(torch.float64))
                   .to(mine[k].dtype) for k in self._names(fragment)}
        self._load({**mine, **new}, round_)

    def _payload_of(self, k: int, ref, round_: int, mine: Payload | None) -> Payload:
        if k == self.rank and mine is None:
            raise ActorDied(died_during(k, round_))
        if k == self.rank:
            return mine
        try:
            return ray.get(ref)
        except ray.exceptions.ObjectLostError as err:  # OwnerDiedError among them
            raise ActorDied(died_during(k, round_)) from err

    def _save_round(self, round_: int, fragment: int, mix: float, nodes: list[dict] | None = None,
                    weights: list[float] | None = None) -> None:
        momentum = self.outer.buf if self.outer is not None else None
        if self.rank == 0:
            write_round(self.storage, GLOBAL, round_, self.global_state, momentum)
        write_round(self.storage, round_path(self.rank), round_, self.global_state, momentum, self.codec.residual(),
                    nodes, fragment=fragment, mix=mix, **({"weights": weights} if weights else {}))

    def global_hash(self) -> str:
        """Exact hash of this node's global model and frozen weights: what every replica must agree on
        (its own trained weights differ from its peers' between a fragment's syncs); where rounds merge,
        the frozen base moves with every round."""
        frozen = [(k, p) for k, p in self.model.named_parameters() if not p.requires_grad]
        return parameter_hash(list(self.global_state.items()) + frozen)

    def round_of(self) -> tuple[int, int]:
        """The rounds this node has landed and the step it has trained to."""
        return self.rounds, self.step


def died_during(node: int, round_: int) -> str:
    """Why a round cannot finish: the payload a node put in the object store died with the node."""
    return (f"lofi node {node} died during averaging round {round_}'s exchange: its payload died with it; "
            "rerun with --resume")


def exchange_round(group, round_: int, until: int, weights: list[float], fetched: dict, phase: str = "train",
                   fragment: int | None = None, overlap: bool = False) -> tuple[list, str | None]:
    """One peer round from the driver: the nodes put their payloads (of `fragment`, or all), the
    driver hands every node the refs, the nodes average and step, the driver checks their global
    models' hashes; returns the refs and the common hash. With `overlap` the nodes only begin the
    round (it lands during their next `train`, checked after it: `check_global`), and no hash yet.
    The ledger books each payload's packed bytes once per receiving peer (`outer_gradients`), each
    node's reply (its ref and size, `round_replies`: also counted in `fetched`, no tensor) and what
    every node is sent (round, the N refs and the weights, and the fragment where there are
    several, `round_args`). An ObjectRef crosses as its binary id."""
    n, ledger = len(group), group.ledger
    part = [] if fragment is None else [fragment]
    sent = group.call("send_delta", *part, phase=phase)
    refs = [ref for ref, _ in sent]
    replies = sum(len(ref[0].binary()) + payload_nbytes(nbytes) for ref, nbytes in sent)
    fetched["bytes"] += ledger.record(phase, "round_replies", replies)
    fetched["tensors"] += count_tensors(sent)
    for _, nbytes in sent:
        ledger.record(phase, "outer_gradients", nbytes, copies=n - 1)
    args = payload_nbytes(round_) + sum(len(r[0].binary()) for r in refs) + payload_nbytes(weights)
    ledger.record(phase, "round_args", args + 2 * sum(payload_nbytes(f) for f in part), copies=n)
    if overlap:
        group.call("begin_round", round_, refs, weights, *part, phase=phase)
        return refs, None
    group.call("apply_round", round_, refs, weights, *part, phase=phase)  # a lost payload: ActorDied (`died_during`)
    return refs, check_global(group, until, ledger, phase)


def check_global(group, step: int, ledger: Ledger, phase: str = "train") -> str:
    """The nodes' common global-model hash (`PeerRounds.global_hash`); ReplicaMismatch otherwise."""
    return check_replicas(dict(zip(group.keys(), group.handles())), step, ledger, phase, method="global_hash")


def landing(plan, i: int) -> list:
    """`train`'s extra argument for the call up to boundary i where rounds overlap: [round, step] of
    the exchange sent at boundary i − 1, which lands in that call (none before the first boundary)."""
    return [[i, plan.landings[i - 1]]] if plan.landings is not None and i > 0 else []


def final_round(group, opts, start: dict, outer: OuterNesterov | None, plan, param_order: list[str],
                fetched: dict) -> dict:
    """The final average, as one more round: every node ends holding it (hash-checked), and the
    driver decodes the same N payloads from `start` (with `outer`, the momentum there) into its own
    copy, start − Δ̄ (or the outer step on Δ̄) over the floating-point tensors, the rest as `start`
    has it. Its floating-point tensors must hash as the nodes' global models do: one average, not two."""
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
    mine = parameter_hash(list(crossing(average, opts).items()))  # what `global_hash` hashes on every node
    if mine != nodes_hash:
        raise ReplicaMismatch(f"lo-fi's final average on the driver (hash {mine[:16]}) differs from the nodes' "
                              f"(hash {nodes_hash[:16]})")
    return average


def nodes_hold_result(opts, merges_rounds: bool) -> bool:
    """Whether the final round's average lives on the nodes only (node 0 saves it): after averaging
    rounds its start is the last global model, which only the nodes hold (the driver would read a
    whole model to decode the round on it), and under LoRA the base moves with every round."""
    return opts.average_every is not None or merges_rounds


def driver_start(initial: dict, params: set[str], opts) -> tuple[dict, OuterNesterov | None]:
    """The shared start of lo-fi's one compressed average, as the driver decodes it: the pretrained
    weights (`initial`, copied), with a fresh outer momentum where there is an outer step."""
    state = dict(initial)
    if opts.outer_optimizer != "nesterov":
        return state, None
    outer = OuterNesterov(state, params, opts.outer_lr, opts.outer_momentum)
    return outer.state, outer
