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

from ..sequence.layout import LayoutKind
from ..mesh import SPMesh
from .checks import CheckedCall
from .compiled import compiled_attention
from .ring import ring_attention
from .schedule import for_heads
from .planning import check_backend, plan_attention  # noqa: F401  (check_backend: read by bench hot_path)
from .async_ulysses import OutputProjection, Projection, async_ulysses_attention
from .ulysses import InnerAttention, ulysses_attention


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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    image_blocks: Sequence[tuple[int, int]] | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    alibi: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded on ``mesh``'s sequence group.

    Args:
        q: ``(B, L, Hq, D)`` this rank's queries, in the layout's local order (``shard_sequence``).
        k, v: ``(B, L, Hk, D)`` and ``(B, L, Hk, Dv)`` with ``Hq % Hk == 0`` (MHA, GQA, MQA); ``Dv`` may
            differ from ``D`` (MLA-style heads): kernels that need one head dim are skipped by ``auto``.
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
        window: causal sliding window, as transformers' ``sliding_window`` (Mistral, Gemma, gpt-oss):
            the query at global position i sees keys j with ``i - window < j <= i`` (itself and the
            ``window - 1`` before it), within its document. The ring skips blocks (and, when the
            window is shorter than a ring chunk, whole steps and their K/V transfers) it never sees.
        sinks: ``(Hq,)`` learned per-head logits added to every row's softmax denominator only
            (gpt-oss ``s_aux``), folded into the fp32 log-sum-exp once. Its gradient on each rank
            is this rank's part (its Ulysses heads, its ring block's rows): sum it over the sequence
            group, as FSDP/DDP does for every weight when the sequence ranks are data ranks too.
        image_blocks: global ``[start, stop)`` intervals of positions, ascending, each inside one document,
            whose tokens see each other both ways (Gemma 3's images): with ``causal``, a query in a block
            also sees the block's later keys. Under a ``window`` a block may hold at most ``window`` tokens.
            Without ``causal`` they change nothing. ``seqmesh.shard_batch`` finds them (``SequenceInfo``).
        chunk: chunked attention (Llama 4's ``attention_chunk_size``): the sequence is cut every ``chunk``
            positions of each document and a query sees only keys of its own chunk (as transformers' chunked
            mask on packed documents: chunks count from each document's start). The layout is the
            documents' alone; the ring skips the blocks no chunk crosses. Not with ``image_blocks``.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): each scaled score becomes
            ``softcap * tanh(s / softcap)`` inside every kernel call, backward included; the log-sum-exp
            merge is unchanged. Kernels that cannot cap (torch's CPU and CUDA ops) are skipped by ``auto``.
        alibi: ALiBi (BLOOM, MPT): one slope per query head (``Hq`` floats, in q's head order), causal only, no window
            or image blocks. The scaled score of a query and a key ``d`` positions earlier in its document gets
            ``-slope * d``, on every ring block (each call knows its distance: ``BlockMask.alibi``). ``auto`` takes
            seqmesh's Triton flash kernel on CUDA (``triton_flash``), torch's CPU flash op in row bands in fp32 and
            fp64 on the CPU, else the math kernel (one (rows, keys) score block per call).

    Under autocast, floating q, k and v are first cast to autocast's dtype, as torch's SDPA does (transformers'
    rotary leaves q and k in float32 beside a bfloat16 v there); the kernels then run with autocast off.

    Returns:
        ``(B, L, Hq, Dv)`` in q's dtype (autocast's under autocast) and the same local order.
    """
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():  # one graph node: two torch.library ops that plan inside (compiled.py)
        return compiled_attention(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens, seq_len=seq_len,
                                  softmax_scale=softmax_scale, backend=backend, validate=validate, window=window,
                                  sinks=sinks, image_blocks=image_blocks, chunk=chunk, softcap=softcap, alibi=alibi)
    call, ring_part = prepare_attention(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                        seq_len=seq_len, softmax_scale=softmax_scale, backend=backend,
                                        validate=validate, window=window, sinks=sinks, image_blocks=image_blocks,
                                        chunk=chunk, softcap=softcap, alibi=alibi)
    if mesh.ulysses == 1:
        return ring_part(q, k, v, None)
    return ulysses_attention(q, k, v, mesh, call.heads, ring_part)


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v in autocast's dtype where autocast is on for their device (float64 left, as autocast leaves it)."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t for t in (q, k, v))


def prepare_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool, layout: str | LayoutKind,
    cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int | None, softmax_scale: float | None, backend: str,
    validate: bool | None, window: int | None, sinks: torch.Tensor | None,
    image_blocks: Sequence[tuple[int, int]] | None = None, chunk: int | None = None, softcap: float | None = None,
    alibi: Sequence[float] | torch.Tensor | None = None,
) -> tuple[CheckedCall, InnerAttention]:
    """Check a call of :func:`attention` (arguments as there; only q, k, v's shapes, dtype and device are read,
    so expanded views do) and return it with the ring attention that runs on each Ulysses rank's heads."""
    call, schedule, choose = plan_attention(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                            seq_len=seq_len, backend=backend, validate=validate, window=window,
                                            sinks=sinks, image_blocks=image_blocks, chunk=chunk, softcap=softcap,
                                            alibi=alibi)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ring_group = mesh.ring_group if call.layout.ring > 1 else None

    def ring_part(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, kv_map: torch.Tensor | None) -> torch.Tensor:
        a, b = call.heads.q_range(mesh.ulysses_rank) if mesh.ulysses > 1 else (0, q.shape[2])  # this rank's heads
        own_sinks = None if sinks is None else sinks[a:b]  # autograd scatters the gradient back
        return ring_attention(qr, kr, vr, ring_group, for_heads(schedule, a, b), choose, scale, kv_map, own_sinks)

    return call, ring_part


def projected_attention(
    hidden: torch.Tensor,
    project: Projection,
    output: OutputProjection,
    mesh: SPMesh,
    *,
    pieces: int = 2,
    causal: bool = True,
    layout: str | LayoutKind = "zigzag",
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    seq_len: int | None = None,
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate: bool | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    image_blocks: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """``output(attention(*project(hidden)))`` with async Ulysses: ``hidden`` (B, L, E) is projected in
    ``pieces`` pieces of tokens and each piece's all-to-all overlaps the next piece's projection; the
    inverse all-to-alls overlap ``output`` likewise (``seqmesh.sharded_attention.async_ulysses``).

    ``project(hidden[:, tokens], tokens)`` returns that piece's ``q (B, l, Hq, D), k, v (B, l, Hk, D)``
    (one head dim for all three); ``output(o)`` maps ``(B, l, Hq, D)`` to ``(B, l, E')``; both act per
    token. The other arguments are :func:`attention`'s. Without a Ulysses axis there is nothing to overlap
    and this is the synchronous composition. Returns ``(B, L, E')``."""
    options = dict(causal=causal, layout=layout, cu_seqlens=cu_seqlens, seq_len=seq_len, softmax_scale=softmax_scale,
                   backend=backend, validate=validate, window=window, sinks=sinks, image_blocks=image_blocks)
    if mesh.ulysses == 1:
        q, k, v = project(hidden, slice(0, hidden.shape[1]))
        return output(attention(q, k, v, mesh, **options))

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        call, ring_part = prepare_attention(q, k, v, mesh, **options)
        return call.heads, ring_part

    return async_ulysses_attention(hidden, project, output, prepare, mesh, pieces)
