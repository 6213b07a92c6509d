"""The planner's time model reproduces hand-computed times (numbers chosen so that every operation is
exact in binary floating point), calibrates from what a record says, and runs as `raylowcomm plan`."""

import json
from pathlib import Path

import pytest

from raylowcomm.cli import main
from raylowcomm.core.interlock.schedule import Link, StageCost
from raylowcomm.planner import MODELS, Target, check, plan, short_run
from raylowcomm.planner.calibrate import costs_of, merge_repeats
from raylowcomm.planner.costs import Cost, all_gather_s, predict, ring_allreduce_s, star_down_s, star_up_s
from tests.test_cli_errors import no_ray as no_ray  # a fixture, used by its name

LINK = Link(latency_s=0.5, bytes_per_s=1e6)


def test_ring_allreduce_by_hand():
    # 4 nodes, 8 MB each: 2 x 3 steps, each moving a 2 MB chunk (2 s) after 0.5 s of latency
    assert ring_allreduce_s(8e6, 4, LINK) == 15.0
    assert ring_allreduce_s(8e6, 1, LINK) == 0.0
    ddp = Cost("ddp", "allreduce", steps=10, compute_s=1.0, step_bytes=8e6)
    p = predict(ddp, 4, LINK)
    assert (p.compute_s, p.link_s, p.total_s, p.step_s) == (10.0, 150.0, 160.0, 16.0)
    assert p.bound == "link 15.0x"


def test_all_gather_with_overlap_by_hand():
    # 3 nodes: each fetches 2 peers' 3 MB payloads, 6 s + 0.5 s latency; 2 steps of 1 s compute hide 2 s
    assert all_gather_s(3e6, 3, LINK) == 6.5
    peers = Cost("lofi", "peers", steps=10, compute_s=1.0, rounds=5, round_bytes=3e6, overlap_steps=2)
    p = predict(peers, 3, LINK)
    assert (p.compute_s, p.link_s) == (10.0, 5 * 4.5)
    hidden = predict(
        Cost("lofi", "peers", steps=10, compute_s=1.0, rounds=5, round_bytes=3e6, overlap_steps=7), 3, LINK
    )
    assert hidden.link_s == 0.0 and hidden.bound == "compute"
    tiny = predict(Cost("lofi", "peers", steps=10, compute_s=1.0, rounds=1, round_bytes=1.0), 2, Link(bytes_per_s=1e6))
    assert tiny.link_s == 1e-6 and tiny.bound == "compute >1000x"  # not 'compute 10000000.0x'
    # fragments: twice the syncs, each of half the payload (3 s + 0.5 s), none hidden
    halves = Cost("lofi", "peers", steps=10, compute_s=1.0, rounds=5, round_bytes=3e6, fragments=2)
    assert predict(halves, 3, LINK).link_s == 10 * 3.5
    # the star: every node's 1 MB to the driver at once (0.5 + 1), and the average back from the driver's
    # host, beside node 0, to each other node over its one link: 0.5 + (N - 1) x 1
    assert star_up_s(1e6, 3, LINK) == star_up_s(1e6, 2, LINK) == 1.5
    assert (star_down_s(1e6, 2, LINK), star_down_s(1e6, 4, LINK), star_down_s(1e6, 1, LINK)) == (1.5, 3.5, 0.0)


def test_a_pipeline_by_hand():
    plan = [[frozenset()], [frozenset()]]  # two stages, local losses: only activations cross
    stages = [StageCost(1.0, 0.0, 0.0, activation_bytes=1_000_000), StageCost(1.0)]
    cost = Cost("interlocking", "pipeline", steps=20, compute_s=0.0, stages=stages, plan=plan)
    fast = predict(cost, 2, Link(bytes_per_s=1e6))  # 1 s of wire per activation: hidden behind 1 s of work
    assert (fast.step_s, fast.compute_s, fast.link_s) == (1.0, 20.0, 0.0)
    slow = predict(cost, 2, Link(bytes_per_s=0.25e6))  # 4 s of wire per batch: the link sets the pace
    assert (slow.step_s, slow.link_s) == (4.0, 60.0) and slow.bound == "link 3.0x"


