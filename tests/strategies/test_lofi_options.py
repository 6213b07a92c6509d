"""lo-fi's option groups (`options.LofiOptions`) without Ray: each group passes a good config and refuses a
bad combination of its fields with the field, the value and the fix; the exchange is chosen once per
validation and handed to the groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from raylowcomm.config import ConfigError, LoraConfig
from raylowcomm.core.membership import LeaveEvent
from raylowcomm.finetune import FullWeights
from raylowcomm.strategies import lofi as lofi_module
from raylowcomm.strategies.lofi import Lofi, exchange_for
from raylowcomm.strategies.lofi.options import LofiOptions
from raylowcomm.strategies.lofi.peers import PeerExchange
from raylowcomm.strategies.lofi.quorum import QuorumExchange
from raylowcomm.strategies.lofi.star import StarExchange
from raylowcomm.strategies.lofi.streaming import module_of
from tests.strategies.test_lofi import tiny_config

GOOD = {"average_every": 4, "compress": "int8", "fragments": 2, "overlap": 1, "dense": ["head"]}
"""Peer rounds with every group's options in use: a config every group passes."""


config = tiny_config
"""The lo-fi tests' small config: the options under test are all that changes."""


def refusal(cfg, **changes) -> ConfigError:
    """The error `Lofi.validate` raises once `changes` are set on a config that passed."""
    for name, value in changes.items():
        setattr(cfg.options["lofi"], name, value)
    with pytest.raises(ConfigError) as err:
        Lofi.validate(cfg)
    return err.value


def test_a_good_config_passes_every_group():
    cfg = config(**GOOD)
    groups = LofiOptions.of(Lofi.opts(cfg))
    assert (groups.rounds.fragments, groups.codec.compress, groups.quorum.quorum) == (2, "int8", None)
    assert exchange_for(cfg) is PeerExchange
    groups.rounds.check(cfg, PeerExchange, timed=False)
    groups.codec.check(groups.rounds)
    groups.quorum.check(cfg, PeerExchange, groups.rounds, groups.codec)
    groups.outer.check(cfg)
    groups.probe.check(cfg, PeerExchange, groups.outer)
    groups.average.check(cfg, PeerExchange, groups.rounds, groups.codec)


def test_the_exchange_is_chosen_once_per_validation(monkeypatch):
    cfg, chosen = config(**GOOD), []

    def counted(cfg):
        chosen.append(exchange_for(cfg))
        return chosen[-1]

    monkeypatch.setattr(lofi_module, "exchange_for", counted)
    Lofi.validate(cfg)
    assert chosen == [PeerExchange]


@pytest.mark.parametrize(
    "changes, field, fix",
    [
        ({"compress": "none", "exchange": "auto"}, "lofi.fragments", "needs peer rounds"),
        ({"overlap": 3}, "lofi.overlap", "at most average_every/fragments (2)"),
        ({"fragments": 3}, "lofi.fragments", "must divide lofi.average_every (4)"),
        ({"average_every": [2, 4]}, "lofi.fragments", "needs one period"),
        ({"warmup_steps": 2, "average_every": None, "fragments": 1, "overlap": 0}, "lofi.warmup_steps", "needs rounds"),
        ({"round_momentum": "reset"}, "lofi.round_momentum", "lofi.fragments: 1"),
    ],
)
def test_rounds_refuse_what_their_topology_cannot_run(changes, field, fix):
    err = refusal(config(**GOOD), **changes)
    assert err.field_name == field and fix in err.allowed


def test_rounds_with_adapters_leave_nothing_to_mix():
    cfg = config(**GOOD)
    cfg.model.lora = LoraConfig(r=4, alpha=8)
    err = refusal(cfg, mix=0.5, fragments=1, dense=[])
    assert err.field_name == "lofi.mix" and "set lofi.mix: 0" in err.allowed


def test_rounds_against_the_loaded_model_and_the_runs_length():
    cfg = config(**GOOD)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # two modules to cut into fragments
    ctx = SimpleNamespace(cfg=cfg, architecture=model, fine_tune=FullWeights())
    rounds = LofiOptions.of(Lofi.opts(cfg)).rounds
    rounds.check_loaded(ctx, module_of, smallest_shard=256)  # 2 epochs of 16 steps: rounds every 4 fit
    with pytest.raises(ConfigError, match="sends 2 modules") as err:
        LofiOptions.of(Lofi.opts(config(**{**GOOD, "fragments": 4}))).rounds.check_loaded(ctx, module_of, None)
    assert err.value.field_name == "lofi.fragments"
    long = LofiOptions.of(Lofi.opts(config(average_every=40))).rounds
    with pytest.raises(ConfigError, match="longer than the run") as err:
        long.check_loaded(SimpleNamespace(**{**vars(ctx), "cfg": config(average_every=40)}), module_of, 256)
    assert err.value.field_name == "lofi.average_every" and "at most 32" in err.value.allowed


