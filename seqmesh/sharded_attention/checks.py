"""Input checks that every rank of a sequence group agrees on, so a bad input fails everywhere.

Each rank checks its own tensors, then the group exchanges a small integer description of the call
(and whether the rank found a problem). Every rank then raises the same kind of ValueError, so no
rank is left waiting in a collective that its peers never reach.
"""

from __future__ import annotations

import bisect

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single
from ..comm.stats import record
from ..kernels.base import SUPPORTED_DTYPES
from ..tensor_values import has_values
from ..sequence.layout import LayoutKind, SequenceLayout
from ..mesh import SPMesh
from .heads import HeadPlan

FIELDS = ("batch", "local tokens", "query heads", "kv heads", "head dim", "dtype", "causal", "layout",
          "sequence length", "documents", "value head dim", "window", "sinks", "image blocks")
_LAYOUTS = tuple(LayoutKind)
VALIDATED_CALLS = 256  # signatures remembered per mesh (packed batches bring new boundaries each step)


def _as_ints(cu_seqlens: torch.Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}.")
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def _as_blocks(blocks: Sequence[tuple[int, int]] | None) -> tuple[tuple[int, int], ...]:
    return () if blocks is None else tuple((int(a), int(b)) for a, b in blocks)


def _fingerprint(cu: tuple | None) -> int:
    """The same integer on every process for the same boundaries (int tuples hash deterministically)."""
    return 0 if not cu else (hash(cu) & (2**62 - 1)) + 1


@dataclass(frozen=True)
class CheckedCall:
    """What a checked ``seqmesh.attention`` call resolved to, the same on every rank."""

    layout: SequenceLayout
    heads: HeadPlan
    cu_seqlens: tuple[int, ...] | None
    real_len: int  # tokens that are not padding
    image_blocks: tuple[tuple[int, int], ...] = ()  # [start, stop) of each image block, ascending


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool, layout: str | LayoutKind,
    cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int | None, validate: bool | None,
    window: int | None = None, sinks: torch.Tensor | None = None,
    image_blocks: Sequence[tuple[int, int]] | None = None,
) -> CheckedCall:
    """Check one rank's inputs and, with ``validate``, that the sequence group agrees on them; raise the
    same ValueError on every rank otherwise. ``validate=None`` agrees once per call signature (shapes,
    dtype, flags, length, documents) and remembers it on the mesh, so a training loop pays one small
    exchange per new shape rather than one per layer."""
    p = mesh.sp_size
    problem = describe_shapes(q, k, v) or describe_variants(q, causal, window, sinks)
    try:
        cu = _as_ints(cu_seqlens)
    except (TypeError, ValueError) as err:  # reported through the group below, so no peer is left waiting
        cu, problem = None, problem or f"cu_seqlens could not be read as integers: {err}"
    try:
        blocks = _as_blocks(image_blocks)
    except (TypeError, ValueError) as err:
        blocks, problem = (), problem or f"image_blocks must be (start, stop) pairs of ints: {err}"
    values = [0] * len(FIELDS)
    lay = plan = None
    if problem is None:
        b, n, hq, d = q.shape
        total = n * p
        try:
            lay = SequenceLayout(layout, mesh.ring, mesh.ulysses, total)  # type: ignore[arg-type]  # parsed inside
            plan = HeadPlan(hq, k.shape[2], mesh.ulysses)
        except ValueError as err:
            problem = str(err)
        if problem is None and cu is not None:
            problem = check_cu_seqlens(cu, total)
        if problem is None and cu is not None and lay is not None and lay.kind is LayoutKind.PER_DOCUMENT:
            lay = SequenceLayout(lay.kind, lay.ring, lay.ulysses, total, cu)  # its runs follow the documents
        if problem is None and seq_len is not None and not 1 <= seq_len <= total:
            problem = f"seq_len={seq_len} must be in [1, {total}] (local tokens {n} x sequence degree {p})."
        if problem is None and blocks:
            problem = check_image_blocks(blocks, cu, cu[-1] if cu is not None else (seq_len or total), window)
        if problem is None and q.device.type != mesh.device_type:
            problem = f"the tensors are on {q.device.type} but the mesh was built for {mesh.device_type}."
        values = [b, n, hq, k.shape[2], d, SUPPORTED_DTYPES.index(q.dtype) + 1, int(causal),
                  _LAYOUTS.index(lay.kind) if lay else -1, seq_len or 0, _fingerprint(cu), v.shape[3], window or 0,
                  int(sinks is not None), _fingerprint(blocks)]
    key = (problem is None, *values)
    if validate is None:
        validate = problem is not None or key not in mesh.validated_calls
    if validate and p > 1:
        readable = None  # FIELDS as a user writes them
        if problem is None:
            readable = [b, n, hq, k.shape[2], d, str(q.dtype).removeprefix("torch."), causal,
                        lay.kind.value if lay else None, seq_len, list(cu) if cu is not None else None, v.shape[3],
                        window, sinks is not None, [list(b) for b in blocks]]
        agree(mesh.sp_group, values, problem, mesh.collective_device(), readable)
    elif problem:
        raise ValueError(problem)
    assert lay is not None and plan is not None
    mesh.validated_calls[key] = True
    mesh.validated_calls.move_to_end(key)
    while len(mesh.validated_calls) > VALIDATED_CALLS:
        mesh.validated_calls.popitem(last=False)
    real = cu[-1] if cu is not None else (seq_len or lay.padded_len)
    return CheckedCall(lay, plan, cu, real, blocks)


