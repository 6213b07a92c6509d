"""The `raylowcomm` command line: one builder per command, and the numbers its flags take. A
numeric flag's `type` is a `Number`: what is not a number is refused as the line is parsed, and a
number out of its range (`plan --params 0`, `--latency -50`, `--lora-rank 0`, nan) by
`check_numbers` right after, as a ConfigError naming the flag and what to give: exit code 2 and one
`error:` line, before any file is read or Ray starts. Nothing heavy is imported here."""

from __future__ import annotations

import argparse
import math


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one `error:` line (exit 2), not usage plus message."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {one_line(message)}; see `{self.prog} --help`\n")


def one_line(text) -> str:
    return " ".join(str(text).split())


class Number:
    """The `type` of a numeric flag: an int or a float, finite, at least `low` (above it with
    `above`), at most `high`. Parsing converts (what is not a number is refused naming the flag, as
    argparse prefixes `argument --flag:`); `check_numbers` holds the value to the range."""

    def __init__(self, kind: type, low: float, example: str, above: bool = False, high: float | None = None):
        self.kind, self.low, self.example, self.above, self.high = kind, low, example, above, high
        self.__name__ = "an integer" if kind is int else "a number"  # what argparse calls the type

    @property
    def rule(self) -> str:
        """'an integer >= 1, e.g. 8', 'a number > 0, e.g. 8e9', 'a number in (0, 1], e.g. 0.95'."""
        if self.high is not None:
            return f"{self.__name__} in {'(' if self.above else '['}{self.low:g}, {self.high:g}], e.g. {self.example}"
        return f"{self.__name__} {'>' if self.above else '>='} {self.low:g}, e.g. {self.example}"

    def allows(self, value: float) -> bool:
        return (
            math.isfinite(value)
            and (value > self.low if self.above else value >= self.low)
            and (self.high is None or value <= self.high)
        )

    def __call__(self, text: str):
        try:
            return self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.__name__}: give {self.rule}") from None


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser (run, tune, bench, report, plan, assets)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every numeric flag the command was given in its range (its `Number`), or a ConfigError naming
    the flag, the value and the range: one line, exit code 2, as a bad config field is."""
    from raylowcomm.config import ConfigError

    for action in command_parsers(parser)[args.command]._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action.type, Number) and value is not None and not action.type.allows(value):
            raise ConfigError(action.option_strings[-1], value, f"give {action.type.rule}")


COUNT = Number(int, 1, "8")
POSITIVE = Number(float, 0, "8e9", above=True)


def _add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raylowcomm", description="Low-communication fine-tuning on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_run, _tune, _bench, _report, _plan, _assets):
        add(sub)
    return parser


def _run(sub) -> None:
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


def _tune(sub) -> None:
    tune_p = sub.add_parser("tune", help="sweep config fields with Ray Tune (a sweep file: see tune_configs/)")
    tune_p.add_argument("sweep")
    _add_overrides(tune_p, "override a field of the sweep's base config for every trial (repeatable)")
    tune_p.add_argument("--storage-path", help="where Tune writes the sweep (default: the sweep file's storage_path)")


def _bench(sub) -> None:
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
        "--hosts",
        type=Number(int, 2, "4"),
        default=2,
        help="wan: hosts, one node actor, DDP worker or stage each (default 2)",
    )
    bench_p.add_argument(
        "--repeats",
        type=COUNT,
        default=1,
        help="wan: run every rate this many times, every other repeat in reverse order (1g 100m 100m 1g), "
        "so that a rate's repeats and their median meet the machine at the same times as the other rate's",
    )
    _add_overrides(bench_p, "override a config field (repeatable)")
    bench_p.add_argument("--out", help="output directory (default: the config's out_dir)")


def _report(sub) -> None:
    report_p = sub.add_parser(
        "report",
        help="rebuild report.md and the curve plots of a bench, run or multi-seed run (run --seeds) directory "
        "from its saved results",
    )
    report_p.add_argument("dir")
    report_p.add_argument(
        "--target-fraction",
        type=Number(float, 0, "0.95", above=True, high=1),
        default=0.95,
        help="target = this fraction of DDP's final accuracy (for a loss: DDP's final / it)",
    )


def _plan(sub) -> None:
    from raylowcomm.planner import MODELS

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
    plan_p.add_argument("--latency", type=Number(float, 0, "20"), default=0.0, metavar="MS", help="one-way latency, ms")
    size = plan_p.add_mutually_exclusive_group()
    size.add_argument("--params", type=POSITIVE, help="another model's parameters, e.g. 8e9")
    size.add_argument("--model", help="a known decoder's size instead: " + ", ".join(MODELS))
    plan_p.add_argument(
        "--lora-rank", type=Number(int, 1, "16"), help="with --model: LoRA adapters of this rank cross, not the weights"
    )
    plan_p.add_argument(
        "--device-flops", type=Number(float, 0, "4e14", above=True), help="effective FLOP/s of one node's device"
    )
    plan_p.add_argument(
        "--tokens-per-step", type=Number(float, 0, "16384", above=True), help="tokens (or samples) per node and step"
    )
    plan_p.add_argument("--steps", type=COUNT, help="the run's steps per node (default: the calibrating run's)")
    plan_p.add_argument("--calibrate-steps", type=COUNT, default=8, help="steps of the short run (a config)")
    plan_p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="check the calibration: predict these measured runs (repeatable; repeats count as their median)",
    )
    plan_p.add_argument("--out", help="folder for plan.json and plan.png (default: none written)")


def _assets(sub) -> None:
    assets_p = sub.add_parser("assets", help="list or fetch the bundled pretrained models and datasets")
    assets_p.add_argument("action", choices=["list", "fetch"])
    assets_p.add_argument("names", nargs="*", help="assets to fetch (default: all)")
