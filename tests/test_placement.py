"""Gang placement: a strategy's actors start in one placement group, together or not at all; the
group is gone after success, failure and Ctrl-C; nodes.hosts pins actor k to its host, also when
it restarts. (The 2-host pinning test is in test_cluster.py.)"""

import pytest
import ray

from raylowcomm.actors import NodeGroup
from raylowcomm.common.ledger import Ledger
from raylowcomm.config import ConfigError
from raylowcomm.runner import run
from raylowcomm.strategies import from_dict
from tests.test_actors import actor_processes, live_groups, wait_until_gone


@ray.remote
class Probe:
    def where(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_placement_group_id(), ctx.get_node_id()

    def crash(self) -> None:
        import os

        os._exit(1)


def nodes_config(**nodes):
    return from_dict({"nodes": {"count": 2, "cpus": 1, **nodes}, "strategies": ["lofi"]})


def test_actors_start_in_one_group_and_it_is_removed_after_success_and_after_a_failure(ray_session):
    assert live_groups() == {}
    with NodeGroup(Probe, nodes_config(), Ledger()) as group:
        for k in range(2):
            group.start(k)
        where = group.call("where")
        [(pg_id, info)] = live_groups().items()
        assert {w[0] for w in where} == {pg_id} and list(info["bundles"].values()) == [{"CPU": 1.0}] * 2
    assert live_groups() == {}
    with pytest.raises(RuntimeError, match="injected"), NodeGroup(Probe, nodes_config(), Ledger()) as group:
        group.start(0)
        raise RuntimeError("injected")
    assert live_groups() == {} and wait_until_gone("Probe") == []


def test_a_gang_that_does_not_fit_starts_no_actor_and_holds_nothing(ray_session):
    """3 of the session's 4 CPUs are taken: two 1-CPU actors wait together, none starts, and the
    timeout gives everything back, naming what to change."""
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 3}])
    ray.get(blocker.ready())
    free = ray.available_resources().get("CPU", 0)
    try:
        with pytest.raises(ConfigError) as err, NodeGroup(Probe, nodes_config(start_timeout_s=3), Ledger()) as group:
            group.start(0)
        assert err.value.field_name == "nodes.count" and "found no room in 3 s" in str(err.value)
        assert "nodes.cpus" in str(err.value) and "nodes.placement" in str(err.value)
        assert actor_processes("Probe") == [] and list(live_groups()) == [blocker.id.hex()]
        assert ray.available_resources().get("CPU", 0) == free
    finally:
        remove_placement_group(blocker)
    assert live_groups() == {}


def test_strict_spread_over_one_ray_node_stops_before_reserving(ray_session):
    with pytest.raises(ConfigError) as err, NodeGroup(Probe, nodes_config(placement="STRICT_SPREAD"), Ledger()):
        pass
    assert err.value.field_name == "nodes.placement" and "the cluster has 1" in str(err.value)
    assert live_groups() == {}


def test_pinned_actors_run_on_their_host_and_a_restart_comes_back_to_its_bundle(ray_session):
    node = ray.get_runtime_context().get_node_id()
    cfg = nodes_config(hosts=["127.0.0.1", node])  # an address or a node id
    with NodeGroup(Probe, cfg, Ledger(), restarts=1) as group:
        for k in range(2):
            group.start(k)
        before = group.call("where")
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group[1].crash.remote())
        after = group.call("where")  # the dead actor is restarted, in its own bundle
        assert group.restarted == {1: 1} and before == after == [(before[0][0], node)] * 2
        assert [group.gang.options(k)["scheduling_strategy"].placement_group_bundle_index for k in (0, 1)] == [0, 1]
    assert live_groups() == {}


@pytest.mark.parametrize(
    "nodes, says",
    [
        ({"hosts": ["127.0.0.1"]}, "lofi starts 2 actors"),
        ({"hosts": ["10.255.255.9", "127.0.0.1"]}, "'10.255.255.9' is no live Ray node"),
    ],
)
def test_nodes_hosts_of_the_wrong_length_or_unknown_stop_the_run_naming_the_field(ray_session, tmp_path, nodes, says):
    raw = {
        "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
        "optim": {"batch_size": 16, "max_steps": 2},
        "strategies": ["lofi"],
        "nodes": {"count": 2, "cpus": 1, **nodes},
    }
    with pytest.raises(ConfigError) as err:
        run(from_dict(raw), tmp_path)  # the length is checked before Ray, the host on the live cluster
    assert err.value.field_name == "nodes.hosts" and says in str(err.value)
    assert actor_processes("LofiNode") == [] and live_groups() == {}


def test_ddp_hosts_must_list_each_hosts_workers_together():
    with pytest.raises(ConfigError, match="host by host"):
        from_dict({"nodes": {"count": 3, "hosts": ["a", "b", "a"]}, "strategies": ["ddp"]})
    assert from_dict({"nodes": {"count": 3, "hosts": ["a", "a", "b"]}, "strategies": ["ddp"]}).nodes.hosts


def test_spsa_joiners_count_as_actors_to_pin():
    raw = {"nodes": {"count": 1, "hosts": ["a"]}, "strategies": ["spsa"], "spsa": {"steps": 8, "join": [{"step": 4}]}}
    with pytest.raises(ConfigError, match="spsa starts 2 actors"):
        from_dict(raw)
