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

from ..kernels import kernel_chooser
from ..layout import LayoutKind
from ..mesh import SPMesh
from .blocks import document_bounds
from .checks import check_attention_inputs
from .ring import ring_attention
from .schedule import ring_schedule
from .ulysses import ulysses_attention


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
    validate: bool | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded on ``mesh``'s sequence group.

    Args:
        q: ``(B, L, Hq, D)`` this rank's queries, in the layout's local order (``shard_sequence``).
        k, v: ``(B, L, Hk, D)`` with ``Hq % Hk == 0`` (MHA, GQA, MQA).
        mesh: the :class:`SPMesh`; attention runs over its ``ring x ulysses`` sequence group.
        causal: causal masking by global position.
        layout: ``"zigzag"``, ``"contiguous"`` or ``"per_document"``, as the inputs were sharded
            (``per_document`` places tokens by ``cu_seqlens``: pass the same boundaries to both).
        cu_seqlens: global document boundaries ``(0, e1, e2, ...)`` (int, flash-attn style, shared by
            the batch): no token attends across a boundary and tokens past the last one are padding.
        seq_len: the real length when there are no documents; positions at or past it are padding.
            Defaults to ``L * P``. Give it whenever the sequence was padded to shard it
            (``shard_sequence`` pads with zeros): non-causal attention would otherwise see the padding.
        softmax_scale: defaults to ``D ** -0.5``.
        backend: ``"auto"`` or a kernel name from ``seqmesh.kernels.BACKENDS``.
        validate: check that every rank of the sequence group passes matching inputs (one small
            all-gather with a host sync); any problem raises the same ValueError on every rank.
            ``None`` (the default) checks each new call signature once per mesh and skips the
            exchange for signatures the group already agreed on; ``True`` checks every call (use it
            while debugging a loop whose ranks may diverge); ``False`` never does.

    Returns:
        ``(B, L, Hq, D)`` in q's dtype and the same local order.
    """
    call = check_attention_inputs(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                  seq_len=seq_len, validate=validate)
    lay = call.layout
    schedule = ring_schedule(lay, document_bounds(lay.padded_len, call.real_len, call.cu_seqlens), causal)
    choose = kernel_chooser(backend)
    if backend != "auto":  # a named kernel may refuse some blocks (documents): find out before any rank sends
        for r in range(lay.ring):
            for step in range(lay.ring):
                for piece in schedule.pieces(r, step):
                    choose(q, k, piece.mask)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ring_group = mesh.ring_group if lay.ring > 1 else None

    def ring_part(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, kv_map: torch.Tensor | None) -> torch.Tensor:
        return ring_attention(qr, kr, vr, ring_group, schedule, choose, scale, kv_map)

    if mesh.ulysses == 1:
        return ring_part(q, k, v, None)
    return ulysses_attention(q, k, v, mesh, call.heads, ring_part)
