"""Loading a config: YAML files, `--set key=value` overrides, and typing a raw mapping into the
dataclasses, with errors that name the field, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from raylowcomm.config.schema import ConfigError


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_describe(typing.get_args(tp)[0])} to {_describe(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _coerce(tp, value, name: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(tp, value, name)
    if origin in (Literal, list, dict):
        return _COERCE_GENERIC[origin](tp, value, name)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(name, value, "expected null")
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, name)
    if tp is typing.Any:
        return value
    scalar = _SCALARS.get(tp)
    if scalar is not None and (got := scalar(value)) is not None:
        return got
    raise ConfigError(name, value, f"expected {_describe(tp)}")


def _coerce_union(tp, value, name: str):
    if value is None and type(None) in typing.get_args(tp):
        return None  # `lora: null` is no LoRA, not a LoraConfig of defaults
    inner = None  # an option whose shape the value has, wrong inside (`lora: {rank: 8}`): its own error
    for option in typing.get_args(tp):
        try:
            return _coerce(option, value, name)
        except ConfigError as err:
            inner = inner or (err if err.field_name != name else None)
    raise inner or ConfigError(name, value, f"expected {_describe(tp)}")


def _coerce_literal(tp, value, name: str):
    if value in typing.get_args(tp):
        return value
    if isinstance(value, bool) and (word := "on" if value else "off") in typing.get_args(tp):
        return word  # YAML reads a bare `off` (`on`) as a boolean
    raise ConfigError(name, value, f"expected {_describe(tp)}")


def _coerce_list(tp, value, name: str):
    if not isinstance(value, list):
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    return [_coerce(typing.get_args(tp)[0], v, f"{name}[{i}]") for i, v in enumerate(value)]


def _coerce_dict(tp, value, name: str):
    if not isinstance(value, dict):
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    key_tp, value_tp = typing.get_args(tp)
    return {_coerce(key_tp, k, f"{name}.{k}"): _coerce(value_tp, v, f"{name}.{k}") for k, v in value.items()}


_COERCE_GENERIC = {Literal: _coerce_literal, list: _coerce_list, dict: _coerce_dict}


def _as_float(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _YAML11_FLOAT.match(value):  # YAML 1.1 reads 3e-5 as a string
        return float(value)
    return None


_SCALARS = {  # the value as the field holds it, or None where it is not one
    bool: lambda v: v if isinstance(v, bool) else None,
    float: _as_float,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else None,
    str: lambda v: v if isinstance(v, str) else None,
}


def build_dataclass(cls, data, prefix: str):
    """Build `cls` from a mapping, rejecting unknown keys and values of the wrong type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        keys = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(prefix, data, f"expected a mapping with keys {keys}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{prefix}.{key}" if prefix else key,
                data[key],
                f"unknown field; known fields of '{prefix or 'the config'}': {', '.join(sorted(known))}",
            )
    kwargs = {k: _coerce(hints[k], v, f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def yaml_problem(err: yaml.YAMLError) -> str:
    """Where and what, from a YAML parse error: 'malformed YAML at line L, column C: problem'."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"malformed YAML{where}: {problem or err}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping: plain YAML keeps the last
    and drops the first without a word (an `optim:` section written twice trains on the second)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                continue  # an unhashable key: the base loader raises its own error for it
            if key in seen:
                raise DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class DuplicateKey(Exception):
    """A mapping key written twice: the key and both lines (1-based)."""

    def __init__(self, key, first: int, second: int):
        super().__init__(f"key {key!r} is written twice, at lines {first} and {second}")
        self.key, self.first, self.second = key, first, second


def load_yaml_mapping(path: str | Path, field_name: str = "CONFIG") -> dict:
    """A YAML file that must hold a mapping with each key once. An empty or comment-only file is an
    error: a failed redirect (`> cfg.yaml`) would otherwise run every default."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(field_name, str(path), "no such file; check the path")
    if path.is_dir():
        raise ConfigError(field_name, str(path), "is a folder; give a YAML file")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except DuplicateKey as err:
        raise ConfigError(field_name, str(path), f"{err}; keep one (merge the two)") from None
    except yaml.YAMLError as err:
        raise ConfigError(field_name, str(path), f"{yaml_problem(err)}; fix the file's YAML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(field_name, str(path), "is not a text (UTF-8) file; give a YAML file") from None
    except OSError as err:
        raise ConfigError(field_name, str(path), f"cannot be read ({err.strerror})") from None
    if data is None:
        raise ConfigError(
            field_name, str(path), "the file is empty (or only comments): write the run's sections into it"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            field_name,
            str(path),
            f"the file must hold a YAML mapping (`key: value` lines), not a {type(data).__name__}",
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    usage = "an override must look like key.sub=value, e.g. --set optim.lr=0.01"
    if "=" not in text:
        raise ConfigError("--set", text, usage)
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError("--set", text, usage)
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else None
    except DuplicateKey as err:
        raise ConfigError(key.strip(), raw, f"{err} in --set {text}; keep one") from None
    except yaml.YAMLError as err:
        raise ConfigError(
            key.strip(), raw, f"{yaml_problem(err)} in --set {text}; quote the value or fix its syntax"
        ) from None
    return [k.strip() for k in keys], value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:  # absent, or an empty section (`optim:` in YAML)
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(
                    ".".join(keys),
                    value,
                    f"'{'.'.join(keys[: i + 1])}' is not a section; set a field of a section, e.g. optim.lr=0.01",
                )
        node[keys[-1]] = value
    return raw


def read_yaml(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The raw mapping of a config file with `--set` overrides applied (not yet typed)."""
    raw = load_yaml_mapping(path) if path is not None else {}
    return apply_overrides(raw, list(overrides))
