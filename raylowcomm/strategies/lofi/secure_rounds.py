"""lo-fi's secure rounds, the driver's side (`lofi.secure`, docs/privacy.md): it gathers the nodes' public
keys into a roster and hands it out (`SecureRoster`: again after any node restarted, since a restarted node
has a new key pair), and runs each round (`secure_round`) in the nodes' three calls (`node_secure`): send,
fetch, land. It passes ObjectRefs and member lists only: it never holds a pair key, and owns the masked
payloads (so that they outlive a node killed after masking) without fetching one in rounds (lo-fi's one
average, decoded on the driver, is a sum of the members' masked payloads: `peers.final_round`).

Who is in a round (`members`): every node at first. A node killed after it masked is still in it: its
payload is the driver's. A node whose payload does not exist or is lost (it died before making it, was
restarted and holds no key of the roster, or its host went with the only copy, which nobody fetched) is
dropped, and the others mask the same payloads again among themselves, until a fetch loses nobody.
Nobody held a lost payload, so nobody holds a first sum to take the second from. Every member then lands
the members' exact sum: the same model, to the bit, as the same members' round in the clear. A node that
could not land it (restarted) adopts a member's round file. Fewer than 3 members left ends the run with
the first cause, to resume."""

from __future__ import annotations

import logging
import uuid

import ray

from raylowcomm.actors import ActorDied
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.core.secagg import MIN_NODES
from raylowcomm.strategies.lofi import streaming
from raylowcomm.strategies.lofi.round_file import round_path

logger = logging.getLogger(__name__)


