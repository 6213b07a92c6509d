"""lo-fi's peer rounds (`lofi.exchange: peers`), the driver's side: at a round's boundary every node
encodes its Δ and puts the payload in the object store itself; the driver passes the N ObjectRefs
on (it never fetches a payload during training); every node fetches its peers' payloads and lands
the same global model (`node_rounds`), whose exact hash the driver then checks on every node.

The final average is one more round: every node ends holding it, hash-checked. After averaging
rounds (or under LoRA) its start, the last global model, is on the nodes only: node 0 saves the
average it holds and the driver reads no model. Lo-fi's one average starts from the pretrained
weights, which the driver holds: it fetches the same N payloads and decodes them there into the
result (`final_round`), checking that its hash is the nodes'. BatchNorm recalibration and scoring
then run on the model the nodes hold: no model crosses for them.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import ray
import torch

from raylowcomm.actors import NodeGroup, ReplicaMismatch, check_replicas, count_tensors
from raylowcomm.common.hashing import parameter_hash
from raylowcomm.common.ledger import Ledger, payload_nbytes
from raylowcomm.config import RunConfig
from raylowcomm.core.averaging import OuterNesterov
from raylowcomm.models import state_dict_of
from raylowcomm.strategies.base import RunContext
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.exchange import FinalModel
from raylowcomm.strategies.lofi.merging import merging_for
from raylowcomm.strategies.lofi.payload import DeltaCodec, crossing, dense_names, final_is_own
from raylowcomm.strategies.lofi.plan import Plan
from raylowcomm.strategies.lofi.robust_average import robust_details
from raylowcomm.strategies.lofi.round_file import GLOBAL
from raylowcomm.strategies.lofi.secure_rounds import SecureRoster, secure_details, secure_round
from raylowcomm.strategies.lofi.star import curve_needs_driver_weights

logger = logging.getLogger(__name__)


def nodes_hold_result(opts, adapters: bool) -> bool:
    """Whether the final round's average lives on the nodes only (node 0 saves it): after averaging
    rounds its start is the last global model, which only the nodes hold (the driver would read a
    whole model to decode the round on it), and under LoRA the base moves with every round."""
    return opts.average_every is not None or adapters


class PeerExchange:
    name: ClassVar[str] = "peers"
    nodes_keep_rounds: ClassVar[bool] = True
    paced: ClassVar[bool] = False

    def __init__(self, ctx: RunContext, o: LofiConfig, start: dict | None):
        """`start` is unused: every node starts from the weights it was given and keeps its own global model."""
        self.opts, self.storage = o, ctx.storage
        self.on_nodes = nodes_hold_result(self.opts, merging_for(ctx.spec).merges_rounds)
        self.fetched = {"bytes": 0, "tensors": 0}  # what the driver read back during training: refs and sizes
        self.roster = SecureRoster() if o.secure else None  # lofi.secure: the nodes' public keys
        self.adder = None
        """Secure rounds through the driver (`secure_star`): final → the function adding a round's payloads."""
        self.hashes: list[list] = []
        """[step, the nodes' common global-model hash] after each round this driver saw land, the final one's last."""

    @staticmethod
    def driver_weights(cfg: RunConfig, o: LofiConfig) -> str | None:
        if not nodes_hold_result(o, cfg.model.lora is not None):
            return "lo-fi's one compressed average is decoded on the driver from the pretrained weights"
        return curve_needs_driver_weights(cfg)

    def resume(self, ctx: RunContext, group: NodeGroup, plan: Plan) -> int:
        """Every node restored its round state itself; the run continues after their round."""
        done, steps = zip(*group.call("round_of", phase="train"))
        if len(set(done)) > 1:
            raise RuntimeError(
                f"lo-fi nodes resumed at different averaging rounds {done}: the run was stopped "
                "during a round's exchange, which a resume does not repair; start it afresh"
            )
        if done[0] >= len(plan.boundaries):
            raise RuntimeError(
                f"lo-fi's final round ({done[0]}) had finished when the run stopped: the average is in "
                f"storage ({GLOBAL}); start afresh to score it again"
            )
        sent_at = plan.boundaries[done[0]]
        if max(steps) > sent_at:  # lofi.overlap: trained past the send of a round that never landed
            raise RuntimeError(
                f"lo-fi nodes trained to steps {list(steps)}, past step {sent_at} where round "
                f"{done[0] + 1} was sent: the run stopped while that exchange was in flight "
                "(lofi.overlap), which a resume does not repair; start it afresh"
            )
        return done[0]

    def landed(self, group: NodeGroup, step: int, phase: str) -> None:
        self.hashes.append([step, check_global(group, step, group.ledger, phase)])

    def round(self, group: NodeGroup, plan: Plan, round_: int, until: int) -> None:
        _, hashed = exchange_round(
            group,
            round_,
            until,
            plan.weights,
            self.fetched,
            fragment=plan.fragments[round_ - 1],
            overlap=plan.landings is not None,
            roster=self.roster,
            adder=self.adder,
        )
        if hashed is not None:  # overlapped: checked where it lands (`landed`)
            self.hashes.append([until, hashed])

    def finish(
        self, ctx: RunContext, group: NodeGroup, plan: Plan, metric: str, node_metrics: list[dict]
    ) -> FinalModel:
        """One more round, the nodes' compressed Δ on their global model, which leaves the average on
        every node; lo-fi's one average is decoded on the driver too, from the pretrained weights."""
        everyone, own = list(range(len(group))), final_is_own(self.opts)
        if self.on_nodes:
            fetched = {"bytes": 0, "tensors": 0}
            _, hashed = exchange_round(
                group,
                len(plan.boundaries),
                plan.steps,
                plan.weights,
                fetched,
                "final",
                final=own,
                roster=self.roster,
                adder=self.adder,
            )
            self.hashes.append([plan.steps, hashed])
            return FinalModel(everyone, on_nodes=True)
        order = [k for k, _ in ctx.architecture.named_parameters()]
        start, outer = driver_start(state_dict_of(ctx.load_driver_weights()), set(order), self.opts)
        dense = dense_names(ctx.architecture, ctx.spec.family, self.opts.dense)
        average = final_round(group, self.opts, start, outer, plan, order, dense, self.roster)
        return FinalModel(everyone, on_nodes=True, weights=average)

    def details(self) -> dict:
        return {
            "driver_fetched": {"train": self.fetched},
            "global_hashes": self.hashes,
            **robust_details(self.storage, self.opts),
            **secure_details(self.roster),
        }


