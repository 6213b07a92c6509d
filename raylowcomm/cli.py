"""raylowcomm run | tune | bench | report | plan | assets.

Bad input of any kind — a command line argparse rejects, a config or sweep file, a field, an
output folder — ends the command with exit code 2 and one line on stderr, `error: ...`, naming
the field, flag or path and the fix, before Ray starts. Heavy modules load only once the command
line is parsed, after the Hugging Face loaders are defaulted to offline (raylowcomm/env.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one `error:` line (exit 2), not usage plus message."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {_one_line(message)}; see `{self.prog} --help`\n")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _fail(err) -> int:
    print(f"error: {_one_line(err)}", file=sys.stderr)
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


def _add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raylowcomm", description="Low-communication fine-tuning on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run the strategies of a config and compare them")
    run_p.add_argument("config")
    _add_overrides(run_p, "override a config field, e.g. --set optim.lr=0.01 (repeatable)")
    run_p.add_argument("--out", help="output directory (default: the config's out_dir)")
    run_p.add_argument(
        "--resume",
        metavar="OUT",
        help="continue the run in OUT whose driver stopped: finished strategies "
        "are kept, the others continue from their last checkpoint in storage",
    )
    run_p.add_argument(
        "--seeds",
        metavar="S,S,...",
        help="run the config once per seed (only `seed` changes; the test rows stay data.shuffle_seed's) into "
        "OUT/seed_<s>/, then OUT/seeds.json and a table: per strategy mean ± 95%% interval of every metric, "
        "bytes and time, and the paired difference to DDP; e.g. --seeds 0,1,2",
    )
    run_p.add_argument(
        "--verbose", action="store_true", help="also show what node actors, Ray and the model and data loaders print"
    )
    tune_p = sub.add_parser("tune", help="sweep config fields with Ray Tune (a sweep file: see tune_configs/)")
    tune_p.add_argument("sweep")
    _add_overrides(tune_p, "override a field of the sweep's base config for every trial (repeatable)")
    tune_p.add_argument("--storage-path", help="where Tune writes the sweep (default: the sweep file's storage_path)")
    bench_p = sub.add_parser(
        "bench",
        help="every strategy of a config on identical inputs, curves and a report: "
        "over shaped links between hosts (wan, needs root) or on local Ray",
    )
    bench_p.add_argument("mode", choices=["wan", "local"])
    bench_p.add_argument("config")
    bench_p.add_argument(
        "--rate",
        dest="rates",
        action="append",
        default=[],
        metavar="RATE",
        help="wan: link rate, e.g. 100mbit or 1gbit (repeatable; default 100mbit)",
    )
    bench_p.add_argument(
        "--budget-s",
        nargs="?",
        const="ddp",
        metavar="SECONDS|ddp",
        help="the same training seconds for every strategy (optim.budget_s): each trains until it has spent "
        "them, its epochs repeating, then is scored; ddp (the default, --budget-s alone): DDP's own time to "
        "finish at the slowest rate, measured by a run of DDP alone first",
    )
    bench_p.add_argument(
        "--hosts", type=int, default=2, help="wan: hosts, one node actor, DDP worker or stage each (default 2)"
    )
    bench_p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="wan: run every rate this many times, every other repeat in reverse order (1g 100m 100m 1g), "
        "so that a rate's repeats and their median meet the machine at the same times as the other rate's",
    )
    _add_overrides(bench_p, "override a config field (repeatable)")
    bench_p.add_argument("--out", help="output directory (default: the config's out_dir)")
    report_p = sub.add_parser(
        "report",
        help="rebuild report.md and the curve plots of a bench, run or multi-seed run (run --seeds) directory "
        "from its saved results",
    )
    report_p.add_argument("dir")
    report_p.add_argument(
        "--target-fraction",
        type=float,
        default=0.95,
        help="target = this fraction of DDP's final accuracy (for a loss: DDP's final / it)",
    )
    plan_p = sub.add_parser(
        "plan", help="predict each strategy's wall time for N nodes on a link, from a run folder or a short run"
    )
    plan_p.add_argument(
        "sources",
        nargs="+",
        metavar="CONFIG_OR_RUN_DIR",
        help="run folders (results.json) or a config, run briefly here",
    )
    plan_p.add_argument("--nodes", default="2,4,8,16,32,64", help="node counts, comma-separated (default 2..64)")
    plan_p.add_argument("--link", action="append", default=[], metavar="RATE", help="e.g. 100mbit (repeatable)")
    plan_p.add_argument("--latency", type=float, default=0.0, metavar="MS", help="one-way latency in ms")
    size = plan_p.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, help="another model's parameters, e.g. 8e9")
    size.add_argument("--model", help="a known decoder's size instead: " + ", ".join(_plan_models()))
    plan_p.add_argument("--lora-rank", type=int, help="with --params/--model: LoRA adapters cross, not the weights")
    plan_p.add_argument("--device-flops", type=float, help="effective FLOP/s of one node's device, e.g. 4e14")
    plan_p.add_argument("--tokens-per-step", type=float, help="tokens (or samples) per node and step")
    plan_p.add_argument("--steps", type=int, help="the run's steps per node (default: the calibrating run's)")
    plan_p.add_argument("--calibrate-steps", type=int, default=8, help="steps of the short run (a config)")
    plan_p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="check the calibration: predict these measured runs (repeatable; repeats count as their median)",
    )
    plan_p.add_argument("--out", help="folder for plan.json and plan.png (default: none written)")
    assets_p = sub.add_parser("assets", help="list or fetch the bundled pretrained models and datasets")
    assets_p.add_argument("action", choices=["list", "fetch"])
    assets_p.add_argument("names", nargs="*", help="assets to fetch (default: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a bad command line, already reported in one line (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    from raylowcomm.env import set_hub_defaults

    set_hub_defaults()  # before anything loads a model or dataset
    commands = {"run": _run, "tune": _tune, "bench": _bench, "report": _report, "plan": _plan, "assets": _assets}
    return commands[args.command](args)


def _plan_models() -> list[str]:
    from raylowcomm.planner import MODELS

    return list(MODELS)


def _plan(args) -> int:
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import as_json, check, check_table, link_of, plan, plot, table
    from raylowcomm.planner.calibrate import merge_repeats

    try:
        nodes, links, target = _plan_inputs(args)
        against = _against_inputs(args) if args.against else None  # before a config's short run starts Ray
        costs = merge_repeats(_plan_costs(args))
        if against is not None:
            runs, (rate, bits) = against
            rows = check(costs, runs, link_of(bits, args.latency))
            if not rows:
                raise ConfigError("--against", ",".join(args.against), "no run there ran as a calibrating run did")
        else:
            rows = plan(costs, nodes, links, args.latency, target)
    except (ConfigError, ValueError) as err:
        return _fail(err)
    print(check_table(rows, rate) if against is not None else table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if against is not None:
            (out / "check.json").write_text(json.dumps(rows, indent=2))
            print(f"plan: {out / 'check.json'}")
        else:
            (out / "plan.json").write_text(json.dumps(as_json(rows), indent=2))
            plot(rows, out / "plan.png")
            print(f"plan: {out / 'plan.json'}, {out / 'plan.png'}")
    return 0


def _against_inputs(args) -> tuple[list, tuple[str, float]]:
    """`plan --against`: the measured runs' costs and the link they met (`--link`, or the rate their
    `bench wan` folder was shaped to), or a ConfigError naming the flag."""
    from raylowcomm.bench import rate_bits
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import bench_run, load_source

    for flag, value in (("--params", args.params), ("--model", args.model), ("--steps", args.steps)):
        if value is not None:
            raise ConfigError(flag, value, "--against checks the runs as they ran: leave it out")
    if len(args.link) > 1:
        raise ConfigError("--link", ",".join(args.link), "--against checks runs over one link: give it once")
    runs, rates = [], set()
    for name in args.against:
        folder = Path(name)
        try:
            runs += load_source(folder)
        except (FileNotFoundError, KeyError) as err:
            raise ConfigError("--against", name, f"cannot read a run from it: {err}") from None
        rates.add(bench_run(folder).get("rate"))
    if args.link:
        rate = args.link[0]
    elif len(rates) == 1 and None not in rates:
        rate = rates.pop()  # the rate their `bench wan` shaped
    else:
        raise ConfigError("--link", None, "give the rate the --against runs met, e.g. --link 100mbit")
    return runs, (rate, rate_bits(rate))


def _plan_inputs(args):
    """The node counts, links and target model of `raylowcomm plan`, or a ConfigError naming the flag."""
    from raylowcomm.bench import rate_bits
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import MODELS, Target

    try:
        nodes = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        raise ConfigError("--nodes", args.nodes, "give node counts, comma-separated, e.g. 2,4,8") from None
    if min(nodes) < 1:
        raise ConfigError("--nodes", args.nodes, "every count must be >= 1")
    links = [(rate, rate_bits(rate)) for rate in args.link or ["100mbit"]]
    if args.device_flops is not None and (not (args.params or args.model) or args.tokens_per_step is None):
        raise ConfigError(
            "--device-flops", args.device_flops, "needs the model's size (--params or --model) and --tokens-per-step"
        )
    shape = MODELS.get(args.model) if args.model else None
    if args.model and shape is None:
        raise ConfigError("--model", args.model, f"choose one of {', '.join(MODELS)}, or give --params")
    if args.lora_rank is not None and shape is None:
        raise ConfigError("--lora-rank", args.lora_rank, "counts the adapters of a known decoder: give --model")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("--steps", args.steps, "must be >= 1")
    adapters = shape.lora_params(args.lora_rank) if shape and args.lora_rank else None
    target = Target(shape.params if shape else args.params, adapters, args.device_flops, args.tokens_per_step)
    return nodes, links, target


def _plan_costs(args) -> list:
    """Each source's calibrated costs: a run folder's record, or a config's short run here."""
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import load_source

    costs = []
    for name in args.sources:
        source = Path(name)
        try:
            if source.is_dir():
                found = load_source(source)
            else:
                from raylowcomm.planner.short_run import calibrate_config

                found = calibrate_config(source, args.calibrate_steps)
        except (FileNotFoundError, KeyError) as err:
            raise ConfigError("CONFIG_OR_RUN_DIR", name, f"cannot calibrate from it: {err}") from None
        if not found:
            raise ConfigError("CONFIG_OR_RUN_DIR", name, "no finished strategy to calibrate from")
        costs += [c.for_steps(args.steps) for c in found]
    return costs


