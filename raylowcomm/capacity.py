"""Whether a run's actors fit the cluster, checked before any starts: a request that cannot be
met stops with the config field to change instead of waiting forever."""

from __future__ import annotations

import logging

import ray

from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.execution import check_placement, resolve_hosts
from raylowcomm.strategies import STRATEGIES

logger = logging.getLogger("raylowcomm")


def check_cluster_fits(
    cfg: RunConfig, demands: dict[str, list[dict]] | None = None, groups: list[list[dict]] | None = None
) -> None:
    """Every strategy's actors must fit the cluster: on the local Ray, which cannot grow, asking
    for more CPUs, GPUs or custom resources than it has stops the run now (ConfigError naming the
    field) instead of waiting forever; on a joined cluster, which may autoscale, it is a warning,
    and the actor layer says what it waits for while it waits, unless no node has the resource
    at all (a GPU run on a CPU-only cluster): that stops too, unless nodes.wait_for_resources.
    `demands`: what must fit at once, by who asks (default: each strategy's own bundles; a sweep
    passes a trial's whole reservation); `groups`: the placement groups those bundles start in,
    each placed by nodes.placement on its own (default: one per demand; a trial's Ray Train run
    has a group of its own beside the trial's)."""
    import os

    capacity = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    total = ray.cluster_resources()
    node_ids = resolve_hosts(cfg.nodes.hosts)  # a host no live node has stops the run now
    if demands is None:
        demands = {
            name: STRATEGIES[name].bundles(cfg) + STRATEGIES[name].external_bundles(cfg) for name in cfg.strategies
        }
    for bundles in groups or demands.values():  # STRICT_SPREAD over too few nodes, too much pinned to one
        check_placement(
            bundles,
            cfg.nodes.placement,
            node_ids if len(bundles) == len(node_ids or ()) else None,
            local=not os.environ.get("RAY_ADDRESS"),
        )
    for name, bundles in demands.items():
        for key in sorted({k for b in bundles for k in b}):
            need, each, have = (
                sum(b.get(key, 0) for b in bundles),
                max(b.get(key, 0) for b in bundles),
                total.get(key, 0),
            )
            largest = max((n.get(key, 0) for n in capacity), default=0)
            if need <= have and each <= largest:
                continue
            field, value = _resource_field(cfg, name, key, too_big_each=each > largest)
            has = (
                f"has {have:g} {key}, at most {largest:g} on one node"
                if have
                else f"has no {key} on any node (set nodes.wait_for_resources if an autoscaler adds them)"
            )
            message = (
                f"{name} starts {len(bundles)} actors needing {need:g} {key} in all ({each:g} each), but the cluster "
                f"{has}: lower {field} or add nodes"
            )
            if os.environ.get("RAY_ADDRESS") and (have or cfg.nodes.wait_for_resources):
                logger.warning("%s; waiting for the cluster to grow", message)
            else:
                raise ConfigError(field, value, message)


def _resource_field(cfg: RunConfig, who: str, key: str, too_big_each: bool) -> tuple[str, object]:
    """The config field to change: what one actor asks for when no node can hold it, else how many
    actors (the strategy's own count field; nodes.count for a sweep's trial)."""
    if too_big_each:
        if key in ("CPU", "GPU"):
            return f"nodes.{key.lower()}s", getattr(cfg.nodes, f"{key.lower()}s")
        return f"nodes.resources.{key}", cfg.nodes.resources.get(key)
    if who in STRATEGIES:
        return STRATEGIES[who].count_field, STRATEGIES[who].count(cfg)
    return "nodes.count", cfg.nodes.count
