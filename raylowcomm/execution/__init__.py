"""How a strategy's actors are placed on the cluster (the actor layer's part that talks to Ray's
placement groups): `placement.Gang` reserves every actor's bundle at once, pins bundles to hosts
and releases the reservation on every exit; `probe.hosts_without` asks every host whether it
holds what its actors would read."""

from raylowcomm.execution.placement import Gang, check_placement, node_bundle, pin_bundles, resolve_hosts
from raylowcomm.execution.probe import hosts_without

__all__ = ["Gang", "check_placement", "hosts_without", "node_bundle", "pin_bundles", "resolve_hosts"]
