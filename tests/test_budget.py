"""optim.budget_s is refused where a budget cannot end a run (a run on a budget, end to end:
tests/test_bench.py, `bench local --budget-s`)."""

import pytest

from raylowcomm.config import ConfigError
from raylowcomm.strategies import from_dict
from tests.test_bench import TINY


@pytest.mark.parametrize(
    "budget, lofi",
    [
        (0, {}),  # not a budget
        (5, {"average_every": 4, "compress": "int8", "quorum": 1}),  # quorum rounds count node-steps
        (5, {"average_every": 4, "compress": "int8", "fragments": 2}),  # the final round syncs the whole model
    ],
)
def test_a_budget_is_refused_where_it_cannot_end_a_run(budget, lofi):
    raw = {
        **TINY,
        "strategies": ["lofi"],
        "eval_every": 0,
        "optim": {**TINY["optim"], "budget_s": budget},
        "lofi": lofi,
    }
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field_name == "optim.budget_s"
