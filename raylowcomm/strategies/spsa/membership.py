"""The membership side of SPSA's driver: nodes starting (from the initial weights, or from the checkpoint
and replay log in storage), leaving, dying and joining at step boundaries, each booked in the node's
record."""

from __future__ import annotations

import logging

import ray

logger = logging.getLogger(__name__)


class NodeMembership:
    """Starts, removes and joins `SpsaRun`'s nodes: a base of `SpsaRun`, whose attributes (ctx, cfg,
    opts, group, ledger, storage, slots, records, infos, counts, train clock) and `verify` it uses."""

    def start_node(self, k: int, phase: str, until: int | None) -> None:
        """Node `k`: the initial weights, or (`until`) the checkpoint and log in storage, on top of
        the initial weights where the checkpoint holds only what SPSA tunes (LoRA). It reads its
        own shard (of `slots`) where it runs: only the recipe crosses."""
        initial = until is None or self.ctx.fine_tune.trainable_only()
        if initial:
            if self.weights_ref is None:  # the driver's weights, or the recipe the node loads them by
                self.start = self.ctx.initial_model()
                self.weights_ref = ray.put(self.start[1])
            self.ledger.send(phase, *self.start)
        recipe = self.group.put(self.ctx.data.train, phase, "data_recipe")
        self.group.start(
            k,
            k,
            self.ctx.spec,
            self.ctx.data.task,
            recipe,
            self.slots,
            self.cfg,
            self.opts,
            self.storage,
            weights=self.weights_ref if initial else None,
            until=until,
        )

    def leave(self, k: int, step: int, how: str) -> None:
        if how == "remove":
            self.infos[k] = self.group.fetch.get([self.group[k].info.remote()], "final", "node_info")[0]
        self.group.remove(k, kill=how == "remove")
        died = {"died_of": self.group.died_of.get(k)} if how == "died" else {}  # the node's own cause, where known
        self.records[k].update(left_step=step, left_how=how, left_at_s=self.train_clock.elapsed(), **died)
        logger.info("[spsa] step %d: node %d left (%s); running: %s", step, k, how, self.group.keys())

    def membership(self, step: int) -> None:
        for ev in self.opts.leave:
            if ev.step == step and ev.how == "kill":
                self.group[ev.node].crash.remote()  # found dead by the compute call that follows
            elif ev.step == step:
                self.leave(ev.node, step, "remove")
        for i, ev in enumerate(self.opts.join):
            if ev.step == step:
                k, group = self.cfg.nodes.count + i, self.group
                # a node writes it, the joiner reads it
                log_size = ray.get(group[min(group.keys())].save_log.remote(self.counts.ckpt_step))
                self.ledger.record("train", "join_log", log_size)
                self.ledger.record("train", "join_checkpoint", self.counts.ckpt_size)
                self.start_node(k, "train", step)
                self.records[k] = {
                    "node": k,
                    "joined_step": step,
                    "left_step": None,
                    "left_how": None,
                    "joined_at_s": self.train_clock.elapsed(),
                    "joined_from_checkpoint_step": self.counts.ckpt_step,
                    "join_log_bytes": log_size,
                }
                self.verify(step)
