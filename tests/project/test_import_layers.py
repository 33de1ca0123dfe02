"""The library never imports the job: nothing in seqmesh.model, seqmesh.hf, seqmesh.memory or
seqmesh.compose imports seqmesh.training (the ``seqmesh train`` job), so the job can change freely and
a user's own loop does not load it."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "seqmesh"
LIBRARY = ("seqmesh.model", "seqmesh.hf", "seqmesh.memory", "seqmesh.compose", "seqmesh.sequence")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved; ``from M import name``
    gives ``M.name`` so a submodule imported by name is seen."""
    importer, found = _module_name(path), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = importer.split(".")
                parts = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_the_library_does_not_import_the_job():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not _module_name(path).startswith(LIBRARY):
            continue
        for line, module in imports_of(path):
            if (module + ".").startswith("seqmesh.training."):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert wrong == [], "the job may import the library, not the other way: move the shared code into seqmesh.model"


def _package(module: str) -> str:
    """``seqmesh.model.lm`` -> ``seqmesh.model``; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_packages():
    packages = {_package(_module_name(path)) for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _package(_module_name(path))
        for _, module in imports_of(path):
            there = _package(module)
            if there in packages and there != here:
                edges.setdefault(here, set()).add(there)
    cycles = []

    def walk(node: str, trail: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in trail:
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif len(trail) < 12:
                walk(nxt, trail + [nxt])

    for start in sorted(edges):
        walk(start, [start])
    assert cycles == [], "packages must import one way; move the shared part below both"
