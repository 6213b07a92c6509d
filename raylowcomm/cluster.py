"""A real multi-node Ray cluster on one Linux machine, for tests, demos and WAN benchmarks.

Each host is a network namespace with its own address on a private /24; the hosts hang off a
bridge in a switch namespace, so they talk over real (virtual) Ethernet links that `tc` can
shape (`shape`). The Ray head runs on host 0, one worker on each other host, all from this
Python's `ray`. Needs root, iproute2 and nsenter. A host's processes enter only its network namespace
(`in_host`): they keep the machine's mounts, so a node can hold itself to its CPU share there
(`churn.cpu_quota`'s cgroup, which `ip netns exec`'s fresh /sys would hide).

Token authentication is always on: each cluster makes its own token (256 random bits, as
`ray get-auth-token --generate` makes them) in a 0600 file in its temp dir, and every process it
starts, the nodes and every client (`run`, `submit`, `ray status`), gets `RAY_AUTH_MODE=token`
and `RAY_AUTH_TOKEN_PATH` pointing at that file. Only a client can be told to leave the token
out (`auth=False`) or use another one, to check that the cluster refuses it.

Everything it starts lives inside its own namespaces, so teardown kills exactly the processes
whose network namespace is one of ours — never `ray stop`, which would stop every Ray on the
machine (including other users' and a test session's). Usable as a context manager, so the
cluster and namespaces go away also on failure. The plumbing (namespaces, bridge, tc, killing by
namespace) is `netns`'s:

    with NamespaceCluster(hosts=2, cpus=2) as c:
        c.run(0, ["raylowcomm", "run", "cfg.yaml"])           # a driver on the head host
        c.submit(["raylowcomm", "tune", "sweep.yaml"])        # or a Ray job
    python -m raylowcomm.cluster --hosts 2 -- raylowcomm run cfg.yaml   # the same, from a shell
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from raylowcomm.netns import ClusterError, kill_in, make_network, pids_in, sh, shape_link, tc_rate_bits

GCS_PORT = 6380
DASHBOARD_PORT = 8265
# Fixed agent ports (each host has its own network stack, so they cannot collide): with dynamic
# ones the raylet waits for the agents to publish theirs, and on a busy machine it can give up first.
AGENT_PORTS = [
    "--metrics-export-port=8090",
    "--dashboard-agent-listen-port=52365",
    "--dashboard-agent-grpc-port=52366",
    "--runtime-env-agent-port=52367",
]
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Where Ray reads its authentication settings; the cluster alone sets them for what it runs."""

logger = logging.getLogger(__name__)


