"""`Storage.probe`: the write a run's storage must take, tried once before Ray starts; it leaves
nothing behind and answers in bounded time (the CLI's refusals: tests/test_cli_errors.py)."""

from __future__ import annotations

import threading

from raylowcomm.storage import Storage


def test_probe_of_a_new_folder_leaves_no_folder(tmp_path):
    assert Storage(tmp_path / "run" / "state").probe() is None
    assert list(tmp_path.iterdir()) == []


def test_probe_keeps_what_storage_holds(tmp_path):
    storage = Storage(tmp_path)
    storage.write_json("lofi/state.json", {"step": 3})
    assert storage.probe() is None
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["lofi", "lofi/state.json"]
    assert storage.read_json("lofi/state.json") == {"step": 3}


def test_probe_of_an_object_store(tmp_path):
    assert Storage("mock://bucket/run").probe() is None


def test_probe_of_a_store_that_never_answers_is_bounded(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(Storage, "write_bytes", lambda self, rel, data: release.wait(30))
    try:
        problem = Storage(tmp_path).probe(timeout_s=0.2)
    finally:
        release.set()
    assert problem is not None and "no answer in 0.2 s" in problem
