import pickle

import pytest
import torch

from raylowcomm.common.ledger import Ledger, payload_nbytes


def test_known_payloads_are_counted_exactly():
    assert payload_nbytes(torch.zeros(10, 3)) == 120
    assert payload_nbytes(torch.zeros(7, dtype=torch.uint8)) == 7
    assert payload_nbytes(torch.zeros(5, dtype=torch.float16)) == 10
    assert payload_nbytes({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)}) == 32
    assert payload_nbytes(b"\x01") == 1
    obj = {"step": 3, "loss": 0.5}
    assert payload_nbytes(obj) == len(pickle.dumps(obj, protocol=5))


def test_tensors_inside_mixed_containers_count_their_data_and_the_rest_its_pickle():
    stats = ({"bn.running_mean": torch.zeros(8), "bn.num_batches_tracked": torch.tensor(3)}, 12)
    assert payload_nbytes(stats) == 32 + 8 + len(pickle.dumps(12, protocol=5))
    nested = {"test": {"images": torch.zeros(2, 3, dtype=torch.uint8), "labels": [torch.zeros(2)]}, "name": "mnist"}
    assert payload_nbytes(nested) == 6 + 8 + len(pickle.dumps("mnist", protocol=5))


def test_phases_kinds_and_copies():
    ledger = Ledger()
    ledger.send("setup", "weights", torch.zeros(100), copies=3)
    ledger.send("train", "byte", b"\x07")
    ledger.record("final", "weights", 400, copies=2)
    assert ledger.bytes_by_phase == {"setup": 1200, "train": 1, "final": 800}
    assert ledger.total_bytes == 2001
    assert ledger.messages == 6
    d = ledger.to_dict()
    assert d["by_kind"]["setup/weights"] == 1200 and d["by_phase"]["train"] == 1
    with pytest.raises(ValueError):
        ledger.record("warmup", "x", 1)


def test_merge_adds_up():
    a, b = Ledger(), Ledger()
    a.record("train", "g", 5)
    b.record("train", "g", 7)
    a.merge(b)
    assert a.bytes_by_phase["train"] == 12 and a.bytes_by_kind["train/g"] == 12
