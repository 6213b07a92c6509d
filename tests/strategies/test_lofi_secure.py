"""`lofi.secure` (secure aggregation of summable codes, `core.secagg`) in lo-fi's peer rounds: its refusals
without Ray, and small Ray runs: the global model after every round equal, bit for bit, with and without
masks; a node lost after masking leaves the others to finish the round among themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import load_file

from raylowcomm.config import ConfigError
from raylowcomm.core.secagg import PUBLIC_KEY_NBYTES
from raylowcomm.strategies import from_dict
from raylowcomm.strategies.lofi import secure_rounds
from raylowcomm.strategies.lofi.payload import DeltaCodec, dense_names
from tests.strategies.test_lofi import run_lofi
from tests.strategies.test_lofi_robust import _raw

SECURE = {"compress": "int2", "compress_scale": "shared", "secure": True}


def _three(lofi: dict) -> dict:
    return _raw({**SECURE, **lofi})


def test_secure_rounds_are_accepted_where_masked_codes_add():
    from_dict(_three({}))
    from_dict(
        _three({"compress": "int4", "dense": ["vectors"], "dense_codec": "int8", "fragments": 2, "average_every": 2})
    )
    from_dict(_three({"privacy": {"epsilon": 8.0}, "bn_recalibrate": False}))
    from_dict(_three({"dial": "auto", "compress": "none"}))  # the dial picks codes that add, checked again then


@pytest.mark.parametrize(
    "lofi, field, fix",
    [
        ({"compress_scale": "node"}, "lofi.compress_scale", "set lofi.compress_scale: shared"),
        ({"compress": "none", "exchange": "auto"}, "lofi.exchange", "set lofi.compress (int8, int4 or int2)"),
        ({"quorum": 2}, "lofi.secure", "use lockstep rounds"),
        ({"aggregate": "median"}, "lofi.aggregate", "set lofi.aggregate: mean"),
        ({"aggregate": "trimmed_mean"}, "lofi.aggregate", "set lofi.aggregate: mean"),
        ({"aggregate": "clip"}, "lofi.aggregate", "lofi.privacy.clip bounds each node's Δ before it is masked"),
        ({"on_bad_payload": "drop"}, "lofi.on_bad_payload", "set lofi.on_bad_payload: fail"),
        ({"weighting": "examples"}, "lofi.weighting", "set lofi.weighting: uniform"),
        ({"overlap": 1}, "lofi.overlap", "set lofi.overlap: 0"),
        ({"probe_steps": 2}, "lofi.probe_steps", "set 0"),
    ],
)
def test_refusals_name_both_fields_and_the_fix(lofi, field, fix):
    with pytest.raises(ConfigError) as err:
        from_dict(_three(lofi))
    message = str(err.value)
    assert field in message and "lofi.secure" in message and fix in message and "\n" not in message


def test_two_nodes_and_adapters_and_a_curve_are_refused():
    raw = _three({})
    raw["nodes"]["count"] = 2
    with pytest.raises(ConfigError, match="nodes.count.*at least 3 nodes.*reveal the other's"):
        from_dict(raw)
    raw = _three({})
    raw["model"]["lora"] = {"r": 4}
    with pytest.raises(ConfigError, match="model.lora.*lofi.secure"):
        from_dict(raw)
    raw = _three({})
    raw["eval_every"] = 4
    with pytest.raises(ConfigError, match="eval_every.*lofi.secure"):
        from_dict(raw)


def _secure_config(n: int, epochs: int = 2, **lofi):
    """`test_lofi.tiny_config`'s run on `n` nodes of half a CPU, int2 rounds every 8 steps on shared scales."""
    return from_dict(
        {
            "model": {"name": "test_efficientnet", "family": "timm", "pretrained": False},
            "data": {"name": "mnist", "train_size": 512, "test_size": 200, "image_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "batch_size": 16, "epochs": epochs},
            "nodes": {"count": n, "cpus": 0.5},
            "strategies": ["lofi"],
            "checkpoint_every": 4,
            "log_every": 1000,
            "lofi": {
                "average_every": 8,
                "compress": "int2",
                "compress_scale": "shared",
                "bn_recalibrate": True,
                **lofi,
            },
        }
    )


def _masked_bytes(ctx, n: int) -> tuple[int, int]:
    """(masked codes, masked magnitudes) bytes of one node's whole payload in the run of `ctx` on `n` nodes."""
    model = ctx.architecture
    opts = ctx.cfg.options["lofi"]
    dense = dense_names(model, ctx.spec.family, opts.dense)
    codec = DeltaCodec(opts, model.state_dict(), {k for k, _ in model.named_parameters()}, dense)
    return codec.masked_nbytes(dict.fromkeys(model.state_dict()), False, n)


@pytest.mark.slow
@pytest.mark.heavy  # CI runs 4 nodes' first rounds against the clear (the killed-node test below)
@pytest.mark.parametrize(("fragments", "steps"), [(1, [8, 16, 20]), (2, [4, 8, 12, 16, 20])])
def test_secure_rounds_land_the_same_global_model_as_rounds_in_the_clear(ray_session, tmp_path, fragments, steps):
    """3 nodes, int2 codes with int8 dense vectors, whole rounds or two fragments: every round's global-model
    hash and the final average equal with and without masks; what crossed is the keys, and masked codes and
    magnitudes of exactly the width rule's size: each node's payload fetched by the 2 others in each round."""
    runs = {}
    for secure in (False, True):
        cfg = _secure_config(3, secure=secure, dense=["vectors"], fragments=fragments)
        ctx, runs[secure] = run_lofi(cfg, tmp_path / str(secure))
    plain, masked = runs[False], runs[True]
    assert [s for s, _ in masked["details"]["global_hashes"]] == steps  # the rounds and the final one
    assert masked["details"]["global_hashes"] == plain["details"]["global_hashes"]
    a, b = load_file(plain["weights"]), load_file(masked["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    kinds = masked["comm"]["by_kind"]
    assert "train/outer_gradients" not in kinds and kinds["setup/secure_keys"] > 3 * PUBLIC_KEY_NBYTES
    codes, scales = _masked_bytes(ctx, 3)  # a whole payload: two rounds of fragments make one
    assert kinds["train/masked_codes"] == 2 * 3 * 2 * codes and kinds["final/masked_codes"] == 3 * 2 * codes
    assert kinds["train/masked_scales"] == 2 * 3 * 2 * scales
    assert masked["details"]["secure"] == {"rosters": 1, "masked_again": []}


def _kill_node_3_in_round_2(monkeypatch, where: str) -> list:
    """Kill node 3 in round 2 just before the driver's call `where` of `secure_rounds` (`_send`: before it
    masks; `_args_nbytes`: once every node has sent its masked payload); returns [its pid] once it is done."""
    groups, killed = [], []
    ensure, call = secure_rounds.SecureRoster.ensure, getattr(secure_rounds, where)

    def keep_group(self, group, phase):
        groups.append(group)
        return ensure(self, group, phase)

    def kill_then_call(*args):
        round_ = args[1] if where == "_send" else args[0]
        if round_ == 2 and not killed:
            killed.append(ray.get(groups[-1][3].info.remote())["pid"])
            ray.kill(groups[-1][3])
        return call(*args)

    monkeypatch.setattr(secure_rounds.SecureRoster, "ensure", keep_group)
    monkeypatch.setattr(secure_rounds, where, kill_then_call)
    return killed


@pytest.mark.slow
@pytest.mark.parametrize(("where", "lost"), [("_args_nbytes", []), ("_send", [[2, [3]]])])
def test_a_node_killed_in_a_round_leaves_the_others_to_finish_it(ray_session, tmp_path, monkeypatch, where, lost):
    """4 nodes; node 3 killed in round 2. Once it has masked, its payload outlives it (the driver owns it): the
    round lands over all four. Before it masked, the other three mask theirs again among themselves and land
    the round over their sum. Either way node 3 restarts, adopts the round, and the final round is all four
    again on a new roster (its new key pair), every node agreeing (hash-checked). Killed after masking, the
    first two rounds are those of the same run in the clear, to the bit."""
    cfg = _secure_config(4, epochs=3, secure=True)  # 8 steps an epoch
    clean = None if lost else run_lofi(_secure_config(4, epochs=3), tmp_path / "clean")[1]
    killed = _kill_node_3_in_round_2(monkeypatch, where)
    _, rec = run_lofi(cfg, tmp_path / "killed")
    assert killed and rec["nodes"][3]["pid"] != killed[0]
    assert rec["details"]["secure"] == {"rosters": 2, "masked_again": lost}
    hashes = rec["details"]["global_hashes"]
    assert [step for step, _ in hashes] == [8, 16, 24]
    if clean is not None:  # round 2 over all four nodes: the uninterrupted run's in the clear, to the bit
        assert hashes[:2] == clean["details"]["global_hashes"][:2]


@pytest.mark.slow
@pytest.mark.heavy  # the rounds' path is CI's; this is lo-fi's one average, decoded on the driver
def test_one_secure_average_decoded_on_the_driver_is_the_one_in_the_clear(ray_session, tmp_path):
    """No rounds (average_every null): the driver decodes the nodes' one compressed average from the
    pretrained weights, here from the members' masked payloads, which it sums without reading one."""
    runs = {}
    for secure in (False, True):
        _, runs[secure] = run_lofi(_secure_config(3, secure=secure, average_every=None), tmp_path / str(secure))
    a, b = load_file(runs[False]["weights"]), load_file(runs[True]["weights"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    kinds = runs[True]["comm"]["by_kind"]
    assert "final/outer_gradients" not in kinds and kinds["final/masked_codes"] > 0


class _Reports:
    """A group whose members report, fetch after fetch, what `reports` says: (could not fetch, holds)."""

    def __init__(self, reports: list[list[tuple]]):
        self.reports, self.forwarded = reports, []
        self.ledger = None

    def call(self, method, round_, refs, phase, keys):
        assert method == "secure_fetch"
        return self.reports.pop(0)

    def __getitem__(self, holder):
        group = self

        class Forward:
            @staticmethod
            def remote(round_, member):
                group.forwarded.append((holder, member))
                return f"copy of {member} from {holder}"

        return SimpleNamespace(secure_forward=Forward)


def test_a_payload_some_member_holds_is_forwarded_and_one_nobody_holds_is_lost():
    """Node 2 could not fetch node 3's payload, which node 0 holds: node 0 forwards it and the round goes on
    over all four (masking again would give node 0 a first sum to take the second from). Where nobody holds
    it, it is lost: the round is masked again without it."""
    refs = {k: [f"ref {k}"] for k in range(4)}
    everyone = [0, 1, 2, 3]
    group = _Reports([[([], everyone), ([], everyone), ([3], [0, 1, 2]), ([], everyone)], [([], everyone)] * 4])
    assert secure_rounds._fetch(group, 2, refs, everyone, "train") == []
    assert group.forwarded == [(0, 3)] and refs[3] == ["copy of 3 from 0"]
    nobody = _Reports([[([3], [0, 1, 2]), ([3], [0, 1, 2]), ([3], [0, 1, 2]), ([], [])]])  # node 3 restarted
    assert secure_rounds._fetch(nobody, 2, dict(refs), everyone, "train") == [3] and nobody.forwarded == []


@pytest.mark.slow
def test_secure_rounds_through_the_driver_land_the_rounds_in_the_clear_at_n_payloads_up_and_n_sums_down(
    ray_session, tmp_path
):
    """lofi.exchange: driver with secure: the driver adds the 3 masked payloads and sends each node the sum.
    Every round's global model is the one of the same rounds in the clear (peer rounds), and what crossed
    is each payload once up and the sum once down to each node, where peer rounds fetch each payload twice."""
    runs = {}
    for name, lofi in (("clear", {}), ("star", {"secure": True, "exchange": "driver"})):
        ctx, runs[name] = run_lofi(_secure_config(3, **lofi), tmp_path / name)
    clear, star = runs["clear"], runs["star"]
    assert (
        star["details"]["exchange"] == "driver"
        and star["details"]["global_hashes"] == clear["details"]["global_hashes"]
    )
    codes, scales = _masked_bytes(ctx, 3)
    kinds = star["comm"]["by_kind"]
    assert kinds["train/masked_codes"] == 2 * 3 * codes and kinds["train/masked_scales"] == 2 * 3 * scales
    assert kinds["train/masked_sum"] == 2 * 3 * (codes + scales)  # the sum's words are a payload's
    with pytest.raises(ConfigError, match="lofi.exchange.*through the driver with lofi.secure"):
        from_dict(_raw({"compress": "int2", "exchange": "driver"}))
