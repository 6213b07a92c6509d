"""The actor layer: the one place where node actors are created, placed, given a device and a
model, evaluated, and torn down. Strategies compose it; it never knows which paper it serves.

- `Node` is what every node process holds (threads, device, model, task, evaluation sets); Ray
  actor classes subclass it, and DDP's Ray Train workers use it as it is. It lives here.
- `NodeGroup` is the driver's handle on a strategy's actors: it starts them from `NodesConfig`
  (resources, restarts) in one placement group reserved up front (`execution.Gang`: placement,
  pinning to hosts), books every payload it sends or fetches in the ledger, and kills every
  actor and removes the group when its `with` block ends: on success, on an error, on Ctrl-C.
  It lives in `node_group` (with `DriverFetches` and the replicas' hash check), imported here.
"""

from __future__ import annotations

import logging
import os
import socket

import ray
import torch

from raylowcomm.catalog import TaskSpec
from raylowcomm.common.cpu_quota import cap_cpu
from raylowcomm.common.hashing import parameter_hash
from raylowcomm.common.timing import peak_rss_bytes, rss_bytes
from raylowcomm.config import RunConfig
from raylowcomm.finetune import ModelRecipe, fine_tune_for
from raylowcomm.models import ModelSpec, build_architecture, place
from raylowcomm.node_group import ActorDied as ActorDied
from raylowcomm.node_group import DriverFetches as DriverFetches
from raylowcomm.node_group import NodeGroup as NodeGroup
from raylowcomm.node_group import ReplicaMismatch as ReplicaMismatch
from raylowcomm.node_group import check_replicas as check_replicas
from raylowcomm.node_group import count_tensors as count_tensors
from raylowcomm.runtime import device_for, log_to_stdout, setup_threads
from raylowcomm.storage import Storage
from raylowcomm.tasks import make_task, score_sets
from raylowcomm.training import dedupe_shared

logger = logging.getLogger("raylowcomm")


def start_process(cpus: float, gpus: float, cpu_quota: bool = False) -> str:
    """What every node process does first: torch threads = its CPUs (and its CPU time held to them
    where `churn.cpu_quota` asks), log lines to stdout; returns the device it computes on."""
    if cpu_quota:
        cap_cpu(cpus)
    setup_threads(cpus)
    log_to_stdout()
    return device_for(gpus)


def process_info() -> dict:
    """Where an actor runs and how much memory it peaked at (GPU memory: where it computed on one)."""
    context = ray.get_runtime_context() if ray.is_initialized() else None
    return {
        "host": socket.gethostname(),
        "ray_node_id": context.get_node_id() if context else None,
        "pid": os.getpid(),
        "placement_group": context.get_placement_group_id() if context else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None,
    }


class Node:
    """One node's process: its model (loaded here by a `ModelRecipe`, or rebuilt from the spec and
    loaded with the driver's `weights`) and what trains in it (`fine_tune`), its task on its device,
    and the evaluation sets it fetches once, at its first evaluation."""

    label = "node"
    keeps_contiguous = False
    """Whether the model keeps torch's contiguous layout whatever model.memory_format says."""

    def __init__(
        self, rank: int, cfg: RunConfig, spec: ModelSpec, task: TaskSpec, weights: dict | ModelRecipe | None = None
    ):
        self.rank, self.cfg, self.spec = rank, cfg, spec
        self.device = start_process(cfg.nodes.cpus, cfg.nodes.gpus, cfg.churn.cpu_quota)
        self.rss_before_model = rss_bytes()  # the process's own share of its peak: imports, Ray's worker
        self.fine_tune = fine_tune_for(spec)
        if isinstance(weights, ModelRecipe):  # from model.path / the asset / the hub cache on this host
            self.model = place(weights.load(), spec, self.device, self.keeps_contiguous)
        else:
            self.model = place(self.fine_tune.wrap(build_architecture(spec)), spec, self.device, self.keeps_contiguous)
            if weights is not None:
                self.model.load_state_dict(weights)
        self.task = make_task(task, self.device)
        self.eval_sets: dict | None = None
        self.own_sets: dict = {}
        """data.eval_on_nodes: this node's own held-out rows, scored as its test set; never sent."""
        self._scratch: torch.nn.Module | None = None

    def log(self, msg: str) -> None:
        logger.info("[%s %s] %s", self.label, self.rank, msg)

    def evaluate(self, sets: list) -> dict:
        """Score the model through its task; `sets` = [ref of {name: split}], nested so that the
        sets are fetched once, by the first evaluation, and kept."""
        if self.eval_sets is None:
            self.eval_sets = ray.get(sets[0]) if isinstance(sets[0], ray.ObjectRef) else sets[0]
        return score_sets(self.task, self.model, {**self.eval_sets, **self.own_sets}, self.cfg.eval_rows)

    def score_weights(self, state: dict, sets: list, val: bool = False) -> dict:
        """A model the driver put together (an average, a soup: plain weights, adapters merged) scored
        here, where the device is: no model is scored on the driver. The node's own model stays as it
        is: under LoRA it computes the plain weights in place for the scoring (`FineTune.computing`),
        else they load into a scratch model. `val`: the held-out set too (a greedy soup's choice).
        `state` may need this node's model to become plain weights (under LoRA: the nodes' adapters,
        merged here on this node's base)."""
        state = self.fine_tune.plain_state(state, self.model)
        if self.eval_sets is None:
            self.eval_sets = ray.get(sets[0])
        chosen = {k: v for k, v in {**self.eval_sets, **self.own_sets}.items() if val or k != "val"}
        with self.fine_tune.computing(self.model, state) as model:
            if model is None:
                if self._scratch is None:
                    self._scratch = place(build_architecture(self.spec), self.spec, self.device, self.keeps_contiguous)
                self._scratch.load_state_dict(state)
                model = self._scratch
            return score_sets(self.task, model, chosen, self.cfg.eval_rows)

    def save_plain(self, payload, storage: Storage, rel: str) -> None:
        """Plain weights from what the driver sent (the nodes' adapters: merged on this node's base), or
        (None) this node's own model, saved at `rel` in `storage` by this node, which holds the model
        the driver does not."""
        state = self.fine_tune.plain_state(payload, self.model)
        storage.save_tensors(rel, dedupe_shared(state))

    def hold_out(self, data, count: int) -> None:
        """With data.eval_on_nodes, keep this node's own held-out rows (read here) as its test set."""
        if self.cfg.data.eval_on_nodes:
            self.own_sets = {"test": data.load_holdout(self.rank, count)}

    def weights(self) -> dict:
        """What the node has learned: every weight, or under LoRA (model.lora) the adapters and head only."""
        return self.fine_tune.node_state(self.model)

    def hash(self) -> str:
        """Exact hash of the parameters: replicas that must be identical compare it."""
        return parameter_hash(list(self.model.named_parameters()))

    def crash(self) -> None:
        """Exit abruptly, as a crashed node would (failure tests and `spsa.leave` with how=kill)."""
        os._exit(1)

    def info(self) -> dict:
        return {
            "node": self.rank,
            **process_info(),
            "rss_before_model_bytes": self.rss_before_model,
            **self.extra_info(),
        }

    def extra_info(self) -> dict:
        return {}
