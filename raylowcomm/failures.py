"""The first cause of a strategy's failure: the exception a node or stage raised itself, named with
the node or stage and the call it came from, in place of whatever the driver would trip over next
(an empty loss list, a missing reply, a call that failed only because its input had).

- An actor keeps its own first exception in a `FirstFailure` (the calls after it fail as its
  consequences); the driver asks for it (`ask_first_failure`) when a call fails or a report says so.
- `NodeFailed` is what the driver raises: one line, the cause's type and message first, then who
  raised it where; its `failure` dict is what a failed strategy's record keeps (`failure` in
  results.json: node or stage, call, type, message).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import ray

ASK_TIMEOUT_S = 10.0
"""How long the driver waits for the actors' own failures before it reports the error it holds."""

WHERE_KEYS = ("step", "batch", "micro_batch", "set", "chunk")
"""Keys of a failure that say where in the run it happened, in the order the message names them."""


def own_exception(err: BaseException) -> BaseException:
    """The exception an actor raised itself, out of Ray's wrappers (a task's error, nested where a
    task failed on another task's result)."""
    while isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None and err.cause is not err:
        err = err.cause
    return err


def cause_of(err: BaseException) -> dict:
    """{type, message} of an actor's own exception; the message is its first line (the rest, a
    traceback or a loader's detail, stays in the actor's log)."""
    own = own_exception(err)
    lines = str(own).strip().splitlines()
    return {"type": type(own).__name__, "message": lines[0] if lines else ""}


def describe(failure: dict) -> str:
    """One line, cause first: "IndexError: index out of range in self (interlocking stage 0 of 2, in
    forward, batch 0, micro-batch 0)", and what followed from it where the failure says (`outcome`)."""
    who = failure["actor"] + (f" of {failure['of']}" if failure.get("of") else "")
    where = [f"in {failure['call']}"] if failure.get("call") else []
    where += [f"{key.replace('_', '-')} {failure[key]}" for key in WHERE_KEYS if failure.get(key) is not None]
    outcome = f"; {failure['outcome']}" if failure.get("outcome") else ""
    return f"{failure['type']}: {failure['message']} ({', '.join([who, *where])}){outcome}"


class NodeFailed(RuntimeError):
    """A node's or stage's own exception, raised on the driver naming it: the first cause of its
    strategy's failure. `failure`: {actor, node or stage, call, type, message, ...}."""

    def __init__(self, failure: dict):
        super().__init__(describe(failure))
        self.failure = failure

    def __reduce__(self):
        return type(self), (self.failure,)

    @classmethod
    def of(cls, err: BaseException, label: str, key: int, call: str | None = None, of: int | None = None):
        """The failure of actor `key` (`label`: "lofi node", "interlocking stage") in `call`, from the
        error the driver got for it."""
        index = "stage" if label.endswith("stage") else "node"
        failure = {"actor": f"{label} {key}", index: key, "of": of, "call": call, **cause_of(err)}
        return cls({k: v for k, v in failure.items() if v is not None})


def all_left(step: int, label: str, died_of: dict[int, dict]) -> Exception:
    """The error of a run whose nodes have all left by `step`: the first death's own cause, naming the
    node (`died_of`: {node: {type, message}} in the order they died), not the emptiness that followed;
    where none died (they left on schedule), a RuntimeError saying so."""
    if not died_of:
        return RuntimeError(f"step {step}: every node has left")
    k, cause = next(iter(died_of.items()))
    outcome = f"every node had left by step {step}"
    return NodeFailed({"actor": f"{label} {k}", "node": k, **cause, "outcome": outcome})


class FirstFailure:
    """An actor's first own exception (later ones follow from it), kept with who and where, for the
    driver to ask about: `watch` each call that may fail, `failure` is what it records."""

    def __init__(self, **who):
        self.who, self.failure = who, None

    @contextmanager
    def watch(self, call: str, **where):
        """Record the first exception raised inside, with `call` and `where` (batch, micro-batch),
        and re-raise it. One that only carries another task's error is not this actor's own."""
        try:
            yield
        except Exception as err:
            if self.failure is None and not isinstance(err, ray.exceptions.RayTaskError):
                self.failure = {**self.who, "call": call, **where, **cause_of(err), "at": time.time()}
            raise


def first_of(failures: list[dict | None]) -> dict | None:
    """The earliest of the failures the actors recorded (by the time each was recorded), without its
    time; None where none did."""
    found = sorted((f for f in failures if f), key=lambda f: f["at"])
    return {k: v for k, v in found[0].items() if k != "at"} if found else None


def ask_first_failure(handles: list) -> dict | None:
    """The first failure the actors `handles` recorded themselves (each has a `failure` method), or
    None where none did, an actor is dead or does not answer in time (its death is the cause then)."""
    try:
        return first_of(ray.get([h.failure.remote() for h in handles], timeout=ASK_TIMEOUT_S))
    except (ray.exceptions.RayError, AttributeError):
        return None
