"""The one place through which the files a command reads pass: results.json, bench.json,
seeds.json, a saved config's text, a checkpoint's or round file's safetensors header, a state
file's JSON. A missing, truncated or malformed file becomes a `FileError` naming the file, what is
wrong with it and what to do, which the CLI prints as its one `error:` line, instead of a parser's
traceback (`JSONDecodeError`) or a node's `SafetensorError` naming neither. Only JSON and
safetensors headers are parsed here; nothing is ever unpickled."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_SAFETENSORS_HEADER = 100_000_000
"""safetensors' own limit on a header's length: a longer one is damage, not a header."""


class FileError(ValueError):
    """A file that cannot be used: `path`, what is wrong (`problem`) and what to do (`fix`), in one line."""

    def __init__(self, path: str | Path, problem: str, fix: str):
        super().__init__(f"{path} {problem}: {fix}")
        self.path, self.problem, self.fix = str(path), problem, fix

    def __reduce__(self):
        """Picklable, so one raised on a node reaches the driver as itself."""
        return type(self), (self.path, self.problem, self.fix)


def read_text(path: str | Path, fix: str) -> str:
    """`path`'s UTF-8 text, or a FileError: missing, a folder, not text, unreadable."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileError(path, "does not exist", fix) from None
    except IsADirectoryError:
        raise FileError(path, "is a folder, not a file", fix) from None
    except UnicodeDecodeError:
        raise FileError(path, "is not text (not UTF-8): it is damaged", fix) from None
    except OSError as err:
        raise FileError(path, f"cannot be read ({err.strerror})", fix) from None


def parse_json(text: str | bytes, path: str | Path, fix: str, kind: type | None = None, what: str = "") -> Any:
    """`text` (the content of `path`) as JSON; a FileError says where it was cut off or broken, and,
    with `kind`, that it holds another kind of value than `what`."""
    try:
        value = json.loads(text)
    except UnicodeDecodeError:
        raise FileError(path, "is not text (not UTF-8): it is damaged", fix) from None
    except json.JSONDecodeError as err:
        # the parser ran out of text, at the end or inside a string: a write that stopped part way
        cut = err.pos >= len(err.doc.rstrip()) or err.msg.startswith("Unterminated string")
        problem = "is cut off (truncated JSON: " if cut else "is not valid JSON ("
        where = f"{err.msg.removesuffix(' at')} at line {err.lineno}, column {err.colno}"
        raise FileError(path, f"{problem}{where})", fix) from None
    if kind is not None and not isinstance(value, kind):
        raise FileError(path, f"holds {_kind_of(value)}, not {what}", fix)
    return value


def read_json(path: str | Path, fix: str, kind: type | None = None, what: str = "") -> Any:
    """`path`'s JSON (`parse_json`), or a FileError naming it."""
    return parse_json(read_text(path, fix), path, fix, kind, what)


RESULTS = "a list of strategy records: it is not a raylowcomm results file"


def read_records(path: str | Path, fix: str) -> list[dict]:
    """A results.json as `raylowcomm run` writes it: a non-empty list of records, each a mapping
    naming its strategy; anything else (`{}`, `[]`, a list of numbers) is a FileError, so that a
    report or a plan built on it is not silently empty."""
    records = read_json(path, fix, list, RESULTS)
    if not records:
        raise FileError(path, "holds no records (an empty list): it is not a raylowcomm results file", fix)
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("strategy"), str):
            raise FileError(path, f"record {i} names no strategy: it is not a raylowcomm results file", fix)
    return records


def safetensors_problem(read_at: Callable[[int, int], bytes], size: int) -> str | None:
    """Why a safetensors file of `size` bytes cannot be loaded, or None, from its header alone:
    `read_at(offset, n)` reads n bytes. The file is the 8-byte header length, the JSON header, and
    the tensors' bytes, which must end exactly where the header's last `data_offsets` says (what
    safetensors calls 'incomplete metadata' when a write was cut off)."""
    if size < 8:
        return f"is cut off: {size} bytes, shorter than a safetensors header"
    (length,) = struct.unpack("<Q", read_at(0, 8))
    if length > MAX_SAFETENSORS_HEADER:
        return "does not start with a safetensors header: it is damaged or not a safetensors file"
    if 8 + length > size:
        return f"is cut off inside its safetensors header ({size:,} of at least {8 + length:,} bytes)"
    try:
        header = json.loads(read_at(8, length))
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "has a damaged safetensors header (not the JSON of its tensors)"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is cut off: {size:,} of the {expected:,} bytes its safetensors header describes"
    if size > expected:
        return f"is damaged: {size - expected:,} bytes past the tensors its safetensors header describes"
    return None


def _kind_of(value: Any) -> str:
    """'a mapping', 'a list', 'a number', ...: what a JSON value is, for a message."""
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "true or false", type(None): "null"}
    return kinds.get(type(value), "a number")