@pytest.mark.parametrize(
    "changes, field, fix",
    [
        ({"exchange": "driver", "fragments": 1, "overlap": 0}, "lofi.exchange", "set lofi.exchange: peers"),
        ({"compress": "none", "exchange": "peers", "fragments": 1}, "lofi.dense", "set lofi.compress"),
        ({"compress": "topk", "topk_fraction": 0.0}, "lofi.topk_fraction", "(0, 1]"),
        ({"compress_block": 0}, "lofi.compress_block", "[1, 65536]"),
    ],
)
def test_the_codec_refuses_what_cannot_cross(changes, field, fix):
    err = refusal(config(**GOOD), **changes)
    assert err.field_name == field and fix in err.allowed


QUORUM = {"average_every": 4, "compress": "int8", "quorum": 2}


@pytest.mark.parametrize(
    "lofi, changes, field, fix",
    [
        ({"average_every": 4}, {"quorum": 2}, "lofi.quorum", "quorum rounds are peer rounds"),
        (QUORUM, {"quorum": 3}, "lofi.quorum", "a node count in 1..2"),
        (QUORUM, {"grace_s": -1.0}, "lofi.grace_s", ">= 0 seconds"),
        (QUORUM, {"sync": "time", "average_every": None}, "lofi.sync_every_s", "seconds between payloads"),
        (QUORUM, {"sync": "time", "sync_every_s": 2.0}, "lofi.average_every", "sync: time replaces average_every"),
        (QUORUM, {"leave": [LeaveEvent(node=1, step=3, how="kill")]}, "lofi.leave[0].how", "set how: remove"),
        (QUORUM, {"leave": [LeaveEvent(node=5, step=3)]}, "lofi.leave[0].node", "no such node"),
        (QUORUM, {"fragments": 2}, "lofi.fragments", "quorum rounds sync the whole model"),
        (QUORUM, {"final_round": "exact"}, "lofi.final_round", "set lofi.final_round: compressed"),
        ({"average_every": 4}, {"keep_training": True}, "lofi.keep_training", "set lofi.quorum"),
        (GOOD, {"keep_training": True, "mix": 0.5}, "lofi.mix", "with lofi.keep_training"),
    ],
)
def test_quorum_and_membership_refuse_what_quorum_rounds_cannot_run(lofi, changes, field, fix):
    err = refusal(config(**lofi), **changes)
    assert err.field_name == field and fix in err.allowed


def test_quorum_rounds_are_chosen_where_the_options_ask_for_them():
    assert exchange_for(config(**QUORUM)) is QuorumExchange
    assert exchange_for(config(average_every=4)) is StarExchange
    cfg = config(**QUORUM, leave=[{"node": 1, "step": 3}])
    quorum = LofiOptions.of(Lofi.opts(cfg)).quorum
    quorum.check_loaded(cfg, steps=32)
    with pytest.raises(ConfigError, match="the run has 3 steps") as err:
        quorum.check_loaded(cfg, steps=3)
    assert err.value.field_name == "lofi.leave[0].step"


@pytest.mark.parametrize(
    "lofi, changes, field, fix",
    [
        ({}, {"outer_lr": 0.0}, "lofi.outer_lr", "> 0"),
        ({}, {"outer_momentum": 1.0}, "lofi.outer_momentum", "[0, 1)"),
        ({"average_every": 4}, {"outer_optimizer": "nesterov", "probe_steps": 2}, "lofi.probe_steps", "peer rounds"),
        ({}, {"probe_steps": -1}, "lofi.probe_steps", ">= 0"),
        ({}, {"soup": "greedy"}, "lofi.soup", "set data.val_size > 0"),
        ({}, {"bn_batches": 0}, "lofi.bn_batches", "> 0, or null"),
    ],
)
def test_the_outer_step_probe_and_average_refuse_bad_values(lofi, changes, field, fix):
    err = refusal(config(**lofi), **changes)
    assert err.field_name == field and fix in err.allowed


def test_a_greedy_soup_is_refused_on_peer_rounds_by_the_codec_that_asks_for_them():
    cfg = config(compress="int4")
    cfg.data.val_size = 32
    err = refusal(cfg, soup="greedy")
    assert (err.field_name, err.value) == ("lofi.compress", "int4") and "set lofi.soup: uniform" in err.allowed
