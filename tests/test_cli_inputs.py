"""What the commands are given beyond a config: every number a flag takes is range-checked under the
flag's own name, every file a command reads (results.json, bench.json, seeds.json, a checkpoint a
resume continues from, a state file's JSON) passes raylowcomm.common.files. Each bad input: exit
code 2 and one `error:` line naming the flag or file and the fix, before Ray starts. No Ray, no
model: these tests are fast. (The plan's own flags: tests/planner; a sweep's metric: test_tune.py.)"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from raylowcomm.cli import build_parser, main
from raylowcomm.cli.args import Number, check_numbers, command_parsers
from raylowcomm.common.files import FileError, parse_json, read_records, safetensors_problem
from raylowcomm.storage import Storage
from tests.planner.test_planner import ddp_record
from tests.test_cli_errors import _config
from tests.test_cli_errors import no_ray as no_ray  # a fixture, used by its name

# ------------------------------------------------------------------------------- numeric flags

POSITIONALS = {"plan": ["run_dir"], "bench": ["wan", "cfg.yaml"], "report": ["dir"]}
"""What each command needs besides a flag, for the parser to reach the flag."""


def numeric_flags() -> list[tuple[str, argparse.Action]]:
    """(command, action) of every option of every command whose value is a number (by its type or
    its default), found by walking `build_parser`, so that a flag added later is checked too."""
    found = []
    for command, sub in command_parsers(build_parser()).items():
        for action in sub._actions:
            numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            if action.option_strings and (
                numeric_default or isinstance(action.type, Number) or action.type in (int, float)
            ):
                found.append((command, action))
    return found


def out_of_range(rule: Number) -> list[str]:
    """Values `rule` must refuse: below or at its low end, above its high end, not finite, not a number."""
    below = rule.low if rule.above else rule.low - 1
    values = [repr(below), "nan", "inf", "-inf", "many"] + ([repr(rule.high + 1)] if rule.high is not None else [])
    return values + (["1.5"] if rule.kind is int else [])


NUMERIC = numeric_flags()
INTEGER_FLAGS = {(c, a.option_strings[-1]) for c, a in NUMERIC if isinstance(a.type, Number) and a.type.kind is int}
BAD_NUMBERS = [
    (command, action.option_strings[-1], value)
    for command, action in NUMERIC
    if isinstance(action.type, Number)
    for value in out_of_range(action.type)
]


def test_the_walk_finds_every_numeric_flag_and_each_is_range_checked():
    """A numeric flag with a bare int/float type (or a numeric default and no checked type) would take
    0, -50 or nan silently, as --params 0 and --lora-rank 0 once did."""
    found = {(c, a.option_strings[-1]) for c, a in NUMERIC}
    assert {
        ("plan", "--params"),
        ("plan", "--lora-rank"),
        ("plan", "--latency"),
        ("report", "--target-fraction"),
    } <= found
    assert {("bench", "--hosts"), ("bench", "--repeats"), ("plan", "--steps"), ("plan", "--calibrate-steps")} <= found
    unchecked = [f"{c} {a.option_strings[-1]}" for c, a in NUMERIC if not isinstance(a.type, Number)]
    assert not unchecked, f"numeric flags without a range (cli.args.Number): {unchecked}"


@pytest.mark.parametrize("command, flag, value", BAD_NUMBERS, ids=[f"{c}{f}={v}" for c, f, v in BAD_NUMBERS])
def test_a_number_out_of_its_flags_range_is_one_line_naming_the_flag(capsys, no_ray, command, flag, value):
    assert main([command, *POSITIONALS.get(command, []), f"{flag}={value}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    kind = int if (command, flag) in INTEGER_FLAGS else float
    try:
        kind(value)
    except ValueError:  # not a number (of its kind): the parser says so
        assert f"argument {flag}: {value!r} is not" in lines[0], lines[0]
    else:  # a number out of its range: a ConfigError, as a config field's
        assert f"config field '{flag}' = " in lines[0] and " is invalid: give " in lines[0], lines[0]
    assert "e.g. " in lines[0], lines[0]


@pytest.mark.parametrize("command, action", NUMERIC, ids=[f"{c}{a.option_strings[-1]}" for c, a in NUMERIC])
def test_each_numeric_flag_takes_its_own_example(command, action):
    """The ranges refuse what they must, not everything: each flag's example parses to its number."""
    rule, parser = action.type, build_parser()
    args = parser.parse_args([command, *POSITIONALS.get(command, []), f"{action.option_strings[-1]}={rule.example}"])
    check_numbers(parser, args)
    value = getattr(args, action.dest)
    assert value == rule.kind(rule.example) and math.isfinite(value)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_bench_budget_seconds_are_checked(tmp_path, capsys, no_ray, value):
    assert main(["bench", "local", _config(tmp_path), f"--budget-s={value}"]) == 2
    assert "'--budget-s'" in capsys.readouterr().err


# --------------------------------------------------------------------------- files a command reads


