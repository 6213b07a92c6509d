"""No import side effects (`import raylowcomm` leaves the process as it found it), the Python API,
and the settings `init_ray` makes for a local Ray instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import raylowcomm
from raylowcomm.env import HUB_DEFAULTS, LOCAL_RAY_DEFAULTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env() -> dict:
    """This environment without what raylowcomm (or conftest.py) might set."""
    env = {k: v for k, v in os.environ.items() if k not in {**HUB_DEFAULTS, **LOCAL_RAY_DEFAULTS, "RAY_ADDRESS": 1}}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _python(code: str, env: dict, timeout: int = 300) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_changes_no_environment():
    out = _python(
        """
        import os, sys
        before = dict(os.environ)
        import raylowcomm, raylowcomm.cli
        assert dict(os.environ) == before, {k: os.environ.get(k) for k in set(os.environ) ^ set(before)}
        heavy = [m for m in ("ray", "torch", "transformers", "yaml") if m in sys.modules]
        assert not heavy, heavy  # `import raylowcomm` stays cheap

        # Loading and validating a config (which imports ray and torch) sets nothing either,
        # beyond what `import ray` itself sets (RAY_CLIENT_MODE).
        import ray, torch
        before = dict(os.environ)
        cfg = raylowcomm.load_config(None, ["strategies=[lofi]", "optim.lr=0.01"])
        assert cfg.optim.lr == 0.01
        assert dict(os.environ) == before, {k: os.environ.get(k) for k in set(os.environ) ^ set(before)}

        from raylowcomm.runner import run
        assert raylowcomm.run is run
        print("ok")
    """,
        _clean_env(),
    )
    assert out.strip().endswith("ok")


def test_python_api_names():
    from raylowcomm.config import ConfigError, RunConfig
    from raylowcomm.strategies import from_dict, load_config

    assert raylowcomm.ConfigError is ConfigError and raylowcomm.RunConfig is RunConfig
    assert raylowcomm.from_dict is from_dict and raylowcomm.load_config is load_config
    assert callable(raylowcomm.run) and callable(raylowcomm.run_seeds)
    assert set(raylowcomm.__all__) <= set(dir(raylowcomm))
    with pytest.raises(AttributeError):
        raylowcomm.no_such_name  # noqa: B018
    with pytest.raises(raylowcomm.ConfigError):
        raylowcomm.from_dict({"strategies": []})


@pytest.mark.slow
def test_local_ray_stays_on_loopback_whatever_was_imported_first():
    """RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is read at `import ray`; init_ray also sets the value Ray
    read, so a local node is on 127.0.0.1 even when ray was imported before, and actors get the
    hub-offline settings through the runtime_env."""
    out = _python(
        """
        import os
        import ray  # before init_ray, as raylowcomm's own modules and many user programs do
        from raylowcomm.runtime import init_ray
        init_ray(num_cpus=1)
        print("nodes", sorted(n["NodeManagerAddress"] for n in ray.nodes()))

        @ray.remote
        def actor_env():
            return os.environ.get("HF_HUB_OFFLINE"), ray.util.get_node_ip_address()

        print("task", *ray.get(actor_env.remote()))
        ray.shutdown()
    """,
        {**_clean_env(), "RAY_AUTH_MODE": "disabled"},
    )
    assert "nodes ['127.0.0.1']" in out and "task 1 127.0.0.1" in out, out


def test_the_loaders_print_no_load_report_or_progress_bar_unless_verbose():
    """A fresh process loading MiniLM with a new head, as `raylowcomm run` does, with and without
    --verbose: transformers' report lists the head as MISSING, and its progress bar draws."""
    code = """
        import sys
        from raylowcomm.config import ModelConfig
        from raylowcomm.env import quiet_loaders, set_hub_defaults
        from raylowcomm.finetune import load_pretrained
        set_hub_defaults()
        if sys.argv[1] == "quiet":
            quiet_loaders(hf_model=True)
        load_pretrained(ModelConfig(name="all-MiniLM-L6-v2", family="hf_classifier"), 2, seed=0)
    """
    printed = {}
    for mode in ("quiet", "verbose"):
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), mode],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr
        printed[mode] = proc.stdout + proc.stderr
    assert "MISSING" in printed["verbose"] and "Loading weights" in printed["verbose"], "the check would not see them"
    assert "MISSING" not in printed["quiet"] and "Loading weights" not in printed["quiet"], printed["quiet"]


def test_quieting_the_loaders_for_a_timm_run_does_not_import_transformers():
    out = _python(
        """
        import sys
        from raylowcomm.env import quiet_loaders
        quiet_loaders(hf_model=False)
        print("transformers imported:", "transformers" in sys.modules)
    """,
        _clean_env(),
    )
    assert "transformers imported: False" in out, out
