"""The package's layering, checked by parsing every import (function-level ones too) of every module.

Units are the top-level packages / modules of ``titanlike`` (``parallel``, ``layout``, ``config``, ...). The graph
between them must be acyclic, and the lower layers may import only what lies below them:

    errors  -> nothing of ours (ConfigError: every unit may raise it)
    init    -> nothing of ours            loss     -> nothing of ours
    models  -> init (parameter distributions), errors
    layout  -> models, errors             kernels  -> models, layout, errors (model transforms: TE, float8)
    parallel -> layout, models, loss, kernels, init, errors
    training -> everything below (it is the top, with the planner and the scripts)
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titanlike"

ALLOWED = {
    "errors": set(),
    "init": set(),
    "models": {"init", "errors"},
    "loss": set(),
    "layout": {"models", "errors"},
    "parallel": {"layout", "models", "loss", "kernels", "init", "errors"},
    "kernels": {"models", "layout", "errors"},
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


def test_lower_layers_import_only_what_lies_below():
    edges = import_graph()
    for unit, allowed in ALLOWED.items():
        assert edges.get(unit, set()) <= allowed, (unit, edges.get(unit, set()) - allowed)


def test_a_planted_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
