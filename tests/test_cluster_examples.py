"""Clusters are secure by default: the example cluster configs turn Ray's token authentication on
and publish no port, no command the docs show turns it off, and the namespace test cluster gives
every process it runs the cluster's token whatever the caller's environment says. Fast: nothing
starts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from raylowcomm.cluster import NamespaceCluster
from tests.test_docs import COMMANDS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "cluster"
AUTH_MODE = re.compile(r"""RAY_AUTH_MODE["']?\s*[=:]\s*["']?(\w+)""")


def _walk(node):
    """Every mapping and string in a parsed YAML document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)
    elif isinstance(node, str):
        yield node


def auth_modes(text: str) -> set[str]:
    """Every RAY_AUTH_MODE a config file sets or tells its reader to set: shell assignments and
    YAML keys anywhere in the text (comments and embedded YAML such as runtimeEnvYAML included),
    Kubernetes env entries ({name: RAY_AUTH_MODE, value: ...}) and KubeRay's authOptions.mode."""
    modes = set(AUTH_MODE.findall(text))
    for node in (n for doc in yaml.safe_load_all(text) for n in _walk(doc) if isinstance(n, dict)):
        if node.get("name") == "RAY_AUTH_MODE":
            modes.add(str(node.get("value")))
        if isinstance(node.get("authOptions"), dict):
            modes.add(str(node["authOptions"].get("mode", "token")))  # KubeRay's default mode is token
    return modes


def aws_problems(text: str) -> list[str]:
    """What leaves the cluster launcher's cluster open: a Ray started without token auth, the
    dashboard on a non-loopback address, no token on the nodes."""
    config, problems = yaml.safe_load(text), []
    starts = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in config.get(key, [])
        if "ray start" in c
    ]
    problems += [f"started without RAY_AUTH_MODE=token: {c}" for c in starts if "RAY_AUTH_MODE=token" not in c]
    hosts = re.findall(r"--dashboard-host[= ](\S+)", " ".join(starts))
    problems += [f"dashboard on {h}" for h in hosts if h not in ("127.0.0.1", "localhost")]
    if not any(str(src).endswith(".ray/auth_token") for src in (config.get("file_mounts") or {}).values()):
        problems.append("no token in file_mounts (every node needs it)")
    return problems


def _labels(template: dict | None) -> dict:
    return dict(((template or {}).get("metadata") or {}).get("labels") or {})


def _selects(selector: dict, labels: dict) -> bool:
    wanted = selector.get("matchLabels") or {}
    return not selector.get("matchExpressions") and all(labels.get(k) == v for k, v in wanted.items())


def _admits(policy: dict, labels: dict) -> bool:
    """Whether an ingress rule of the policy admits a pod of this namespace with these labels."""
    return any(
        peer.get("namespaceSelector") is None and _selects(peer.get("podSelector") or {}, labels)
        for rule in policy["spec"].get("ingress") or []
        for peer in rule.get("from") or []
    )


