"""Two run folders' results.json compared field by field: did a change alter what a run computes?

    python -m benchmarks.same_results OLD_DIR NEW_DIR [--tol REL]

A refactor should leave every accuracy, loss, byte count (by phase and by kind), step, hash and node
count of a run exactly as it was. This walks both folders' results.json recursively (records keyed by
strategy, so a path reads `lofi.comm.by_kind.train/round_payload`) and prints one line per field that
differs, is missing on one side, or changes type. What a rerun changes without any code change
(durations, memory peaks, hosts, process and Ray ids, paths, dates, versions, commit ids, and the
progress posts, which are sent on a timer) is left out by the explicit patterns in IGNORED below; the
ignored fields are counted and their keys listed, so what was not compared is on the page too.

Exit status: 0 when every compared field is equal, 1 when one differs, 2 when a file cannot be read.
Floats compare exactly unless --tol gives a relative tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

# A path component (a key name) that fully matches one of these is not compared, nor is anything under it.
IGNORED = {
    "durations": r".*_s",  # wall_s, train_s, phases_s, mean_step_s, samples_per_s, joined_at_s, ...
    "memory": r"peak_.*|rss_.*|.*_rss_.*|.*memory.*",
    "host facts": r"host|hostname|ip|node_ip|ray_node_id|pid|placement_group|cpu|gpu|device_name|platform",
    "paths": r"weights|train_run|path|.*_path|dir|.*_dir|out_dir|file|.*_file|tensorboard",
    "dates": r"date|time|timestamp|started|finished|.*_at",
    "versions and commits": r"version|.*_version|versions|commit|git|sha|revision",
    "timed progress posts": r"progress_posts|progress_bytes",
    "prose quoting a measured time": r".*_note",  # curve_note: "... + 1.48 s, the measured time to collect ..."
}
# A key that fully matches one of these is not compared where its value is no dict (a dict of that name is).
IGNORED_LEAVES = {"ratios of durations": r"goodput|busy_fraction"}

_COMPONENT = re.compile("|".join(f"(?:{p})" for p in IGNORED.values()))
_LEAF = re.compile("|".join(f"(?:{p})" for p in IGNORED_LEAVES.values()))


def load(folder: Path) -> object:
    """A run folder's results.json (or the file itself), records keyed by their strategy."""
    path = folder / "results.json" if folder.is_dir() else folder
    data = json.loads(path.read_text())
    if isinstance(data, list) and all(isinstance(r, dict) and "strategy" in r for r in data):
        return {r["strategy"]: r for r in data}
    return data


def ignored(keys: list[str], leaf: bool) -> bool:
    return any(_COMPONENT.fullmatch(k) for k in keys) or (leaf and bool(keys) and bool(_LEAF.fullmatch(keys[-1])))


def equal(a: object, b: object, tol: float) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or (tol > 0 and math.isclose(a, b, rel_tol=tol))
    return a == b


def compare(old, new, path: str, keys: list[str], tol: float, diffs: list[str], skipped: Counter) -> int:
    """Appends each difference under `path` to diffs, counts ignored keys in skipped; returns fields compared."""
    shown = path or "(top)"
    if isinstance(old, dict) and isinstance(new, dict):
        n = 0
        for k in list(old) + [k for k in new if k not in old]:
            sub, subkeys = f"{path}.{k}" if path else str(k), [*keys, str(k)]
            leaf = not isinstance(old.get(k, new.get(k)), dict)
            if ignored(subkeys, leaf):
                skipped[re.sub(r"\[\d+\]", "[]", sub)] += 1
            elif k not in new:
                diffs.append(f"{sub}: only in OLD ({json.dumps(old[k])[:80]})")
            elif k not in old:
                diffs.append(f"{sub}: only in NEW ({json.dumps(new[k])[:80]})")
            else:
                n += compare(old[k], new[k], sub, subkeys, tol, diffs, skipped)
        return n
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            diffs.append(f"{shown}: length {len(old)} -> {len(new)}")
        return sum(compare(a, b, f"{path}[{i}]", keys, tol, diffs, skipped) for i, (a, b) in enumerate(zip(old, new)))
    if not equal(old, new, tol):
        if isinstance(old, str) and isinstance(new, str):  # from a little before the first differing character
            at = max(0, next((i for i, (x, y) in enumerate(zip(old, new)) if x != y), min(len(old), len(new))) - 20)
            old, new = old[at:], new[at:]
        diffs.append(f"{shown}: {json.dumps(old)[:80]} -> {json.dumps(new)[:80]}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the old run's folder (or its results.json)")
    parser.add_argument("new", type=Path, help="the new run's folder (or its results.json)")
    parser.add_argument("--tol", type=float, default=0.0, help="relative tolerance for floats (default 0: exact)")
    parser.add_argument("--paths", action="store_true", help="list every ignored path, not only its key")
    args = parser.parse_args(argv)
    try:
        old, new = load(args.old), load(args.new)
    except (OSError, ValueError) as err:
        print(f"cannot read results: {err}")
        return 2
    diffs: list[str] = []
    skipped: Counter = Counter()
    compared = compare(old, new, "", [], args.tol, diffs, skipped)
    for line in diffs:
        print(f"DIFF {line}")
    names: Counter = Counter()
    for path, count in skipped.items():
        names[path if args.paths else path.rsplit(".", 1)[-1].removesuffix("[]")] += count
    print(f"{compared} fields compared, {len(diffs)} differ; {sum(skipped.values())} ignored under {len(names)} keys:")
    for key, count in sorted(names.items()):
        print(f"  ignored {key}" + (f" (x{count})" if count > 1 else ""))
    print("SAME" if not diffs else "DIFFERENT")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
