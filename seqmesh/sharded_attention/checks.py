"""Input checks that every rank of a sequence group agrees on, so a bad input fails everywhere.

Each rank checks its own tensors, then the group exchanges a small integer description of the call
(and whether the rank found a problem). Every rank then raises the same kind of ValueError, so no
rank is left waiting in a collective that its peers never reach.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single
from ..comm.stats import record

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
FIELDS = ("batch", "local tokens", "query heads", "kv heads", "head dim", "dtype", "causal", "layout",
          "sequence length", "documents")


def describe_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """A problem with the local q/k/v, or None."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k and v must be 4-D (batch, local tokens, heads, head dim); got {q.dim()}-D, "
                f"{k.dim()}-D and {v.dim()}-D tensors.")
    if k.shape != v.shape:
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape."
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        return (f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and local tokens "
                "(dims 0 and 1).")
    if q.shape[3] != k.shape[3]:
        return f"q has head dim {q.shape[3]} but k and v have {k.shape[3]}; they must be equal."
    if q.shape[2] % k.shape[2]:
        return (f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads; grouped-query "
                "attention needs query heads = kv heads x group size.")
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them first."
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported; use one of {', '.join(map(str, _DTYPES))}."
    if not (q.device == k.device == v.device):
        return f"q, k and v are on different devices ({q.device}, {k.device}, {v.device})."
    return None


def check_cu_seqlens(cu: Sequence[int], total: int) -> str | None:
    """A problem with global document boundaries over ``total`` (padded) tokens, or None."""
    if len(cu) < 2:
        return f"cu_seqlens needs at least two entries (0 and the end of the first document), got {list(cu)}."
    if cu[0] != 0:
        return f"cu_seqlens must start at 0, got {cu[0]}."
    for i in range(1, len(cu)):
        if cu[i] <= cu[i - 1]:
            return (f"cu_seqlens must be strictly increasing, but entry {i} is {cu[i]} after {cu[i - 1]}; "
                    "drop empty documents (repeated boundaries).")
    if cu[-1] > total:
        return (f"cu_seqlens ends at {cu[-1]} but the sequence holds {total} tokens "
                "(local tokens x sequence-parallel degree); the last boundary must not exceed it.")
    return None


def agree(group: dist.ProcessGroup, values: Sequence[int], problem: str | None, device: torch.device) -> None:
    """All-gather ``values`` (one int per :data:`FIELDS` entry) and each rank's problem flag over
    ``group``; raise the same ValueError on every rank if anyone has a problem or they differ."""
    world = dist.get_world_size(group)
    mine = torch.tensor([1 if problem else 0, *values], dtype=torch.int64, device=device)
    rows = mine.new_empty(world * mine.numel())
    all_gather_single(rows, mine, group=group)
    rows = rows.view(world, -1)
    record("control", "forward", (world - 1) * mine.numel() * 8, (world - 1) * mine.numel() * 8)
    table = rows.tolist()
    failed = [r for r in range(world) if table[r][0]]
    if failed:
        messages: list[str | None] = [None] * world
        dist.all_gather_object(messages, problem, group=group)
        if problem:
            raise ValueError(problem)
        raise ValueError(
            f"sequence-parallel rank(s) {failed} rejected their attention inputs, so this rank stops too. "
            f"Rank {failed[0]} said: {messages[failed[0]]}"
        )
    for i, name in enumerate(FIELDS, start=1):
        seen = [table[r][i] for r in range(world)]
        if len(set(seen)) > 1:
            raise ValueError(
                f"the ranks of a sequence group disagree on {name}: {seen} (by rank in the group). Every rank "
                "must call seqmesh.attention with the same shapes, dtype, causal flag, layout, length and "
                "documents; shard inputs with seqmesh.shard_sequence or seqmesh.shard_batch."
            )
