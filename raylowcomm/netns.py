"""The network plumbing of `cluster.NamespaceCluster`: commands run as the cluster runs them,
namespaces joined by a bridge, a link shaped with tc, and the processes inside namespaces found
and killed (by their network namespace, never by name)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

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


def sh(
    args: list[str], check: bool = True, timeout: float = 60, capture: bool = True, **kwargs
) -> subprocess.CompletedProcess:
    """`args` run to the end (output captured unless `capture=False`); ClusterError with its output
    when it fails and `check`."""
    proc = subprocess.run(args, capture_output=capture, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        detail = ((proc.stderr or "").strip()[-3000:] + "\n" + (proc.stdout or "").strip()[-3000:]) if capture else ""
        raise ClusterError(f"{' '.join(args)} failed ({proc.returncode}): {detail}")
    return proc


def kill_in(namespaces: list[str]) -> None:
    """Every process whose network namespace is one of `namespaces`: SIGTERM, then SIGKILL, each
    followed by up to 5 s for them to go."""
    inodes = set()
    for ns in namespaces:
        try:
            inodes.add(os.stat(f"/var/run/netns/{ns}").st_ino)
        except FileNotFoundError:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_in(inodes):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 5
        while time.time() < deadline and pids_in(inodes):
            time.sleep(0.2)


def pids_in(inodes: set[int]) -> list[int]:
    """The processes whose network namespace has one of these inodes (/proc/<pid>/ns/net)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                    pids.append(int(entry))
            except (FileNotFoundError, PermissionError, ProcessLookupError):
                continue
    return pids


def make_network(switch: str, hosts: list[str], addresses: list[str], made: list[str]) -> None:
    """A bridge in namespace `switch` and one namespace per host, joined to it by a veth pair (rl0 on the
    host) with the host's address; each namespace is appended to `made` as soon as it exists."""
    sh(["ip", "netns", "add", switch])
    made.append(switch)
    sh(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
    sh(["ip", "-n", switch, "link", "set", "br0", "up"])
    for i, (ns, addr) in enumerate(zip(hosts, addresses)):
        sh(["ip", "netns", "add", ns])
        made.append(ns)
        sh(["ip", "link", "add", "rl0", "netns", ns, "type", "veth", "peer", "name", f"h{i}", "netns", switch])
        sh(["ip", "-n", switch, "link", "set", f"h{i}", "master", "br0"])
        sh(["ip", "-n", switch, "link", "set", f"h{i}", "up"])
        sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "rl0"])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        sh(["ip", "-n", ns, "link", "set", "rl0", "up"])


def shape_link(ns: str, rate: str, burst: str, latency: str) -> None:
    """A token bucket (tc tbf) on namespace `ns`'s outgoing link rl0, replacing any qdisc there."""
    qdisc = ["tbf", "rate", rate, "burst", burst, "latency", latency]
    sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "rl0", "root", *qdisc])
