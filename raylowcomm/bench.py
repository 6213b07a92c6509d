"""The comparison harness: every strategy of one config on identical model, data and
hyper-parameters, then a report (raylowcomm.report).

`wan`: for each rate, `--hosts` hosts (2 by default) in network namespaces, each host's link shaped
to that rate in both directions (tc tbf), a Ray cluster of one node per host, the run's driver on
the head host and one actor (node, worker or stage) per host; torn down after each rate, also on
failure or Ctrl-C.
`local`: the same run on the local embedded Ray, no shaping, for anyone without root.

    raylowcomm bench wan examples/wan_compare.yaml --rate 100mbit --rate 1gbit --out runs/wan
    raylowcomm bench wan examples/wan_compare.yaml --hosts 4 --set nodes.count=4 --set interlocking.stages=4
    raylowcomm bench wan examples/wan_compare.yaml --rate 1gbit --rate 100mbit --repeats 2  # 1g 100m 100m 1g
    raylowcomm bench local examples/wan_compare.yaml --out runs/wan_local
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import yaml

from raylowcomm.cluster import tc_rate_bits
from raylowcomm.common.files import read_records
from raylowcomm.config import ConfigError, RunConfig
from raylowcomm.seedstats import BASELINE

LINK_PROBE_BYTES = 20_000_000
SHOWN, ALONE_DIR = BASELINE.upper(), f"{BASELINE}_time"
"""The baseline as messages name it, and the folder of its run alone (`--budget-s ddp`)."""


def rate_bits(rate: str, flag: str = "--rate") -> float:
    """'100mbit' -> 1e8 bits/s: a rate `tc tbf` takes (`cluster.tc_rate_bits`), checked before any
    namespace or cluster is made; a bad one is a ConfigError naming `flag`, the option that gave it
    (`bench --rate`, `plan --link`)."""
    try:
        return tc_rate_bits(rate)
    except ValueError as err:
        raise ConfigError(flag, rate, str(err)) from None


def wan_runs(rates: list[str], repeats: int = 1) -> list[dict]:
    """The runs of a wan bench, in order: each repeat runs every rate once, every other repeat in reverse
    (1gbit 100mbit | 100mbit 1gbit | ...), so the repeats of one rate sit around the other's and a drift
    in the machine's speed falls on both alike. A rate's first run is in folder RATE, its k-th in RATE_k.
    Checks every rate, and the repeats, before any namespace or cluster is made."""
    for rate in rates:
        rate_bits(rate)
    if len(set(rates)) != len(rates):
        raise ConfigError("--rate", rates, "each rate once: run a rate several times with --repeats")
    if repeats < 1:
        raise ConfigError("--repeats", repeats, "give 1 or more runs of each rate")
    runs = []
    for k in range(repeats):
        for rate in rates if k % 2 == 0 else rates[::-1]:
            name = rate if k == 0 else f"{rate}_{k + 1}"
            runs.append({"label": rate if repeats == 1 else f"{rate} #{k + 1}", "rate": rate, "dir": name})
    return runs


def tbf_burst(rate: str) -> str:
    """A token bucket big enough for the rate at the kernel's timer granularity (rate / 250 Hz),
    and at least 32 kbit, so the link really reaches the rate asked for."""
    return f"{max(32_000, int(rate_bits(rate) / 250)) // 1000}kbit"


def check_wan_prerequisites() -> None:
    """Fail before anything starts, saying what is missing."""
    if os.geteuid() != 0:
        raise PermissionError(
            "`raylowcomm bench wan` makes network namespaces and shapes their link with tc: it needs root "
            "(run it with sudo). `raylowcomm bench local CONFIG` runs the same harness without root, unshaped."
        )
    missing = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(
            f"`raylowcomm bench wan` needs iproute2 and util-linux ({', '.join(missing)} not found): "
            "apt-get install iproute2 util-linux"
        )


def wan_config(cfg: RunConfig, hosts: int = 2) -> RunConfig:
    """One actor per host: `hosts` node actors (or stages), one on each host."""
    from raylowcomm.strategies import STRATEGIES

    if cfg.nodes.count != hosts:
        raise ConfigError(
            "nodes.count",
            cfg.nodes.count,
            f"the WAN bench runs one node actor per host on {hosts} hosts: set nodes.count: {hosts}",
        )
    for name in cfg.strategies:
        s = STRATEGIES[name]
        if s.count(cfg) != hosts:
            raise ConfigError(
                s.count_field,
                s.count(cfg),
                f"the WAN bench puts one {name} actor on each of {hosts} hosts: set {hosts}",
            )
    cfg.nodes.placement = "STRICT_SPREAD"  # one actor per host, or none at all
    return cfg


_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); \
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0)
"""
_PROBE_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        time.sleep(0.1)
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[3]) >> 20): c.sendall(block)
c.close()
"""


def measure_link(cluster, nbytes: int = LINK_PROBE_BYTES, port: int = 5999) -> dict:
    """Throughput from host 1 to host 0 over the shaped link, measured with a plain TCP stream."""
    import subprocess

    server = subprocess.Popen(
        cluster.in_host(0, [sys.executable, "-c", _PROBE_SERVER, cluster.addresses[0], str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        cluster.run(1, [sys.executable, "-c", _PROBE_CLIENT, cluster.addresses[0], str(port), str(nbytes)], timeout=600)
        received, seconds = server.communicate(timeout=600)[0].split()
    finally:
        server.kill()
    return {
        "bytes": int(received),
        "seconds": round(float(seconds), 3),
        "mbit_per_s": round(int(received) * 8 / float(seconds) / 1e6, 1),
    }


def _write_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def baseline_alone(cfg: RunConfig) -> RunConfig:
    """The config's baseline run (`seedstats.BASELINE`, the strategy every comparison is measured
    against) with no budget: the run whose time to finish `--budget-s ddp` gives everyone."""
    alone = copy.deepcopy(cfg)
    alone.strategies, alone.optim.budget_s = [BASELINE], None
    return alone


class BenchError(RuntimeError):
    """A bench that cannot go on: what happened, in one line."""


def baseline_budget(results: Path) -> float:
    """The baseline's training seconds, from the results.json of its run alone (`baseline_alone`)."""
    if not results.exists():
        raise BenchError(f"{SHOWN}'s run for --budget-s {BASELINE} wrote no {results}: see its output above")
    records = read_records(results, f"rerun the bench: {SHOWN}'s run alone rewrites it")
    if len(records) != 1 or records[0].get("strategy") != BASELINE:
        raise BenchError(f"{results} is not the record of {SHOWN}'s run alone: rerun the bench, which rewrites it")
    record = records[0]
    if "error" in record:
        raise BenchError(f"{SHOWN}'s run for --budget-s {BASELINE} failed: {record['error']}")
    return float(record["train_s"])


