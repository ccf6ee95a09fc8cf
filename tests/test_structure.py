"""The shape of the house (docs/design.md, "The path of a call"): no module of the package
imports one that imports it back, and a validated call is never changed after validation."""

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import cpuflash
from cpuflash import _call, _validate

PACKAGE = Path(cpuflash.__file__).parent


def import_graph(root):
    """{module: the package's modules it imports}, imports inside functions included."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                named = [f"{target}.{alias.name}" for alias in node.names
                         if f"{target}.{alias.name}" in modules]
                edges.update(m for m in named or [target] if m in modules and m != name)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = edges
    return graph


def cycles(graph):
    """The import circles of `graph`: each group of modules that import each other, directly or
    through others (a strongly connected component of more than one module), sorted."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(tuple(sorted(group)))

    for module in graph:
        if module not in order:
            visit(module)
    return sorted(found)


def test_the_finder_sees_an_import_circle(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import x\n")
    (package / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(package)) == [("pkg.a", "pkg.b")]


def test_no_import_circle_in_the_package():
    assert cycles(import_graph(PACKAGE)) == []


def test_a_validated_call_cannot_be_changed(rng):
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    call = _validate.attention_args(q, q, q)
    assert isinstance(call, _call.AttentionCall)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.softcap = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.user = _call.NO_USER_FUNCTIONS
