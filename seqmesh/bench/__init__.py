"""``seqmesh bench``: one module per subcommand, each with ``add_subcommand(bench_sub)`` that registers
its parser, flags and ``func``; what several share is in ``common``.

``hot_path`` is a module, not a subcommand: ``python -m seqmesh.bench.hot_path`` (see its docstring).
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = ("attention", "linear", "merge", "host", "balance", "window", "memory", "baseline", "vision",
               "async_ulysses", "compile", "experts", "families", "indexer")
"""The modules registered under ``seqmesh bench``, in the order ``--help`` lists them."""


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """``seqmesh bench WHAT`` for every module of ``SUBCOMMANDS``; a module is imported here, when the
    parser is built, not when ``seqmesh.bench`` is."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f".{name}", __name__).add_subcommand(bench_sub)
