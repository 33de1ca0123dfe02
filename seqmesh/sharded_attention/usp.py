"""``seqmesh.attention``: Ulysses inside rows of the mesh, ring attention across them (USP).

On a ``ring x ulysses`` sequence group, with L = padded_len / P local tokens::

    q (B, L, Hq, D), k, v (B, L, Hk, D)                            this rank's shard
      -- all-to-all in the Ulysses group: scatter heads, gather the ring block -->
    q (B, U*L, hq, D), k, v (B, U*L, hk, D)                          one ring block, a head subset
      -- ring attention across the ring group -->
    o (B, U*L, hq, D)
      -- inverse all-to-all -->
    o (B, L, Hq, D)

``ulysses=1`` is pure ring attention (no all-to-all), ``ring=1`` pure Ulysses (the ring has one step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.collectives import head_to_seq, seq_to_head
from ..kernels import kernel_chooser
from ..layout import LayoutKind, SequenceLayout
from ..mesh import SPMesh
from .blocks import document_bounds
from .checks import FIELDS, agree, check_cu_seqlens, describe_shapes
from .heads import HeadPlan
from .ring import ring_attention
from .schedule import RingSchedule

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}


def _as_ints(cu_seqlens: torch.Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}.")
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def _fingerprint(cu: tuple[int, ...] | None) -> int:
    """The same integer on every process for the same boundaries (int tuples hash deterministically)."""
    return 0 if cu is None else (hash(cu) & (2**62 - 1)) + 1


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SPMesh,
    *,
    causal: bool = True,
    layout: str | LayoutKind = "zigzag",
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    seq_len: int | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Exact attention over a sequence sharded on ``mesh``'s sequence group.

    Args:
        q: ``(B, L, Hq, D)`` this rank's queries, in the layout's local order (``shard_sequence``).
        k, v: ``(B, L, Hk, D)`` with ``Hq % Hk == 0`` (MHA, GQA, MQA).
        mesh: the :class:`SPMesh`; attention runs over its ``ring x ulysses`` sequence group.
        causal: causal masking by global position.
        layout: ``"zigzag"`` or ``"contiguous"``, as the inputs were sharded.
        cu_seqlens: global document boundaries ``(0, e1, e2, ...)`` (int, flash-attn style, shared by
            the batch): no token attends across a boundary and tokens past the last one are padding.
        seq_len: the real length when there are no documents; positions at or past it are padding.
            Defaults to ``L * P``. Give it whenever the sequence was padded to shard it
            (``shard_sequence`` pads with zeros): non-causal attention would otherwise see the padding.
        softmax_scale: defaults to ``D ** -0.5``.
        backend: ``"auto"`` or a kernel name from ``seqmesh.kernels.BACKENDS``.
        validate: check that every rank of the sequence group passes matching inputs (one small
            all-gather); any problem raises the same ValueError on every rank.

    Returns:
        ``(B, L, Hq, D)`` in q's dtype and the same local order.
    """
    p, ring, ulysses = mesh.sp_size, mesh.ring, mesh.ulysses
    problem = describe_shapes(q, k, v)
    try:
        cu = _as_ints(cu_seqlens)
    except (TypeError, ValueError) as err:  # reported through the group below, so no peer is left waiting
        cu, problem = None, problem or f"cu_seqlens could not be read as integers: {err}"
    values = [0] * len(FIELDS)
    lay = plan = None
    if problem is None:
        b, n, hq, d = q.shape
        total = n * p
        try:
            lay = SequenceLayout(layout, ring, ulysses, total)  # type: ignore[arg-type]  # parsed inside
            plan = HeadPlan(hq, k.shape[2], ulysses)
        except ValueError as err:
            problem = str(err)
        if problem is None and cu is not None:
            problem = check_cu_seqlens(cu, total)
        if problem is None and seq_len is not None and not 1 <= seq_len <= total:
            problem = f"seq_len={seq_len} must be in [1, {total}] (local tokens {n} x sequence degree {p})."
        if problem is None and q.device.type != mesh.device_type:
            problem = f"the tensors are on {q.device.type} but the mesh was built for {mesh.device_type}."
        values = [b, n, hq, k.shape[2], d, _DTYPE_CODES.get(q.dtype, 0), int(causal),
                  list(LayoutKind).index(lay.kind) if lay else -1, seq_len or 0, _fingerprint(cu)]
    if validate and p > 1:
        agree(mesh.sp_group, values, problem, mesh.collective_device())
    elif problem:
        raise ValueError(problem)
    assert lay is not None and plan is not None

    real = cu[-1] if cu is not None else (seq_len or lay.padded_len)
    schedule = RingSchedule(lay, document_bounds(lay.padded_len, real, cu), causal)
    choose = kernel_chooser(backend)
    if backend != "auto":  # a named kernel may refuse some blocks (documents): find out before any rank sends
        for r in range(ring):
            for step in range(ring):
                for piece in schedule.pieces(r, step):
                    choose(q, k, piece.mask)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ring_group = mesh.ring_group if ring > 1 else None
    if ulysses == 1:
        return ring_attention(q, k, v, ring_group, schedule, choose, scale)

    u = mesh.ulysses_rank
    nq, nk = plan.q_count(u), plan.kv_count(u)
    packed = seq_to_head([q, k, v], mesh.ulysses_group, plan.send_chunks(), plan.send_heads(), nq + 2 * nk)
    qh, kh, vh = packed.split([nq, nk, nk], dim=2)  # (B, U*L, h, D) each
    out = ring_attention(qh, kh, vh, ring_group, schedule, choose, scale, plan.kv_map(u, q.device))
    chunks = [(0, *plan.q_range(r)) for r in range(ulysses)]
    return head_to_seq(out, mesh.ulysses_group, chunks, [plan.q_count(r) for r in range(ulysses)], nq, q.shape)
