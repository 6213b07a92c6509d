"""How a strategy's actors are placed on the cluster (the actor layer's part that talks to Ray's
placement groups): `placement.Gang` reserves every actor's bundle at once, pins bundles to hosts
and releases the reservation on every exit."""

from raylowcomm.execution.placement import Gang, check_placement, node_bundle, pin_bundles, resolve_hosts

__all__ = ["Gang", "check_placement", "node_bundle", "pin_bundles", "resolve_hosts"]
