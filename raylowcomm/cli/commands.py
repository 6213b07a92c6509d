"""The commands run, tune, bench, report and assets: each checks its inputs (a bad one is one
`error:` line and exit code 2, naming the field, flag or file and the fix) before Ray starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from raylowcomm.cli.args import one_line


def fail(err) -> int:
    """A bad input: one `error:` line on stderr; the exit code, 2."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return 2


def check_out_dir(path: str | Path, field: str) -> None:
    """Fail now, not after training, when `path` cannot become (or is not) a writable folder."""
    from raylowcomm.config import ConfigError

    target = Path(path).absolute()
    existing = target
    for existing in (target, *target.parents):
        try:
            if existing.exists():
                break
        except OSError as err:  # e.g. a parent that may not be searched
            raise ConfigError(
                field, str(path), f"cannot look into {existing.parent} ({err.strerror}): choose another folder"
            ) from None
    if not existing.is_dir():
        where = "is an existing file" if existing == target else f"lies under {existing}, which is a file"
        raise ConfigError(field, str(path), f"{where}: choose a folder (new or existing) for the outputs")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(field, str(path), f"{existing} is not writable: choose a folder you can write to")


def assets_command(args) -> int:
    """`raylowcomm assets list|fetch`: what is cached, or fetch it (an unknown name: exit 2)."""
    from raylowcomm import assets

    for name in args.names or list(assets.ASSETS):
        if name not in assets.ASSETS:
            return fail(f"unknown asset {name!r}; known: {', '.join(assets.ASSETS)}")
    for name in args.names or list(assets.ASSETS):
        a = assets.ASSETS[name]
        if args.action == "fetch":
            try:
                print(f"{name}: {assets.fetch(name)}")
            except assets.AssetError as err:
                print(f"error: {one_line(err)}", file=sys.stderr)
                return 1
        else:
            print(f"{name:20s} {a.kind:5s} {'cached' if a.ready() else 'not cached':10s} {a.about}")
    return 0


def bench_command(args) -> int:
    """`raylowcomm bench wan|local`: flags and config checked, then every strategy on identical inputs
    and a report; exit 1 where a run or the cluster failed."""
    from raylowcomm import assets
    from raylowcomm.bench import BenchError, bench_local, bench_wan, check_wan_prerequisites, wan_runs
    from raylowcomm.cluster import ClusterError
    from raylowcomm.common.files import FileError
    from raylowcomm.config import ConfigError
    from raylowcomm.strategies import load_config

    try:
        if args.mode == "local" and args.rates:
            raise ConfigError("--rate", args.rates, "only `bench wan` shapes a link; drop --rate for `bench local`")
        if args.mode == "local" and args.hosts != 2:
            raise ConfigError("--hosts", args.hosts, "only `bench wan` makes hosts; drop --hosts for `bench local`")
        if args.mode == "local" and args.repeats != 1:
            raise ConfigError("--repeats", args.repeats, "only `bench wan` repeats its rates; drop --repeats")
        wan_runs(args.rates, args.repeats)  # every --rate, and --repeats
        from_ddp = args.budget_s == "ddp"
        budget = [] if args.budget_s is None else [f"optim.budget_s={1.0 if from_ddp else _seconds(args.budget_s)}"]
        cfg = load_config(args.config, args.overrides + budget)  # a budget's refusals apply to ddp's too
        if from_ddp and "ddp" not in cfg.strategies:
            raise ConfigError("--budget-s", "ddp", "takes DDP's time to finish: add ddp to strategies, or give seconds")
        out = args.out or cfg.out_dir
        check_out_dir(out, "--out" if args.out else "out_dir")
        if args.mode == "wan":
            check_wan_prerequisites()
            meta = bench_wan(cfg, args.rates or ["100mbit"], Path(out), args.hosts, from_ddp, args.repeats)
        else:
            meta = bench_local(cfg, Path(out), from_ddp)
    except (ConfigError, assets.AssetError, PermissionError, FileNotFoundError) as err:
        return fail(err)
    except ClusterError as err:
        print(f"error: the cluster failed (it has been torn down): {one_line(err)}", file=sys.stderr)
        return 1
    except (BenchError, FileError) as err:  # a file the bench wrote itself, damaged
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    failed = [r["label"] for r in meta["runs"] if r["returncode"] != 0]
    if failed:
        print(f"error: the run failed at {', '.join(failed)}: see its output above and results.json", file=sys.stderr)
    return 1 if failed else 0


def _seconds(value: str) -> float:
    """--budget-s as seconds: a number > 0."""
    from raylowcomm.config import ConfigError

    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ConfigError("--budget-s", value, "give seconds > 0 (e.g. 600), or ddp for DDP's own time to finish")
    return seconds


