"""How much of a collective stays exposed when it is pipelined with compute: the one formula that async
Ulysses' runtime (``seqmesh.sharded_attention.async_ulysses``) is built around and the planner predicts
with. Torch-free: ``seqmesh plan`` uses it.
"""

from __future__ import annotations

ASYNC_PIECES = 4
"""Pieces of tokens async Ulysses cuts each layer's projections and all-to-alls into."""


def pipelined_exposed(comm: float, compute: float, pieces: int) -> float:
    """Seconds of ``comm`` left on the critical path when it and ``compute`` are cut into ``pieces`` equal
    pieces and piece i's communication runs beside piece i+1's compute (async Ulysses: an all-to-all beside
    the next piece's projection, forward and backward). One piece's communication is never hidden (the
    first output all-to-all, or the last input one); the other ``pieces - 1`` hide behind as much compute::

        exposed = comm / pieces + max(0, comm - compute) * (pieces - 1) / pieces

    ``pieces=1`` is the synchronous path: all of ``comm``."""
    if pieces < 1:
        raise ValueError(f"pieces={pieces}: at least 1.")
    return comm / pieces + max(0.0, comm - compute) * (pieces - 1) / pieces
