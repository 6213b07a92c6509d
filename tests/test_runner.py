"""What a failed strategy's record says: the exception the actor or worker raised itself, in one
line, however Ray wrapped it."""

import ray
from ray.train import WorkerGroupError

from raylowcomm.config import ConfigError
from raylowcomm.runner import failure_message

BAD_ROW = ConfigError("data.columns.text", "review", "row 0 of data.node_files[1] is unreadable as text (int '0' is not text)")


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
