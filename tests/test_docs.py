"""The docs keep up with the code: the configuration reference is what the generator writes now,
every config field has a docstring, every relative link resolves, and every command the README
and docs/ show still works. Config commands are loaded and validated, not run (no Ray starts);
the cheap ones (`raylowcomm --help`, `raylowcomm assets list`, the reference check) run for real."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

from raylowcomm import configref

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```(\S*)")


def _blocks(path: Path) -> tuple[list[tuple[str, int, list[str]]], list[tuple[int, str]]]:
    """A page's fenced blocks (info string, first line number, lines) and its prose lines."""
    blocks, prose, current = [], [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if current is None and fence:
            current = (fence.group(1), number + 1, [])
        elif current is not None and fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
        else:
            prose.append((number, line))
    return blocks, prose


def _shell_lines(info: str, first: int, lines: list[str]) -> list[tuple[int, str, str | None]]:
    """(line, command, the error line the docs show after it or None) for one shell block. In a
    console block commands follow `$ `; elsewhere every line is one, `\\` continuing it."""
    found: list[tuple[int, str, str | None]] = []
    pending, start = "", first
    for number, line in enumerate(lines, first):
        if info == "console":
            if line.startswith("$ "):
                found.append((number, line[2:], None))
            elif line.startswith("error: ") and found:
                found[-1] = (found[-1][0], found[-1][1], line)
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((start, pending + line, None))
        pending = ""
    return found


PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.yaml)?$|<|\.\.\.")


def _inline_commands(prose: list[tuple[int, str]]) -> list[tuple[int, str, None]]:
    """`raylowcomm ... x.yaml ...` spans in the prose (they may wrap lines); not mentions such as
    `raylowcomm run`, nor spans with placeholders such as CONFIG or <sweep>."""
    text = "\n".join(line for _, line in prose)
    numbers = [number for number, _ in prose]
    found = []
    for match in re.finditer(r"`(raylowcomm [^`]+)`", text):
        tokens = shlex.split(match.group(1))
        if any(t.endswith(".yaml") for t in tokens) and not any(PLACEHOLDER.search(t) for t in tokens):
            found.append((numbers[text.count("\n", 0, match.start())], " ".join(match.group(1).split()), None))
    return found


def _commands() -> list[tuple[str, list[str], str | None]]:
    """Every command the pages show, once each: (where, argv, expected error line)."""
    seen, out = set(), []
    for path in PAGES:
        blocks, prose = _blocks(path)
        found = [c for info, first, lines in blocks if info in SHELL_BLOCKS for c in _shell_lines(info, first, lines)]
        for number, command, error in found + _inline_commands(prose):
            argv = shlex.split(command, comments=True)
            if argv and (tuple(argv), error) not in seen:
                seen.add((tuple(argv), error))
                out.append((f"{path.relative_to(ROOT)}:{number}", argv, error))
    return out


COMMANDS = _commands()


def shown_python(page: str, containing: str) -> dict:
    """The names a page's python block holding `containing` defines, the block run as the page shows it."""
    path = ROOT / page
    found = [
        (first, lines)
        for info, first, lines in _blocks(path)[0]
        if info == "python" and any(containing in line for line in lines)
    ]
    assert len(found) == 1, f"{page}: {len(found)} python blocks hold {containing!r}"
    first, lines = found[0]
    module = types.ModuleType(f"shown_{path.stem.replace('-', '_')}_{first}")
    sys.modules[module.__name__] = module  # where dataclasses look a class's module up
    exec(compile("\n" * (first - 1) + "\n".join(lines), str(path), "exec"), module.__dict__)
    return module.__dict__


# --- the configuration reference ---------------------------------------------------------------


def test_configuration_reference_is_what_the_generator_writes():
    assert configref.PAGE.read_text() == configref.render(), (
        "docs/configuration.md is stale: run `python -m raylowcomm.configref` and commit the page"
    )


@dataclasses.dataclass
class _NewOptions:
    rate: float = 0.5
    """A field someone has just added."""


class _NewStrategy:
    name = "new_strategy"
    Config = _NewOptions


def test_a_field_added_without_regenerating_fails_the_check(monkeypatch, capsys):
    assert configref.main(["--check"]) == 0
    monkeypatch.setitem(configref.STRATEGIES, _NewStrategy.name, _NewStrategy)
    assert "`new_strategy.rate` | `float` | `0.5` | A field someone has just added. |" in configref.render()
    assert configref.main(["--check"]) == 1
    assert capsys.readouterr().err.count("\n") == 1  # one line, naming the command that fixes it


def test_every_config_field_has_a_docstring():
    missing = [
        f"{path or 'top level'}.{f.name} ({cls.__module__}.{cls.__qualname__})"
        for path, cls in configref.sections()
        for f in configref.config_fields(cls)
        if f.name not in configref.field_docs(cls)
    ]
    assert not missing, "write a docstring right after each of these fields: " + ", ".join(missing)


