"""The driver's side of the data (`prepare_data`: the evaluation sets loaded, the classes) and
the training data as a recipe, not rows (`TrainSource`): small and picklable, it travels to a
node, which reads there only the rows it trains on."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from raylowcomm.catalog import TaskSpec
from raylowcomm.common.batches import Split, num_examples, shard_indices
from raylowcomm.config import RunConfig
from raylowcomm.data.recipe import DataPlan, NodeFiles, SplitRule, describe_data
from raylowcomm.data.rows import Encoder, Rows
from raylowcomm.data.sources import SourceSpec

logger = logging.getLogger("raylowcomm")


@dataclass(frozen=True)
class TrainSource:
    """The training data as a recipe, not rows: small and picklable. `load` runs on a node and
    reads what that node trains on: its own files, or its shard of the shared source, the one the
    driver computes too (same split rule, same shard indices)."""

    encoder: Encoder
    columns: dict[str, str]
    rule: SplitRule
    seed: int
    """The run seed: which shard a node gets (shard_indices)."""
    pool: SourceSpec | None = None
    test: SourceSpec | None = None
    nodes: NodeFiles | None = None
    num_rows: int | None = None
    """The shared source's example count as the driver saw it: a node that finds another fails."""
    eval_on_nodes: bool = False

    def load(self, node: int, count: int) -> Split:
        """Node `node` of `count`'s training rows, read on the calling host."""
        if self.nodes is not None:
            return self._own(node, "train")
        rows = self._shared()
        return self._shard(rows, self.rule.parts(len(rows))["train"], node, count)

    def load_holdout(self, node: int, count: int) -> Split:
        """Node `node`'s own held-out rows (data.eval_on_nodes): test_size of its own files, or its
        shard of the shared source's test rows."""
        if not self.eval_on_nodes:
            raise ValueError("held-out rows on the nodes need data.eval_on_nodes: true")
        if self.nodes is not None:
            return self._own(node, "test")
        if self.test is not None:
            rows = self.encoder.rows(self.test, self.columns, "data.test_split")
            return self._shard(rows, torch.arange(len(rows)), node, count)
        rows = self._shared()
        return self._shard(rows, self.rule.parts(len(rows))["test"], node, count)

    def load_all(self) -> Split:
        """The whole training split of a shared source, in the calling process (tests, benchmarks)."""
        if self.nodes is not None:
            raise ValueError("with data.node_files each node holds its own rows: load(node, count)")
        rows = self._shared()
        return rows.select(self.rule.parts(len(rows))["train"])

    def sizes(self, count: int) -> list[int] | None:
        """Each node's training examples, known without reading them (shared source); None with
        node files, whose sizes only the nodes know (ask each for num_examples of its load)."""
        if self.nodes is not None:
            return None
        rest = self.num_rows - self.rule.test_size - self.rule.val_size
        n = min(self.rule.train_size, rest) if self.rule.train_size else rest
        return [len(range(k, n, count)) for k in range(count)]

    def _own(self, node: int, part: str) -> Split:
        spec = self.nodes.spec(node)
        rows = self.encoder.rows(spec, self.columns, spec.files_field)
        if not self.eval_on_nodes:
            return rows.select()
        rule = SplitRule(self.rule.shuffle_seed, self.rule.test_size, 0, None)
        return rows.select(rule.parts(len(rows))[part])

    def _shared(self) -> Rows:
        rows = self.encoder.rows(self.pool, self.columns, "data.classes")
        if self.num_rows is not None and len(rows) != self.num_rows:
            raise RuntimeError(
                f"the training source changed since the driver read it: {self.num_rows} examples then, "
                f"{len(rows)} here ({self.pool.files or self.pool.source})"
            )
        return rows

    def _shard(self, rows: Rows, index: torch.Tensor, node: int, count: int) -> Split:
        return rows.select(index[shard_indices(len(index), count, self.seed)[node]])


@dataclass
class PreparedData:
    """What the driver holds: evaluation sets only ("test", "val", "shift/<name>"), the classes,
    the training recipe for the nodes, and the task they build (tasks.make_task)."""

    eval_sets: dict[str, Split]
    classes: list[str] | None
    train: TrainSource
    task: TaskSpec
    plan: DataPlan


def prepare_data(
    cfg: RunConfig, tokenizer=None, image_cfg: dict | None = None, plan: DataPlan | None = None
) -> PreparedData:
    """The driver's side: evaluation sets loaded, training rows left where they are. `image_cfg`:
    the model's preprocessing (models.image_preprocessing: input_size, mean, std)."""
    d, plan = cfg.data, plan or describe_data(cfg)
    image_cfg = image_cfg or {}
    image_size = d.image_size or image_cfg.get("input_size", (3, 32, 32))[-1]
    encoder = Encoder(plan.task, plan.classes, tokenizer, d.max_length, image_size, plan.template, plan.label_words)
    encoder.check()
    rule = SplitRule(
        d.shuffle_seed,
        0 if plan.test else d.test_size,
        d.val_size,
        None if plan.nodes else d.train_size,
        needs_train=plan.nodes is None,
    )
    sets, num_rows = {}, None
    if plan.pool is not None:
        rows = encoder.rows(plan.pool, plan.columns, "data.classes")
        num_rows, parts = len(rows), rule.parts(len(rows))
        if not d.eval_on_nodes:
            if plan.test is not None:
                sets["test"] = encoder.rows(plan.test, plan.columns, "data.test_split").select()
            else:
                sets["test"] = rows.select(parts["test"])
            if d.val_size:
                sets["val"] = rows.select(parts["val"])
    for name, (spec, columns) in plan.shifts.items():
        rows = encoder.rows(spec, columns, spec.field)
        sample = None  # data.shift_size: a fixed sample of a large shift set
        if d.shift_size and len(rows) > d.shift_size:
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(d.shuffle_seed))
            sample = order[: d.shift_size].sort().values
        sets[f"shift/{name}"] = rows.select(sample)
    mean, std = tuple(image_cfg.get("mean", (0.5,) * 3)), tuple(image_cfg.get("std", (0.5,) * 3))
    task = TaskSpec(plan.task, image_size, mean, std)
    train = TrainSource(
        encoder,
        plan.columns,
        rule,
        cfg.seed,
        None if plan.nodes else plan.pool,
        plan.test,
        plan.nodes,
        None if plan.nodes else num_rows,
        d.eval_on_nodes,
    )
    sizes = ", ".join(f"{k} {num_examples(v)}" for k, v in sets.items())
    logger.info("data %s: %s, %s", plan.name, plan.task, sizes or "no driver-side sets")
    return PreparedData(sets, list(plan.classes) if plan.classes else None, train, task, plan)
