"""Issue 19: the modules of kernels.serve import each other without a circle, counting imports
under `if TYPE_CHECKING:` too (a reader, and a type checker, follows those as well)."""

from __future__ import annotations

import ast
from pathlib import Path

import kernels.serve

SERVE = Path(kernels.serve.__file__).parent


def _imports(path: Path) -> set[str]:
    """The sibling modules `path` imports (`from .x import ...`, `from . import x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_serve_modules_form_no_import_circle():
    graph = {p.stem: _imports(p) for p in SERVE.glob("*.py") if p.stem != "__init__"}
    graph = {name: {d for d in deps if d in graph} for name, deps in graph.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name) :] + [name]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
