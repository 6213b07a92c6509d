"""lo-fi's node actor: its own copy of the model, its own shard, its own optimizer, a checkpoint;
with peer rounds also its side of them (`node_rounds.NodeRounds`: its global model, outer momentum
and error feedback)."""

from __future__ import annotations

import dataclasses

import ray

from raylowcomm.actors import Node
from raylowcomm.common.batches import batch_at, group_seed, num_examples, steps_per_epoch
from raylowcomm.common.seeding import epoch_seed, node_seed
from raylowcomm.common.timing import TrainClock
from raylowcomm.config import RunConfig
from raylowcomm.core.averaging import measure_bn_statistics
from raylowcomm.core.bad_updates import learning_rate_of, relabelled
from raylowcomm.data import TrainSource
from raylowcomm.execution.churn import Churn
from raylowcomm.storage import Storage
from raylowcomm.strategies.lofi.config import LofiConfig
from raylowcomm.strategies.lofi.merging import merging_for
from raylowcomm.strategies.lofi.messages import ResumePoint, TrainReport
from raylowcomm.strategies.lofi.node_peer import PeerRoundCalls
from raylowcomm.strategies.lofi.node_rounds import NodeRounds
from raylowcomm.strategies.lofi.payload import dense_names
from raylowcomm.strategies.lofi.probe import head_names
from raylowcomm.training import StepHooks, load_checkpoint, make_optimizer, save_checkpoint, train_steps