def _budget_from_baseline(cfg: RunConfig, out: Path, meta: dict, rate: str | None) -> RunConfig:
    """`cfg` with every strategy's budget the baseline's time to finish (in `out`/ALONE_DIR), booked in `meta`."""
    seconds = baseline_budget(out / ALONE_DIR / "results.json")
    cfg = copy.deepcopy(cfg)
    cfg.optim.budget_s = seconds
    meta["budget"] = {"seconds": seconds, "from": BASELINE, "rate": rate, "dir": ALONE_DIR}
    meta["config"] = cfg.to_dict()
    print(f"[bench] budget: {seconds:.1f} s, {SHOWN}'s time to finish{f' at {rate}' if rate else ''}", flush=True)
    return cfg


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def bench_wan(
    cfg: RunConfig, rates: list[str], out: Path, hosts: int = 2, budget_from_ddp: bool = False, repeats: int = 1
) -> dict:
    """Each run of `wan_runs`: cluster up, link shaped and measured, `raylowcomm run` on the head host,
    cluster down. `budget_from_ddp` (`--budget-s ddp`): the slowest rate goes first, the baseline alone runs there
    before the others, and its time to finish becomes every strategy's budget at every rate."""
    from raylowcomm.cluster import NamespaceCluster
    from raylowcomm.config.checks import check_storage
    from raylowcomm.data import describe_data
    from raylowcomm.models import model_source

    check_wan_prerequisites()
    runs = wan_runs(sorted(rates, key=rate_bits) if budget_from_ddp else rates, repeats)
    cfg = wan_config(cfg, hosts)
    describe_data(cfg)  # bad data and missing assets fail here, before any namespace or cluster exists,
    model_source(cfg.model)  # without loading model and data twice: the run on the cluster loads them
    if cfg.storage is not None:  # the default, OUT/<rate>/state, lies in `out`, checked by the CLI
        check_storage(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    if not budget_from_ddp:  # else written once the baseline's time is known, with it
        _write_config(cfg, config_path)
    meta = {"mode": "wan", "hosts": hosts, "config": cfg.to_dict(), "runs": []}
    if budget_from_ddp:
        _write_config(baseline_alone(cfg), out / f"config_{ALONE_DIR}.yaml")
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so a kill still tears the cluster down
    try:
        for run in runs:
            rate = run["rate"]
            print(f"=== {run['label']}: starting a {hosts}-host cluster ===", flush=True)
            started = time.time()
            with NamespaceCluster(hosts=hosts, cpus=cfg.nodes.cpus) as cluster:
                cluster.shape(rate, burst=tbf_burst(rate))
                link = measure_link(cluster)
                print(
                    f"[bench] link {rate}: measured {link['mbit_per_s']} Mbit/s "
                    f"({link['bytes'] / 1e6:.0f} MB in {link['seconds']} s)",
                    flush=True,
                )
                if budget_from_ddp and "budget" not in meta:
                    _run_on_head(cluster, out / f"config_{ALONE_DIR}.yaml", out / ALONE_DIR)
                    cfg = _budget_from_baseline(cfg, out, meta, rate)
                    _write_config(cfg, config_path)
                proc = _run_on_head(cluster, config_path, out / run["dir"])
            meta["runs"].append(
                {
                    **run,
                    "link": link,
                    "returncode": proc.returncode,
                    "wall_s": round(time.time() - started, 1),
                }
            )
            (out / "bench.json").write_text(json.dumps(meta, indent=2))
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(out)
    return meta


def _run_on_head(cluster, config: Path, out: Path):
    """`raylowcomm run CONFIG --out OUT` on the head host, its output on this terminal."""
    return cluster.run(
        0,
        [sys.executable, "-m", "raylowcomm.cli", "run", str(config.resolve()), "--out", str(out.resolve())],
        check=False,
        timeout=24 * 3600,
        cwd=os.getcwd(),
        capture=False,
    )


def bench_local(cfg: RunConfig, out: Path, budget_from_ddp: bool = False) -> dict:
    """The same comparison on the local embedded Ray (or RAY_ADDRESS), no shaping; `budget_from_ddp`:
    the baseline alone first, its time to finish every strategy's budget."""
    from raylowcomm.runner import run

    out.mkdir(parents=True, exist_ok=True)
    meta = {"mode": "local", "runs": []}
    if budget_from_ddp:
        run(baseline_alone(cfg), out / ALONE_DIR)
        cfg = _budget_from_baseline(cfg, out, meta, None)
    _write_config(cfg, out / "config.yaml")
    started = time.time()
    records = run(cfg, out / "local")
    meta["config"] = cfg.to_dict()
    meta["runs"].append(
        {
            "label": "local",
            "rate": None,
            "dir": "local",
            "returncode": int(any("error" in r for r in records)),
            "wall_s": round(time.time() - started, 1),
        }
    )
    (out / "bench.json").write_text(json.dumps(meta, indent=2))
    _report(out)
    return meta


def _report(out: Path) -> None:
    from raylowcomm.report import write_report

    print(f"report: {write_report(out)}", flush=True)
