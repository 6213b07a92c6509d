"""The shared training loop: optim.precision bf16 really autocasts, and leaves the weights fp32."""

import torch
from torch import nn

from raylowcomm.config import OptimConfig
from raylowcomm.tasks import ImageClassification
from raylowcomm.training import make_optimizer, train_steps


def _run(precision: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 4))
    shard = {"pixels": torch.randint(0, 255, (64, 8, 8), dtype=torch.uint8), "labels": torch.randint(0, 4, (64,))}
    optimizer = make_optimizer(OptimConfig(lr=0.1), model)
    stats = train_steps(model, ImageClassification(8), optimizer, shard, 0, 6, 16, seed=1, precision=precision)
    return model, stats


def test_bf16_autocasts_forward_and_backward_but_keeps_fp32_weights():
    fp32, fp32_stats = _run("fp32")
    bf16, bf16_stats = _run("bf16")
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert bf16_stats["mean_loss"] != fp32_stats["mean_loss"], "bf16 must change the arithmetic"
    assert abs(bf16_stats["mean_loss"] - fp32_stats["mean_loss"]) < 0.05
    assert not torch.equal(bf16[1].weight, fp32[1].weight)
    again, _ = _run("bf16")
    assert torch.equal(again[1].weight, bf16[1].weight), "bf16 training is deterministic on one device"