def test_a_pipeline_calibrated_from_its_run_predicts_that_run_and_adds_its_overhead_to_every_batch():
    """Stage calls of 1 s and 0.5 s a batch (the busiest sets the pace), 10 batches, 1 MB activations a
    batch; the run took 12 s: 0.2 s a batch beyond its stages' calls, which every prediction carries."""
    rec = {
        "strategy": "interlocking",
        "metrics": {"id_accuracy": 0.5},
        "train_s": 12.0,
        "comm": {"by_kind": {"train/activations": 10_000_000}},
        "details": {"stages": 2, "batches": 10, "micro_batches": 1, "n": 1, "rule": "farthest"},
        "nodes": [
            {"median_call_s": {"forward": 1.0, "backward": None, "step": 0.0}},
            {"median_call_s": {"forward": 0.5, "backward": None, "step": 0.0}},
        ],
    }
    [cost] = costs_of([rec], Link(bytes_per_s=2e6))  # 0.5 s of wire a batch: hidden behind the 1 s stage
    assert cost.overhead_s == (12.0 - 10 * 1.0) / 10
    same = predict(cost, 2, Link(bytes_per_s=2e6))
    assert same.total_s == 10 * (1.0 + cost.overhead_s) and same.link_s == 0.0
    slow = predict(cost, 2, Link(bytes_per_s=0.25e6))  # 4 s of wire a batch: the link's pace, plus the overhead
    assert slow.step_s == 4.0 + cost.overhead_s and slow.total_s == 10 * slow.step_s


def ddp_record(steps=8, grad=4_000_000, train_s=4.0, nodes=2, halfway=0.5):
    return {
        "strategy": "ddp",
        "metrics": {"id_accuracy": 0.8},
        "comm": {"by_kind": {"final/model_checkpoint": grad}},
        "train_s": train_s,
        "details": {"steps_per_worker": steps},
        "nodes": [{"allreduce_bytes": grad * steps}] * nodes,
        "curve": [{"step": 4, "id_accuracy": halfway}, {"step": 8, "id_accuracy": 0.8}],
    }


def lofi_record(train_s=3.0, phases_s=None):
    return {
        "strategy": "lofi",
        "metrics": {"id_accuracy": 0.79},
        "comm": {"by_kind": {"train/outer_gradients": 3 * 2 * 1000, "final/outer_gradients": 2 * 1000}},
        "train_s": train_s,
        "details": {
            "steps_per_node": 8,
            "averaging_steps": [2, 4, 6, 8],
            "exchange": "peers",
            "phases_s": phases_s or {},
        },
        "nodes": [{"train": [{"train_s": 1.0}, {"train_s": 1.0}]}, {"train": [{"train_s": 1.5}, {"train_s": 0.5}]}],
        "curve": [{"step": 8, "id_accuracy": 0.79}],
    }