def rayjob_problems(text: str) -> list[str]:
    """What leaves the KubeRay cluster open: no token auth, a published head, a Ray pod that no
    NetworkPolicy isolates, a policy that admits anything but pods selected by label (an empty
    `from`, an ipBlock), or one that shuts the workers out of the head."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    job = next(d for d in docs if d.get("kind") == "RayJob")
    spec, problems = job["spec"]["rayClusterSpec"], []
    options = spec.get("authOptions")
    if not isinstance(options, dict) or options.get("mode", "token") != "token":  # KubeRay's default: token
        problems.append("rayClusterSpec.authOptions.mode is not token")
    head_group = spec["headGroupSpec"]
    service = (head_group.get("headService") or {}).get("spec") or {}
    if (
        head_group.get("serviceType", "ClusterIP") != "ClusterIP"
        or service.get("type", "ClusterIP") != "ClusterIP"
        or head_group.get("enableIngress")
        or any(d.get("kind") == "Ingress" for d in docs)
    ):
        problems.append("the head is published outside the Kubernetes cluster")
    head = {**_labels(head_group["template"]), "ray.io/node-type": "head"}
    workers = [{**_labels(g["template"]), "ray.io/node-type": "worker"} for g in spec.get("workerGroupSpecs", [])]
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    for name, labels in [("head", head)] + [(f"worker group {i}", w) for i, w in enumerate(workers)]:
        if not any(
            "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], labels)
            for p in policies
        ):
            problems.append(f"no NetworkPolicy isolates the {name}")
    for policy in policies:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from") or []
            if not peers or any("ipBlock" in p or "podSelector" not in p for p in peers):
                problems.append(f"{policy['metadata']['name']} admits more than labelled pods: {rule}")
    head_policies = [p for p in policies if _selects(p["spec"]["podSelector"], head)]
    if not all(any(_admits(p, w) for p in head_policies) for w in workers):
        problems.append("no NetworkPolicy admits the workers to the head")
    return problems


@pytest.mark.parametrize("name", ["aws.yaml", "rayjob.yaml"])
def test_the_cluster_examples_run_with_token_auth(name):
    text = (EXAMPLES / name).read_text()
    assert auth_modes(text) == {"token"}, f"{name} sets RAY_AUTH_MODE to {auth_modes(text)}"
    problems = (aws_problems if name == "aws.yaml" else rayjob_problems)(text)
    assert not problems, f"{name}: " + "; ".join(problems)


def test_the_checks_find_an_open_cluster():
    """The checks above can fail: the recipes this project had before token auth do."""
    aws = """
file_mounts: {~/raylowcomm: .}
head_start_ray_commands:
  - RAY_AUTH_MODE=disabled ray start --head --port=6379 --dashboard-host=0.0.0.0
worker_start_ray_commands:
  - ray start --address=$RAY_HEAD_IP:6379
"""
    assert auth_modes(aws) == {"disabled"}
    assert len(aws_problems(aws)) == 4
    rayjob = """
kind: RayJob
spec:
  runtimeEnvYAML: |
    env_vars:
      RAY_AUTH_MODE: disabled
  rayClusterSpec:
    headGroupSpec:
      serviceType: NodePort
      template: {spec: {containers: [{name: ray-head, env: [{name: RAY_AUTH_MODE, value: disabled}]}]}}
    workerGroupSpecs: [{template: {metadata: {labels: {app: ray}}}}]
---
kind: NetworkPolicy
metadata: {name: open}
spec:
  podSelector: {matchLabels: {app: ray}}
  ingress: [{from: [{ipBlock: {cidr: 0.0.0.0/0}}]}]
"""
    assert auth_modes(rayjob) == {"disabled"}
    assert rayjob_problems(rayjob) == [
        "rayClusterSpec.authOptions.mode is not token",
        "the head is published outside the Kubernetes cluster",
        "no NetworkPolicy isolates the head",
        "open admits more than labelled pods: {'from': [{'ipBlock': {'cidr': '0.0.0.0/0'}}]}",
        "no NetworkPolicy admits the workers to the head",
    ]


def test_no_command_in_the_docs_turns_auth_off():
    shown = [(where, argv) for where, argv, _ in COMMANDS]
    assert any("RAY_AUTH_MODE=token" in argv for _, argv in shown), "the docs show no authenticated command"
    off = [f"{where}: {shlex.join(argv)}" for where, argv in shown if "disabled" in AUTH_MODE.findall(" ".join(argv))]
    assert not off, "commands that turn token authentication off: " + "; ".join(off)


def test_the_namespace_cluster_runs_everything_with_its_token(monkeypatch):
    """Neither the caller's environment (a test session's RAY_AUTH_MODE=disabled, a token of its
    own) nor a host's or command's env turns it off; only a client may leave it out or use another."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses")
    cluster = NamespaceCluster(hosts=2)
    env = cluster.env({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": "/elsewhere", "TMPDIR": "/x"})
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"]) == ("token", str(cluster.token_path))
    assert env["TMPDIR"] == "/x"
    assert "RAY_AUTH_TOKEN" not in env and cluster.token_path.parent == cluster.temp_dir
    anonymous = cluster.env(auth=False)
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(anonymous)
    other = cluster.env(auth="0" * 64)
    assert (other["RAY_AUTH_MODE"], other["RAY_AUTH_TOKEN"]) == ("token", "0" * 64)
    assert "RAY_AUTH_TOKEN_PATH" not in other
