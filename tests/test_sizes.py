"""Sizes a reader can hold (docs/python-api.md, ../DESIGN): a module of raylowcomm/ at most 350
lines, a class 250, a function 60. The places past them today are listed with their size as a
ceiling: none may grow, a new one fails, and one that shrinks must lower its ceiling (or leave the
list once within the limit), so the list only ever gets shorter."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "raylowcomm"
LIMITS = {"module": 350, "class": 250, "function": 60}

CEILINGS: dict[str, int] = {}
"""What is past its limit at the third house step (issue 57): each place's lines today, the most it may hold."""


def _defs(body: list[ast.stmt], prefix: str = ""):
    """(kind, qualified name, lines) of every class and function, nested ones included."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            name = f"{prefix}{node.name}"
            yield kind, name, node.end_lineno - node.lineno + 1
            yield from _defs(node.body, name + ".")


def measured() -> dict[str, tuple[str, int]]:
    """Every module, class and function of the package: its name (as in CEILINGS) -> (kind, lines)."""
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module, text = path.relative_to(PACKAGE).as_posix(), path.read_text()
        sizes[module] = ("module", len(text.splitlines()))
        for kind, name, lines in _defs(ast.parse(text).body):
            sizes[f"{module}::{name}"] = (kind, lines)
    return sizes


def test_nothing_grows_past_its_limit():
    past = {name: lines for name, (kind, lines) in measured().items() if lines > LIMITS[kind]}
    grown = {name: (lines, CEILINGS.get(name)) for name, lines in past.items() if lines > CEILINGS.get(name, 0)}
    assert not grown, f"past the size limits {LIMITS} (lines, ceiling): {grown}; split along responsibilities"


def test_the_ceilings_only_come_down():
    sizes = measured()
    stale = {
        name: sizes.get(name, ("gone", 0))[1]
        for name, ceiling in CEILINGS.items()
        if name not in sizes or sizes[name][1] != ceiling
    }
    assert not stale, f"shrunk or gone (now): {stale}; lower each ceiling to its size, or drop it within the limit"
