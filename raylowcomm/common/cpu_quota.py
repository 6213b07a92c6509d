"""A node process held to its share of the CPU (`churn.cpu_quota`), as if it ran on its own machine.

Ray does not enforce fractional CPUs: four actors of half a CPU on two cores take whatever the others
leave, so a node that waits speeds the rest up, and a benchmark on one machine cannot see what a
wait costs on separate hosts. A CPU quota (Linux cgroup v1's `cpu` controller, CFS bandwidth) caps
each node process at `nodes.cpus` of CPU time whatever the others do. Each process gets its own
cgroup, `raylowcomm/<pid>` under the controller's root; those of processes that have exited are
removed as the next one is made."""

from __future__ import annotations

import os
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's cpu controller, where the quota files live."""
GROUP = "raylowcomm"
PERIOD_US = 100_000


def quota_unavailable(root: Path | None = None) -> str | None:
    """Why a node process cannot be given a quota here (None: it can)."""
    root = root or CPU_CGROUP
    if not (root / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {root} (cgroup v2 is not supported)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable by this user (it needs root)"
    return None


def cap_cpu(cpus: float, root: Path | None = None) -> Path:
    """This process, every thread of it, at `cpus` of CPU time: `cpus` × PERIOD_US of each PERIOD_US.
    Returns its cgroup."""
    parent = (root or CPU_CGROUP) / GROUP
    parent.mkdir(exist_ok=True)
    for old in parent.iterdir():  # cgroups of processes that exited: empty, removable
        if old.is_dir() and old.name.isdigit() and not Path(f"/proc/{old.name}").exists():
            try:
                old.rmdir()
            except OSError:  # still holds a task: leave it
                pass
    mine = parent / str(os.getpid())
    mine.mkdir(exist_ok=True)
    (mine / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (mine / "cpu.cfs_quota_us").write_text(str(max(1000, round(cpus * PERIOD_US))))
    (mine / "cgroup.procs").write_text(str(os.getpid()))
    return mine
