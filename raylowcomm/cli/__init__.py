"""raylowcomm run | tune | bench | report | plan | assets.

Bad input of any kind — a command line argparse rejects, a number out of its flag's range, a
config or sweep file, a field, an output folder, a damaged file a command reads (results.json,
bench.json, seeds.json, a checkpoint a resume continues from) — ends the command with exit code 2
and one line on stderr, `error: ...`, naming the field, flag or file and the fix, before Ray
starts. Heavy modules load only once the command line is parsed, after the Hugging Face loaders
are defaulted to offline (raylowcomm/env.py).

`args` builds the command line, `commands` runs run, tune, bench, report and assets, `plan` the
planner's command.
"""

from __future__ import annotations

import sys

from raylowcomm.cli.args import build_parser, check_numbers
from raylowcomm.cli.commands import (
    assets_command,
    bench_command,
    check_out_dir,
    fail,
    parse_seeds,
    report_command,
    run_command,
    tune_command,
)
from raylowcomm.cli.plan import plan_command

__all__ = ["build_parser", "check_out_dir", "main", "parse_seeds"]


def main(argv: list[str] | None = None) -> int:
    """The `raylowcomm` command: parse `argv` (the process's arguments by default), hold every number
    to its flag's range, and run the command; returns the exit code (2: bad input, said in one line)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0), or a bad command line, already reported in one line (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    from raylowcomm.config import ConfigError
    from raylowcomm.env import set_hub_defaults

    try:
        check_numbers(parser, args)
    except ConfigError as err:
        return fail(err)

    set_hub_defaults()  # before anything loads a model or dataset
    commands = {
        "run": run_command,
        "tune": tune_command,
        "bench": bench_command,
        "report": report_command,
        "plan": plan_command,
        "assets": assets_command,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
