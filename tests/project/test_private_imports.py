"""Within seqmesh no module imports another module's private names: a name that two modules share is
public (no leading underscore) where it is defined."""

from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "seqmesh"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module that ``from ... import`` in ``importer`` reads from."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _imported_from(node, importer, path.name == "__init__.py")
            if source != "seqmesh" and not source.startswith("seqmesh.") or source == importer:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private or any(part.startswith("_") and not part.startswith("__") for part in source.split(".")):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {alias.name} from {source}")
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == [], "make the name public where it is defined, or keep it in one module"


def test_the_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    package = tmp_path / "seqmesh"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .sub.a import _x\n")
    (package / "sub" / "__init__.py").write_text("from .a import _y\nfrom ..b import _z\n")
    (package / "sub" / "a.py").write_text("from seqmesh.b import _w, public\nfrom .a import _self_is_fine\n")
    (package / "b.py").write_text("from ._hidden import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert sorted(private_imports()) == sorted([
        "seqmesh/__init__.py:1 imports _x from seqmesh.sub.a",
        "seqmesh/sub/__init__.py:1 imports _y from seqmesh.sub.a",
        "seqmesh/sub/__init__.py:2 imports _z from seqmesh.b",
        "seqmesh/sub/a.py:1 imports _w from seqmesh.b",
        "seqmesh/b.py:1 imports f from seqmesh._hidden",
    ])
