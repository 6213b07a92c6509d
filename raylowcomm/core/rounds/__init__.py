"""Quorum rounds' policy (`lofi.quorum`), plain Python: events in, decisions out, on the clock the events
give it. `strategies/lofi/quorum.py` runs it on Ray: it turns call results into events and carries the
decisions out.

Every node trains its segments (to its next round boundary) at its own pace. A round lands once a
quorum of nodes' payloads is in, and either no live node is still training or `grace_s` has passed since
the quorum was reached (no node is waited for that its last segment's pace says will come later than
that). It holds every payload that arrived since the last round, in node order, each weighted by its
node's weight times (1 + τ)^-staleness, τ the rounds that landed after the global model its Δ started
from: a payload that missed its round is merged late, not lost. The log of landed rounds is the
membership record: a node lands the rounds it has not, in order, at the start of its next segment, so
every node that lands round r lands the same payloads with the same weights in the same order.

A node whose payload waits for its round does not train on (its next Δ would count what it sent again):
it starts its next segment from the round that merged it. With `keep_training` it trains on, its next Δ
measured from where it sent (at most two of its payloads wait at once). A node that dies leaves the
quorum at once, and the steps of the segment it lost return to the budget; restarted, it joins again at
its next segment by landing the rounds it missed and starting from the latest global model. A node
whose restarts are spent leaves the run.

The run's length is a budget of node-steps, the run's steps times the nodes: a slow node contributes the
steps it managed, and the fast ones take the rest. With every node on time and `quorum` = all nodes,
every round holds every node's payload at the same boundaries as lockstep rounds.

Lockstep rounds' policy (`lockstep.LockstepPolicy`) is plain Python too: which boundary every node
trains to next, whether a round is taken after it, and where `optim.budget_s` stops the run;
`strategies/lofi/lockstep.py` carries its decisions out on Ray.
"""

from raylowcomm.core.rounds.events import Decision, Event
from raylowcomm.core.rounds.lockstep import LockstepDecision, LockstepEvent, LockstepPolicy
from raylowcomm.core.rounds.policy import QuorumPolicy
from raylowcomm.core.rounds.records import Arrival, Flight, LandedRound, NodeLog, Rules, RunRecord, SegmentReport

__all__ = [
    "Arrival",
    "Decision",
    "Event",
    "Flight",
    "LandedRound",
    "LockstepDecision",
    "LockstepEvent",
    "LockstepPolicy",
    "NodeLog",
    "QuorumPolicy",
    "Rules",
    "RunRecord",
    "SegmentReport",
]
