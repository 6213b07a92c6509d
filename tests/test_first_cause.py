"""A failed stage or node says why: model overrides that contradict the tokenizer or the data stop the
command before Ray starts, one line naming the field; and where a stage or node raises anyway, its own
exception (type, message, which stage or node, which call) is the strategy's error and its record's
`failure`, never the driver's follow-on error (an IndexError on an empty loss list)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
import yaml

from raylowcomm import runner
from raylowcomm.cli import main
from raylowcomm.config import ConfigError
from raylowcomm.failures import FirstFailure, NodeFailed, all_left, first_of
from raylowcomm.model_overrides import check_overrides
from raylowcomm.runner import failure_message, prepare, run
from raylowcomm.strategies import from_dict
from tests.test_actors import live_groups

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}
"""A small Llama of SmolLM2's family, drawn at random: its tokenizer has 49,152 tokens."""


def scratch_lm(strategies: list[str], **overrides) -> dict:
    return {
        "model": {
            "name": "SmolLM2-135M",
            "family": "hf_causal_lm",
            "pretrained": False,
            "config_overrides": {**SMALL, **overrides},
        },
        "data": {"name": "hamlet", "max_length": 16, "train_size": 16, "test_size": 8},
        "optim": {"name": "sgd", "lr": 0.01, "batch_size": 4, "max_steps": 3},
        "nodes": {"count": 2, "cpus": 1},
        "strategies": strategies,
        "interlocking": {"stages": 2, "micro_batches": 2, "balance": "blocks"},
        "spsa": {"verify_every": 100},
    }


