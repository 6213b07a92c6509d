"""The shared training loop: optim.precision bf16 really autocasts, and leaves the weights fp32."""

import torch
import torch.nn.functional as F
from torch import nn

from raylowcomm.common.batches import batch_at
from raylowcomm.config import OptimConfig
from raylowcomm.tasks import ImageClassification
from raylowcomm.training import StepHooks, make_optimizer, train_steps


def _setup() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 4))
    shard = {"pixels": torch.randint(0, 255, (64, 8, 8), dtype=torch.uint8), "labels": torch.randint(0, 4, (64,))}
    return model, shard


def _run(precision: str, steps: int = 6) -> tuple[nn.Module, dict]:
    model, shard = _setup()
    optimizer = make_optimizer(OptimConfig(lr=0.1), model)
    stats = train_steps(model, ImageClassification(8), optimizer, shard, 0, steps, 16, seed=1, precision=precision)
    return model, stats


def _linear_error(layer: nn.Linear, h: torch.Tensor, dh: torch.Tensor, cast: float, out: float) -> tuple:
    """(exact output, bound on the computed one's error), float64, elementwise: input h known to within dh, input
    and weights cast to a format of unit roundoff `cast` (0: not cast), the K products and the bias summed in
    float32 (γ_{K+1} = (K+1)·2^-24 / (1 − (K+1)·2^-24) of the absolute terms), the result rounded to a format of
    unit roundoff `out` up to twice (accumulator, then after the bias), with (1 + out)² − 1."""
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    k = w.shape[1] + 1
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    terms = (h.abs() + dh) @ w.abs().T  # |W|·(|h| + dh) ≥ |W|·|ĥ|
    pre = (
        dh @ w.abs().T
        + (2 * cast + cast**2) * terms
        + cast * b.abs()
        + gamma * ((1 + cast) ** 2 * terms + (1 + cast) * b.abs())
    )
    z = h @ w.T + b
    rounding = 2 * out + out**2
    return z, pre + rounding * (z.abs() + pre)


def _first_loss_error(model: nn.Sequential, shard: dict, cast: float, out: float) -> float:
    """Bound on |computed − exact| of train_steps' first loss (batch 0, seed 1, the initial weights) with this
    arithmetic: the two layers' errors (`_linear_error`; ReLU is 1-Lipschitz and exact), then cross-entropy,
    which is 2-Lipschitz in the max norm of the logits (its gradient, softmax − one-hot, has ℓ1 norm ≤ 2), its
    own float32 evaluation (max, exp, sum, log, pick: within 2^-19·(1 + max|z|) per row, generous) and the mean
    of 16 rows in float32 (γ_16 of the sum of the rows' losses). The exact values are computed in float64, whose
    2^-53-level errors vanish in those margins."""
    batch = batch_at(shard, 0, 16, 1)
    x = ImageClassification(8).inputs(batch).flatten(1).double()  # float32 in both: exact in float64
    z1, e1 = _linear_error(model[1], x, torch.zeros_like(x), cast, out)
    z2, e2 = _linear_error(model[3], z1.clamp_min(0), e1, cast, out)
    rows = F.cross_entropy(z2, batch["labels"], reduction="none")
    per_row = 2 * e2.max(1).values + 2.0**-19 * (1 + z2.abs().max(1).values + e2.max(1).values)
    return float(per_row.mean() + 16 * 2.0**-24 / (1 - 16 * 2.0**-24) * (rows + per_row).sum() / 16)


def test_bf16_autocasts_forward_and_backward_but_keeps_fp32_weights():
    fp32, fp32_stats = _run("fp32")
    bf16, bf16_stats = _run("bf16")
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert bf16_stats["mean_loss"] != fp32_stats["mean_loss"], "bf16 must change the arithmetic"
    # the first step's loss (same weights, same batch) in each arithmetic, within the sum of the two derived
    # bounds on their errors from the exact loss: bf16 casts inputs and weights (unit roundoff 2^-8) and rounds
    # each layer's output to bf16, accumulating in float32; fp32 rounds only in its float32 sums
    _, bf16_first = _run("bf16", steps=1)
    _, fp32_first = _run("fp32", steps=1)
    model, shard = _setup()
    bound = _first_loss_error(model, shard, cast=2.0**-8, out=2.0**-8) + _first_loss_error(model, shard, 0.0, 0.0)
    assert bf16_first["mean_loss"] != fp32_first["mean_loss"], "bf16 must change the arithmetic"
    assert abs(bf16_first["mean_loss"] - fp32_first["mean_loss"]) <= bound < 0.5
    assert not torch.equal(bf16[1].weight, fp32[1].weight)
    again, _ = _run("bf16")
    assert torch.equal(again[1].weight, bf16[1].weight), "bf16 training is deterministic on one device"


class ScriptedClock:
    """A clock on which every step takes one second: `elapsed` is read once before the loop and once after
    each step."""

    def __init__(self) -> None:
        self.reads = -1

    def elapsed(self) -> float:
        self.reads += 1
        return float(self.reads)


def _steps_until(seconds: float, nearest: bool) -> int:
    model, shard = _setup()
    optimizer = make_optimizer(OptimConfig(lr=0.1), model)
    hooks = StepHooks(clock=ScriptedClock(), stop_after_s=seconds, stop_nearest=nearest)
    return train_steps(model, ImageClassification(8), optimizer, shard, 0, 10, 16, seed=1, hooks=hooks)["steps"]


def test_a_time_limit_stops_at_the_first_step_past_it_or_at_the_nearest_step_end():
    """Steps of 1 s: a budget of 2.4 s stops after step 3 (never short of it); the nearest step end to 2.4 s
    is step 2 (0.4 s early against 0.6 s late), to 2.6 s step 3, and a limit on a step end stops there."""
    assert _steps_until(2.4, nearest=False) == 3 and _steps_until(2.6, nearest=False) == 3
    assert _steps_until(2.4, nearest=True) == 2 and _steps_until(2.6, nearest=True) == 3
    assert _steps_until(2.0, nearest=True) == 2 and _steps_until(2.0, nearest=False) == 2


def test_a_channels_last_model_resumed_under_a_fused_optimizer_takes_the_same_steps(tmp_path):
    """A checkpoint holds the momentum contiguous; a fused SGD step over a channels_last weight and
    a contiguous buffer would pair entries in memory order. Resumed from the file, the run must end
    bit for bit where the uninterrupted one does."""
    import timm

    from raylowcomm.storage import Storage
    from raylowcomm.training import load_checkpoint, save_checkpoint

    cfg = OptimConfig(name="sgd", lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.rand(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(4)]

    def model():
        torch.manual_seed(0)
        return timm.create_model("test_efficientnet", num_classes=10).to(memory_format=torch.channels_last)

    def train(net, opt, part):
        for x, y in part:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    straight = model()
    train(straight, make_optimizer(cfg, straight), batches)
    first = model()
    opt = make_optimizer(cfg, first)
    train(first, opt, batches[:2])
    save_checkpoint(Storage(tmp_path), "state.safetensors", first, opt, 2)
    resumed = model()
    opt = make_optimizer(cfg, resumed)
    load_checkpoint(Storage(tmp_path), "state.safetensors", resumed, opt)
    train(resumed, opt, batches[2:])
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