class NamespaceCluster:
    """`hosts` Ray nodes, each in its own network namespace; `cpus` and `resources` per host
    (a number/dict for all, or a list per host). Names and subnet are unique per instance."""

    def __init__(
        self,
        hosts: int = 2,
        cpus: float | list[float] = 1,
        resources: dict | list[dict] | None = None,
        start_timeout_s: float = 180,
        gpus: list[int] | None = None,
        host_env: list[dict] | None = None,
    ):
        if hosts < 1:
            raise ValueError("hosts must be >= 1")
        self.tag = secrets.token_hex(3)
        self.hosts = [f"rl{self.tag}h{i}" for i in range(hosts)]
        self.switch = f"rl{self.tag}sw"
        subnet = int(self.tag[:4], 16)
        self.addresses = [f"10.{100 + subnet % 100}.{subnet // 256 % 256}.{i + 1}" for i in range(hosts)]
        self.cpus = cpus if isinstance(cpus, list) else [cpus] * hosts
        self.resources = resources if isinstance(resources, list) else [resources or {}] * hosts
        self.gpus = gpus or [0] * hosts
        """GPUs each host advertises (placement only: a host need not have them to say so)."""
        self.host_env = host_env or [{}] * hosts
        """Environment of each host's Ray processes and so of the actors there, e.g. its own TMPDIR."""
        self.temp_dir = Path(f"/tmp/rlc-{self.tag}")  # short: Ray's unix sockets live under it
        self.token_path = self.temp_dir / "auth_token"
        """The cluster's token, made by `start`; a client that `run` does not start authenticates
        with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set to this file."""
        self.start_timeout_s = start_timeout_s
        self.ray = str(Path(sys.executable).parent / "ray")
        self._made: list[str] = []

    # --- addresses and environment -------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address (RAY_ADDRESS) drivers on any host join."""
        return f"{self.addresses[0]}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        """The jobs API (`ray job submit --address`)."""
        return f"http://{self.addresses[0]}:{DASHBOARD_PORT}"

    def env(self, extra: dict | None = None, auth: bool | str = True) -> dict:
        """The environment of everything run in the cluster: this Python first on PATH, not the
        loopback-only switch (a multi-node cluster needs real addresses), and token auth with the
        cluster's token. The auth settings are applied last: neither this process's environment
        (a test session's RAY_AUTH_MODE=disabled) nor `extra` changes them. `auth` is for clients
        only: a string is another token to send, False a client that sends none (RAY_AUTH_MODE
        unset: Ray's clients then add no authorization header)."""
        dropped = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", *AUTH_VARS)
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        # The hostname resolves to 127.0.0.1 in every namespace: make gloo (DDP) use the host's link.
        env["GLOO_SOCKET_IFNAME"] = "rl0"
        env.update({k: v for k, v in (extra or {}).items() if k not in AUTH_VARS})
        if auth is True:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        elif auth:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=auth)
        return env

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> NamespaceCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
            raise ClusterError("a namespace cluster needs root, iproute2 (ip) and util-linux (nsenter)")
        make_network(self.switch, self.hosts, self.addresses, self._made)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._make_token()
        self._ray_start(
            0,
            [
                "--head",
                f"--port={GCS_PORT}",
                f"--dashboard-host={self.addresses[0]}",
                f"--dashboard-port={DASHBOARD_PORT}",
                "--include-dashboard=true",
            ],
        )
        for i in range(1, len(self.hosts)):
            self._ray_start(i, [f"--address={self.address}"])
        self._wait_for_nodes()

    def _make_token(self) -> None:
        """A new token for this cluster, readable by its owner only (the nodes run as root)."""
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        logger.info("cluster %s: token authentication on, token in %s", self.tag, self.token_path)

    def stop(self) -> None:
        """Kill every process in our host namespaces, then delete the namespaces and temp dir."""
        kill_in(self._made)
        for ns in reversed(self._made):
            sh(["ip", "netns", "del", ns], check=False)
        self._made = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _ray_start(self, host: int, args: list[str], attempts: int = 3) -> None:
        """`ray start` on a host; retried from scratch on that host because on a busy machine a
        raylet can miss Ray's fixed 30 s registration deadline."""
        res = json.dumps(self.resources[host]) if self.resources[host] else None
        command = [
            self.ray,
            "start",
            f"--node-ip-address={self.addresses[host]}",
            f"--num-cpus={math.ceil(self.cpus[host])}",
            f"--num-gpus={self.gpus[host]}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            *AGENT_PORTS,
            *args,
            *([f"--resources={res}"] if res else []),
        ]
        for attempt in range(attempts):
            try:
                self.run(host, command, env=self.host_env[host], timeout=self.start_timeout_s)
                return
            except (ClusterError, subprocess.TimeoutExpired):
                kill_in([self.hosts[host]])
                if attempt == attempts - 1:
                    raise

    def _wait_for_nodes(self) -> None:
        deadline, out = time.time() + self.start_timeout_s, ""
        while time.time() < deadline:
            proc = self.run(0, [self.ray, "status", f"--address={self.address}"], check=False, timeout=60)
            out = proc.stdout
            active = out.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in out else ""
            if len(re.findall(r"node_[0-9a-f]+", active)) == len(self.hosts):
                return
            time.sleep(2)
        raise ClusterError(
            f"{len(self.hosts)} Ray nodes did not come up in {self.start_timeout_s:.0f} s; last `ray status`:\n{out}"
        )

    _pids_in = staticmethod(pids_in)

    # --- running things ------------------------------------------------------------------------

    def in_host(self, host: int, args: list[str]) -> list[str]:
        """`args` as a command on a host: in its network namespace, with the machine's mounts."""
        return ["nsenter", f"--net=/run/netns/{self.hosts[host]}", "--", *args]

    def run(
        self,
        host: int,
        args: list[str],
        env: dict | None = None,
        check: bool = True,
        timeout: float = 600,
        cwd: str | Path | None = None,
        capture: bool = True,
        auth: bool | str = True,
    ) -> subprocess.CompletedProcess:
        """Run a command on a host (in its namespace), with RAY_ADDRESS pointing at the head and
        the cluster's token (`auth`: see `env`)."""
        full_env = self.env({"RAY_ADDRESS": self.address, **(env or {})}, auth=auth)
        return sh(
            self.in_host(host, args),
            check=check,
            timeout=timeout,
            capture=capture,
            env=full_env,
            cwd=cwd,
        )

    def start_on(self, host: int, args: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start a command on a host without waiting (a driver a test kills or watches); its
        output, stdout and stderr together, is the returned process's `stdout`."""
        return subprocess.Popen(
            self.in_host(host, args),
            env=self.env({"RAY_ADDRESS": self.address, **(env or {})}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def kill_host(self, host: int) -> None:
        """Every process of a host at once (its raylet and the actors on it), as a lost machine."""
        kill_in([self.hosts[host]])

    def submit(
        self,
        entrypoint: list[str],
        working_dir: str | Path = ".",
        runtime_env: dict | None = None,
        check: bool = True,
        timeout: float = 600,
        auth: bool | str = True,
    ) -> subprocess.CompletedProcess:
        """`ray job submit` from the head host, authenticated with the cluster's token unless
        `auth` says otherwise (see `env`); waits for the job and returns its output."""
        args = [self.ray, "job", "submit", f"--address={self.dashboard}", f"--working-dir={working_dir}"]
        if runtime_env:
            args.append(f"--runtime-env-json={json.dumps(runtime_env)}")
        return self.run(
            0, [*args, "--", *entrypoint], env={"RAY_ADDRESS": self.dashboard}, check=check, timeout=timeout, auth=auth
        )

    def node_ids(self) -> dict[str, str]:
        """Ray node id -> host address, from the cluster itself."""
        code = (
            "import json, ray; ray.init(); "
            "print(json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))"
        )
        out = self.run(0, [sys.executable, "-c", code], timeout=120).stdout
        return json.loads(out.strip().splitlines()[-1])

    def shape(self, rate: str = "100mbit", burst: str = "32kbit", latency: str = "50ms") -> None:
        """Limit every host's outgoing link with a token bucket (tc tbf); both directions of each
        pair are then shaped. netem (delay, loss) may be missing from the kernel; tbf is not."""
        for ns in self.hosts:
            shape_link(ns, rate, burst, latency)

    def unshape(self) -> None:
        for ns in self.hosts:
            sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "rl0", "root"], check=False)


def main(argv: list[str] | None = None) -> int:
    """Start a cluster, run one command on its head host, tear everything down."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m raylowcomm.cluster", description=main.__doc__)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--cpus", type=float, default=1)
    p.add_argument("--shape", metavar="RATE", help="limit each host's link, e.g. 100mbit (tc tbf)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command, e.g. raylowcomm run cfg.yaml")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give a command after --")
    if args.shape:
        try:
            tc_rate_bits(args.shape)
        except ValueError as err:
            p.error(f"--shape {args.shape}: {err}")
    with NamespaceCluster(args.hosts, args.cpus) as cluster:
        if args.shape:
            cluster.shape(args.shape)
        print(
            f"cluster up: head {cluster.address}, hosts {cluster.addresses}, token auth "
            f"(RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path})",
            flush=True,
        )
        return cluster.run(0, command, check=False, timeout=24 * 3600, cwd=os.getcwd(), capture=False).returncode


if __name__ == "__main__":
    sys.exit(main())