@ray.remote
class LofiNode(Node, PeerRoundCalls):
    """One node: its own copy of the model, its own shard, its own optimizer, a checkpoint; the calls of
    rounds that travel node to node from `PeerRoundCalls` (node_peer.py)."""

    label = "lofi node"

    def __init__(
        self,
        node: int,
        spec,
        task,
        weights,
        data: TrainSource,
        cfg: RunConfig,
        storage: Storage,
        progress=None,
        rounds: LofiConfig | None = None,
        round_momentum: str = "keep",
        slots: int | None = None,
    ):
        # weights: the initial state dict, or the recipe this node loads them by; a checkpoint may hold
        # what trains only: the rest comes from them. rounds: the run's lo-fi options, where its exchange
        # keeps rounds on the nodes (None: the driver's star). slots: the training set's shards, one per
        # node slot (joiners' too; None: nodes.count)
        super().__init__(node, cfg, spec, task, weights)
        self.progress = progress  # a progress.ProgressPoster where the driver watches live
        slots = slots or cfg.nodes.count
        # read here, on the node's host: no training row crosses; a bad node's labels wrong (bad_nodes)
        self.shard = relabelled(cfg.bad_nodes, node, data.load(node, slots), spec.num_classes)
        self.hold_out(data, slots)
        self.seed, self.storage = node_seed(cfg.seed, node), storage
        self.checkpoint = f"lofi/checkpoints/node{node}.safetensors"
        # what this node trains with: the run's optimizer settings, at a bad node's learning rate (bad_nodes)
        self.optim = dataclasses.replace(cfg.optim, lr=learning_rate_of(cfg.bad_nodes, node, cfg.optim.lr))
        self.optimizer = make_optimizer(self.optim, self.model)
        self.step, self.restored_from, self.rounds = 0, None, 0
        self.saved_step: int | None = None
        """The step of this node's checkpoint in storage (model and optimizer as they were then)."""
        self.round_momentum = round_momentum  # lofi.round_momentum
        # peer rounds: what every node sends, as it starts (a copy: restoring a checkpoint overwrites it)
        start = {k: v.clone() for k, v in self.weights().items()} if rounds is not None else None
        if storage.exists(self.checkpoint):  # restarted, wherever Ray placed it, or a resumed run
            meta = load_checkpoint(storage, self.checkpoint, self.model, self.optimizer)
            self.step, self.rounds = meta["step"], meta["extra"].get("rounds", 0)
            self.saved_step = self.step
            self.restored_from = self.step
            self.log(f"resuming from its checkpoint at step {self.step} ({storage.uri_of(self.checkpoint)})")
        self.churn = Churn.for_node(cfg, node, cfg.nodes.count, storage, "lofi")
        self.merging = merging_for(spec)  # how a round's average lands in what trains
        self.peer = None
        if rounds is not None:
            dense = dense_names(self.model, spec.family, rounds.dense)
            self.peer = NodeRounds(self, rounds, cfg.seed, start, self.merging, dense)
        if storage.exists(self._bn_path):  # restarted after the end's recalibration: the combined statistics
            self._load_bn(storage.load_tensors(self._bn_path)[0])

    def probe(self, steps: int) -> dict | None:
        """LP-FT's probe before the nodes split: `steps` steps of the new head alone on this node's shard
        (every other weight frozen, its own optimizer; BatchNorm's running statistics still follow the
        batches, as in any training step); returns the head. None where this node restored a checkpoint: it
        holds the shared head already."""
        if self.restored_from is not None:
            return None
        names = set(head_names(self.model, self.spec.family))
        frozen = [p for n, p in self.model.named_parameters() if n not in names and p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            optimizer = make_optimizer(self.optim, self.model)
            train_steps(
                self.model,
                self.task,
                optimizer,
                self.shard,
                0,
                steps,
                self.cfg.optim.batch_size,
                self.seed,
                precision=self.cfg.optim.precision,
                device=self.device,
                group_seed=group_seed(self.cfg),
            )
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if n in names}

    def load_head(self, head: dict) -> None:
        """The nodes' averaged head: into the model (and the global model of peer rounds, where every node
        starts from it), checkpointed at step 0 so that a restart starts from it too."""
        self.model.load_state_dict({k: v.to(self.device) for k, v in head.items()}, strict=False)
        if self.peer is not None:
            self.peer.global_state.update({k: v.clone() for k, v in head.items()})
        self.save_state(0)

    def save_state(self, step: int) -> None:
        """Model and optimizer; under LoRA the adapters and head only until an average is merged
        into the base (lofi.average_every), after which the base is this node's own too."""
        save_checkpoint(
            self.storage,
            self.checkpoint,
            self.model,
            self.optimizer,
            step,
            extra={"rounds": self.rounds},
            trainable_only=self.fine_tune.trainable_only(base_moved=self.rounds > 0),
        )
        self.saved_step = step

    def _snapshot_path(self, step: int) -> str:
        return f"lofi/snapshots/node{self.rank}_step{step}.safetensors"

    def train(
        self,
        until: int,
        snapshot_at: list[int],
        landing: list | None = None,
        seconds: float | None = None,
        nearest: bool = False,
    ) -> dict:
        """Steps up to `until`, reported as a `TrainReport`'s wire dict; at each step in `snapshot_at`, a
        snapshot on local disk and the training time so far in this call (saving the snapshot is not
        training). `landing`: [round, step] of the peer round in flight (lofi.overlap), landed at that
        step (after a checkpoint of the weights it merges into: a restart in between merges again from
        there); how long training waited for it is `round_wait_s` in what it returns. `seconds`: stop
        after the step that reaches that much training time, if before `until` (a budget), checkpointed
        there; `nearest`: at the step end nearest to it (`lofi.sync: time`)."""
        clock, snaps, snapshot_s, waited = TrainClock(), set(snapshot_at), {}, {}
        if self.peer is not None:
            self.peer.expect_landing(landing)

        def on_step(step):
            if landing is not None and step == landing[1] and landing[0] > self.rounds:
                waited["round_wait_s"] = self._land_at(landing[0], step)
            elif step % self.cfg.checkpoint_steps == 0 or step == until:
                self.save_state(step)
            if step in snaps:
                snapshot_s[step] = self._save_snapshot(step, clock)

        hooks = StepHooks(
            on_step=on_step,
            log=self.log,
            log_every=self.cfg.log_every,
            progress=self.progress,
            clock=clock,
            pace=self.churn,
            stop_after_s=seconds,
            stop_nearest=nearest,
        )
        stats = train_steps(
            self.model,
            self.task,
            self.optimizer,
            self.shard,
            self.step,
            until,
            self.cfg.optim.batch_size,
            self.seed,
            hooks,
            precision=self.cfg.optim.precision,
            device=self.device,
            group_seed=group_seed(self.cfg),
        )
        done = self.step + stats["steps"]
        if landing is not None and landing[0] > self.rounds:  # stopped by time before its step: it lands here
            waited["round_wait_s"] = self._land_at(landing[0], done)
        elif done != until:  # stopped by time: the checkpoint `on_step` keeps for `until`
            self.save_state(done)
        self.step, restored, self.restored_from = done, self.restored_from, None
        return TrainReport.of(self.rank, done, restored, snapshot_s, stats, **waited).wire()

    def _land_at(self, round_: int, step: int) -> float:
        """The peer round in flight lands at `step`, after a checkpoint of the weights it merges into (a
        restart in between merges again from there); returns how long training waited for it."""
        self.save_state(step)
        return self.peer.land(round_, step)

    def _save_snapshot(self, step: int, clock: TrainClock) -> float:
        """This node's weights at `step` on local disk, off the training clock (saving is not training);
        returns the training time so far."""
        elapsed = clock.elapsed()
        with clock.paused():
            self.storage.save_tensors(self._snapshot_path(step), self.weights())
        return elapsed

    def snapshot(self, step: int) -> dict:
        return self.storage.load_tensors(self._snapshot_path(step))[0]

    def load_round(self, state: dict, rounds: int) -> None:
        """The star's global model of averaging round `rounds`; checkpointed at once so a restart keeps it
        (a node that has it already, resuming, keeps what it has)."""
        if rounds <= self.rounds:
            return
        self.load_global(state, rounds)
        self.rounds = rounds
        self.save_state(self.step)

    def load_global(self, state: dict, rounds: int) -> None:
        """A global model: its weights, or under LoRA the merged average as the new frozen base with
        fresh adapters (seeded by the round, the same on every node) and a fresh optimizer; with
        lofi.round_momentum: reset, a fresh optimizer state either way."""
        if self.merging.load_global(self.model, state, seed=epoch_seed(self.cfg.seed, rounds)):
            self.optimizer = make_optimizer(self.optim, self.model)
        elif self.round_momentum == "reset":
            self.optimizer.state.clear()

    def bn_statistics(self, state: dict | None, max_batches: int | None) -> tuple[dict, int]:
        """BatchNorm statistics of `state` (the driver's average) on this node's shard, or with None of
        the model this node holds (after peer rounds' final round: the average itself)."""
        if state is not None:
            self.load_global(state, self.rounds + 1)
        per_epoch = steps_per_epoch(num_examples(self.shard), self.cfg.optim.batch_size)
        n = min(per_epoch, max_batches or per_epoch)
        batches = (batch_at(self.shard, i, self.cfg.optim.batch_size, self.seed) for i in range(n))
        stats, count = measure_bn_statistics(self.model, batches, self.task.forward)
        stats = self.fine_tune.plain_names(stats)  # the average's names
        return {k: v.cpu() for k, v in stats.items()}, count  # nothing device-resident goes to the driver

    @property
    def _bn_path(self) -> str:
        return f"lofi/final/bn_statistics_node{self.rank}.safetensors"

    def load_bn_statistics(self, stats: dict) -> None:
        """The combined BatchNorm statistics (plain names), into the model this node holds (it is scored
        and saved next); kept in storage too, so a node restarted before its save loads them again
        instead of keeping the statistics of its own checkpoint."""
        self._load_bn(stats)
        self.storage.save_tensors(self._bn_path, stats)

    def _load_bn(self, stats: dict) -> None:
        names = self.fine_tune.plain_names({k: k for k in self.model.state_dict()})  # plain name -> the model's
        missing = stats.keys() - names.keys()
        if missing:
            raise KeyError(f"BatchNorm statistics for tensors this model lacks: {sorted(missing)[:3]}")
        self.model.load_state_dict({names[k]: v for k, v in stats.items()}, strict=False)

    def round_of(self) -> ResumePoint:
        """The rounds this node has landed and the step it has trained to."""
        return ResumePoint(self.rounds, self.step)

    def examples(self) -> int:
        return num_examples(self.shard)

    def extra_info(self) -> dict:
        return {"examples": num_examples(self.shard)}
