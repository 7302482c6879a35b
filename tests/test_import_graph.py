"""The package's layering, checked by parsing every import (function-level ones too) of every module.

Units are the top-level packages / modules of ``titanlike`` (``parallel``, ``layout``, ``config``, ...). The graph
between them must be acyclic, and the lower layers may import only what lies below them:

    errors  -> nothing of ours (ConfigError: every unit may raise it)
    init    -> nothing of ours            loss     -> nothing of ours
    sharding -> nothing of ours (the sharding vocabulary: plain data the models declare their TP layout in)
    models  -> init, sharding, errors
    layout  -> models, sharding, errors   kernels  -> models, layout, sharding, errors (model transforms: TE, float8)
    hf      -> models (the adapters live in the model folders; models import nothing of hf)
    parallel -> layout, models, loss, kernels, init, sharding, errors
    training -> everything below (it is the top, with the planner and the scripts)
    localize -> anything (the divergence localiser); no unit imports it

Inside a unit the modules import each other without cycles too: the module graph of the whole package (every
``import`` / ``from ... import`` at any depth, ``from package import submodule`` counted as an edge to the
submodule) has no cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titanlike"

ALLOWED = {
    "errors": set(),
    "init": set(),
    "sharding": set(),
    "models": {"init", "sharding", "errors"},
    "loss": set(),
    "layout": {"models", "sharding", "errors"},
    "parallel": {"layout", "models", "loss", "kernels", "init", "sharding", "errors"},
    "kernels": {"models", "layout", "sharding", "errors"},
    "hf": {"models"},
}


def _unit(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports (absolute and relative imports, at any depth of the module)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        parts = path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                base = ("titanlike",) + parts[:-1][: len(parts) - node.level]
                names = [".".join(base + ((node.module,) if node.module else ()))]
            else:
                continue
            for name in names:
                p = name.split(".")
                if p[0] == "titanlike" and len(p) > 1 and p[1] != unit:
                    edges.setdefault(unit, set()).add(p[1])
    return edges


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (every import statement, function-level ones included;
    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``)."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(name, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    out, state = [], {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                out.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u, [])
    return out


def test_the_package_import_graph_is_acyclic():
    edges = import_graph()
    assert _cycles(edges) == []
    assert len(edges) >= 6  # the walk saw the package (config, parallel, training, planner, checkpoint, ...)


def test_no_two_modules_import_each_other():
    edges = module_graph()
    assert _cycles(edges) == []
    assert len(edges) >= 40  # the walk saw the modules, inside the units too
    assert "titanlike.parallel.tensor_parallel" in edges["titanlike.parallel.parallelize"]


def test_lower_layers_import_only_what_lies_below():
    edges = import_graph()
    for unit, allowed in ALLOWED.items():
        assert edges.get(unit, set()) <= allowed, (unit, edges.get(unit, set()) - allowed)


def test_nothing_imports_the_localiser():
    edges = import_graph()
    assert "localize" in edges  # the walk saw it
    assert [u for u, targets in edges.items() if "localize" in targets and u != "localize"] == []


def test_a_planted_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_a_function_level_import_cycle_between_modules_is_found(tmp_path, monkeypatch):
    """Two modules of one unit that import each other, one of them inside a function (what the unit graph cannot
    see): the module graph has the cycle."""
    pkg = tmp_path / "titanlike" / "unit"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from titanlike.unit import b\n")
    (pkg / "b.py").write_text("def f():\n    from titanlike.unit.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "titanlike")
    assert _cycles(module_graph()) == [["titanlike.unit.a", "titanlike.unit.b", "titanlike.unit.a"]]
