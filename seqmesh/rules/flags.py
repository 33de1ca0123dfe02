"""Command-line flags generated from a dataclass, so a config and its command never drift apart.

Each field ``some_name`` becomes ``--some-name``: its type from the annotation, its default from the
field and its help from the field's docstring (the string literal written under it, as torchtitan's
configs and Sphinx have it). A new field needs nothing here.

    annotation               flag
    int, float, str          --x VALUE
    bool                     --x / --no-x
    Literal["a", "b"]        --x {a,b}
    int | Literal["auto"]    --x N or --x auto
    list[str]                --x [VALUE ...]
    T | None                 as T, default None
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

T = typing.TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring on one line}`` for the fields of ``cls`` and its dataclass bases that have one (a
    subclass's docstring of a field it redefines wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_docs(klass))
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: the flags still work, without help
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def literal_words(hint: Any) -> tuple[str, ...]:
    """The words a ``Literal`` annotation allows, also inside a union (``int | Literal["auto"]``); () for none."""
    parts = typing.get_args(hint) if typing.get_origin(hint) is not Literal else (hint,)
    return tuple(w for p in parts if typing.get_origin(p) is Literal for w in typing.get_args(p))


def _int_or(words: tuple[str, ...]) -> Callable[[str], int | str]:
    def int_or_word(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or {' or '.join(words)}, got {text!r}") from None

    return int_or_word


def _options(name: str, hint: Any) -> dict[str, Any]:
    """``add_argument`` keywords for a field of type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (int, float, str):
        return {"type": hint}
    if origin is Literal:
        return {"type": type(args[0]), "choices": list(args)}
    if origin is list and len(args) == 1 and args[0] in (int, float, str):
        return {"type": args[0], "nargs": "*"}
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) == 1:  # T | None
            return _options(name, present[0])
        words = literal_words(hint)
        if int in present and len(present) == 2 and words:  # int | Literal["auto"]
            return {"type": _int_or(words), "metavar": "{" + ",".join((*words, "N")) + "}"}
    raise TypeError(f"field {name!r}: no command-line flag for type {hint}. Use int, float, str, bool, a Literal, "
                    "a list of int/float/str, int | Literal[...], or one of these | None.")


def flag_fields(cls: type, only: tuple[str, ...] | None = None) -> list[dataclasses.Field]:
    """The fields of ``cls`` that get flags (``only``: those named), the class's own before its bases' (a job's
    model and data before the run settings it inherits)."""
    own = getattr(cls, "__annotations__", {})
    chosen = [f for f in dataclasses.fields(cls) if only is None or f.name in only]
    return sorted(chosen, key=lambda f: f.name not in own)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One ``--flag`` on ``parser`` for every field of the dataclass ``cls`` (``only``: for the fields named;
    ``dest`` is the field name)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in flag_fields(cls, only):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        text = docs.get(f.name, "").replace("%", "%%")
        if default is dataclasses.MISSING:
            extra: dict[str, Any] = {"required": True}
        else:
            extra = {"default": default}
            if default is not None and default != []:
                text = f"{text} (default: %(default)s)".lstrip()
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, help=text, **extra,
                            **_options(f.name, hints[f.name]))


def flag_values(cls: type, args: argparse.Namespace, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``{field: value}`` that flags added by :func:`add_dataclass_flags` (with the same ``only``) give."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls, only)}


def dataclass_from_flags(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` that flags added by :func:`add_dataclass_flags` describe (its checks run as usual)."""
    return cls(**flag_values(cls, args))  # type: ignore[arg-type]
