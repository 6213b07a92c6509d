import pytest

from raylowcomm.cli import main
from raylowcomm.config import ConfigError
from raylowcomm.strategies import from_dict, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.1\nlofi:\n  average_every: 5\n")
    cfg = load_config(path, ["optim.lr=0.01", "nodes.count=3", "lofi.outer_optimizer=nesterov"])
    assert cfg.optim.lr == 0.01 and cfg.nodes.count == 3
    assert cfg.options["lofi"].average_every == 5 and cfg.options["lofi"].outer_optimizer == "nesterov"
    # no strategies named: the ones the registry runs by default, lo-fi and its baseline, written out
    assert cfg.strategies == ["lofi", "ddp"] and cfg.to_dict()["strategies"] == ["lofi", "ddp"]
    assert load_config(path, ["strategies=[spsa]"]).strategies == ["spsa"]


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"optim": {"lr": -1}}, "optim.lr"),
        ({"optim": {"lr": "fast"}}, "optim.lr"),
        ({"optim": {"name": "adam"}}, "optim.name"),
        ({"optim": {"lrr": 0.1}}, "optim.lrr"),
        ({"nodes": {"count": 0}}, "nodes.count"),
        (
            {"nodes": {"gpus": -1}},
            "nodes.gpus",
        ),  # a GPU nowhere in the cluster: tests/test_actors.py (checked against the cluster, not this machine)
        ({"strategies": ["lofi", "gossip"]}, "strategies[1]"),
        ({"data": {"name": "cifar"}}, "data.name"),
        ({"model": {"family": "hf_classifier"}}, "model.family"),
        ({"lofi": {"soup": "greedy"}}, "lofi.soup"),
        (
            {"lofi": {"soup": "greedy"}, "data": {"val_size": 50, "eval_on_nodes": True}},
            "lofi.soup",
        ),  # val rows stay on the nodes
        ({"lofi": {"average_every": 0}}, "lofi.average_every"),
        ({"lofi": {"compress": "int3"}}, "lofi.compress"),
        ({"lofi": {"compress": "int4", "exchange": "driver"}}, "lofi.exchange"),  # compressed rounds go node to node
        ({"lofi": {"compress": "topk", "topk_fraction": 0}}, "lofi.topk_fraction"),
        ({"lofi": {"compress": "int8", "compress_block": 0}}, "lofi.compress_block"),
        ({"lofi": {"compress": "int4", "compress_block": 65537}}, "lofi.compress_block"),  # padding on every node
        ({"lofi": {"compress": "int4", "soup": "greedy"}, "data": {"val_size": 50}}, "lofi.compress"),
        ({"lofi": {"exchange": "peers", "soup": "greedy"}, "data": {"val_size": 50}}, "lofi.exchange"),
        (
            {"lofi": {"compress": "int4", "average_every": 8, "overlap": 1, "mix": 0.5}, "model": {"lora": {"r": 4}}},
            "lofi.mix",
        ),  # a landed LoRA round restarts the adapters: nothing of the node's own is left to mix
        ({"model": {"path": "/no/such/weights"}}, "model.path"),
    ],
)
def test_bad_fields_name_the_field(raw, field):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field_name == field
    assert f"'{field}'" in str(err.value)


def test_cli_rejects_bad_config_before_any_actor(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  momentum: 1.5\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "optim.momentum" in err and "1.5" in err and "[0, 1)" in err


def test_cli_rejects_malformed_override(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("{}\n")
    assert main(["run", str(path), "--set", "optim.lr"]) == 2
    assert "key.sub=value" in capsys.readouterr().err


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    # YAML 1.1 (PyYAML) reads `3e-5` as a string; a float field takes it as the number it is.
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-5\n")
    cfg = load_config(path, ["spsa.eps=1E-3"])
    assert cfg.optim.lr == 3e-5 and cfg.options["spsa"].eps == 1e-3


@pytest.mark.parametrize(
    "strategy, field, refused",
    [
        ("ddp", {"checkpoint_every": 10, "nodes": {"max_restarts": 3}}, None),  # Ray Train checkpoints and restarts
        ("interlocking", {"checkpoint_every": 10}, "checkpoint_every"),
        ("spsa", {"nodes": {"max_restarts": 3}}, "nodes.max_restarts"),
        ("lofi", {"checkpoint_every": 10, "nodes": {"max_restarts": 3}}, None),  # lo-fi checkpoints and restarts
        ("spsa", {"checkpoint_every": 10}, None),  # SPSA joiners start from its checkpoints
        ("lofi", {"lofi": {"compress_block": 128}}, "lofi.compress_block"),  # compress: none
        ("lofi", {"lofi": {"topk_fraction": 0.1}}, "lofi.topk_fraction"),
        ("lofi", {"lofi": {"error_feedback": False}}, "lofi.error_feedback"),
        ("lofi", {"lofi": {"compress": "int4", "compress_block": 128, "error_feedback": False}}, None),
    ],
)
def test_options_a_strategy_does_not_offer_are_refused(caplog, strategy, field, refused):
    """A run of one strategy that sets an option it cannot honour is refused (config.applicability);
    the options it honours load without a word."""
    model = {"name": "test_resnet", "family": "timm", "pretrained": False}
    raw = {"model": model, "strategies": [strategy], **field}
    if refused:
        with pytest.raises(ConfigError, match="cannot take effect") as err:
            from_dict(raw)
        assert err.value.field_name == refused
        return
    with caplog.at_level("WARNING", logger="raylowcomm"):
        cfg = from_dict(raw)
    assert not caplog.records
    assert cfg.checkpoint_steps == field.get("checkpoint_every", 50) and cfg.restarts == field.get("nodes", {}).get(
        "max_restarts", 2
    )


def test_null_for_an_optional_section_means_none_not_its_defaults():
    """A config written back (config.yaml, a bench's per-link config) says `lora: null`: no LoRA."""
    cfg = from_dict({"model": {"lora": None}, "data": {"shift_size": None}})
    assert cfg.model.lora is None and cfg.data.shift_size is None
    assert from_dict(from_dict({"model": {"lora": {"r": 4}}}).to_dict()).model.lora.r == 4
    assert from_dict(from_dict({}).to_dict()).model.lora is None
