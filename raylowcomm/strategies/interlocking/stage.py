"""An interlocking stage on Ray: `StageWorker` turns a core `InterlockStage` into a pipeline
worker (micro-batch ids, optimizer steps, busy time, the size of every message it sends) and
`StageActor` moves its tensors through the object store; stage 0 reads its own training rows."""

from __future__ import annotations

import statistics
import time

import ray
import torch
from torch import Tensor

from raylowcomm.actors import process_info, start_process
from raylowcomm.common.batches import Source
from raylowcomm.common.ledger import payload_nbytes
from raylowcomm.config import OptimConfig
from raylowcomm.core.interlock.heads import LOSSES
from raylowcomm.core.interlock.routing import InterlockStage
from raylowcomm.data import TrainSource
from raylowcomm.failures import FirstFailure
from raylowcomm.models import ModelSpec, place, state_dict_of
from raylowcomm.tasks import CausalLM, ImageClassification
from raylowcomm.training import make_optimizer


def map_tensors(value, fn):
    """`fn` on each tensor of a message: an (h, targets) tuple or a {head: gradient} dict."""
    return tuple(fn(v) for v in value) if isinstance(value, tuple) else {j: fn(g) for j, g in value.items()}


class StageWorker:
    """An :class:`InterlockStage` as a pipeline worker, without any transport: micro-batch ids
    from (batch, micro-batch), the optimizer step as soon as a batch is complete, busy time, the
    step times, and the size of every message it hands to the transport (the Ray StageActor)."""

    def __init__(self, stage: InterlockStage, micro_batches: int, last: bool, task):
        """`task` turns a batch into (inputs, targets) and scores logits (raylowcomm.tasks)."""
        self.stage, self.micro_batches, self.last, self.task = stage, micro_batches, last, task
        self.dtype = next(p.dtype for p in stage.module.parameters() if p.is_floating_point())
        self.steps_done, self.step_times, self.stepped_s = 0, [], 0.0
        self.clock = time.perf_counter  # call_s's clock; a thread-CPU clock times calls on a shared machine
        # for the schedule model; *_wall: the whole actor call, object-store get and put included, step left out
        self.call_s: dict[str, list[float]] = {
            k: [] for k in ("forward", "backward", "step", "forward_wall", "backward_wall")
        }
        self._reset()

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """A first stage's (x, targets) of a batch, x in the stage's dtype."""
        x = self.task.inputs(batch)
        return (x.to(self.dtype) if x.is_floating_point() else x), self.task.targets(batch)

    def _reset(self) -> None:
        self.busy_s, self.sent = 0.0, {"activations": [], "targets": [], "gradients": []}

    def _timed(self, kind: str, work):
        start, clock_start = time.perf_counter(), self.clock()
        out = work()
        worked, clock_worked = time.perf_counter(), self.clock()
        self.call_s[kind].append(clock_worked - clock_start)
        self.stepped_s = 0.0
        if self.stage.ready_to_step:
            self.stage.step()
            self.steps_done += 1
            self.step_times.append(time.perf_counter())
            self.stepped_s = self.step_times[-1] - worked
            self.call_s["step"].append(self.clock() - clock_worked)
        self.busy_s += time.perf_counter() - start
        return out

    def _upstream(self, msg: dict[int, Tensor]) -> dict[int, Tensor]:
        if msg:
            self.sent["gradients"].append(payload_nbytes(msg))
        return msg

    def forward(self, step: int, mb: int, x: Tensor, y: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """(h for the next stage, the early upstream message {k: dL_k/dx_k}, maybe empty)."""
        mb_id = step * self.micro_batches + mb
        h, early = self._timed("forward", lambda: (self.stage.forward(mb_id, x, y), self.stage.backward(mb_id, {})))
        if not self.last:
            self.sent["activations"].append(payload_nbytes(h))
            self.sent["targets"].append(payload_nbytes(y))
        return h, self._upstream(early)

    def backward(self, step: int, mb: int, msg: dict[int, Tensor]) -> dict[int, Tensor]:
        """Use one downstream message {j: dL_j/dh_k}; the message for stage k − 1 (maybe empty)."""
        return self._upstream(self._timed("backward", lambda: self.stage.backward(step * self.micro_batches + mb, msg)))

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict]:
        """Eval-mode forward of a chunk: (h for the next stage, the task's sums for this head)."""
        modules = [m for m in (self.stage.module, self.stage.head) if m is not None]
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        h = self.stage.module(x)
        metrics = self.task.sums(self.stage.head(h) if self.stage.head is not None else h, y)
        for m, w in zip(modules, was):
            m.train(w)
        metrics["sent_bytes"] = 0 if self.last else payload_nbytes((h, y))
        return h, metrics

    def report(self) -> dict:
        """Since the last report: own-head losses, busy seconds, sizes of every message sent."""
        out = {
            "losses": list(self.stage.pop_losses().values()),
            "busy_s": self.busy_s,
            "sent": self.sent,
            "steps_done": self.steps_done,
        }
        self._reset()
        return out

    def timing(self) -> dict:
        """Step count, steps that stashed the weights for a later batch's forwards, the median step
        interval, and the median seconds of a forward call, a backward call (each without the
        optimizer step) and an optimizer step: the schedule model's inputs."""
        gaps = [b - a for a, b in zip(self.step_times, self.step_times[1:])]
        return {
            "steps": self.steps_done,
            "stashes": self.stage.stashes,
            "median_step_interval_s": statistics.median(gaps) if gaps else None,
            "median_call_s": {kind: statistics.median(v) if v else None for kind, v in self.call_s.items()},
        }