def test_costs_are_calibrated_from_what_the_record_says():
    ddp, lofi = costs_of([ddp_record(), lofi_record(), {"strategy": "spsa", "error": "boom"}])
    assert (ddp.steps, ddp.compute_s, ddp.step_bytes, ddp.params) == (8, 0.5, 4e6, 1e6)
    assert (lofi.topology, lofi.rounds, lofi.round_bytes, lofi.compute_s) == ("peers", 4, 1000, 0.25)
    # the rounds' own work: 3 s of training time, 2 s of it the slowest node's steps, over 4 rounds
    assert lofi.round_s == 0.25
    # a run over a measured link: its modelled all-reduce comes out of the step time
    shaped = costs_of([ddp_record(train_s=4.0 + 8 * 4.0)], Link(bytes_per_s=1e6))[0]
    assert shaped.compute_s == 0.5
    # and the peers' transfers (4 rounds of one 1000-byte payload at 1000 B/s) out of the rounds' time, the
    # final round's collect counted: (7 + 1 - 2 - 4) / 4
    assert costs_of([lofi_record(7.0, {"collect": 1.0})], Link(bytes_per_s=1000))[0].round_s == 0.5
    # at 5 nodes a node lands 4 payloads a round, not 1: 4 x 0.25 s of the rounds' work each round
    assert predict(lofi, 5, Link()).compute_s == 2.0 + 4 * 4 * 0.25
    # another model: the rounds' work per crossing parameter, at the speed the given compute implies
    sized = Cost("lofi", "peers", steps=8, compute_s=0.25, rounds=4, round_bytes=1e3, params=1e3, round_s=0.25)
    assert sized.scaled(4e3, None, None).round_s == 4 * 0.25  # 4x the parameters, compute 4x as well
    assert sized.scaled(4e3, None, 0.5).round_s == 4 * 0.25 * 0.5  # a step 2x, not 4x: a device 2x as fast
    rows = plan([ddp, lofi], [2], [("8mbit", 8e6)], 0.0, Target())
    by = {r["prediction"].strategy: r for r in rows}
    # DDP: 8 x (0.5 + 4 s); target 95% of DDP's 0.8, which lo-fi reaches at its step 8 and DDP at its step 8
    assert by["ddp"]["prediction"].total_s == 36.0 and by["ddp"]["to_target_s"] == 36.0
    lofi_row = by["lofi, 4 peer rounds"]
    assert lofi_row["to_target_s"] == lofi_row["prediction"].total_s == 2.0 + 4 * 0.25 + 4 * 0.001
    # made 80 steps long: 1 + 3 x 10 rounds, the same per-step costs, no curve to reach a target on
    longer = lofi.for_steps(80)
    assert (longer.steps, longer.rounds, longer.curve, longer.compute_s) == (80, 31, [], 0.25)


def test_a_secure_run_calibrates_its_rounds_on_the_masked_codes_and_magnitudes_it_sent():
    """lofi.secure books its payloads as masked codes and masked block magnitudes: a round's bytes are both."""
    secure = lofi_record()
    secure["comm"]["by_kind"] = {
        "setup/secure_keys": 400,
        "train/masked_codes": 3 * 2 * 900,
        "train/masked_scales": 3 * 2 * 300,
        "final/masked_codes": 2 * 900,
        "final/masked_scales": 2 * 300,
    }
    assert costs_of([secure])[0].round_bytes == 1200


def test_the_stars_rounds_carry_the_drivers_work_calibrated_from_the_run_and_growing_with_the_nodes():
    """Two averages through the driver of 1000-byte states at 1000 B/s: each 1 s up, and the first 1 s back
    (the final average stays on the driver); the run took 7 s of training plus 1 s collecting the final
    average, 2 s of it the nodes' steps."""
    rec = lofi_record(7.0, {"collect": 1.0})
    rec["details"].update(exchange="driver", averaging_steps=[4, 8])
    rec["comm"]["by_kind"] = {"final/node_weights": 2 * 1000}
    [star] = costs_of([rec], Link(bytes_per_s=1000))
    assert (star.topology, star.rounds, star.round_bytes, star.compute_s) == ("star", 2, 1000, 0.25)
    assert star.round_s == (7.0 + 1.0 - 2.0 - 3.0) / 2 and star.nodes == 2
    same = predict(star, 2, Link(bytes_per_s=1000))
    assert same.total_s == 8.0  # the calibrating run itself
    # at 4 nodes the driver averages 4 states, not 2: the rounds' work twice over; the uploads take as long,
    # and the one average that comes back goes out three times over the driver's link
    four = predict(star, 4, Link(bytes_per_s=1000))
    assert (four.compute_s, four.link_s) == (2.0 + 2 * 1.5 * 2, 2 * 1.0 + 3.0)


