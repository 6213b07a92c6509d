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
cluster and namespaces go away also on failure:

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
import signal
import subprocess
import sys
import time
from pathlib import Path

GCS_PORT = 6380
DASHBOARD_PORT = 8265
# Fixed agent ports (each host has its own network stack, so they cannot collide): with dynamic
# ones the raylet waits for the agents to publish theirs and aborts after ~15 s on a busy machine.
AGENT_PORTS = [
    "--metrics-export-port=8090",
    "--dashboard-agent-listen-port=52365",
    "--dashboard-agent-grpc-port=52366",
    "--runtime-env-agent-port=52367",
]
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Where Ray reads its authentication settings; the cluster alone sets them for what it runs."""

logger = logging.getLogger(__name__)


_TC_RATE = re.compile(r"^(\d+(?:\.\d+)?)([a-z]+)$", re.IGNORECASE)
_TC_RATE_BITS = {
    **{f"{prefix}bit": scale for prefix, scale in (("", 1), ("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12))},
    **{f"{prefix}ibit": 1024.0**power for power, prefix in enumerate(("k", "m", "g", "t"), 1)},
    **{f"{prefix}bps": 8 * scale for prefix, scale in (("", 1), ("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12))},
    **{f"{prefix}ibps": 8 * 1024.0**power for power, prefix in enumerate(("k", "m", "g", "t"), 1)},
}
"""tc's rate units in bits/s (tc(8); matched as tc does, case-insensitively): *bps are bytes/s."""


def tc_rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8: a rate `tc tbf` takes, in bits/s — a number and one of tc's units, from 1
    byte/s (tbf's rate of 0 bytes is none) to below tc's 2**64 bytes/s — or a ValueError saying so,
    so a bad rate is refused before a namespace is made, not by tc after."""
    m = _TC_RATE.match(rate)
    unit = m and m.group(2).lower()
    if unit not in _TC_RATE_BITS:
        raise ValueError(
            "a tc rate: a positive number and a unit (bit, kbit, mbit, gbit, tbit; kbps, mbps... are "
            "bytes/s), e.g. 100mbit, 1gbit or 500kbit"
        )
    bits = float(m.group(1)) * _TC_RATE_BITS[unit]
    if not 8 <= bits < 8 * 2.0**64:
        raise ValueError("tc shapes from 8bit (1 byte/s) to below 2**64 bytes/s: give a link rate such as 100mbit")
    return bits


class ClusterError(RuntimeError):
    """The cluster could not be made or did not come up; the message says what and where."""


def _sh(
    args: list[str], check: bool = True, timeout: float = 60, capture: bool = True, **kwargs
) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=capture, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        detail = ((proc.stderr or "").strip()[-3000:] + "\n" + (proc.stdout or "").strip()[-3000:]) if capture else ""
        raise ClusterError(f"{' '.join(args)} failed ({proc.returncode}): {detail}")
    return proc


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
        self._make_network()
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
        self._kill_in(self._made)
        for ns in reversed(self._made):
            _sh(["ip", "netns", "del", ns], check=False)
        self._made = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_in(self, namespaces: list[str]) -> None:
        inodes = set()
        for ns in namespaces:
            try:
                inodes.add(os.stat(f"/var/run/netns/{ns}").st_ino)
            except FileNotFoundError:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._pids_in(inodes):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while time.time() < deadline and self._pids_in(inodes):
                time.sleep(0.2)

    @staticmethod
    def _pids_in(inodes: set[int]) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                        pids.append(int(entry))
                except (FileNotFoundError, PermissionError, ProcessLookupError):
                    continue
        return pids

    def _make_network(self) -> None:
        _sh(["ip", "netns", "add", self.switch])
        self._made.append(self.switch)
        _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
            _sh(["ip", "netns", "add", ns])
            self._made.append(ns)
            _sh(
                ["ip", "link", "add", "rl0", "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", self.switch]
            )
            _sh(["ip", "-n", self.switch, "link", "set", f"h{i}", "master", "br0"])
            _sh(["ip", "-n", self.switch, "link", "set", f"h{i}", "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "rl0"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns, "link", "set", "rl0", "up"])

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
                self._kill_in([self.hosts[host]])
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
        return _sh(
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
        self._kill_in([self.hosts[host]])

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
            _sh(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    "rl0",
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    latency,
                ]
            )

    def unshape(self) -> None:
        for ns in self.hosts:
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "rl0", "root"], check=False)


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