def report_command(args) -> int:
    """`raylowcomm report DIR`: report.md and the plots from the saved results; a folder or file that
    holds no raylowcomm results (a results.json holding `{}`, a cut-off one) is exit 2, naming it."""
    from raylowcomm.report import ReportError, write_report

    if not Path(args.dir).is_dir():
        what = "is a file" if Path(args.dir).exists() else "does not exist"
        return fail(f"report DIR {args.dir!r} {what}: give a folder written by `raylowcomm run` or `raylowcomm bench`")
    try:
        path = write_report(args.dir, args.target_fraction)
    except (ReportError, OSError, ValueError, KeyError) as err:
        return fail(f"cannot build a report from {args.dir}: {err}")
    print(path.read_text())
    print(f"report: {path}")
    return 0


def tune_command(args) -> int:
    """`raylowcomm tune SWEEP`: the sweep checked (its metric among those the trials report), then run;
    exit 1 where a trial failed."""
    from raylowcomm import assets
    from raylowcomm.config import ConfigError
    from raylowcomm.config.checks import check_storage
    from raylowcomm.tune import SweepError, format_summary, load_sweep, run_sweep

    try:
        sweep = load_sweep(args.sweep, args.overrides)
        if args.storage_path:
            check_out_dir(args.storage_path, "--storage-path")
        else:
            check_out_dir(sweep.spec.storage_path, "storage_path")
        if sweep.cfg.storage is not None:  # the trials' own state: written once now, before Ray starts
            check_storage(sweep.cfg, sweep.cfg.out_dir)
        summary = run_sweep(sweep, args.storage_path)
    except (SweepError, ConfigError, assets.AssetError) as err:
        return fail(err)
    print(format_summary(sweep.spec, summary))
    return 1 if any(t["status"] == "error" for t in summary["trials"]) else 0


def parse_seeds(text: str) -> list[int]:
    """--seeds 0,1,2 -> [0, 1, 2]: distinct integers in [0, 2**31), in the order given."""
    from raylowcomm.config import ConfigError
    from raylowcomm.config.checks import SEED_LIMIT, SEED_RULE

    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):  # isdigit() alone takes '²', which int() refuses
        raise ConfigError("--seeds", text, "give seeds as integers >= 0 separated by commas, e.g. --seeds 0,1,2")
    # the length first: int() refuses a string of thousands of digits
    if any(len(p.lstrip("0")) > len(str(SEED_LIMIT)) or int(p) >= SEED_LIMIT for p in parts):
        raise ConfigError("--seeds", text, SEED_RULE)
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds):
        raise ConfigError("--seeds", text, "each seed once: a repeated seed repeats the same run")
    return seeds


def run_command(args) -> int:
    """`raylowcomm run CONFIG`: the config, --seeds and --resume (the run's config, results.json and
    the state it continues from) checked before Ray starts; exit 1 where a strategy failed."""
    from raylowcomm import assets
    from raylowcomm.config import ConfigError
    from raylowcomm.strategies import load_config

    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        if seeds is not None and any(o.partition("=")[0].strip() == "seed" for o in args.overrides):
            raise ConfigError("--seeds", args.seeds, "--seeds sets `seed` for each run: drop --set seed=...")
        cfg = load_config(args.config, args.overrides)
        if args.resume and args.out and Path(args.out) != Path(args.resume):
            raise ConfigError(
                "--out", args.out, "--resume OUT continues the run in OUT: drop --out or give the same folder"
            )
        if args.out or args.resume:
            cfg.out_dir = args.resume or args.out
        check_out_dir(cfg.out_dir, "--resume" if args.resume else "--out" if args.out else "out_dir")
        from raylowcomm.resume import check_resumable
        from raylowcomm.runner import run
        from raylowcomm.runtime import log_to_stdout
        from raylowcomm.seeds import check_seeds_resumable, run_seeds

        if args.resume and seeds is None:
            check_resumable(cfg, cfg.out_dir)
        elif args.resume:
            check_seeds_resumable(cfg, seeds, cfg.out_dir)
        log_to_stdout()
        if seeds is not None:
            summary = run_seeds(cfg, seeds, verbose=args.verbose, resume=bool(args.resume))
            return 1 if any(entry["failed"] for entry in summary["strategies"]) else 0
        records = run(cfg, verbose=args.verbose, resume=bool(args.resume))
    except (ConfigError, assets.AssetError) as err:
        return fail(err)
    except KeyboardInterrupt:  # the running strategy's actors were released on the way out
        print(
            f"error: interrupted; the running strategy's actors were released; strategies that finished, if any, "
            f"are in {Path(cfg.out_dir) / ('seed_<s>/results.json' if seeds else 'results.json')}"
            + (f"; continue with --resume {cfg.out_dir} --seeds {args.seeds}" if seeds else ""),
            file=sys.stderr,
        )
        return 130
    return 1 if any("error" in r for r in records) else 0