def test_repeats_of_a_run_calibrate_once_on_their_median_and_other_runs_stay_apart():
    """Three runs of one config at 4, 12 and 6 s (0.5, 1.5 and 0.75 s a step), a fourth whose gradient is
    twice the size: the three become one cost at the median, the fourth stays its own."""
    records = [
        ddp_record(train_s=4.0, halfway=0.5),
        ddp_record(train_s=12.0, halfway=0.7),
        ddp_record(train_s=6.0, halfway=0.6),
        ddp_record(grad=8_000_000, train_s=1.0),
    ]
    merged, other = merge_repeats(costs_of(records))
    assert (merged.compute_s, merged.measured_s, merged.curve) == (0.75, 6.0, [(4, 0.6), (8, 0.8)])
    assert (other.step_bytes, other.compute_s) == (8e6, 0.125)
    # a run at other nodes is another run, not a repeat
    assert len(merge_repeats(costs_of([ddp_record(), ddp_record(nodes=4)]))) == 2


def test_the_check_predicts_each_measured_run_at_its_own_nodes_against_the_median_of_its_repeats():
    """Calibrated at 0.5 s a step with no link; measured over 1 MB/s: at N = 2 a step's ring all-reduce of
    4 MB is 2 x 1 x 2 MB (4 s), 8 x 4.5 = 36 s predicted, against repeats of 30, 40 and 32 s (median 32 s,
    +12.5%); at N = 4 it is 2 x 3 x 1 MB (6 s), 8 x 6.5 = 52 s, against one run of 52 s."""
    calibrated = merge_repeats(costs_of([ddp_record()]))
    runs = costs_of([ddp_record(train_s=t) for t in (30.0, 40.0, 32.0)] + [ddp_record(train_s=52.0, nodes=4)])
    two, four = check(calibrated, runs, Link(bytes_per_s=1e6))
    assert (two["nodes"], two["predicted_s"], two["measured_s"], two["runs_s"]) == (2, 36.0, 32.0, [30.0, 40.0, 32.0])
    assert two["error"] == 0.125
    assert (four["nodes"], four["predicted_s"], four["error"]) == (4, 52.0, 0.0)
    # a run the calibration did not make (another gradient) is left out, not predicted from another run
    assert check(calibrated, costs_of([ddp_record(grad=8_000_000)]), Link(bytes_per_s=1e6)) == []


def test_another_model_scales_bytes_with_what_crosses_and_compute_with_the_flops():
    ddp = costs_of([ddp_record()])[0]
    shape = MODELS["llama-3-8b"]
    full = Target(shape.params, None, device_flops=1e15, tokens_per_step=1000)
    lora = Target(shape.params, shape.lora_params(16), device_flops=1e15, tokens_per_step=1000)
    a, b = (ddp.scaled(t.params, t.trainable, t.compute_s(ddp)) for t in (full, lora))
    assert a.step_bytes == 4e6 * shape.params / 1e6 and a.compute_s == 3 * 2 * shape.params * 1000 / 1e15
    assert b.step_bytes == pytest.approx(4e6 * shape.lora_params(16) / 1e6, rel=1e-15)
    assert b.compute_s == 2 * 2 * shape.params * 1000 / 1e15  # no weight gradients for the frozen base
    assert 40e6 < shape.lora_params(16) < 43e6  # Llama-3-8B, r = 16 on every linear layer: about 42M


def test_plan_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([ddp_record(), lofi_record()]))
    assert main(["plan", str(run), "--nodes", "2,4", "--link", "100mbit", "--out", str(tmp_path / "plan")]) == 0
    shown = capsys.readouterr().out
    assert "| ddp | 4 | 100mbit |" in shown and "| lofi, 4 peer rounds | 2 | 100mbit |" in shown
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert len(saved) == 4 and (tmp_path / "plan" / "plan.png").exists()
    assert main(["plan", str(run), "--nodes", "two"]) == 2
    assert main(["plan", str(run), "--link", "fast"]) == 2
    assert main(["plan", str(tmp_path), "--nodes", "2"]) == 2  # no results.json there
    assert "error:" in capsys.readouterr().err


