"""Gang placement: a strategy's actors start in one placement group, together or not at all.

`Gang` owns the group: it reserves one bundle per actor the strategy may ever run (SPSA's
joiners included) before any actor starts, places actor k in bundle k, puts a restarted actor
back in its own bundle, and removes the group however the run ends. Inside a reservation made
for the run (a Tune trial's placement group, which captures the trial's actors) it makes none:
it uses that group's bundles, and its owner removes it.

Pinning: `nodes.hosts[k]` (a Ray node's address or id) pins bundle k to that node with a label
selector on Ray's own `ray.io/node-id` label, so a restarted actor comes back to the same host.
"""

from __future__ import annotations

import logging
import os
import time

import ray

from raylowcomm.config import ConfigError, RunConfig

logger = logging.getLogger("raylowcomm")

NODE_ID_LABEL = "ray.io/node-id"
LOCAL_TIMEOUT_S = 120.0
"""How long a placement group may stay pending on the local Ray (which cannot grow) by default."""
SAY_EVERY_S = 30.0


def node_bundle(cfg: RunConfig) -> dict[str, float]:
    """What one node/stage actor asks Ray for: CPUs, GPUs, custom resources (cfg.nodes)."""
    return {"CPU": cfg.nodes.cpus, **({"GPU": cfg.nodes.gpus} if cfg.nodes.gpus else {}), **cfg.nodes.resources}


def joined_cluster() -> bool:
    """A cluster this process joined (RAY_ADDRESS) may grow; the local Ray cannot."""
    return bool(os.environ.get("RAY_ADDRESS"))


def resolve_hosts(hosts: list[str] | None) -> list[str] | None:
    """The Ray node id of each entry of nodes.hosts (an address or a node id) on the live cluster;
    ConfigError naming nodes.hosts for one no live node has, or an address several nodes share."""
    if hosts is None:
        return None
    alive = [n for n in ray.nodes() if n["Alive"]]
    by_address: dict[str, list[str]] = {}
    for n in alive:
        by_address.setdefault(n["NodeManagerAddress"], []).append(n["NodeID"])
    ids = {n["NodeID"] for n in alive}
    found = []
    for host in hosts:
        if host in ids:
            found.append(host)
        elif len(by_address.get(host, [])) == 1:
            found.append(by_address[host][0])
        elif host in by_address:
            raise ConfigError(
                "nodes.hosts",
                hosts,
                f"{host} runs {len(by_address[host])} Ray nodes: name one by its "
                f"node id ({', '.join(by_address[host])})",
            )
        else:
            raise ConfigError(
                "nodes.hosts",
                hosts,
                f"{host!r} is no live Ray node of this cluster; its nodes: "
                + ", ".join(f"{a} ({', '.join(i)})" for a, i in sorted(by_address.items())),
            )
    return found


def pin_bundles(count: int, node_ids: list[str] | None) -> list[dict[str, str]] | None:
    """The label selectors that pin bundle k to node_ids[k] (None: unpinned)."""
    if node_ids is None:
        return None
    if len(node_ids) != count:
        raise ConfigError("nodes.hosts", node_ids, f"{count} actors start here: give one host per actor")
    return [{NODE_ID_LABEL: node} for node in node_ids]


def check_placement(bundles: list[dict], strategy: str, node_ids: list[str] | None, local: bool) -> None:
    """What can never fit, said before anything is reserved: STRICT_SPREAD over fewer Ray nodes than
    actors, or more pinned to a node than it has. On a joined cluster (it may grow) a warning."""
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    problems = []
    placed = [b for b in bundles if b]  # an empty bundle (a Tune trial's own) is left out of the group
    if strategy == "STRICT_SPREAD" and len(placed) > len(alive) and node_ids is None:
        problems.append(
            (
                "nodes.placement",
                strategy,
                f"STRICT_SPREAD puts each of the {len(placed)} actors on "
                f"its own Ray node, and the cluster has {len(alive)}: lower nodes.count, use SPREAD, "
                "or add nodes",
            )
        )
    for node in sorted(set(node_ids or [])):
        mine = [b for b, n in zip(bundles, node_ids) if n == node]
        for key in sorted({k for b in mine for k in b}):
            need, have = sum(b.get(key, 0) for b in mine), alive.get(node, {}).get(key, 0)
            if need > have:
                problems.append(
                    (
                        "nodes.hosts",
                        node_ids,
                        f"{len(mine)} actors pinned to node {node} need {need:g} "
                        f"{key} and it has {have:g}: lower nodes.cpus/nodes.gpus or pin fewer there",
                    )
                )
    for field, value, message in problems:
        if local:
            raise ConfigError(field, value, message)
        logger.warning("%s; waiting for the cluster to change", message)


