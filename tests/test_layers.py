"""Layers point one way: every import inside raylowcomm (module level and inside functions,
absolute and relative) goes down the order below or stays within a layer, and no import cycle
exists at any level. A new module fails until it is placed in a layer."""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "raylowcomm"

# Lowest first: a module imports only from its own layer (without a cycle) and the layers listed before it.
LAYERS: list[tuple[str, list[str]]] = [
    ("common", ["raylowcomm.common"]),  # the leaf: batches, seeding, ledger, timing
    ("core", ["raylowcomm.core"]),  # plain torch, each part testable alone
    (
        "config",
        ["raylowcomm.config", "raylowcomm.catalog", "raylowcomm.assets", "raylowcomm.env", "raylowcomm.storage"],
    ),
    (
        "model, data, tasks",
        [
            "raylowcomm.models",
            "raylowcomm.timm_checkpoints",  # a timm architecture with a checkpoint's weights, checked to fit
            "raylowcomm.model_overrides",  # config_overrides applied, and checked against the tokenizer and data
            "raylowcomm.finetune",
            "raylowcomm.lora",
            "raylowcomm.data",
            "raylowcomm.tasks",
            "raylowcomm.training",
        ],
    ),
    (
        "actors",
        [
            "raylowcomm.actors",
            "raylowcomm.node_group",  # the driver's handle on a strategy's actors (NodeGroup)
            "raylowcomm.group_scoring",  # NodeGroup's scoring on the nodes
            "raylowcomm.failures",  # a node's or stage's own exception, named: the first cause
            "raylowcomm.runtime",
            "raylowcomm.execution",  # placement: execution.Gang
            "raylowcomm.progress",
        ],
    ),  # workers post their progress through it, the driver's view shows it
    ("strategies", ["raylowcomm.strategies"]),
    (
        "drivers",
        [
            "raylowcomm.runner",
            "raylowcomm.resume",
            "raylowcomm.seeds",
            "raylowcomm.run_progress",
            "raylowcomm.capacity",
            "raylowcomm.results_table",
            "raylowcomm.tune",
            "raylowcomm.bench",
            "raylowcomm.report",
            "raylowcomm.tensorboard",
            "raylowcomm.cluster",
            "raylowcomm.netns",  # the cluster's namespaces, bridge, tc and killing by namespace
            "raylowcomm.configref",
            "raylowcomm.seedstats",
            "raylowcomm.planner",  # calibrates from records, or from a run (runner)
        ],
    ),
    ("cli", ["raylowcomm.cli", "raylowcomm"]),  # `raylowcomm` itself: the lazy API names (importlib, not imports)
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the entry naming `module` or a package above it (raylowcomm.core.zo -> core);
    `raylowcomm` names the package's own __init__ only."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p != "raylowcomm" and module.startswith(p + ".")) for p in prefixes):
            return i
    return None


def imported_names(module: str, tree: ast.AST, is_package: bool = False) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of every import anywhere in `tree`, relative ones made absolute;
    `from a import b` names a.b when that is a module of its own, else a."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno


@functools.cache
def module_imports(module: str) -> list[tuple[str, int]]:
    path = MODULES[module]
    return list(imported_names(module, ast.parse(path.read_text(), str(path)), path.name == "__init__.py"))


def edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> where, for every import of one raylowcomm module by another."""
    found: dict[tuple[str, str], str] = {}
    for module, path in MODULES.items():
        for name, line in module_imports(module):
            target = next((m for m in _prefixes(name) if m in MODULES), None)
            if target is not None and target != module:
                found.setdefault((module, target), f"{path.relative_to(PACKAGE.parent)}:{line}")
    return found


def _prefixes(name: str) -> list[str]:
    """a.b.c, a.b, a: the module an import of a.b.c (or of a name in it) loads."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imports_of(prefix: str) -> Iterator[tuple[str, str, int]]:
    """(module, imported name, line) for every import in the modules under `prefix`."""
    for module in MODULES:
        if module == prefix or module.startswith(prefix + "."):
            yield from ((module, name, line) for name, line in module_imports(module))


def test_every_module_is_placed_in_a_layer():
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, "".join(f"\nplace {m} in a layer (LAYERS in tests/test_layers.py)" for m in unplaced)


def test_no_import_points_up_the_layers():
    upward = [
        f"{where}: {a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for (a, b), where in sorted(edges().items())
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycle_at_any_level():
    found = edges()
    graph: dict[str, set[str]] = {}
    for a, b in found:
        graph.setdefault(a, set()).add(b)
    report = []
    for component in cycles(graph):
        inside = set(component)
        within = [f"\n    {where}: {a} imports {b}" for (a, b), where in sorted(found.items()) if {a, b} <= inside]
        report.append(" <-> ".join(component) + "".join(within))
    assert not report, "import cycles:\n" + "\n".join(report)


def test_the_leaf_imports_only_the_standard_library_torch_and_numpy():
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "raylowcomm"}
    bad = [
        f"{m}:{line} imports {name}"
        for m, name, line in imports_of("raylowcomm.common")
        if name.split(".")[0] not in allowed
        or (name.split(".")[0] == "raylowcomm" and not name.startswith("raylowcomm.common"))
    ]
    assert not bad, "\n".join(bad)


def test_core_never_imports_ray():
    bad = [
        f"{m}:{line} imports {name}" for m, name, line in imports_of("raylowcomm.core") if name.split(".")[0] == "ray"
    ]
    assert not bad, "\n".join(bad)


def test_config_checks_never_import_peft():
    """Validating a config (LoRA fields included) needs no peft: nothing in or below the config layer imports it."""
    config_layer = next(i for i, (name, _) in enumerate(LAYERS) if name == "config")
    low = [m for m in MODULES if layer_of(m) is not None and layer_of(m) <= config_layer]
    bad = [
        f"{m}:{line} imports {name}" for m in low for name, line in module_imports(m) if name.split(".")[0] == "peft"
    ]
    assert not bad, "\n".join(bad)


def test_the_walk_sees_function_level_and_relative_imports():
    """The checks above are only as good as the walk: it finds an import inside a function and a
    relative one, the package's own lazy names (importlib) are not imports, and `raylowcomm` in
    LAYERS places its __init__ alone."""
    tree = ast.parse("def f():\n    from raylowcomm.core.zo import perturb\nfrom .routing import InterlockStage\n")
    names = sorted(imported_names("raylowcomm.core.interlock.probe", tree))
    assert names == [("raylowcomm.core.interlock.routing", 3), ("raylowcomm.core.zo.perturb", 2)]
    assert not [e for e in edges() if e[0] == "raylowcomm"]
    assert layer_of("raylowcomm.a_new_module") is None
