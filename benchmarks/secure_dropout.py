"""A node killed after masking, in a real secure run: the MNIST dial (4 nodes × 1,000 images, 2 epochs of
31 steps, int2 rounds every 8 steps with `dense: [head, vectors]`, block 128, `compress_scale: shared`,
`lofi.secure`), once as it is and once with one node's process SIGKILLed while it lands round `--round`
(it has masked and sent its payload by then, and the driver owns that payload).

    python -m benchmarks.secure_dropout [--round 2] [--out runs/bench/secure_dropout]

Each is one `raylowcomm run` into OUT/clean and OUT/killed (a run already there is read, not repeated).
Prints each run's rounds (step and the nodes' common global-model hash), the rounds masked again and the
rosters (`details.secure`), the restarts and the accuracy: where the killed node's payload was in, its
rounds up to the kill are the clean run's to the bit. A benchmark: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "examples" / "lofi_vs_ddp_mnist.yaml"
SETTING = [
    "strategies=[lofi]",
    "nodes.count=4",
    "nodes.cpus=0.5",
    "lofi.compress=int2",
    "lofi.average_every=8",
    "lofi.dense=[head,vectors]",
    "lofi.compress_block=128",
    "lofi.compress_scale=shared",
    "lofi.secure=true",
]
LANDING = "LofiNode.secure_land"
"""What a node's process title shows while it lands a secure round."""
logger = logging.getLogger(__name__)


def _start(out: Path) -> subprocess.Popen:
    overrides = [arg for item in SETTING for arg in ("--set", item)]
    command = [sys.executable, "-m", "raylowcomm.cli", "run", str(WORKLOAD), *overrides, "--out", str(out)]
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _landing(run: subprocess.Popen) -> list[psutil.Process]:
    """The run's node processes landing a secure round now (descendants of the run's driver)."""
    found = []
    for proc in psutil.Process(run.pid).children(recursive=True):
        try:
            if any(LANDING in part for part in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_while_landing(run: subprocess.Popen, round_: int) -> int | None:
    """SIGKILL one node process during the `round_`-th landing the run's processes show; its pid (None: the
    run ended first). A landing is a stretch of polls in which some node shows `LANDING`."""
    seen, landing = 0, False
    while run.poll() is None:
        procs = _landing(run)
        if procs and not landing:
            seen += 1
        landing = bool(procs)
        if procs and seen == round_:
            procs[-1].send_signal(signal.SIGKILL)
            return procs[-1].pid
        time.sleep(0.002)
    return None


def run_once(out: Path, kill_round: int | None) -> dict:
    """The run's lo-fi record (run now unless OUT holds it), with the pid it killed where it did."""
    results = out / "results.json"
    if not results.exists():
        run = _start(out)
        killed = kill_while_landing(run, kill_round) if kill_round else None
        run.wait()
        if killed is not None:
            (out / "killed_pid.txt").write_text(str(killed))
    record = json.loads(results.read_text())[0]
    pid_file = out / "killed_pid.txt"
    record["killed_pid"] = int(pid_file.read_text()) if pid_file.exists() else None
    return record


def report(name: str, record: dict) -> None:
    details = record["details"]
    logger.info(
        "%s: ID %.1f%%, shift %.1f%%",
        name,
        100 * record["metrics"]["id_accuracy"],
        100 * record["metrics"]["shift_accuracy"],
    )
    logger.info(
        "  killed pid: %s; the nodes' pids at the end: %s", record["killed_pid"], [n["pid"] for n in record["nodes"]]
    )
    logger.info("  secure: %s", details.get("secure"))
    for step, hashed in details.get("global_hashes", []):
        logger.info("  round at step %3d: %s", step, hashed[:16])
    kinds = {k: v for k, v in record["comm"]["by_kind"].items() if "masked" in k or "secure" in k}
    logger.info("  bytes: %s", kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round", type=int, default=2, help="the landing during which a node is killed")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "secure_dropout")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    clean = run_once(args.out / "clean", None)
    killed = run_once(args.out / "killed", args.round)
    report("clean", clean)
    report(f"a node killed while it landed round {args.round}", killed)
    same = [a == b for a, b in zip(clean["details"]["global_hashes"], killed["details"]["global_hashes"])]
    logger.info("rounds equal to the clean run's, in order: %s", same)


if __name__ == "__main__":
    main()
