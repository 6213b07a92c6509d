"""The SmolLM2 SPSA example's recipe (python -m benchmarks.zo): as shipped it is the one-sided recipe the
docs measured, it tunes exactly the final RMSNorm of a Llama-architecture causal LM, a step moves that
tensor and nothing else, and a step equals a plain-torch reference through the prompt task's loss, for
the example's one-sided normalised step and for the two-point step its header gives the flags of."""

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raylowcomm.core.zo.codec import codec_for
from raylowcomm.core.zo.perturb import trainable_parameters
from raylowcomm.core.zo.replay import Replica, SeedSchedule
from raylowcomm.strategies import load_config
from raylowcomm.tasks import PromptClassification

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spsa_smollm2_rotten_tomatoes.yaml"
torch.set_num_threads(1)


def tiny_llama() -> LlamaForCausalLM:
    """SmolLM2's architecture at toy size: tied embeddings, RMSNorm, grouped-query attention."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def prompt_batch(seed: int = 1, rows: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, 10, dtype=torch.long)
    mask[::2, 7:] = 0  # right padding on every other row
    return {
        "input_ids": torch.randint(0, 64, (rows, 10), generator=g),
        "attention_mask": mask,
        "choice_ids": torch.tensor([[5, 9]] * rows),
        "labels": torch.randint(0, 2, (rows,), generator=g),
    }


def example_spsa(overrides: list[str] | None = None):
    return load_config(str(EXAMPLE), overrides or []).options["spsa"]


def rademacher_z(seed: int, n: int = 32) -> torch.Tensor:
    """z of perturbation `seed` on one tensor of n ≤ 64 weights: from the seed's generator, 64 random bits
    per word, bit k of word i is element 64·i + k, +1 if set."""
    words = torch.empty(1, dtype=torch.int64).random_(-(1 << 63), None, generator=torch.Generator().manual_seed(seed))
    bits = (words.view(torch.uint8).unsqueeze(1) >> torch.arange(8)) & 1
    return (bits.reshape(-1)[:n] * 2 - 1).float()


def test_the_example_is_the_measured_one_sided_recipe_and_names_the_two_point_flags():
    """`raylowcomm run` of the example as shipped is the run `python -m benchmarks.zo --variants one_sided`
    measured (docs/strategies/spsa.md: 68.7% ± 5.5 in 300 steps): the whole config, not only the spsa
    section; and the flags its header gives for the two-point recipe (whose figures across N the docs
    give) are the `two_point` variant's."""
    from benchmarks.zo import WORKLOADS

    config, common, variants = WORKLOADS["smollm2"]
    assert config == EXAMPLE
    shipped = load_config(str(EXAMPLE), [])
    assert shipped == load_config(str(EXAMPLE), common + variants["one_sided"])
    o = shipped.options["spsa"]
    assert (o.estimator, o.step, o.samples, o.lr, o.eps) == ("one_sided_batch", "normalised", 3, 1e-2, 1e-3)
    assert shipped.nodes.count == 1 and shipped.optim.batch_size == 8 and shipped.optim.max_steps == 300
    header = " ".join(line.lstrip("# ").strip() for line in EXAMPLE.read_text().splitlines() if line.startswith("#"))
    assert " ".join(f"--set {flag}" for flag in variants["two_point"]) in header
    two = example_spsa(variants["two_point"])
    assert (two.estimator, two.step, two.samples, two.lr) == ("two_point", "plain", 1, 3e-2)


def test_the_example_tunes_exactly_the_final_norm_of_a_llama():
    names = [n for n, _ in trainable_parameters(tiny_llama(), example_spsa().include)]
    assert names == ["model.norm.weight"]


def test_a_step_of_the_example_is_the_reference_one_sided_normalised_step_and_moves_nothing_else():
    """One Replica step under the example's options (made as a node makes them) against plain torch:
    L0 = L(θ) once, g_s = decode(encode((L(θ+εz_s) − L0)/ε)) for the step's 3 seeds, σ the sample
    standard deviation of the 3 decoded g, θ ← θ − lr·(1/3)·Σ (g_s/σ)·z_s."""
    cfg = load_config(str(EXAMPLE), [])
    o = cfg.options["spsa"]
    assert o.perturbation == "rademacher" and o.density == 1.0
    model, task, batch = tiny_llama(), PromptClassification(), prompt_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zs = [rademacher_z(SeedSchedule(0).seed(0, 0, s)) for s in range(o.samples)]
    norm = model.model.norm.weight
    theta = norm.detach().clone()
    codec = o.make_codec()
    with torch.no_grad():
        base = float(task.loss(model, batch))
        gs = []
        for z in zs:
            norm.copy_(theta + o.eps * z)
            gs.append(codec.decode(codec.encode((float(task.loss(model, batch)) - base) / o.eps)))
        norm.copy_(theta)
    mean = sum(gs) / len(gs)
    sigma = math.sqrt(sum((g - mean) ** 2 for g in gs) / (len(gs) - 1))
    expected = theta - o.lr * sum((g / sigma) * z for g, z in zip(gs, zs, strict=True)) / len(gs)

    replica = o.make_replica(model, 0, 0, cfg.optim)
    _, pairs = replica.compute(task.loss, batch)
    replica.apply([0], b"")
    assert [lp for lp, _ in pairs] != [base] * len(pairs) and sigma > 0 and {lb for _, lb in pairs} == {base}
    assert replica.forwards == o.samples + 1
    torch.testing.assert_close(norm.detach(), expected, rtol=0, atol=1e-6)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved == ["model.norm.weight"]