def _tensors(path: Path) -> bytes:
    """A real safetensors file (two tensors, raylowcomm metadata) at `path`; its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.zeros(3), "b": torch.ones(2, 2)}, str(path), metadata={"raylowcomm": "{}"})
    return path.read_bytes()


def _problem(data: bytes) -> str | None:
    return safetensors_problem(lambda offset, n: data[offset : offset + n], len(data))


def test_a_safetensors_header_tells_a_whole_file_from_a_cut_or_damaged_one(tmp_path):
    data = _tensors(tmp_path / "x.safetensors")
    assert _problem(data) is None
    assert "cut off" in _problem(data[:-1]) and f"{len(data) - 1:,} of the {len(data):,} bytes" in _problem(data[:-1])
    assert "cut off inside its safetensors header" in _problem(data[:20])
    assert "shorter than a safetensors header" in _problem(data[:5])
    assert "past the tensors" in _problem(data + b"\0")
    assert "damaged safetensors header" in _problem(data[:8] + b"x" * (len(data) - 8))
    assert "does not start with a safetensors header" in _problem(b"\xff" * 64)


def test_storage_names_a_cut_off_checkpoint_or_json_where_a_node_reads_it(tmp_path):
    """What a node would otherwise report as safetensors' 'incomplete metadata' or a JSONDecodeError."""
    data = _tensors(tmp_path / "state" / "lofi" / "node0.safetensors")
    storage = Storage(tmp_path / "state")
    assert storage.load_tensors("lofi/node0.safetensors")[1] == {}
    (tmp_path / "state" / "lofi" / "node0.safetensors").write_bytes(data[: len(data) // 2])
    assert "cut off" in storage.tensors_problem("lofi/node0.safetensors")
    with pytest.raises(FileError, match=r"node0\.safetensors is cut off.*delete it"):
        storage.load_tensors("lofi/node0.safetensors")
    (tmp_path / "state" / "ddp").mkdir()
    (tmp_path / "state" / "ddp" / "attempts.json").write_text('[{"rank": 0, "st')
    with pytest.raises(
        FileError,
        match=r"attempts\.json is cut off \(truncated JSON: Unterminated string starting at line 1, column 14\)",
    ):
        storage.read_json("ddp/attempts.json")
    assert storage.walk("lofi") == ["lofi/node0.safetensors"] and storage.walk("nothing") == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[{"strategy": "lofi", "metr', "is cut off (truncated JSON: Unterminated string starting at line 1"),
        ("[1, 2,, 3]", "is not valid JSON (Expecting value at line 1, column 7)"),
        ("{}", "holds a mapping, not a list of strategy records: it is not a raylowcomm results file"),
        ("[]", "holds no records"),
        ('[{"metrics": {}}]', "record 0 names no strategy"),
        ("", "is cut off"),
    ],
)
def test_a_results_file_is_a_list_of_records_or_an_error_naming_it(tmp_path, text, problem):
    (tmp_path / "results.json").write_text(text)
    with pytest.raises(FileError) as err:
        read_records(tmp_path / "results.json", "do this")
    assert str(err.value).startswith(f"{tmp_path / 'results.json'} {problem}") and str(err.value).endswith(": do this")


def test_a_missing_file_and_the_wrong_kind_are_named():
    with pytest.raises(FileError, match="nope.json does not exist: fix"):
        read_records("nope.json", "fix")
    with pytest.raises(FileError, match="x.json holds a list, not a mapping: fix"):
        parse_json("[1]", "x.json", "fix", dict, "a mapping")


def _run_folder(tmp: Path, strategies: list[str] | None = None) -> tuple[str, Path]:
    """A config and the folder a run of it wrote (config.yaml as the run saves it), to resume."""
    from raylowcomm.strategies import load_config

    config = _config(tmp, **({"strategies": strategies} if strategies else {}))
    out = tmp / "out"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(load_config(config).to_dict(), sort_keys=False))
    return config, out


def _cut_checkpoint(out: Path) -> Path:
    path = out / "state" / "lofi" / "checkpoints" / "node0.safetensors"
    data = _tensors(path)
    path.write_bytes(data[: len(data) - 7])
    return path


def _report_dir(tmp: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    return str(tmp)


def _plan_dir(tmp: Path, results: str, bench: str | None = None) -> str:
    run = tmp / "bench" / "8mbit"
    run.mkdir(parents=True)
    (run / "results.json").write_text(results)
    if bench is not None:
        (tmp / "bench" / "bench.json").write_text(bench)
    return str(run)


RESULTS = json.dumps([ddp_record()])
FILE_CASES = [
    # (id, argv builder from tmp_path, texts the error line holds)
    (
        "plan-truncated-results",
        lambda t: ["plan", _plan_dir(t, RESULTS[:40])],
        ("'CONFIG_OR_RUN_DIR'", "results.json is cut off (truncated JSON:", "rerun"),
    ),
    (
        "plan-results-not-records",
        lambda t: ["plan", _plan_dir(t, "{}")],
        ("results.json holds a mapping", "not a raylowcomm results file"),
    ),
    (
        "plan-truncated-bench-json",
        lambda t: ["plan", _plan_dir(t, RESULTS, '{"runs": [{"dir": "8m')],
        ("bench.json is cut off", "rerun"),
    ),
    (
        "plan-against-truncated-bench-json",
        lambda t: ["plan", _plan_dir(t, RESULTS, "{"), "--against", str(t / "bench" / "8mbit")],
        ("bench.json is cut off",),
    ),
    (
        "report-empty-mapping",
        lambda t: ["report", _report_dir(t, {"results.json": "{}"})],
        ("results.json holds a mapping", "not a raylowcomm results file", "rerun"),
    ),
    (
        "report-truncated-results",
        lambda t: ["report", _report_dir(t, {"results.json": RESULTS[:30]})],
        ("results.json is cut off",),
    ),
    (
        "report-truncated-seeds",
        lambda t: ["report", _report_dir(t, {"seeds.json": '{"dirs": {"0": "se'})],
        ("seeds.json is cut off",),
    ),
    (
        "report-seeds-not-a-mapping",
        lambda t: ["report", _report_dir(t, {"seeds.json": "[1, 2]"})],
        ("seeds.json holds a list", "summary"),
    ),
    (
        "report-bench-run-truncated",
        lambda t: [
            "report",
            _report_dir(
                t, {"bench.json": '{"runs": [{"label": "1gbit", "dir": "1gbit"}]}', "1gbit/results.json": "[{"}
            ),
        ],
        ("1gbit/results.json is cut off",),
    ),
    (
        "report-bench-without-runs",
        lambda t: ["report", _report_dir(t, {"bench.json": '{"runs": [3]}'})],
        ("bench.json has no list of runs",),
    ),
    (
        "report-damaged-config",
        lambda t: ["report", _report_dir(t, {"results.json": RESULTS, "config.yaml": "model: [\n"})],
        ("config.yaml is malformed YAML", "line 2"),
    ),
    (
        "resume-truncated-results",
        lambda t: ["run", *_resume(t, results='[{"strategy": "lofi", "metrics": {"id_acc')],
        ("'--resume'", "results.json", "is cut off (truncated JSON:", "rerun without --resume"),
    ),
    (
        "resume-results-not-records",
        lambda t: ["run", *_resume(t, results="{}")],
        ("'--resume'", "results.json", "not a raylowcomm results file"),
    ),
    (
        "resume-truncated-node-checkpoint",
        lambda t: ["run", *_resume(t, checkpoint=True)],
        ("'--resume'", "lofi/checkpoints/node0.safetensors", "is cut off", "delete", "state/lofi", "without --resume"),
    ),
    (
        "resume-truncated-state-json",
        lambda t: ["run", *_resume(t, strategies=["lofi", "ddp"], state_json=("ddp/attempts.json", '[{"ra'))],
        ("'--resume'", "ddp/attempts.json", "is cut off", "delete", "state/ddp"),
    ),
]


def _resume(tmp: Path, results=None, checkpoint=False, strategies=None, state_json=None) -> list[str]:
    """argv (after `run`) resuming a run folder with a damaged results.json, node checkpoint or state JSON."""
    config, out = _run_folder(tmp, strategies)
    if results is not None:
        (out / "results.json").write_text(results)
    if checkpoint:
        _cut_checkpoint(out)
    if state_json is not None:
        (out / "state" / state_json[0]).parent.mkdir(parents=True)
        (out / "state" / state_json[0]).write_text(state_json[1])
    return [config, "--resume", str(out)]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_a_damaged_file_is_one_line_naming_it(tmp_path, capsys, no_ray, argv, expected):
    code = main(argv(tmp_path))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in lines[0], lines[0]
    assert not no_ray, "Ray was started on a damaged file"


def test_resume_checks_only_what_the_continuing_strategies_read(tmp_path):
    """A finished strategy's state is never read again: its damage does not stop a resume; a continuing
    one's does, and the fix names its state folder."""
    from raylowcomm.resume import check_state
    from raylowcomm.strategies import load_config

    config, out = _run_folder(tmp_path)
    _cut_checkpoint(out)
    cfg = load_config(config)
    check_state(cfg, out, {"lofi": {"strategy": "lofi"}})
    with pytest.raises(Exception, match=r"node0\.safetensors.*delete .*state/lofi so that lofi starts over"):
        check_state(cfg, out, {})
    (out / "state" / "lofi" / "checkpoints" / "node0.safetensors").unlink()
    _tensors(out / "state" / "lofi" / "checkpoints" / "node1.safetensors")
    check_state(cfg, out, {})  # whole files pass


def test_a_damaged_benchmark_file_is_said_in_its_section_and_the_report_stands(tmp_path, capsys):
    folder = _report_dir(tmp_path, {"results.json": RESULTS, "benchmarks/speed.json": '{"rows": [1,'})
    assert main(["report", folder]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "### speed" in text and "unreadable: is cut off (truncated JSON:" in text