class SecureRoster:
    """The run's current roster: its name, fresh for each, and the group's restarts when it was made; for
    the record, how many rosters the run made and the members each round lost."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.restarts: dict | None = None
        self.rosters = 0
        self.masked_again: list[list] = []
        """[round, the members whose payloads were lost or never made] of each round masked again."""

    def ensure(self, group, phase: str) -> None:
        """A roster every live node joined: gathered again where none is, or a node restarted since. The
        ledger books each public key the driver fetches and the roster each node is sent (`secure_keys`), in
        setup for the run's first roster (a resumed run's too)."""
        if self.name is not None and self.restarts == group.restarted:
            return
        phase = "setup" if self.name is None else phase  # the first is the run's key exchange; later, restarts'
        publics = dict(zip(group.keys(), group.call("secure_public", phase=phase, what="secure_keys")))
        name = uuid.uuid4().hex
        group.ledger.send(phase, "secure_keys", [name, publics], copies=len(group))
        group.call("secure_join", name, publics, phase=phase)
        self.name, self.restarts, self.rosters = name, dict(group.restarted), self.rosters + 1
        logger.info("[lofi] secure: a roster of %d nodes' public keys (%s)", len(publics), name[:8])


def secure_round(
    group, roster: SecureRoster, round_: int, fetched: dict, phase: str, fragment, final: bool, adder=None
) -> list:
    """One secure round (see the module), landed on every node: returns the members' refs in node order.
    `fetched` counts what the driver read back (replies: refs and sizes; with `adder`, the payloads).
    `adder` (`lofi.exchange: driver`): the driver adds the members' masked payloads with it
    (`DeltaCodec.add_masked`) and sends every member the sum, instead of every member fetching every one."""
    roster.ensure(group, phase)
    place = [streaming.ALL if fragment is None else fragment, final]
    members, again, total = list(group.keys()), False, None
    while True:
        sent = _send(group, round_, place, members, again)
        refs = {k: [ref] for k, (_, ref) in sent.items()}
        fetched["bytes"] += group.ledger.send(phase, "round_replies", [size for size, _ in sent.values()])
        lost = sorted(set(members) - set(refs))
        if not lost and adder is not None:
            total, lost = _add_on_driver(group, refs, sent, adder, fetched, phase)
            if not lost:
                break
        elif not lost:
            group.ledger.record(phase, "round_args", _args_nbytes(round_, place, members, refs), copies=len(members))
            lost = _fetch(group, round_, refs, members, phase)
            _book_payloads(group.ledger, phase, members, lost, sent)
            if not lost:
                break
        roster.masked_again.append([round_, lost])
        members, again = _survivors(members, lost, round_), True
    if total is not None:
        sum_ref = group.put(total, phase, "masked_sum", copies=len(members))
        landed = group.call("secure_land_sum", round_, members, [sum_ref], phase=phase)
    else:
        landed = group.call("secure_land", round_, members, phase=phase)
    behind = [k for k, ok in zip(group.keys(), landed) if not ok]
    if behind:
        group.ledger.send(phase, "control", round_path(members[0]), copies=len(behind))
        group.call("adopt_round", round_path(members[0]), phase=phase, keys=behind)
    return [refs[k] for k in members]


FORWARDS = 3
"""How many times a round forwards payloads some member could not fetch, before it takes them as lost."""


def _fetch(group, round_: int, refs: dict, members: list[int], phase: str) -> list[int]:
    """Every member fetches every member's masked payload. One that some member could not fetch but another
    holds is forwarded by a holder (masked bytes are uniform on their own, and every member fetches every
    one anyway) and fetched again: a payload is lost only where no member holds it, so that nobody holds
    the first sum when the round is masked again. Returns the members whose payloads are lost."""
    for _ in range(FORWARDS):
        reports = group.call("secure_fetch", round_, refs, phase=phase, keys=members)
        lost = sorted({k for missing, _ in reports for k in missing})
        holders = {k: [m for m, (_, held) in zip(members, reports) if k in held] for k in lost}
        if not lost or not all(holders.values()):
            return [k for k in lost if not holders[k]]
        for k, held_by in holders.items():
            refs[k] = [group[held_by[0]].secure_forward.remote(round_, k)]  # the driver owns the copy
        logger.warning(
            "[lofi] secure round %d: payloads of nodes %s forwarded by the nodes that hold them", round_, lost
        )
    return lost


def _add_on_driver(group, refs: dict, sent: dict, adder, fetched: dict, phase: str) -> tuple:
    """(the members' masked payloads added by `adder`, []), or (None, the members whose payloads are lost):
    only the driver fetches them here, so a payload it cannot fetch is held by nobody."""
    payloads, lost = {}, []
    for k, ref in refs.items():
        try:
            payloads[k] = ray.get(ref[0])
        except ray.exceptions.ObjectLostError:  # nobody else fetched it: masking again among the rest is safe
            lost.append(k)
    if lost:
        return None, sorted(lost)
    for k in payloads:
        codes, scales = sent[k][0]
        fetched["bytes"] += group.ledger.record(phase, "masked_codes", codes)
        fetched["bytes"] += group.ledger.record(phase, "masked_scales", scales)
    return adder([payloads[k] for k in sorted(payloads)]), []


def _survivors(members: list[int], lost: list[int], round_: int) -> list[int]:
    left = [k for k in members if k not in lost]
    if len(left) < MIN_NODES:
        raise ActorDied(
            f"secure round {round_}: the payloads of nodes {lost} are lost and {len(left)} remain, fewer than the "
            f"{MIN_NODES} a secure sum needs; rerun with --resume"
        )
    logger.warning(
        "[lofi] secure round %d: the payloads of node(s) %s are lost; the round is masked again among nodes %s",
        round_,
        lost,
        left,
    )
    return left


def _send(group, round_: int, place: list, members: list[int], again: bool) -> dict:
    """member → (its sizes, the ref of its masked payload, which the driver owns and never fetches), for the
    members that sent one; a member that died meanwhile is started again (or the run ends where its
    restarts are spent) and sent nothing."""
    calls = {k: group[k].secure_send.remote(round_, *place, members, again) for k in members}
    sizes, dead = group.gather({k: refs[0] for k, refs in calls.items()}, "secure_send")
    for k in dead:
        group.restart(k, ActorDied(f"lofi node {k} died while it masked round {round_}"))
    return {k: (size, calls[k][1]) for k, size in sizes.items() if size is not None}


def _args_nbytes(round_: int, place: list, members: list[int], refs: dict) -> int:
    """What each member is told to fetch: the round, fragment and flag, the members and their refs."""
    return payload_nbytes([round_, *place, members]) + sum(len(ref[0].binary()) for ref in refs.values())


def _book_payloads(ledger, phase: str, members: list[int], lost: list[int], sent: dict) -> None:
    """Each member's masked payload fetched by every other member, but a lost one's (never whole):
    masked codes (`masked_codes`) and masked block magnitudes (`masked_scales`) apart."""
    for k in members:
        if k in lost:
            continue
        codes, scales = sent[k][0]
        ledger.record(phase, "masked_codes", codes, copies=len(members) - 1)
        ledger.record(phase, "masked_scales", scales, copies=len(members) - 1)


def secure_details(roster: SecureRoster | None) -> dict:
    """`details.secure`: how many rosters the run gathered, and the rounds masked again with the members left out."""
    if roster is None:
        return {}
    return {"secure": {"rosters": roster.rosters, "masked_again": roster.masked_again}}
