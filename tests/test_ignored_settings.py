"""A setting the run could not honour is one error line and exit 2 before Ray starts, through the
CLI as a user meets it: keys written twice, an empty file, options whose condition is unmet,
schedules that would never fire (issue: settings silently ignored)."""

from __future__ import annotations

import pytest

from raylowcomm.cli import main
from tests.test_cli_errors import _config, _write, no_ray  # noqa: F401  (no_ray: a fixture)

PEER = {"compress": "int8", "average_every": 2}
"""Lockstep peer rounds every 2 of the 4 steps a node takes in tests/test_cli_errors.GOOD."""

CASES = [
    (
        "section-twice",
        lambda t: _write(t / "c.yaml", "optim:\n  lr: 0.01\nnodes: {count: 2}\noptim:\n  lr: 0.05\n"),
        ("'optim' is written twice, at lines 1 and 4",),
    ),
    ("key-twice", lambda t: _write(t / "c.yaml", "optim:\n  lr: 0.01\n  lr: 0.05\n"), ("'lr'", "lines 2 and 3")),
    ("empty-file", lambda t: _write(t / "c.yaml", ""), ("c.yaml", "empty")),
    ("comments-only", lambda t: _write(t / "c.yaml", "# optim:\n#   lr: 0.1\n"), ("c.yaml", "empty")),
    ("sync-every-s-by-steps", lambda t: _config(t, lofi={"sync_every_s": 5}), ("lofi.sync_every_s", "sync: time")),
    ("grace-without-quorum", lambda t: _config(t, lofi={**PEER, "grace_s": 2}), ("lofi.grace_s", "lofi.quorum")),
    ("dense-codec-without-dense", lambda t: _config(t, lofi={"dense_codec": "int2"}), ("lofi.dense_codec",)),
    (
        "warm-up-past-the-run",
        lambda t: _config(t, lofi={"average_every": 2, "warmup_steps": 500}),
        ("lofi.warmup_steps", "4 steps per node"),
    ),
    (
        "kill-past-the-end",
        lambda t: _config(t, churn={"kill": [{"node": 1, "at_step": 9}]}),
        ("churn.kill[0].at_step", "4 steps per node"),
    ),
    (
        "kill-after-leave",
        lambda t: _config(
            t,
            lofi={**PEER, "quorum": 1, "leave": [{"node": 1, "step": 2}]},
            churn={"kill": [{"node": 1, "at_step": 3}]},
        ),
        ("churn.kill[0].at_step", "lofi.leave"),
    ),
    (
        "kill-without-restarts-in-lockstep",
        lambda t: _config(
            t, lofi=PEER, nodes={"count": 2, "max_restarts": 0}, churn={"kill": [{"node": 0, "at_step": 2}]}
        ),
        ("'churn.kill'", "nodes.max_restarts", "lockstep"),
    ),
    (
        "two-budgets",
        lambda t: _config(
            t, strategies=["interlocking"], optim={"batch_size": 8, "budget_s": 5}, interlocking={"time_budget_s": 20}
        ),
        ("interlocking.time_budget_s", "optim.budget_s"),
    ),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_setting_the_run_cannot_honour_is_one_error_line(tmp_path, capsys, no_ray, make, expected):  # noqa: F811
    code = main(["run", str(make(tmp_path))])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], lines[0]
    assert not no_ray


def test_a_key_written_twice_in_an_override_is_refused(tmp_path, capsys, no_ray):  # noqa: F811
    assert main(["run", _config(tmp_path), "--set", "churn.slow=[{node: 0, node: 1}]"]) == 2
    assert "written twice" in capsys.readouterr().err