def test_a_step_of_the_two_point_recipe_is_the_reference_two_point_step_and_moves_nothing_else():
    """One Replica step under the two-point recipe (the example with its header's flags: the `two_point`
    variant) against plain torch: z from the seed's generator, g = (L(θ+εz) − L(θ−εz))/2ε with the
    prompt task's loss, θ ← θ − lr·decode(encode(g))·z."""
    from benchmarks.zo import WORKLOADS

    o = example_spsa(WORKLOADS["smollm2"][2]["two_point"])
    assert (o.estimator, o.step, o.samples, o.perturbation) == ("two_point", "plain", 1, "rademacher")
    model, task, batch = tiny_llama(), PromptClassification(), prompt_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    z = rademacher_z(SeedSchedule(0).seed(0, 0, 0))
    norm = model.model.norm.weight
    theta = norm.detach().clone()
    with torch.no_grad():
        losses = []
        for sign in (1, -1):
            norm.copy_(theta + sign * o.eps * z)
            losses.append(float(task.loss(model, batch)))
        norm.copy_(theta)
    codec = codec_for(o.codec, g_min=o.g_min, g_max=o.g_max)
    g = codec.decode(codec.encode((losses[0] - losses[1]) / (2 * o.eps)))
    expected = theta - o.lr * g * z

    replica = Replica(model, 0, 0, codec, eps=o.eps, samples=1, lr=o.lr, include=o.include)
    replica.compute(task.loss, batch)
    replica.apply([0], b"")
    assert g != 0
    torch.testing.assert_close(norm.detach(), expected, rtol=0, atol=1e-6)
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved == ["model.norm.weight"]


# CI's time: the benchmark's replica is benchmarks/zo's, which steps the package's own SPSA code
# (test_spsa's replicas run in CI)
@pytest.mark.heavy
def test_the_benchmark_replica_is_bit_for_bit_a_one_node_run(ray_session, tmp_path):
    """`python -m benchmarks.zo` runs a node's loop in-process (a third of the memory): its weights
    and its curve must be those of `raylowcomm run` with one node, under both estimators."""
    from benchmarks.zo import run_replica
    from raylowcomm.runner import prepare
    from raylowcomm.strategies.spsa import Spsa
    from tests.strategies.test_spsa import tiny_config

    for spsa in ({"samples": 1}, {"estimator": "one_sided_batch", "step": "normalised", "samples": 3, "lr": 1e-3}):
        cfg = tiny_config(steps=6, count=1, eval_every=3, verify_every=100, **spsa)
        rec = Spsa().run(prepare(cfg, tmp_path / "ray")).to_dict()
        mine = run_replica(cfg, tmp_path / "in_process")
        assert mine["hash"] == rec["nodes"][0]["final_hash"]
        ray_curve = [{"step": 0, **rec["details"]["step0_metrics"]}] + rec["curve"]
        assert [(p["step"], p["forwards"], p["accuracy"], p["loss"]) for p in mine["curve"]] == [
            (p["step"], p.get("forwards", 0), p["id_accuracy"], p["id_loss"]) for p in ray_curve
        ]


@pytest.mark.heavy  # CI's time: the one-node replica's bit-for-bit test runs in CI
def test_the_benchmark_replica_stands_for_n_nodes_bit_for_bit(ray_session, tmp_path):
    """`python -m benchmarks.zo --nodes 4` computes each node's codes on its own shard in one process and
    applies all of them: its weights and held-out scores must be those of every node of a 4-node run."""
    from benchmarks.zo import run_replica
    from raylowcomm.runner import prepare
    from raylowcomm.strategies.spsa import Spsa
    from tests.strategies.test_spsa import tiny_config

    cfg = tiny_config(steps=6, count=4, eval_every=3, verify_every=100, samples=2)
    rec = Spsa().run(prepare(cfg, tmp_path / "ray")).to_dict()
    mine = run_replica(cfg, tmp_path / "in_process", nodes=4)
    assert {n["final_hash"] for n in rec["nodes"]} == {mine["hash"]}
    ray_curve = [{"step": 0, **rec["details"]["step0_metrics"]}] + rec["curve"]
    assert [(p["step"], p["accuracy"], p["loss"]) for p in mine["curve"]] == [
        (p["step"], p["id_accuracy"], p["id_loss"]) for p in ray_curve
    ]


def test_every_zo_benchmark_variant_is_a_valid_spsa_config():
    """Each workload's variants (`python -m benchmarks.zo --workload ...`) load and validate as SPSA runs:
    an example renamed or a key misspelt fails here, not an hour into a benchmark."""
    from benchmarks.zo import WORKLOADS
    from raylowcomm.strategies import load_config
    from raylowcomm.strategies.spsa import Spsa
    from raylowcomm.strategies.spsa.config import check_membership

    for config, common, variants in WORKLOADS.values():
        for overrides in variants.values():
            cfg = load_config(str(config), common + overrides)
            assert cfg.strategies == ["spsa"] and cfg.nodes.count == 1  # one replica, in process
            Spsa.validate(cfg)
            check_membership(cfg.nodes.count, Spsa.opts(cfg), 10)