def exchange_round(
    group,
    round_: int,
    until: int,
    weights: list[float],
    fetched: dict,
    phase: str = "train",
    fragment: int | None = None,
    overlap: bool = False,
    final: bool = False,
    roster: SecureRoster | None = None,
    adder=None,
) -> tuple[list, str | None]:
    """One peer round from the driver: the nodes put their payloads (of `fragment`, or all), the
    driver hands every node the refs, the nodes average and step, the driver checks their global
    models' hashes; returns the refs and the common hash. With `overlap` the nodes only begin the
    round (it lands during their next `train`, checked after it: `check_global`), and no hash yet.
    The ledger books each payload's packed bytes once per receiving peer (`outer_gradients`), each
    node's reply (its ref and size, `round_replies`: also counted in `fetched`, no tensor) and what
    every node is sent (round, the N refs and the weights, and the fragment where there are
    several, `round_args`, and the final round's flag where it is encoded unlike the others: `final`). An
    ObjectRef crosses as its binary id. With `roster` (lofi.secure) the round is `secure_round`'s, with its
    members' refs; with `adder` (secure rounds through the driver) too, the driver adding the payloads."""
    if roster is not None:
        refs = secure_round(group, roster, round_, fetched, phase, fragment, final, adder and adder(final))
        return refs, check_global(group, until, group.ledger, phase)
    n, ledger = len(group), group.ledger
    part = [] if fragment is None else [fragment]
    if final:  # the final round syncs every fragment
        part = [streaming.ALL, True]
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


def final_round(
    group,
    opts,
    start: dict,
    outer: OuterNesterov | None,
    plan,
    param_order: list[str],
    dense: set[str],
    roster: SecureRoster | None = None,
) -> dict:
    """The final average, as one more round: every node ends holding it (hash-checked), and the
    driver decodes the same N payloads from `start` (with `outer`, the momentum there; `dense`, the
    parameters that cross whole) into its own copy, start − Δ̄ (or the outer step on Δ̄) over the
    floating-point tensors, the rest as `start` has it. Its floating-point tensors must hash as the
    nodes' global models do: one average, not two."""
    params = set(param_order)
    own = final_is_own(opts)
    refs, nodes_hash = exchange_round(
        group,
        len(plan.boundaries),
        plan.steps,
        plan.weights,
        {"bytes": 0, "tensors": 0},
        "final",
        final=own,
        roster=roster,
    )
    codec = DeltaCodec(opts, start, params, dense)
    if roster is not None:  # the members' masked payloads: the driver reads their sum only
        payloads = ray.get([ref[0] for ref in refs])
        for payload in payloads:
            codes, scales = codec.masked_nbytes(payload, own, len(group))
            group.fetch.bytes += group.ledger.record("final", "masked_codes", codes)
            group.fetch.bytes += group.ledger.record("final", "masked_scales", scales)
        mean = codec.average_masked(payloads, own, len(group))
    else:
        payloads = group.fetch.get([ref[0] for ref in refs], "final", "outer_gradients")
        mean = codec.average(payloads, plan.weights, final=own)
    if outer is not None:
        average = dict(outer.step_delta(mean))
    else:
        average = dict(start)
        for k, d in mean.items():
            average[k] = (start[k].to(torch.float64) - d).to(start[k].dtype)
    mine = parameter_hash(list(crossing(average, opts).items()))  # what `global_hash` hashes on every node
    if mine != nodes_hash:
        raise ReplicaMismatch(
            f"lo-fi's final average on the driver (hash {mine[:16]}) differs from the nodes' (hash {nodes_hash[:16]})"
        )
    return average


def driver_start(initial: dict, params: set[str], opts) -> tuple[dict, OuterNesterov | None]:
    """The shared start of lo-fi's one compressed average, as the driver decodes it: the pretrained
    weights (`initial`, copied), with a fresh outer momentum where there is an outer step."""
    state = dict(initial)
    if opts.outer_optimizer != "nesterov":
        return state, None
    outer = OuterNesterov(state, params, opts.outer_lr, opts.outer_momentum)
    return outer.state, outer