# --- links -------------------------------------------------------------------------------------


def _slugs(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (a repeated heading gets -1, -2, ...)."""
    slugs: set[str] = set()
    for _, line in _blocks(path)[1]:
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = base = configref.anchor(heading.group(1).replace("`", "").strip())
            n = 0
            while slug in slugs:
                n += 1
                slug = f"{base}-{n}"
            slugs.add(slug)
    return slugs


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    prose = "\n".join(line for _, line in _blocks(path)[1])
    prose = re.sub(r"`[^`]*`", "", prose)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in _slugs(linked):
            broken.append(f"{target} (no heading #{fragment} in {linked.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


# --- commands ----------------------------------------------------------------------------------


def test_ci_runs_the_readme_install_and_test_commands():
    shown = {" ".join(argv) for where, argv, _ in COMMANDS if where.startswith("README.md")}
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("pip install -e .[test]", "pytest"):
        assert command in shown, f"README.md no longer shows `{command}`"
    assert "pip install -e '.[test]'" in ci and "\npytest\n" in ci


def _raylowcomm(argv: list[str]) -> None:
    """Parse as the CLI does; load and validate what a run, sweep or bench would (no Ray)."""
    from raylowcomm.cli import build_parser, main

    if "--help" in argv or argv == ["assets", "list"]:  # cheap: run them
        assert main(argv) == 0
        return
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"the CLI rejects `raylowcomm {shlex.join(argv)}` (exit {exit_.code})")
    if args.command == "run":
        from raylowcomm.cli import parse_seeds
        from raylowcomm.strategies import load_config

        load_config(args.config, args.overrides)
        if args.seeds is not None:
            parse_seeds(args.seeds)
    elif args.command == "tune":
        from raylowcomm.tune import load_sweep

        load_sweep(args.sweep, args.overrides)
    elif args.command == "bench":
        from raylowcomm.bench import rate_bits, wan_config, wan_runs
        from raylowcomm.strategies import load_config

        cfg = load_config(args.config, args.overrides)
        if args.mode == "wan":
            wan_config(cfg, args.hosts)
            wan_runs(args.rates, args.repeats)
        for rate in args.rates:
            rate_bits(rate)
    elif args.command == "assets":
        from raylowcomm.assets import ASSETS

        assert set(args.names) <= set(ASSETS), f"unknown assets: {set(args.names) - set(ASSETS)}"


def _python(argv: list[str]) -> None:
    """`python -m module ...` or `python script.py ...`: the source exists and takes every flag shown."""
    if argv[0] == "-m":
        spec = importlib.util.find_spec(argv[1])
        assert spec is not None and spec.origin, f"no module {argv[1]}"
        source, rest = Path(spec.origin), argv[2:]
        if spec.submodule_search_locations:  # python -m package: its __main__
            source = source.parent / "__main__.py"
    else:
        source, rest = ROOT / argv[0], argv[1:]
    assert source.exists(), f"{source} does not exist"
    if argv[:2] == ["-m", "raylowcomm.configref"] and "--check" in rest:  # cheap, and writes nothing
        assert configref.main(rest) == 0
        return
    if "--" in rest:  # a wrapper: python -m raylowcomm.cluster ... -- raylowcomm run ...
        rest, inner = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
        _check(inner)
    text = source.read_text()
    unknown = [flag.split("=")[0] for flag in rest if flag.startswith("--") and f'"{flag.split("=")[0]}"' not in text]
    assert not unknown, f"{source.relative_to(ROOT)} takes no {', '.join(unknown)}"


def _check(argv: list[str], pytestconfig=None) -> None:
    while argv and (re.match(r"^[A-Z_]+=", argv[0]) or argv[0] == "sudo"):  # env assignments, sudo
        argv = argv[1:]
    program, rest = argv[0], argv[1:]
    if program == "raylowcomm":
        _raylowcomm(rest)
    elif program == "python":
        _python(rest)
    elif program == "pip":
        assert rest[:2] == ["install", "-e"], f"pip {shlex.join(rest)}"
        extra = re.fullmatch(r"\.(?:\[(\w+)\])?", rest[2])
        assert extra, f"pip install -e {rest[2]}: install the repository itself"
        if extra.group(1):
            assert f"\n{extra.group(1)} = [" in (ROOT / "pyproject.toml").read_text(), f"no extra {extra.group(1)!r}"
    elif program == "pytest":
        if "-m" in rest and pytestconfig is not None:
            declared = {m.split(":")[0].strip() for m in pytestconfig.getini("markers")}
            words = set(re.findall(r"\w+", rest[rest.index("-m") + 1])) - {"not", "and", "or"}
            assert words <= declared, f"undeclared markers: {words - declared}"
    elif program == "ray":
        if "--" in rest:  # ray job submit ... -- <the entrypoint>
            _check(rest[rest.index("--") + 1 :])
        else:
            assert rest[0] in ("start", "up", "down"), f"ray {rest[0]}: a command these docs do not check yet"
    elif program != "tensorboard":
        pytest.fail(f"`{program}`: no check for this program yet; add one to tests/test_docs.py")


@pytest.mark.parametrize("where,argv,error", COMMANDS, ids=[f"{w} {shlex.join(a)[:70]}" for w, a, _ in COMMANDS])
def test_shown_command_works(where, argv, error, pytestconfig):
    from raylowcomm.config import ConfigError

    if error is None:
        _check(argv, pytestconfig)
        return
    with pytest.raises(ConfigError) as raised:
        _check(argv, pytestconfig)
    assert f"error: {raised.value}" == error, f"{where}: the docs show another message than the code gives"


def test_the_docs_show_commands():
    """The extraction itself: if it found nothing, the test above would check nothing."""
    programs = {argv[0] for _, argv, _ in COMMANDS}
    assert {"raylowcomm", "python", "pip", "pytest"} <= programs
    assert any(error for _, _, error in COMMANDS)


# --- the python the docs show -------------------------------------------------------------------


def test_the_smallest_strategy_shown_registers_loads_typed_and_runs(monkeypatch, tmp_path):
    from raylowcomm import strategies
    from raylowcomm.runner import prepare
    from raylowcomm.tasks import make_task, score_sets

    shown = shown_python("docs/python-api.md", "class Pretrained(")
    pretrained = shown["Pretrained"]
    monkeypatch.setitem(strategies.STRATEGIES, "pretrained", pretrained)  # the registry's one line
    cfg = strategies.from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 64, "test_size": 60, "image_size": 16},
            "optim": {"batch_size": 16},
            "strategies": ["pretrained"],
            "pretrained": {"batch_size": 25},
        }
    )
    opts = pretrained.opts(cfg)
    assert isinstance(opts, shown["PretrainedConfig"]) and opts.batch_size == 25
    ctx = prepare(cfg, tmp_path)  # no Ray: it starts no actor
    rec = pretrained().run(ctx.for_strategy(ctx.report)).to_dict()
    model = ctx.load_driver_weights()
    assert rec["metrics"] == score_sets(make_task(ctx.data.task), model, ctx.eval_sets(val=False), 25)
    assert rec["comm"]["total_bytes"] == 0 and rec["weights"].endswith("pretrained/model.safetensors")


def test_the_smallest_aggregator_shown_combines_decoded_payloads():
    """docs/python-api.md's median, through `average_decoded` on int8 payloads of three nodes: each
    coordinate is the middle node's decoded value, and the mean's path is not taken."""
    import torch

    from raylowcomm.core.aggregation import average_decoded
    from raylowcomm.core.compression import layout_of, make_codec

    median = shown_python("docs/python-api.md", "class Median")["Median"]()
    codec, nodes = make_codec("int8", 64), [torch.full((3, 5), v) for v in (1.0, 9.0, 2.0)]
    nodes[2][0, 0] = 100.0  # one node far off in one coordinate: the median keeps the middle value
    payloads = [codec.encode({"w": t}) for t in nodes]
    decoded = [codec.decode(p, layout_of({"w": nodes[0]}), dtype=torch.float64)["w"] for p in payloads]
    got = average_decoded(codec, payloads, layout_of({"w": nodes[0]}), [1.0, 1.0, 1.0], torch.float64, median)
    assert torch.equal(got["w"], torch.stack(decoded).median(dim=0).values)
    assert got["w"][0, 0] == decoded[1][0, 0] and got["w"][1, 1] == decoded[2][1, 1]


def test_the_round_policy_shown_lands_a_round_of_one_on_a_quorum_of_one():
    """docs/python-api.md's policy block: both nodes get a segment to the first boundary; node 0's payload
    alone makes the quorum, lands as round 1 with its node's weight, and node 0 goes on to the next
    boundary, landing round 1 first. No Ray and no torch: the policy is plain Python."""
    from raylowcomm.core.rounds.events import Assign, Land, Progress, Wait

    started, arrived, ticked = shown_python("docs/python-api.md", "def first_round_of_two_nodes")[
        "first_round_of_two_nodes"
    ]()
    assert [(type(d), getattr(d, "node", None), getattr(d, "until", None)) for d in started] == [
        (Assign, 0, 4),
        (Assign, 1, 4),
        (Wait, None, None),
    ]
    assert arrived == []
    land, assign, progress, wait = ticked
    assert isinstance(land, Land) and [a.node for a in land.round.payloads] == [0] and land.round.weights == [1.0]
    assert land.round.payloads[0].payload == "node 0's payload" and land.round.number == 1
    assert isinstance(assign, Assign) and (assign.node, assign.until, assign.catch_up) == (0, 8, [land.round])
    assert progress == Progress(2) and wait == Wait(None)  # 4 node-steps over 2 nodes; nobody else due yet
