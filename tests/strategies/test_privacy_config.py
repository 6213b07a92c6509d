"""`lofi.privacy` before anything starts: every refusal is one `error:` line naming the field, exit code 2,
before Ray starts (the CLI, `raylowcomm run` with `--set`); a good config gets its σ for the run's rounds
and one log line; and one short Ray run whose record's ε is the accountant's."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from raylowcomm.cli import main
from raylowcomm.config import ConfigError, LoraConfig
from raylowcomm.core import privacy
from raylowcomm.runner import prepare
from raylowcomm.storage import Storage
from raylowcomm.strategies.lofi import Lofi
from raylowcomm.strategies.lofi.node_rounds import NodeRounds
from raylowcomm.strategies.lofi.privacy import NodeNoise, PrivacyOptions, PrivacyPlan, secret_path
from tests.strategies.test_lofi import run_lofi, tiny_config
from tests.test_cli_errors import GOOD, no_ray  # noqa: F401 (a fixture)

PEERS = {"compress": "int8", "average_every": 2, "bn_recalibrate": False, "privacy": {"epsilon": 8.0}}
"""Peer rounds with privacy on the CLI tests' small config: 4 steps a node, a round at step 2, the final at 4."""


def cli_config(tmp: Path) -> str:
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "out_dir": str(tmp / "out"), "lofi": PEERS}))
    return str(path)


REFUSALS = [
    ("epsilon-missing", ["lofi.privacy={clip: 1.0}"], "'lofi.privacy.epsilon' = None"),
    ("epsilon-zero", ["lofi.privacy.epsilon=0"], "'lofi.privacy.epsilon' = 0.0"),
    ("delta-one", ["lofi.privacy.delta=1"], "'lofi.privacy.delta' = 1.0"),
    ("delta-zero", ["lofi.privacy.delta=0"], "'lofi.privacy.delta' = 0.0"),
    ("clip-zero", ["lofi.privacy.clip=0"], "'lofi.privacy.clip' = 0.0"),
    ("noise-negative", ["lofi.privacy.noise=-1"], "'lofi.privacy.noise' = -1.0"),
    ("noise-spends-too-much", ["lofi.privacy.noise=0.3"], ("'lofi.privacy.noise' = 0.3", "over the run's 2 rounds")),
    ("epsilon-no-sigma-fits", ["lofi.privacy.epsilon=1.0e-9"], ("'lofi.privacy.epsilon'", "no noise multiplier")),
    ("driver-star", ["lofi.exchange=driver", "lofi.compress=none"], ("'lofi.exchange' = 'driver'", "peers")),
    ("auto-star", ["lofi.compress=none"], ("'lofi.exchange' = 'auto'", "un-noised")),
    ("quorum", ["lofi.quorum=1"], ("'lofi.quorum' = 1", "lockstep")),
    ("sync-time", ["lofi.sync=time", "lofi.sync_every_s=1", "lofi.average_every=null"], "'lofi.sync' = 'time'"),
    ("join", ["lofi.join=[{step: 2}]"], "'lofi.join'"),
    ("soup-greedy", ["lofi.soup=greedy", "data.val_size=16"], "'lofi.soup' = 'greedy'"),
    ("probe", ["lofi.probe_steps=2"], "'lofi.probe_steps' = 2"),
    ("curve", ["eval_every=2"], "'eval_every' = 2"),
    ("weighting", ["lofi.weighting=examples"], "'lofi.weighting' = 'examples'"),
    ("robust-rule", ["lofi.aggregate=median"], "'lofi.aggregate' = 'median'"),
    ("drop-bad-payloads", ["lofi.on_bad_payload=drop"], "'lofi.on_bad_payload' = 'drop'"),
    ("bn-recalibrate", ["lofi.bn_recalibrate=true"], ("'lofi.bn_recalibrate' = True", "bn_recalibrate: false")),
]
"""(case, --set overrides on `PEERS`, what the one error line must say)."""


