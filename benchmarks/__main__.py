"""The single-machine benchmarks from one command, at sizes that take minutes on 2 CPUs.

    python -m benchmarks [--only NAME ...] [--out runs/benchmarks]

Each benchmark prints its table and saves OUT/<name>.json; `raylowcomm report DIR` shows every
DIR/benchmarks/*.json, so `--out DIR/benchmarks` puts them beside a bench report. Each runs in a
fresh Python process: its own Ray (interlocking sizes Ray to its stages), its own torch threads
(spsa_replay pins them) and memory (SmolLM2) that do not leak into the next one's figures. For
other sizes, run a script itself with its flags (`python -m benchmarks.NAME --help`). These are
benchmarks: they print figures and fail on no speed; the exit status is 1 only if one crashed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Small sizes (each finishes in a few minutes on 2 CPUs); the rest are each script's defaults.
BENCHMARKS: dict[str, list[str]] = {
    "lofi_scaling": ["--steps", "20"],  # lo-fi vs DDP, N = 1, 2: 20 steps per actor
    "spsa_replay": ["--repeats", "2", "--steps", "3"],  # SmolLM2-135M replay, memory, 3 exchange steps
    "interlocking_steptime": ["--budget", "30"],  # K = 2, n = 1, 2: 30 s of training each
    "driver_memory": ["--rows", "5000", "50000"],  # the driver's peak RSS after prepare: 5k vs 50k training rows
}


def run_benchmarks(names: list[str], out_dir: str | Path, extra: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Run each named benchmark with its small sizes (plus `extra[name]`, which wins), writing
    out_dir/<name>.json; returns each one's exit status."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    status = {}
    for name in names:
        args = BENCHMARKS[name] + (extra or {}).get(name, []) + ["--out", str(out / f"{name}.json")]
        print(f"\n=== {name}: python -m benchmarks.{name} {' '.join(args)}", flush=True)
        start = time.perf_counter()
        status[name] = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT).returncode
        print(
            f"=== {name}: {'done' if status[name] == 0 else f'FAILED (exit {status[name]})'}"
            f" in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only these ({', '.join(BENCHMARKS)}); default: all",
    )
    parser.add_argument("--out", default="runs/benchmarks", help="folder for <name>.json (default: runs/benchmarks)")
    args = parser.parse_args(argv)
    status = run_benchmarks(args.only or list(BENCHMARKS), args.out)
    print(
        "\n"
        + "\n".join(
            f"{name:24s} {'saved ' + str(Path(args.out) / (name + '.json')) if rc == 0 else f'failed (exit {rc})'}"
            for name, rc in status.items()
        )
    )
    return 1 if any(status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
