"""Interlocking's K = 4 step time on one GPU, predicted from measured call times: a decoder of
SmolLM2-135M's shape (random weights: a step's time does not depend on their values) split into K
stages, every stage's forward (its aux head's loss and local backward included), backward and step
timed on the device (CUDA-synchronised, median of the batches after a warm-up), then the schedule
model (`core/interlock/schedule.simulate`, one device per stage, no link) gives the step time of
n-way interlocking and of end to end (n = K), with full aux heads and with heads on a subset of the
positions (`interlocking.aux_positions`). Plain torch, no Ray: it runs where only torch and
transformers are installed.

    python -m benchmarks.interlocking_gpu [--stages 4] [--batch 8] [--length 512] [--micro-batches 4]
        [--positions 1,0.25,0.125] [--batches 6] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raylowcomm.core.interlock.heads import PositionSubsetHead, causal_lm_loss, decoder_aux_heads
from raylowcomm.core.interlock.routing import build_stages, message_plan
from raylowcomm.core.interlock.schedule import StageCost, simulate
from raylowcomm.core.interlock.splitting import split_hf_decoder

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)


def model_of(tiny: bool, device: str) -> LlamaForCausalLM:
    shape = TINY if tiny else SMOLLM2_135M
    config = LlamaConfig(vocab_size=512 if tiny else 49152, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).train()


def timed(device: str, call, *args):
    """`call(*args)` and its seconds, the device's queued work included."""
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    out = call(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - began


def micro_batch(stages, mb_id: int, ids, device: str, calls: dict, sent: list, keep: bool) -> None:
    """One micro-batch as `run_interlocked_batch` runs it, each stage call timed into `calls`."""
    h, inbox = ids, [{} for _ in stages]
    for k, stage in enumerate(stages):
        h, forward = timed(device, stage.forward, mb_id, h, ids)
        msg, early = timed(device, stage.backward, mb_id, {})
        if keep:
            calls[(k, "forward")].append(forward + early)
        if k < len(stages) - 1:
            sent[k] = h.nbytes
        if msg and k:
            inbox[k - 1].update(msg)
    for k in reversed(range(len(stages))):
        if stages[k].needs_from_downstream():
            msg, back = timed(device, stages[k].backward, mb_id, inbox[k])
            if keep:
                calls[(k, "backward")].append(back)
            if msg and k:
                inbox[k - 1].update(msg)


def measure(args, positions: float, n: int, device: str) -> list[StageCost]:
    """Median seconds of each stage's forward (with its head's loss and early backward), backward on one
    downstream message and optimizer step, over `args.batches` batches after one warm-up."""
    model = model_of(args.tiny, device)
    modules = split_hf_decoder(model, args.stages)
    heads = [head.to(device) for head in decoder_aux_heads(model, args.stages)]
    if positions < 1:
        heads = [PositionSubsetHead(h, positions, seed=k) for k, h in enumerate(heads)]
    stages = build_stages(
        modules,
        heads,
        n,
        "farthest",
        loss_fn=causal_lm_loss,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-4),
        micro_batches_per_step=args.micro_batches,
    )
    vocab, size = model.config.vocab_size, args.batch // args.micro_batches
    calls = {(k, kind): [] for k in range(args.stages) for kind in ("forward", "backward", "step")}
    sent = [0] * args.stages
    for batch in range(args.batches + 1):  # batch 0 warms up
        for mb in range(args.micro_batches):
            ids = torch.randint(0, vocab, (size, args.length), device=device)
            micro_batch(stages, batch * args.micro_batches + mb, ids, device, calls, sent, batch > 0)
        for k, stage in enumerate(stages):
            _, step = timed(device, stage.step)
            if batch:
                calls[(k, "step")].append(step)
            stage.pop_losses()
    med = {key: statistics.median(v) if v else 0.0 for key, v in calls.items()}
    return [
        StageCost(med[(k, "forward")], med[(k, "backward")], med[(k, "step")], sent[k], sent[k - 1] if k else 0)
        for k in range(args.stages)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--positions", default="1,0.25,0.125", help="aux_positions fractions, comma-separated")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--stage-batches", type=int, default=2, help="batches a stage holds in the overlap rows")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer toy (a CPU smoke test)")
    parser.add_argument("--out", help="a JSON file for the figures")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    K, rows = args.stages, []
    for positions in (float(p) for p in args.positions.split(",")):
        for n in (2, K):
            costs = measure(args, positions, n, device)
            plan = message_plan(K, n, "farthest")
            step_s = simulate(costs, plan, args.micro_batches, 12).step_time_s
            ahead_s = simulate(costs, plan, args.micro_batches, 12, stage_batches=args.stage_batches).step_time_s
            rows.append({"positions": positions, "n": n, "step_s": step_s, "overlap_step_s": ahead_s, "costs": costs})
            print(
                f"aux_positions {positions:g}, n = {n}: predicted step {step_s * 1e3:.2f} ms, "
                f"{ahead_s * 1e3:.2f} ms overlapping {args.stage_batches} batches a stage; "
                f"forward calls {[round(c.forward_s * 1e3, 2) for c in costs]} ms, "
                f"backward {[round(c.backward_s * 1e3, 2) for c in costs]} ms",
                flush=True,
            )
    end_to_end = {r["positions"]: r["step_s"] for r in rows if r["n"] == K}
    full = end_to_end[max(end_to_end)]
    for r in rows:
        if r["n"] == 2:
            print(
                f"2-way interlocking, aux_positions {r['positions']:g}: {r['step_s'] / full:.3f}x end to end's "
                f"step (end to end with the same heads: {r['step_s'] / end_to_end[r['positions']]:.3f}x), "
                f"{r['overlap_step_s'] / full:.3f}x with stages overlapping batches (interlocking.overlap)"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{**r, "costs": [c.__dict__ for c in r["costs"]]} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
