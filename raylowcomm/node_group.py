"""The driver's side of the actor layer: `NodeGroup`, its handle on a strategy's actors. It starts
them from `NodesConfig` (resources, restarts) in one placement group reserved up front
(`execution.Gang`: placement, pinning to hosts), books every payload it sends or fetches in the
ledger, and kills every actor and removes the group when its `with` block ends: on success, on an
error, on Ctrl-C. Also what the driver reads back (`DriverFetches`) and the replicas' hash check.
Its names are imported from `actors` too."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import ray
import torch

from raylowcomm.common.ledger import Ledger
from raylowcomm.config import RunConfig
from raylowcomm.execution import Gang, node_bundle
from raylowcomm.failures import NodeFailed, ask_first_failure, cause_of
from raylowcomm.group_scoring import GroupScoring
from raylowcomm.runtime import actor_options

logger = logging.getLogger("raylowcomm")

STREAM_POLL_S = 0.05
"""How often `NodeGroup.stream` looks for results that have landed while it fetches them."""


def count_tensors(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


class DriverFetches:
    """Everything the driver reads back from actors: booked in the ledger by phase and kind, and
    counted (bytes, tensors) so a strategy can show that only small messages came back."""

    def __init__(self, ledger: Ledger):
        self.ledger, self.bytes, self.tensors = ledger, 0, 0

    def get(self, refs: list, phase: str, what: str) -> list:
        values = ray.get(refs)
        for v in values:
            self.book(v, phase, what)
        return values

    def book(self, value, phase: str, what: str):
        self.bytes += self.ledger.send(phase, what, value)
        self.tensors += count_tensors(value)
        return value


class ReplicaMismatch(RuntimeError):
    pass


class ActorDied(RuntimeError):
    failure: dict | None = None
    """Where set, what the strategy's record keeps of the death (`failures.NodeFailed`'s fields)."""


def check_replicas(nodes: dict, step: int, ledger: Ledger, phase: str = "train", method: str = "hash") -> str:
    """The replicas' common exact parameter hash (or what their `method` hashes); ReplicaMismatch
    naming the step and the nodes of each differing group otherwise."""
    hashes = dict(zip(nodes, ray.get([getattr(n, method).remote() for n in nodes.values()])))
    ledger.record(phase, "verify_hash", sum(len(h) for h in hashes.values()))
    groups: dict[str, list[int]] = {}
    for k, h in hashes.items():
        groups.setdefault(h, []).append(k)
    if len(groups) > 1:
        detail = "; ".join(f"nodes {ks} hash {h[:16]}" for h, ks in groups.items())
        raise ReplicaMismatch(f"replicas differ after step {step}: {detail}")
    return next(iter(groups))


class NodeGroup(GroupScoring):
    """A strategy's actors, keyed by node id: started from `cfg.nodes`, every transfer booked,
    all killed when the `with` block ends however it ends.

    Placement is a gang's: entering the block reserves one bundle per actor the strategy may run
    (`bundles`; default: nodes.count node bundles) in one placement group, or raises holding
    nothing; actor k starts in bundle k (pinned to nodes.hosts[k] where given), and leaving the
    block removes the group.

    Restarts are the group's, not Ray's: an actor that dies during a `call` or `stream` is
    started again with its constructor arguments (up to `restarts` times; its constructor
    resumes from its own checkpoint) and the call is repeated. Ray's own actor restarts would
    pin the constructor's object-store arguments and warn on every healthy run (ray#53727).

    An actor's own exception in a call reaches the caller as `NodeFailed`, naming the actor (its
    class's `label` and its key) and the call: the first cause of the strategy's failure.

    Scoring on the nodes (the evaluation sets, `evaluate_*`, `score_weights`) is `GroupScoring`'s."""

    def __init__(
        self, actor_class, cfg: RunConfig, ledger: Ledger, restarts: int = 0, bundles: list[dict] | None = None
    ):
        self.actor_class, self.ledger, self.restarts = actor_class, ledger, restarts
        self.label = getattr(actor_class, "label", "node")  # "lofi node", "interlocking stage": in errors
        n = cfg.nodes
        self.options = actor_options(n.cpus, n.gpus, 0, n.resources)
        self.gang = Gang(bundles or [node_bundle(cfg)] * n.count, n.placement, n.hosts, n.start_timeout_s)
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.fetch = DriverFetches(ledger)
        self._started: dict[int, tuple] = {}
        self.unplaced: set[int] = set()
        self.restarted: dict[int, int] = {}
        self.died_of: dict[int, dict] = {}
        """What each actor found dead by `gather` died of ({type, message}): the cause a caller names."""
        self._eval_sets: dict = {}
        self._eval_ref = None
        self._holding_eval_sets: set[int] = set()

    def __enter__(self) -> NodeGroup:
        self.gang.reserve()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, key: int):
        return self.actors[key]

    def keys(self) -> list[int]:
        return sorted(self.actors)

    def handles(self) -> list:
        return [self.actors[k] for k in self.keys()]

    def start(self, key: int, *args, **kwargs):
        """Start actor `key` (its constructor gets `*args, **kwargs`); ObjectRefs among them are
        fetched by the actor itself, from wherever they live, and held here for restarts."""
        self._started[key] = (args, kwargs)
        self.actors[key] = self._launch(key)
        return self.actors[key]

    def start_unplaced(self, key: int, *args, **kwargs):
        """As `start`, for an actor with no bundle reserved: Ray places it (and a restart of it) wherever
        and whenever the cluster holds its resources; until then it is pending (`__ray_ready__` says when)."""
        self.unplaced.add(key)
        return self.start(key, *args, **kwargs)

    def _launch(self, key: int):
        """Actor `key` in its own bundle (or unplaced), with the arguments it was first started with."""
        args, kwargs = self._started[key]
        placement = {} if key in self.unplaced else self.gang.options(key)
        return self.actor_class.options(**self.options, **placement).remote(*args, **kwargs)

    def restart(self, key: int, err: Exception) -> None:
        """Start dead actor `key` again (see `_restart`), for a caller that issues its own calls."""
        self._restart(key, err)

    def _restart(self, key: int, err: Exception) -> None:
        """Start a dead actor again, or re-raise `err` when its restarts are spent."""
        done = self.restarted.get(key, 0)
        if key not in self.actors or done >= self.restarts:
            raise err
        lost = self.gang.host_lost(key)
        if lost is not None:
            raise ActorDied(
                f"node {key} died and its host {lost} (nodes.hosts[{key}]) is gone: a pinned node restarts only there"
            ) from err
        self.restarted[key] = done + 1
        logger.warning("node %d died (%s); restarting it (%d of %d)", key, type(err).__name__, done + 1, self.restarts)
        self.actors[key] = self._launch(key)

    def ready(self, every_s: float = 30.0) -> None:
        """Wait until every actor has started, saying every `every_s` seconds how many are still
        starting (or waiting for resources) and what the cluster has free: on a busy or
        autoscaling cluster a wait is not silent."""
        pending = [a.__ray_ready__.remote() for a in self.actors.values()]
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=every_s)
            ray.get(done)
            if pending:
                logger.info(
                    "%d of %d actors still starting or waiting for resources (each %s); free in the cluster now: %s",
                    len(pending),
                    len(self.actors),
                    {k: v for k, v in self.options.items() if k in ("num_cpus", "num_gpus", "resources")},
                    {k: v for k, v in ray.available_resources().items() if not k.startswith(("node:", "object_store"))},
                )

    def put(self, obj, phase: str, what: str, copies: int = 1) -> ray.ObjectRef:
        """One object in the store for `copies` actors to fetch: each fetch is booked."""
        self.ledger.send(phase, what, obj, copies=copies)
        return ray.put(obj)

    def stream(
        self,
        method: str,
        *args,
        phase: str,
        what: str | None,
        keys: list[int] | None = None,
        fetch: DriverFetches | None = None,
    ):
        """Yield (key, result) of `method(*args)` on the actors as each arrives, booked by `fetch`
        (the group's; none without `what`); an actor that dies is restarted and asked again.

        Every pending result is fetched at once, each over its own host's link: a `ray.wait` for one
        result pulls only that one, so the others would wait for it instead of crossing their own
        links meanwhile (docs/planning.md has the measurement)."""
        fetch = fetch or self.fetch
        pending = {getattr(self.actors[k], method).remote(*args): k for k in (self.keys() if keys is None else keys)}
        while pending:
            ray.wait(list(pending), num_returns=1, fetch_local=False)  # until one result exists, anywhere
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=STREAM_POLL_S)
            for ref in ready:
                key = pending.pop(ref)
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._restart(key, err)
                    pending[getattr(self.actors[key], method).remote(*args)] = key
                    continue
                except ray.exceptions.RayTaskError as err:
                    raise NodeFailed.of(err, self.label, key, method) from err
                yield key, (fetch.book(value, phase, what) if what else value)

    def call(
        self, method: str, *args, phase: str = "final", what: str | None = None, keys: list[int] | None = None
    ) -> list:
        """`method(*args)` on the actors (all, or `keys`), in key order; results booked under
        `what` (nothing is booked without it)."""
        keys = self.keys() if keys is None else keys
        results = dict(self.stream(method, *args, phase=phase, what=what, keys=keys))
        return [results[k] for k in keys]

    def gather(self, calls: dict[int, ray.ObjectRef], call: str | None = None) -> tuple[dict[int, object], list[int]]:
        """Results of calls (of method `call`) keyed by actor, and the actors that died meanwhile, what
        each died of kept in `died_of` (the caller books what crossed: it knows what the payload is)."""
        values, dead = {}, []
        for key, ref in calls.items():
            try:
                values[key] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                dead.append(key)
                self.died_of[key] = cause_of(err)
            except ray.exceptions.RayTaskError as err:
                raise NodeFailed.of(err, self.label, key, call) from err
        return values, dead

    def gather_timed(
        self, calls: dict[int, ray.ObjectRef], sent_at: float, call: str | None = None
    ) -> tuple[dict, list[int], dict[int, float]]:
        """As `gather`, with the seconds from `sent_at` (when the calls went out) until each call's result was
        in: the driver's view of each actor's time on it, its reply's latency included."""
        by_ref, pending, seconds = {ref: k for k, ref in calls.items()}, list(calls.values()), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            seconds[by_ref[done[0]]] = time.perf_counter() - sent_at
        values, dead = self.gather(calls, call)
        return values, dead, seconds

    def dead(self, timeout_s: float = 10.0) -> list[int]:
        """Keys of the actors that have died."""
        probes = {a.__ray_ready__.remote(): k for k, a in self.actors.items()}
        done, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout_s)
        found = []
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                found.append(probes[ref])
        return sorted(found)

    @contextmanager
    def stop_on_death(self, what: str, why: str):
        """Inside the block, an actor's death ends it with ActorDied naming the actor (`what` and
        its key) and `why` the run cannot go on: for actors that hold what no other has. A call that
        failed with no actor dead ends it with the first exception the actors recorded themselves
        (`failures.FirstFailure`: they have a `failure` method), as `NodeFailed`."""
        try:
            yield
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            dead = self.dead()
            first = None if dead else ask_first_failure(self.handles())
            if first is not None:
                raise NodeFailed(first) from err
            if not dead:
                raise
            names = ", ".join(f"{what} {k}" for k in dead)
            died = ActorDied(f"{names} (of {len(self.actors)}) died: {why}; every actor of the run was released")
            died.failure = NodeFailed.of(err, what, dead[0], of=len(self.actors)).failure
            raise died from err

    def remove(self, key: int, kill: bool = True) -> None:
        """Take an actor out of the group: killed, or (kill=False) already dead by itself."""
        actor = self.actors.pop(key)
        if kill:
            ray.kill(actor)

    def shutdown(self) -> None:
        """Kill every actor, then release the group's placement group."""
        try:
            for actor in self.actors.values():
                ray.kill(actor)
            self.actors.clear()
        finally:
            self.gang.release()
