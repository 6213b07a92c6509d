"""benchmarks.same_results: a changed byte count or accuracy is a difference, a changed duration is not."""

import json

from benchmarks.same_results import main


def _run(folder, total_bytes: int, accuracy: float, train_s: float):
    folder.mkdir()
    record = {
        "strategy": "lofi",
        "metrics": {"id_accuracy": accuracy},
        "comm": {"total_bytes": total_bytes, "by_kind": {"final/bn_statistics": total_bytes - 10}},
        "train_s": train_s,
    }
    (folder / "results.json").write_text(json.dumps([record]))
    return str(folder)


def test_a_rerun_that_only_took_longer_is_the_same(tmp_path, capsys):
    old, new = _run(tmp_path / "old", 100, 0.8, 1.0), _run(tmp_path / "new", 100, 0.8, 9.0)
    assert main([old, new]) == 0
    assert "SAME" in capsys.readouterr().out


def test_a_byte_or_an_accuracy_that_moved_is_named_by_its_path(tmp_path, capsys):
    old, new = _run(tmp_path / "old", 100, 0.8, 1.0), _run(tmp_path / "new", 102, 0.75, 1.0)
    assert main([old, new]) == 1
    diffs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DIFF ")]
    assert diffs == [
        "DIFF lofi.metrics.id_accuracy: 0.8 -> 0.75",
        "DIFF lofi.comm.total_bytes: 100 -> 102",
        "DIFF lofi.comm.by_kind.final/bn_statistics: 90 -> 92",
    ]