@pytest.mark.parametrize("overrides, expected", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_every_refusal_is_one_line_and_exit_2_before_ray(tmp_path, capsys, no_ray, overrides, expected):  # noqa: F811
    argv = ["run", cli_config(tmp_path), *[a for o in overrides for a in ("--set", o)]]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for text in expected if isinstance(expected, tuple) else (expected,):
        assert text in lines[0], lines[0]
    assert not no_ray, "Ray was started on bad input"


def test_model_lora_is_refused_beside_privacy():
    cfg = tiny_config(**PEERS)
    cfg.model.lora = LoraConfig()
    with pytest.raises(ConfigError) as err:
        Lofi.validate(cfg)
    assert err.value.field_name == "model.lora"


def test_node_files_are_refused_since_the_rounds_cannot_be_counted():
    cfg = tiny_config(**PEERS)
    cfg.data.node_files = "shards/*.jsonl"
    ctx = type("Ctx", (), {"cfg": cfg, "architecture": None})()
    group = PrivacyOptions.of(Lofi.opts(cfg))
    with pytest.raises(ConfigError) as err:
        group.check_loaded(ctx, Lofi.opts(cfg), None)
    assert err.value.field_name == "data.node_files"


def test_a_good_config_gets_the_sigma_that_fits_and_one_log_line(tmp_path, caplog):
    cfg = tiny_config(**{**PEERS, "average_every": 8})  # 32 steps a node: rounds at 8, 16, 24 and the final one
    with caplog.at_level(logging.INFO):
        prepare(cfg, tmp_path)
    plan = Lofi.opts(cfg).privacy_plan
    assert plan.chosen and plan.nodes == 2 and plan.clip == 1.0
    assert plan.noise_multiplier == privacy.noise_for(8.0, 4, 1e-5)
    record = plan.record(4)
    assert record["epsilon"] <= 8.0 and record["epsilon_one_update_seen_alone"] > record["epsilon"]
    lines = [r.getMessage() for r in caplog.records if "[lofi] privacy:" in r.getMessage()]
    assert len(lines) == 1 and "over 4 rounds" in lines[0] and f"σ={plan.noise_multiplier:.4g}" in lines[0]


def test_a_given_sigma_that_fits_is_kept(tmp_path):
    cfg = tiny_config(**{**PEERS, "average_every": 8, "privacy": {"epsilon": 8.0, "noise": 3.0, "clip": 0.5}})
    prepare(cfg, tmp_path)
    plan = Lofi.opts(cfg).privacy_plan
    assert (plan.noise_multiplier, plan.chosen, plan.clip) == (3.0, False, 0.5)


@pytest.mark.slow
def test_a_private_run_records_the_accountants_epsilon_and_its_nodes_agree(ray_session, tmp_path):
    cfg = tiny_config(**{**PEERS, "average_every": 8, "compress": "int4"})
    _, rec = run_lofi(cfg, tmp_path)
    got = rec["details"]["privacy"]
    rounds = len(rec["details"]["averaging_steps"])  # every round's Δ crosses, the final one's too
    assert got["rounds"] == rounds == 4 and got["unit"] == "node" and got["nodes"] == 2
    assert got["epsilon"] == privacy.epsilon_of(got["noise_multiplier"], rounds, got["delta"]) <= 8.0
    assert got["epsilon_one_update_seen_alone"] == privacy.epsilon_of(got["noise_multiplier"] / 2**0.5, rounds, 1e-5)
    assert got["epsilon_against_peers_and_driver"] == got["epsilon_one_update_seen_alone"]  # rounds in the clear
    secrets = [tmp_path / "state" / "lofi" / "checkpoints" / f"node{k}_noise.secret" for k in range(2)]
    assert all(len(s.read_bytes()) == 32 for s in secrets) and secrets[0].read_bytes() != secrets[1].read_bytes()
    kinds = rec["comm"]["by_kind"]  # every round's global-model hashes were read from both nodes and agreed
    assert rec["details"]["exchange"] == "peers" and kinds["train/verify_hash"] > 0 and kinds["final/verify_hash"] > 0


def test_a_nodes_delta_leaves_clipped_and_noised_from_a_secret_it_keeps(tmp_path):
    """`NodeRounds._delta` with privacy: Δ = θ_global − θ clipped to C and noised for (round, step, final), from
    the secret the node made at its first start; a node started again on the same storage reads it back and
    draws the same noise (a resumed run is bit-identical)."""
    storage = Storage(tmp_path)
    plan = PrivacyPlan(8.0, 1e-5, noise_multiplier=0.5, clip=1.0, nodes=4, chosen=False)
    host = SimpleNamespace(
        weights=lambda: {"w": torch.zeros(1000)}, rounds=2, step=16, rank=1, cfg=tiny_config(**PEERS)
    )

    def rounds() -> NodeRounds:
        peer = NodeRounds.__new__(NodeRounds)  # the parts `_delta` reads, without a model or codec
        peer.node, peer.pending, peer.seed = host, None, 0
        peer.global_state = {"w": torch.full((1000,), 3.0)}  # Δ's norm: 3·√1000, clipped to 1
        peer.noise = NodeNoise(plan, storage, host.rank)
        return peer

    first = rounds()._delta()["w"]
    assert storage.exists(secret_path(1)) and len(storage.read_bytes(secret_path(1))) == 32
    clipped = torch.full((1000,), 1.0 / 1000**0.5, dtype=torch.float64)
    noise = first - clipped
    assert 0.15 < noise.std().item() < 0.35  # σ·C/√N = 0.25 (a loose bound: 1000 draws)
    assert torch.equal(rounds()._delta()["w"], first)
    assert not torch.equal(rounds()._delta(final=True)["w"], first)
    host.step = 24
    assert not torch.equal(rounds()._delta()["w"], first)
    with pytest.raises(TypeError, match="stays on the node"):
        pickle.dumps(rounds().noise)


def test_with_secure_rounds_the_peers_and_the_driver_face_the_epsilon_of_the_sum():
    clear = PrivacyPlan(8.0, 1e-5, noise_multiplier=0.5, clip=1.0, nodes=4, chosen=False)
    masked = PrivacyPlan(8.0, 1e-5, noise_multiplier=0.5, clip=1.0, nodes=4, chosen=False, secure=True)
    assert clear.record(5)["epsilon_against_peers_and_driver"] == clear.record(5)["epsilon_one_update_seen_alone"]
    assert masked.record(5)["epsilon_against_peers_and_driver"] == masked.record(5)["epsilon"]
    assert masked.record(5)["epsilon"] < masked.record(5)["epsilon_one_update_seen_alone"]