@ray.remote
class StageActor:
    """One stage on Ray: a `StageWorker` (its module, aux head and own optimizer) whose tensors go
    in and out through the object store; stage 0 builds the micro-batches from its `Source`. Its own
    first exception is kept (`failure`) and reported: the calls that depend on a failed call never
    run, and the driver holds no reply of theirs to read it from."""

    label = "interlocking stage"

    def __init__(self, cpus: float, gpus: float, cpu_quota: bool = False):
        self.device, self.worker = start_process(cpus, gpus, cpu_quota), None
        self.first = FirstFailure(actor="interlocking stage")

    def load(
        self,
        index: int,
        num_stages: int,
        width: int,
        rule: str,
        payload: tuple,
        loss: str,
        optim: OptimConfig,
        micro_batches: int,
        source: Source | None = None,
        recipe: TrainSource | None = None,
        spec: ModelSpec | None = None,
    ) -> None:
        """(Re)build the stage from ``payload`` (module, aux head) with a fresh optimizer; a process is
        reusable. Stage 0 reads the training rows itself, from `recipe`, on its own host. `spec`: the
        model's, for the memory format its layers compute in here (None: torch's default)."""
        self.first = FirstFailure(actor=f"interlocking stage {index}", stage=index, of=num_stages)
        with self.first.watch("load"):
            if recipe is not None:
                source.train = recipe.load(0, 1)
            module, head = (
                None if m is None else m.to(self.device) if spec is None else place(m, spec, self.device)
                for m in payload
            )
            stage = InterlockStage(
                index,
                num_stages,
                width,
                rule,
                module,
                head,
                LOSSES[loss],
                lambda params: make_optimizer(optim, params),
                micro_batches,
            )
            if loss == "causal_lm":
                task = CausalLM(self.device)
            else:
                task = ImageClassification(
                    source.image_size if source else 0, self.device, *((source.mean, source.std) if source else ())
                )
            self.worker = StageWorker(stage, micro_batches, index == num_stages - 1, task)
            self.index, self.source = index, source

    def _received(self, ref):
        return map_tensors(ray.get(ref), lambda t: t.to(self.device))

    @staticmethod
    def _put(value, ok: bool = True):
        return ray.put(map_tensors(value, Tensor.cpu)) if ok else None

    @ray.method(num_returns=2)
    def forward(self, step: int, mb: int, x_ref=None):
        """Forward micro-batch ``mb`` of batch ``step``; returns (ref of (h, targets) for stage
        k + 1, ref of the early upstream message {k: dL_k/dx_k} or None)."""
        start = time.perf_counter()
        with self.first.watch("forward", batch=step, micro_batch=mb):
            x, y = (
                self.worker.inputs(self.source.micro_batch(step, mb, self.worker.micro_batches))
                if self.index == 0
                else self._received(x_ref)
            )
            h, early = self.worker.forward(step, mb, x, y)
            out = self._put((h, y), not self.worker.last), self._put(early, bool(early))
        self.worker.call_s["forward_wall"].append(time.perf_counter() - start - self.worker.stepped_s)
        return out

    def backward(self, step: int, mb: int, msg_ref):
        """Use one downstream message; returns the ref of the message for stage k − 1, or None."""
        start = time.perf_counter()
        with self.first.watch("backward", batch=step, micro_batch=mb):
            up = self.worker.backward(step, mb, self._received(msg_ref)) if msg_ref is not None else None
            out = self._put(up, bool(up))
        self.worker.call_s["backward_wall"].append(time.perf_counter() - start - self.worker.stepped_s)
        return out

    def report(self) -> dict:
        """The worker's report since the last one, with this stage's first own failure where it had one."""
        failed = {"failure": self.first.failure} if self.first.failure else {}
        return {"stage": self.index, **self.worker.report(), **failed}

    def failure(self) -> dict | None:
        """This stage's first own exception (`failures.FirstFailure`), or None."""
        return self.first.failure

    @ray.method(num_returns=2)
    def evaluate(self, name: str, chunk: int, x_ref=None):
        """Eval-mode forward of eval chunk ``chunk``; returns (ref of (h, targets) for stage
        k + 1 or None, this head's summed metrics)."""
        with self.first.watch("evaluate", set=name, chunk=chunk):
            x, y = self.worker.inputs(self.source.eval_chunk(name, chunk)) if self.index == 0 else self._received(x_ref)
            h, metrics = self.worker.evaluate(x, y)
            return self._put((h, y), not self.worker.last), metrics

    def state(self) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """(stage module weights, aux head weights or None)."""
        head = self.worker.stage.head
        return state_dict_of(self.worker.stage.module), (state_dict_of(head) if head is not None else None)

    def info(self) -> dict:
        return {"stage": self.index, **process_info(), **self.worker.timing()}