class Gang:
    """The placement group of one strategy run's actors (see the module's doc)."""

    def __init__(
        self,
        bundles: list[dict],
        strategy: str = "PACK",
        hosts: list[str] | None = None,
        timeout_s: float | None = None,
    ):
        self.bundles, self.strategy, self.hosts, self.timeout_s = [dict(b) for b in bundles], strategy, hosts, timeout_s
        self.pg = None
        self.owned = False
        self.indices: list[int] = []
        """Bundle index in `pg` of actor k."""
        self.node_ids: list[str] | None = None

    @property
    def reserved(self) -> bool:
        return self.pg is not None

    def reserve(self) -> None:
        """Reserve every bundle at once, or raise holding nothing."""
        if self.pg is not None:
            return
        self.node_ids = resolve_hosts(self.hosts)
        current = ray.util.get_current_placement_group()
        if current is not None:
            self.pg, self.indices = current, self._match(current)
            return
        local = not joined_cluster()
        check_placement(self.bundles, self.strategy, self.node_ids, local)
        from ray.util.placement_group import placement_group

        self.pg, self.owned = (
            placement_group(
                self.bundles,
                strategy=self.strategy,
                bundle_label_selector=pin_bundles(len(self.bundles), self.node_ids),
            ),
            True,
        )
        self.indices = list(range(len(self.bundles)))
        try:
            self._wait(LOCAL_TIMEOUT_S if self.timeout_s is None and local else self.timeout_s)
        except BaseException:
            self.release()
            raise

    def _wait(self, timeout_s: float | None) -> None:
        """Until the group is placed; every SAY_EVERY_S what it waits for; ConfigError after `timeout_s`."""
        started = time.monotonic()
        ready = self.pg.ready()
        while True:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - started)
            step = SAY_EVERY_S if left is None else max(0.0, min(SAY_EVERY_S, left))
            done, _ = ray.wait([ready], timeout=step)
            if done:
                ray.get(done)
                return
            if left is not None and left <= step:
                raise ConfigError(
                    "nodes.count",
                    len(self.bundles),
                    f"{self._asked()} found no room in "
                    f"{timeout_s:g} s; free now: {_free()}: lower nodes.count or nodes.cpus, choose "
                    "another nodes.placement, or raise nodes.start_timeout_s if other work will end",
                )
            logger.info("waiting for the cluster to hold %s; free now: %s", self._asked(), _free())

    def _asked(self) -> str:
        pinned = f", pinned to {self.hosts}" if self.hosts else ""
        shapes = sorted({str(b) for b in self.bundles})
        return f"{len(self.bundles)} actors ({', '.join(shapes)} each) placed {self.strategy}{pinned}"

    def _match(self, current) -> list[int]:
        """Inside a reservation made for the run: the bundle of each actor, by shape (and pinned
        node), the first unused one in order (its owner's own bundle, if any, has another shape;
        Tune leaves an empty one out of the group)."""
        table = ray.util.placement_group_table(current)
        specs = [{k: float(v) for k, v in b.items()} for b in current.bundle_specs]
        on_node = table.get("bundles_to_node_id", {})
        used, found = set(), []
        for k, bundle in enumerate(self.bundles):
            want = {key: float(v) for key, v in bundle.items()}
            j = next(
                (
                    j
                    for j, spec in enumerate(specs)
                    if j not in used and spec == want and (self.node_ids is None or on_node.get(j) == self.node_ids[k])
                ),
                None,
            )
            if j is None:
                raise RuntimeError(
                    f"the run's reservation (placement group {current.id.hex()}, bundles {specs}) "
                    f"has no bundle left for actor {k} ({bundle}"
                    + (f" on node {self.node_ids[k]})" if self.node_ids else ")")
                )
            used.add(j)
            found.append(j)
        return found

    def options(self, key: int) -> dict:
        """Actor options that place actor `key` in its bundle (reserving the group if not yet)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.reserve()
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg,
                placement_group_bundle_index=self.indices[key],
                placement_group_capture_child_tasks=False,
            )
        }

    def host_lost(self, key: int) -> str | None:
        """The pinned host of actor `key` when it is no longer alive (a restart would wait for it)."""
        if not self.node_ids:
            return None
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return None if self.node_ids[key] in alive else self.hosts[key]

    def release(self) -> None:
        """Remove the group if it is this gang's own; a reservation made for the run stays its owner's."""
        if self.pg is not None and self.owned:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as err:  # the cluster is gone (shut down, lost): nothing is held any more
                logger.warning("could not remove placement group %s: %s", self.pg.id.hex(), err)
        self.pg, self.owned, self.indices = None, False, []


def _free() -> dict:
    return {k: v for k, v in ray.available_resources().items() if not k.startswith(("node:", "object_store"))}
