"""What a failed strategy's record says: the exception the actor or worker raised itself, in one
line, however Ray wrapped it; the results table it lands in."""

import ray
from ray.train import WorkerGroupError

from raylowcomm.config import ConfigError
from raylowcomm.results_table import format_results_table
from raylowcomm.runner import failure_message

BAD_ROW = ConfigError(
    "data.columns.text", "review", "row 0 of data.node_files[1] is unreadable as text (int '0' is not text)"
)


@ray.remote(num_cpus=0)
class FailsToStart:
    def __init__(self):
        raise BAD_ROW

    def ping(self):
        return 1


@ray.remote(num_cpus=0)
class FailsInATask:
    def work(self):
        raise RuntimeError("the shard ran out")


def _raised(ref) -> Exception:
    try:
        ray.get(ref)
    except Exception as err:
        return err
    raise AssertionError("nothing was raised")


def test_the_record_names_the_actors_own_exception_in_one_line(ray_session):
    died = _raised(FailsToStart.remote().ping.remote())
    assert isinstance(died, ray.exceptions.ActorDiedError) and "creation task" in str(died)
    assert failure_message(died) == f"ConfigError: {BAD_ROW}"
    assert failure_message(_raised(FailsInATask.remote().work.remote())) == "RuntimeError: the shard ran out"
    ranks = WorkerGroupError("rank 0 failed", {1: RuntimeError("late"), 0: BAD_ROW})
    assert failure_message(ranks) == f"ConfigError: {BAD_ROW}"
    assert failure_message(KeyError("curve")) == "KeyError: 'curve'"


def test_the_table_names_its_metric_only_when_a_strategy_scored():
    failed = {"strategy": "lofi", "error": f"ConfigError: {BAD_ROW}", "wall_s": 10.8}
    scored = {
        "strategy": "ddp",
        "metrics": {"id_accuracy": 0.75},
        "comm": {"by_phase": {"setup": 1, "train": 2, "final": 3}, "total_bytes": 6},
        "wall_s": 30.0,
        "samples_per_s": 40.0,
        "peak_rss_bytes": 10**9,
    }
    lines = format_results_table([failed]).splitlines()
    assert not any(line.startswith("(id/shift") for line in lines), lines
    assert lines[-1].startswith("lofi") and "FAILED: ConfigError" in lines[-1]
    lines = format_results_table([failed, scored]).splitlines()
    assert "(id/shift = accuracy)" in lines and lines[-1].split()[:2] == ["ddp", "0.7500"]