def _assets(args) -> int:
    from raylowcomm import assets

    for name in args.names or list(assets.ASSETS):
        if name not in assets.ASSETS:
            return _fail(f"unknown asset {name!r}; known: {', '.join(assets.ASSETS)}")
    for name in args.names or list(assets.ASSETS):
        a = assets.ASSETS[name]
        if args.action == "fetch":
            try:
                print(f"{name}: {assets.fetch(name)}")
            except assets.AssetError as err:
                print(f"error: {_one_line(err)}", file=sys.stderr)
                return 1
        else:
            print(f"{name:20s} {a.kind:5s} {'cached' if a.ready() else 'not cached':10s} {a.about}")
    return 0


def _bench(args) -> int:
    from raylowcomm import assets
    from raylowcomm.bench import BenchError, bench_local, bench_wan, check_wan_prerequisites, wan_runs
    from raylowcomm.cluster import ClusterError
    from raylowcomm.config import ConfigError
    from raylowcomm.strategies import load_config

    try:
        if args.mode == "local" and args.rates:
            raise ConfigError("--rate", args.rates, "only `bench wan` shapes a link; drop --rate for `bench local`")
        if args.mode == "local" and args.hosts != 2:
            raise ConfigError("--hosts", args.hosts, "only `bench wan` makes hosts; drop --hosts for `bench local`")
        if args.hosts < 2:
            raise ConfigError("--hosts", args.hosts, "a link needs two hosts at least: give 2 or more")
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
        return _fail(err)
    except ClusterError as err:
        print(f"error: the cluster failed (it has been torn down): {_one_line(err)}", file=sys.stderr)
        return 1
    except BenchError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
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