PLAN_CASES = [
    # (id, argv after `plan RUN_DIR`, texts the error line holds)
    ("params-zero", ["--params", "0"], ("'--params' = 0.0", "> 0")),
    ("lora-rank-zero", ["--model", "llama-3-8b", "--lora-rank", "0"], ("'--lora-rank' = 0", ">= 1")),
    ("latency-negative", ["--latency", "-50"], ("'--latency' = -50.0", ">= 0")),
    ("steps-zero", ["--steps", "0"], ("'--steps' = 0", ">= 1")),
    ("link-unknown-unit", ["--link", "5parsecs"], ("'--link'", "5parsecs")),
    ("link-zero", ["--link", "0mbit"], ("'--link'", "0mbit")),
    ("nodes-zero", ["--nodes", "0,2"], ("'--nodes'", ">= 1")),
    ("nodes-not-counts", ["--nodes", "2,,4"], ("'--nodes'", "comma-separated")),
    ("lora-rank-without-model", ["--params", "8e9", "--lora-rank", "8"], ("'--lora-rank'", "--model")),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plan_flags(tmp_path, capsys, no_ray, argv, expected):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([ddp_record()]))
    assert main(["plan", str(run), *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "--rate" not in lines[0], lines[0]  # plan has no --rate: a rate is named by the flag that gave it
    for text in expected:
        assert text in lines[0], lines[0]


def test_plan_against_names_link_too(tmp_path, capsys, no_ray):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([ddp_record()]))
    assert main(["plan", str(run), "--against", str(run), "--link", "5parsecs"]) == 2
    err = capsys.readouterr().err
    assert "'--link'" in err and "--rate" not in err


def test_plan_against_checks_the_calibration_on_runs_over_the_rate_their_bench_shaped(tmp_path, capsys, monkeypatch):
    """Two repeats calibrate (0.5 and 1.0 s a step over no link: 0.75 s); the bench's 8 Mbit/s run took
    8 x (0.75 + 4) = 38 s, as predicted."""
    for name, train_s in (("a", 4.0), ("b", 8.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps([ddp_record(train_s=train_s)]))
    bench = tmp_path / "bench"
    (bench / "8mbit").mkdir(parents=True)
    (bench / "8mbit" / "results.json").write_text(json.dumps([ddp_record(train_s=38.0)]))
    (bench / "bench.json").write_text(json.dumps({"runs": [{"dir": "8mbit", "rate": "8mbit"}]}))
    calibrating = [str(tmp_path / "a"), str(tmp_path / "b")]
    against = ["--against", str(bench / "8mbit"), "--out", str(tmp_path / "check")]
    assert main(["plan", *calibrating, *against]) == 0
    assert "| ddp | 2 | 8mbit | 38.0 s | 38.0 s | 38.0 | +0.0% |" in capsys.readouterr().out
    [row] = json.loads((tmp_path / "check" / "check.json").read_text())
    assert (row["predicted_s"], row["measured_s"], row["error"]) == (38.0, 38.0, 0.0)
    assert main(["plan", *calibrating, "--against", str(tmp_path / "a")]) == 2  # no bench: which rate?
    assert "--link" in capsys.readouterr().err
    assert main(["plan", *calibrating, *against, "--link", "1gbit", "--link", "8mbit"]) == 2
    assert main(["plan", *calibrating, *against, "--model", "llama-3-8b"]) == 2
    # refused before a config's short run would start Ray to calibrate
    monkeypatch.setattr(short_run, "calibrate_config", lambda *a: pytest.fail("the short run started"))
    example = str(Path(__file__).resolve().parents[2] / "examples" / "wan_compare.yaml")
    assert main(["plan", example, *against, "--link", "1gbit", "--link", "8mbit"]) == 2
    assert main(["plan", *calibrating, "--against", str(tmp_path / "nothing"), "--link", "8mbit"]) == 2
