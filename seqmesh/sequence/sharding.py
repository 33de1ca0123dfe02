"""Moving whole sequences onto the sequence group and back, differentiably.

Every function takes the layout by name (``layout``), the packed documents (``cu_seqlens``) and the
``per_document`` layout's ``min_chunk``: give the same to every call that places one sequence
(``seqmesh.attention`` and ``shard_batch`` keep the default ``min_chunk``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..comm.collectives import all_gather, split
from ..mesh import SPMesh
from .layout import LayoutKind, SequenceLayout
from .runs import DEFAULT_MIN_CHUNK


def sequence_layout(
    mesh: SPMesh,
    seq_len: int,
    layout: str | LayoutKind = "zigzag",
    cu_seqlens: Sequence[int] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
) -> SequenceLayout:
    """The layout a ``seq_len``-token sequence gets on ``mesh``'s sequence group (padded as needed).
    ``cu_seqlens`` (packed documents) and ``min_chunk`` place the tokens of the ``per_document`` layout;
    the other layouts ignore them. With tensor parallelism each share is padded to split into ``mesh.tp``
    equal slices."""
    docs = tuple(int(x) for x in cu_seqlens) if cu_seqlens is not None else None
    return SequenceLayout.for_length(layout, mesh.ring, mesh.ulysses, seq_len, docs, min_chunk, getattr(mesh, "tp", 1))


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return F.pad(x, pad)


def shard_sequence(
    x: torch.Tensor,
    mesh: SPMesh,
    *,
    dim: int = 1,
    layout: str | LayoutKind = "zigzag",
    cu_seqlens: Sequence[int] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
) -> torch.Tensor:
    """This rank's shard of ``x``, which every rank of the sequence group holds whole.

    ``x`` has the sequence along ``dim`` (e.g. ``(B, S, ...)``). It is padded with zeros to the
    layout's multiple, permuted by the layout and cut into ``ring x ulysses`` shards; the result
    has ``padded_len / P`` tokens along ``dim``. When padding was added, tell ``seqmesh.attention``
    the real length (``seq_len=x.shape[dim]``) so no token attends to the zeros. Backward all-gathers the shards' gradients, so the
    gradient of ``x`` is whole on every rank. The ``per_document`` layout needs the packed documents'
    ``cu_seqlens``, the same that ``seqmesh.attention`` is given.
    """
    dim = dim % x.dim()
    lay = sequence_layout(mesh, x.shape[dim], layout, cu_seqlens, min_chunk)
    if lay.size == 1:
        return x
    order = lay.indices(device=x.device)
    full = _pad(x, dim, lay.padded_len).index_select(dim, order)  # shard order
    return split(full, mesh.sp_group, dim)


def gather_sequence(
    x_local: torch.Tensor,
    mesh: SPMesh,
    *,
    dim: int = 1,
    layout: str | LayoutKind = "zigzag",
    length: int | None = None,
    cu_seqlens: Sequence[int] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards, restore natural order, and drop
    padding beyond ``length``. Backward is a reduce-scatter (each rank gets its shard's gradient
    summed over the ranks that used the gathered tensor)."""
    dim = dim % x_local.dim()
    p = mesh.sp_size
    padded = x_local.shape[dim] * p
    docs = tuple(int(x) for x in cu_seqlens) if cu_seqlens is not None else None
    lay = SequenceLayout(layout, mesh.ring, mesh.ulysses, padded, docs, min_chunk)  # type: ignore[arg-type]  # parsed inside
    if length is not None and not 0 < length <= padded:
        raise ValueError(f"length={length} must be in [1, {padded}] (the gathered, padded length).")
    full = x_local if p == 1 else all_gather(x_local, mesh.sp_group, dim)
    if p > 1:
        full = full.index_select(dim, lay.indices(restore=True, device=full.device))
    return full if length is None else full.narrow(dim, 0, length)


def sequence_positions(
    seq_len: int,
    mesh: SPMesh,
    *,
    layout: str | LayoutKind = "zigzag",
    device: torch.device | str = "cpu",
    cu_seqlens: Sequence[int] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
) -> torch.Tensor:
    """``(padded_len / P,)`` int64 global position of every token this rank holds (for RoPE, masks).
    Positions at or past ``seq_len`` are padding."""
    lay = sequence_layout(mesh, seq_len, layout, cu_seqlens, min_chunk)
    return lay.local_positions(mesh.sp_rank).to(device)