def _report(args) -> int:
    from raylowcomm.report import ReportError, write_report

    if not 0 < args.target_fraction <= 1:
        return _fail(f"--target-fraction = {args.target_fraction}: must be in (0, 1], e.g. 0.95")
    if not Path(args.dir).is_dir():
        what = "is a file" if Path(args.dir).exists() else "does not exist"
        return _fail(f"report DIR {args.dir!r} {what}: give a folder written by `raylowcomm run` or `raylowcomm bench`")
    try:
        path = write_report(args.dir, args.target_fraction)
    except (ReportError, OSError, ValueError, KeyError) as err:
        return _fail(f"cannot build a report from {args.dir}: {err}")
    print(path.read_text())
    print(f"report: {path}")
    return 0


def _tune(args) -> int:
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
        return _fail(err)
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


def _run(args) -> int:
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
        return _fail(err)
    except KeyboardInterrupt:  # the running strategy's actors were released on the way out
        print(
            f"error: interrupted; the running strategy's actors were released; strategies that finished, if any, "
            f"are in {Path(cfg.out_dir) / ('seed_<s>/results.json' if seeds else 'results.json')}"
            + (f"; continue with --resume {cfg.out_dir} --seeds {args.seeds}" if seeds else ""),
            file=sys.stderr,
        )
        return 130
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