def describe_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """A problem with the local q/k/v, or None."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k and v must be 4-D (batch, local tokens, heads, head dim); got {q.dim()}-D, "
                f"{k.dim()}-D and {v.dim()}-D tensors.")
    if k.shape[:3] != v.shape[:3]:
        return (f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on batch, tokens and heads (their head "
                "dims may differ).")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        return (f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and local tokens "
                "(dims 0 and 1).")
    if q.shape[3] != k.shape[3]:
        return f"q has head dim {q.shape[3]} but k has {k.shape[3]}; they must be equal (v's may differ)."
    if q.shape[2] % k.shape[2]:
        return (f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads; grouped-query "
                "attention needs query heads = kv heads x group size.")
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them first."
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported; use one of {', '.join(map(str, SUPPORTED_DTYPES))}."
    if not (q.device == k.device == v.device):
        return f"q, k and v are on different devices ({q.device}, {k.device}, {v.device})."
    return None


def describe_variants(q: torch.Tensor, causal: bool, window: int | None, sinks: torch.Tensor | None) -> str | None:
    """A problem with the sliding window or the attention sinks, or None."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            return f"window must be a positive int (tokens each query sees, itself included), got {window!r}."
        if not causal:
            return ("sliding windows are supported with causal attention only (query i sees keys i - window < j <= i); "
                    "pass causal=True or window=None.")
    if sinks is not None:
        if sinks.shape != (q.shape[2],) or not sinks.is_floating_point():
            return (f"sinks must be a float tensor of shape (query heads,) = ({q.shape[2]},), one logit per head; "
                    f"got {tuple(sinks.shape)} {sinks.dtype}.")
        if sinks.device != q.device:
            return f"sinks are on {sinks.device} but q is on {q.device}."
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


def check_image_blocks(blocks: Sequence[tuple[int, int]], cu: Sequence[int] | None, real: int,
                       window: int | None) -> str | None:
    """A problem with image blocks (``[start, stop)`` positions whose tokens see each other both ways) over a
    sequence of ``real`` tokens in the documents ``cu``, under a causal ``window``, or None."""
    previous = 0
    for a, b in blocks:
        if not previous <= a < b <= real:
            return (f"image block [{a}, {b}) is not a non-empty interval of real positions after the previous block "
                    f"(which ends at {previous}) and before {real}; give ascending, disjoint blocks of the sequence.")
        after = bisect.bisect_right(cu or (), a)  # the first document boundary past the block's start
        if cu and after < len(cu) and cu[after] < b:
            return (f"image block [{a}, {b}) crosses the document boundary {cu[after]}; an image lies inside one "
                    "document: cut the block there (each document sees only its own tokens).")
        if window is not None and b - a > window:
            return (f"image block [{a}, {b}) holds {b - a} tokens, more than the sliding window of {window}: its first "
                    "tokens would see later image tokens farther away than the window (transformers' Gemma 3 mask "
                    "allows that), which seqmesh does not compute. Use images of at most the window's tokens "
                    "(mm_tokens_per_image) or a longer sliding_window.")
        previous = b
    return None


def agree(
    group: dist.ProcessGroup, values: Sequence[int], problem: str | None, device: torch.device,
    readable: Sequence[object] | None = None,
) -> None:
    """All-gather ``values`` (one int per :data:`FIELDS` entry) and each rank's problem flag over
    ``group``; raise the same ValueError on every rank if anyone has a problem or they differ.
    ``readable`` holds the same fields as a user would write them (dtype names, the boundaries
    themselves); it is exchanged only on the error path, to name what differs."""
    world = dist.get_world_size(group)
    mine = torch.tensor([1 if problem else 0, *values], dtype=torch.int64, device=device)
    rows = mine.new_empty(world * mine.numel())
    all_gather_single(rows, mine, group=group)
    rows = rows.view(world, -1)
    record("control", "forward", (world - 1) * mine.numel() * 8, (world - 1) * mine.numel() * 8)
    if not has_values(rows):  # fake tensors (seqmesh rehearse): one process plays the rank, nothing to compare
        return
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
            words: list[Sequence[object] | None] = [None] * world
            dist.all_gather_object(words, readable, group=group)  # every rank is here: the table is shared
            if all(w is not None for w in words):
                seen = [w[i - 1] for w in words]  # type: ignore[index]
            raise ValueError(
                f"the ranks of a sequence group disagree on {name}: {seen} (by rank in the group). Every rank "
                "must call seqmesh.attention with the same shapes, dtype, causal flag, layout, length and "
                "documents; shard inputs with seqmesh.shard_sequence or seqmesh.shard_batch."
            )