def test_a_vocabulary_below_the_tokenizers_stops_raylowcomm_run_before_ray(tmp_path, monkeypatch, capsys):
    """The issue's config: `raylowcomm run` ends with exit 2 and one line naming the override, the
    tokenizer's size and the fix, before Ray starts (a stage's IndexError was all it said)."""

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started: the override must be refused before")

    monkeypatch.setattr(runner, "init_ray", no_ray)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**scratch_lm(["interlocking"], vocab_size=8000), "out_dir": str(tmp_path / "o")}))
    assert main(["run", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: config field 'model.config_overrides.vocab_size' = 8000 is invalid: ")
    assert "49152 tokens of SmolLM2-135M's tokenizer" in lines[0] and "at least 49152" in lines[0]
    assert not (tmp_path / "o" / "results.json").exists()


def test_fewer_positions_than_data_max_length_are_refused_while_the_tokenizers_vocabulary_passes(tmp_path):
    with pytest.raises(ConfigError) as err:
        prepare(from_dict(scratch_lm(["interlocking"], max_position_embeddings=8)), tmp_path / "a")
    assert err.value.field_name == "model.config_overrides.max_position_embeddings"
    assert "below data.max_length (16 tokens" in str(err.value)
    ctx = prepare(from_dict(scratch_lm(["interlocking"], vocab_size=49152, max_position_embeddings=16)), tmp_path)
    assert ctx.spec.hf_config.vocab_size == 49152


class Tokenizer:
    """What `check_overrides` reads of a tokenizer: its size and the inputs it makes."""

    def __init__(self, size: int, inputs=("input_ids", "token_type_ids", "attention_mask")):
        self.size, self.model_input_names = size, list(inputs)

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize(
    "overrides, config, columns, field, says",
    [
        ({"vocab_size": 100}, {"vocab_size": 100}, {}, "vocab_size", "below the 30522 tokens"),
        ({"num_labels": 3}, {"num_labels": 3}, {}, "num_labels", "gives the head 3 classes where the data has 2"),
        ({"id2label": {0: "a"}}, {"num_labels": 1}, {}, "id2label", "gives the head 1 classes where the data has 2"),
        ({"type_vocab_size": 1}, {"type_vocab_size": 1}, {"text_pair": "b"}, "type_vocab_size", "segment ids 0 and 1"),
        ({"max_position_embeddings": 32}, {"max_position_embeddings": 32}, {}, "max_position_embeddings", "64 tokens"),
    ],
)
def test_each_override_that_contradicts_the_tokenizer_or_data_is_named(overrides, config, columns, field, says):
    cfg = from_dict(
        {
            "model": {"name": "all-MiniLM-L6-v2", "family": "hf_classifier", "pretrained": False},
            "data": {"name": "rotten_tomatoes", "max_length": 64},
        }
    )
    cfg.model.config_overrides = overrides
    built = SimpleNamespace(
        **{"vocab_size": 30522, "num_labels": 2, "type_vocab_size": 2, "max_position_embeddings": 512, **config}
    )
    with pytest.raises(ConfigError) as err:
        check_overrides(cfg, built, Tokenizer(30522), 2, {"text": "a", **columns})
    assert err.value.field_name == f"model.config_overrides.{field}" and says in str(err.value)
    fitting = SimpleNamespace(vocab_size=30522, num_labels=2, type_vocab_size=2, max_position_embeddings=512)
    check_overrides(cfg, fitting, Tokenizer(30522), 2, {"text": "a", **columns})  # the same overrides, fitting


def test_an_actors_first_own_exception_is_kept_and_named_cause_first():
    first = FirstFailure(actor="interlocking stage 1", stage=1, of=2)
    with pytest.raises(IndexError), first.watch("forward", batch=0, micro_batch=1):
        [][0]
    with pytest.raises(RuntimeError), first.watch("backward", batch=0, micro_batch=1):
        raise RuntimeError("a consequence")
    assert first.failure["type"] == "IndexError" and first.failure["call"] == "forward"
    later = {**first.failure, "stage": 0, "at": first.failure["at"] + 1}
    failure = first_of([None, later, first.failure])
    assert failure == {
        "actor": "interlocking stage 1",
        "stage": 1,
        "of": 2,
        "call": "forward",
        "batch": 0,
        "micro_batch": 1,
        "type": "IndexError",
        "message": "list index out of range",
    }
    err = NodeFailed(failure)
    expected = "IndexError: list index out of range (interlocking stage 1 of 2, in forward, batch 0, micro-batch 1)"
    assert str(err) == failure_message(err) == expected


STAGE_FAILURE = {
    "actor": "interlocking stage 0",
    "stage": 0,
    "of": 2,
    "call": "forward",
    "batch": 0,
    "micro_batch": 0,
    "type": "IndexError",
    "message": "index out of range in self",
}


@pytest.mark.slow
@pytest.mark.parametrize("strategies", [["interlocking", "lofi"], pytest.param(["spsa"], marks=pytest.mark.heavy)])
def test_a_stage_or_node_failing_at_its_first_batch_is_the_error_not_the_drivers_follow_on(
    ray_session, tmp_path, monkeypatch, strategies
):
    """The issue's run, let through the driver's check: the interlocking stage holding the embedding
    fails at its first forward with its own IndexError, which is the record's error and `failure`; the
    driver used to raise its own IndexError (`stage_losses[K-1][-1]`, an empty list) in its place.
    lo-fi and SPSA nodes name the node and the call the same way."""
    monkeypatch.setattr(runner, "check_overrides", lambda *args: None)
    own = "IndexError: index out of range in self"
    cpus = ray.available_resources().get("CPU", 0)
    records = run(from_dict(scratch_lm(strategies, vocab_size=8000)), tmp_path)
    deadline = time.time() + 30  # a killed actor's CPUs come back as Ray notices it gone
    while ray.available_resources().get("CPU", 0) < cpus and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= cpus, "every CPU the failed runs took is free again"
    assert live_groups() == {}, "a placement group outlived its failed run"
    for record in records:
        failure = record["failure"]
        if record["strategy"] == "interlocking":
            assert record["error"] == f"{own} (interlocking stage 0 of 2, in forward, batch 0, micro-batch 0)"
            assert failure == STAGE_FAILURE
            continue
        label = f"{record['strategy']} node"
        assert record["error"].startswith(f"{own} ({label} "), record
        assert failure["actor"] == f"{label} {failure['node']}" and failure["type"] == "IndexError", failure
        assert failure["message"] == "index out of range in self" and failure["call"], failure


def test_when_every_node_has_died_the_first_death_is_the_error():
    died_of = {
        1: {"type": "ActorDiedError", "message": "The actor died unexpectedly."},
        0: {"type": "X", "message": ""},
    }
    err = all_left(4, "spsa node", died_of)
    assert isinstance(err, NodeFailed) and err.failure["node"] == 1
    assert str(err) == "ActorDiedError: The actor died unexpectedly. (spsa node 1); every node had left by step 4"
    scheduled = all_left(4, "spsa node", {})  # they left on schedule: no death to name
    assert type(scheduled) is RuntimeError and str(scheduled) == "step 4: every node has left"


@pytest.mark.slow
def test_lofi_quorum_and_spsa_runs_whose_every_node_dies_name_the_first_death(ray_session, tmp_path):
    """Both nodes preempted, none restarted: lo-fi on quorum rounds used to end in the driver's own
    StopIteration (checking the replicas of no node), SPSA in "every node has left"."""
    raw = {
        "model": {"name": "test_resnet", "family": "timm", "pretrained": False},
        "data": {"name": "mnist", "train_size": 128, "test_size": 64, "image_size": 16},
        "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "max_steps": 8},
        "nodes": {"count": 2, "cpus": 1, "max_restarts": 0},
        "strategies": ["lofi", "spsa"],
        "lofi": {"quorum": 1, "average_every": 2, "exchange": "peers"},
        "spsa": {"verify_every": 100},
        "churn": {"kill": [{"node": 0, "at_step": 3}, {"node": 1, "at_step": 3}]},
    }
    for record, label in zip(run(from_dict(raw), tmp_path), ("lofi node", "spsa node")):
        failure = record["failure"]
        assert failure["actor"] == f"{label} {failure['node']}" and failure["type"] == "ActorDiedError", record
        assert record["error"].startswith("ActorDiedError: ") and "every node had left by step" in record["error"]
