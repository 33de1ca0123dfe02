"""No two modules of seqmesh import each other, directly or round a circle.

Every ``seqmesh/**/*.py`` is parsed with ``ast`` (nothing is imported) and each import of another
seqmesh module becomes an edge of the module graph. Counted: ``import seqmesh.a.b``; ``from seqmesh.a
import b`` and ``from . import b`` as the module ``seqmesh.a.b`` when ``b`` is a module, else as
``seqmesh.a`` (the package's ``__init__``); ``from .b import name`` as ``seqmesh.a.b``; imports at
module level, inside ``if TYPE_CHECKING:``, inside ``try`` and inside function and method bodies (a lazy
import is still a dependency, only a later one). Not counted: the implicit run of a parent package's
``__init__`` when a submodule is imported. Every strongly connected component of more than one module
is a circle; the test names each one, its modules in import order.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "seqmesh"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _owner(name: str) -> str | None:
    """The longest seqmesh module that ``name`` is or lies in (``seqmesh.a.b.Thing`` -> ``seqmesh.a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def module_imports(module: str) -> dict[str, int]:
    """The seqmesh modules ``module`` imports, each with the first line that imports it."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for target in targets:
            owner = _owner(target)
            if owner is not None and owner != module:
                found.setdefault(owner, node.lineno)
    return found


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components, each in the order a depth-first walk from its smallest module meets them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            components.append(sorted(component, key=lambda name: index[name]))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def _circle(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    """One circle through the component's first module, each hop with the line that makes it."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(edges.get(node, {})):
            if nxt == start:
                trail = paths[node] + [start]
                hops = [f"{a} (line {edges[a][b]})" for a, b in zip(trail, trail[1:])]
                return " -> ".join(hops + [start])
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    return " -> ".join(component)


def test_no_import_cycle_between_modules():
    edges = {module: module_imports(module) for module in MODULES}
    circles = [component for component in strongly_connected(edges) if len(component) > 1]
    report = [f"{{{', '.join(component)}}}: {_circle(component, edges)}" for component in circles]
    assert report == [], "modules must import one way; move what both need into a module below both:\n" + "\n".join(
        report
    )
