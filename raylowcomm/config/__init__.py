"""Run configuration: typed dataclasses (`schema`) loaded from YAML with `--set key=value`
overrides (`loading`), and checks (`checks`) that name the field, the value and what is allowed —
all before any actor starts.

Each strategy owns the dataclass of its options (`Strategy.Config`); a YAML section named after
the strategy fills it, so a new strategy needs no change here.
"""

from raylowcomm.config.checks import kind_mismatch, own_data_name, validate, validate_lora
from raylowcomm.config.loading import (
    apply_overrides,
    build_dataclass,
    load_yaml_mapping,
    parse_override,
    read_yaml,
    yaml_problem,
)
from raylowcomm.config.schema import (
    ConfigError,
    DataConfig,
    LoraConfig,
    ModelConfig,
    NodesConfig,
    OptimConfig,
    RunConfig,
    ShiftSource,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "NodesConfig",
    "OptimConfig",
    "RunConfig",
    "ShiftSource",
    "apply_overrides",
    "build_dataclass",
    "kind_mismatch",
    "load_yaml_mapping",
    "own_data_name",
    "parse_override",
    "read_yaml",
    "validate",
    "validate_lora",
    "yaml_problem",
]
