"""`raylowcomm plan`: its inputs checked flag by flag (a bad one is a ConfigError naming the flag),
the sources calibrated (a run folder's results.json, read through raylowcomm.common.files, or a
config's short run), then the table, plan.json and plan.png, or the check against measured runs."""

from __future__ import annotations

import json
from pathlib import Path


def plan_command(args) -> int:
    """`raylowcomm plan`: the table (or the check against measured runs), and plan.json and plan.png
    with --out; a bad flag or source is one `error:` line and exit code 2, before a short run starts Ray."""
    from raylowcomm.cli.commands import fail
    from raylowcomm.common.files import FileError
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
    except (ConfigError, FileError) as err:
        return fail(err)
    print(check_table(rows, rate) if against is not None else table(rows))  # the command's output
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


def _read_run(folder: Path, flag: str, name: str) -> list:
    """A run folder's costs (planner.load_source), or a ConfigError naming `flag` and the folder; a
    damaged results.json or bench.json there is named in it (raylowcomm.common.files)."""
    from raylowcomm.common.files import FileError
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import load_source

    try:
        return load_source(folder)
    except (FileError, FileNotFoundError, KeyError, TypeError) as err:
        raise ConfigError(flag, name, f"cannot read a run from it: {err}") from None


def _against_inputs(args) -> tuple[list, tuple[str, float]]:
    """`plan --against`: the measured runs' costs and the link they met (`--link`, or the rate their
    `bench wan` folder was shaped to), or a ConfigError naming the flag."""
    from raylowcomm.bench import rate_bits
    from raylowcomm.common.files import FileError
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import bench_run

    for flag, value in (("--params", args.params), ("--model", args.model), ("--steps", args.steps)):
        if value is not None:
            raise ConfigError(flag, value, "--against checks the runs as they ran: leave it out")
    if len(args.link) > 1:
        raise ConfigError("--link", ",".join(args.link), "--against checks runs over one link: give it once")
    runs, rates = [], set()
    for name in args.against:
        runs += _read_run(Path(name), "--against", name)
        try:
            rates.add(bench_run(Path(name)).get("rate"))
        except FileError as err:
            raise ConfigError("--against", name, f"cannot read its bench: {err}") from None
    if args.link:
        rate = args.link[0]
    elif len(rates) == 1 and None not in rates:
        rate = rates.pop()  # the rate their `bench wan` shaped
    else:
        raise ConfigError("--link", None, "give the rate the --against runs met, e.g. --link 100mbit")
    return runs, (rate, rate_bits(rate, "--link"))


def _plan_inputs(args):
    """The node counts, links and target model of `raylowcomm plan`, or a ConfigError naming the flag
    (the numbers' ranges are checked as the line is parsed: cli.args.Number)."""
    from raylowcomm.bench import rate_bits
    from raylowcomm.config import ConfigError
    from raylowcomm.planner import MODELS, Target

    try:
        nodes = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        raise ConfigError("--nodes", args.nodes, "give node counts, comma-separated, e.g. 2,4,8") from None
    if min(nodes) < 1:
        raise ConfigError("--nodes", args.nodes, "every count must be >= 1")
    links = [(rate, rate_bits(rate, "--link")) for rate in args.link or ["100mbit"]]
    if args.device_flops is not None and (not (args.params or args.model) or args.tokens_per_step is None):
        raise ConfigError(
            "--device-flops", args.device_flops, "needs the model's size (--params or --model) and --tokens-per-step"
        )
    shape = MODELS.get(args.model) if args.model else None
    if args.model and shape is None:
        raise ConfigError("--model", args.model, f"choose one of {', '.join(MODELS)}, or give --params")
    if args.lora_rank is not None and shape is None:
        raise ConfigError("--lora-rank", args.lora_rank, "counts the adapters of a known decoder: give --model")
    adapters = shape.lora_params(args.lora_rank) if shape and args.lora_rank is not None else None
    target = Target(shape.params if shape else args.params, adapters, args.device_flops, args.tokens_per_step)
    return nodes, links, target


def _plan_costs(args) -> list:
    """Each source's calibrated costs: a run folder's record, or a config's short run here."""
    from raylowcomm.config import ConfigError

    costs = []
    for name in args.sources:
        source = Path(name)
        if source.is_dir():
            found = _read_run(source, "CONFIG_OR_RUN_DIR", name)
        else:
            from raylowcomm.planner.short_run import calibrate_config

            try:
                found = calibrate_config(source, args.calibrate_steps)
            except (FileNotFoundError, KeyError) as err:
                raise ConfigError("CONFIG_OR_RUN_DIR", name, f"cannot calibrate from it: {err}") from None
        if not found:
            raise ConfigError("CONFIG_OR_RUN_DIR", name, "no finished strategy to calibrate from")
        costs += [c.for_steps(args.steps) for c in found]
    return costs
