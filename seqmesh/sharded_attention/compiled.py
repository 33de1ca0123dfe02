"""``seqmesh.attention`` as two ``torch.library`` ops, so ``torch.compile`` traces it as one graph node.

Dynamo cannot trace the Python around the kernels (the group's agreement, with its host sync; the
ring schedule; the P2P loop), so under ``torch.compile`` :func:`seqmesh.attention` calls
``seqmesh::attention_forward`` and its registered backward ``seqmesh::attention_backward`` instead.
Both do the whole planning inside (checks, schedule, head deal), from arguments a graph can hold:
tensors, numbers, strings, and the mesh by its :attr:`~seqmesh.mesh.SPMesh.name`::

    forward:  q, k, v (B, L, H, D) -> out (B, L, Hq, Dv), lse (B, hq, U*L),
              and what backward needs: heads (B, U*L, hq + 2 hk, D), this rank's q, k and v heads after the
              all-to-all, packed (q and k only, and v_apart (B, U*L, hk, Dv), when v's head dim differs),
              and oh (B, U*L, hq, Dv); empty for pure ring, which keeps q, k, v and out
    backward: dout (B, L, Hq, Dv) -> dq, dk, dv, dsinks

The same saved tensors as eager (the ring's inputs, its output and log-sum-exp), and the same
collectives: the inputs' all-to-all and the ring in forward; dout's all-to-all, the ring's backward
and the gradients' all-to-all in backward (q, k and v packed in one message, as eager). The fake
implementations give the shapes from the head deal alone, so tracing moves no data and syncs nothing.

Validation under compile: the ops run at every call, so the group agrees on each new call signature
inside the forward op exactly as in eager (``validate``), with the host sync it implies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.collectives import gather_heads, scatter_heads
from ..kernels.base import lse_dtype
from ..mesh import SPMesh, mesh_by_name
from ..sequence.layout import LayoutKind
from .checks import CheckedCall
from .heads import HeadPlan
from .planning import plan_attention
from .ring import local_backward, local_forward, ring_backward, ring_forward
from .schedule import for_heads

_VALIDATE_CODES = {None: -1, False: 0, True: 1}


def _validate_flag(code: int) -> bool | None:
    return {-1: None, 0: False, 1: True}[code]


def _pairs(flat: list[int] | None) -> list[tuple[int, int]] | None:
    """Image blocks ``[(start, stop), ...]`` from the flat list an op takes."""
    return None if flat is None else list(zip(flat[0::2], flat[1::2]))


def _own_heads(call: CheckedCall, mesh: SPMesh, hq: int) -> tuple[int, int]:
    """This Ulysses rank's query heads ``[a, b)``."""
    return call.heads.q_range(mesh.ulysses_rank) if mesh.ulysses > 1 else (0, hq)


def _inner_forward(q, k, v, sinks, mesh, schedule, choose, kv_map, scale):
    if schedule.layout.ring == 1:
        return local_forward(q, k, v, sinks, schedule, choose, kv_map, scale)
    return ring_forward(q, k, v, sinks, mesh.ring_group, schedule, choose, kv_map, scale)


def _inner_backward(dout, q, k, v, out, lse, sinks, mesh, schedule, choose, kv_map, scale):
    if schedule.layout.ring == 1:
        return local_backward(dout, q, k, v, out, lse, sinks, schedule, choose, kv_map, scale)
    return ring_backward(dout, q, k, v, out, lse, sinks, mesh.ring_group, schedule, choose, kv_map, scale)


def _to_heads(q, k, v, plan, nq: int, nk: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The Ulysses all-to-all of q (B, L, Hq, D), k, v (B, L, Hk, Dv) to this rank's nq query and nk kv
    heads: one packed message (B, U*L, nq + 2 nk, D) and an empty v when the head dims agree (as eager
    sends them), else q and k packed (B, U*L, nq + nk, D) and v on its own (B, U*L, nk, Dv)."""
    if v.shape[-1] == q.shape[-1]:
        return scatter_heads([q, k, v], plan.send_chunks(), plan.send_heads(), nq + 2 * nk, group, "forward"), q.new_empty(0)
    (qk_chunks, qk_heads), (v_chunks, v_heads) = plan.split_sends()
    qk = scatter_heads([q, k], qk_chunks, qk_heads, nq + nk, group, "forward")
    return qk, scatter_heads([v], v_chunks, v_heads, nk, group, "forward")


def _split_heads(heads: torch.Tensor, vh: torch.Tensor, nq: int, nk: int):
    """qh, kh, vh (views) from :func:`_to_heads`' two tensors."""
    if vh.numel() == 0:  # q, k and v packed
        return heads.split([nq, nk, nk], dim=2)
    qh, kh = heads.split([nq, nk], dim=2)
    return qh, kh, vh


def _from_heads(dqh, dkh, dvh, shapes, plan, group):
    """The adjoint of :func:`_to_heads`: gradients back to (B, L, H, D), summed over replicated kv heads."""
    if dvh.shape[-1] == dqh.shape[-1]:
        return gather_heads(torch.cat([dqh, dkh, dvh], dim=2), plan.send_chunks(), list(shapes), plan.send_heads(),
                            dqh.shape[2] + dkh.shape[2] + dvh.shape[2], group, "backward")
    (qk_chunks, qk_heads), (v_chunks, v_heads) = plan.split_sends()
    dq, dk = gather_heads(torch.cat([dqh, dkh], dim=2), qk_chunks, list(shapes[:2]), qk_heads,
                          dqh.shape[2] + dkh.shape[2], group, "backward")
    (dv,) = gather_heads(dvh, v_chunks, [shapes[2]], v_heads, dvh.shape[2], group, "backward")
    return dq, dk, dv


@torch.library.custom_op("seqmesh::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, mesh_name: str, causal: bool,
    layout: str, cu_seqlens: list[int] | None, seq_len: int | None, scale: float, backend: str, validate: int,
    window: int | None, image_blocks: list[int] | None, chunk: int | None, softcap: float | None,
    alibi: list[float] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, L, Hq, Dv), lse (B, hq, U*L) and the head-sharded heads, v_apart, oh that backward reads."""
    mesh = mesh_by_name(mesh_name)
    with torch.autocast(q.device.type, enabled=False):
        call, schedule, choose = plan_attention(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                                seq_len=seq_len, backend=backend, validate=_validate_flag(validate),
                                                window=window, sinks=sinks, image_blocks=_pairs(image_blocks),
                                                chunk=chunk, softcap=softcap, alibi=alibi)
        a, b = _own_heads(call, mesh, q.shape[2])
        own_sinks = None if sinks is None else sinks[a:b]
        schedule = for_heads(schedule, a, b)
        if mesh.ulysses == 1:
            out, lse = _inner_forward(q, k, v, own_sinks, mesh, schedule, choose, None, scale)
            empty = q.new_empty(0)
            return out.contiguous(), lse.to(lse_dtype(q.dtype)).contiguous(), empty, empty.clone(), empty.clone()
        plan, u, group = call.heads, mesh.ulysses_rank, mesh.ulysses_group
        nq, nk = plan.q_count(u), plan.kv_count(u)
        heads, v_apart = _to_heads(q, k, v, plan, nq, nk, group)
        qh, kh, vh = _split_heads(heads, v_apart, nq, nk)
        oh, lse = _inner_forward(qh, kh, vh, own_sinks, mesh, schedule, choose, plan.kv_map(u, q.device), scale)
        chunks, counts = call.heads.query_sends()
        shape = torch.Size((*q.shape[:3], v.shape[-1]))
        (out,) = gather_heads(oh, chunks, [shape], counts, nq, group, "forward")
        return out.contiguous(), lse.to(lse_dtype(q.dtype)).contiguous(), heads, v_apart, oh.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, sinks, mesh_name, causal, layout, cu_seqlens, seq_len, scale, backend,
                            validate, window, image_blocks, chunk, softcap, alibi):
    mesh = mesh_by_name(mesh_name)
    b, n, hq, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    out = q.new_empty((b, n, hq, dv))
    if mesh.ulysses == 1:
        empty = q.new_empty(0)
        return out, q.new_empty((b, hq, n), dtype=lse_dtype(q.dtype)), empty, empty.clone(), empty.clone()
    plan, u = HeadPlan(hq, hk, mesh.ulysses), mesh.ulysses_rank  # the real op's deal, from the shapes alone
    nq, nk, rows = plan.q_count(u), plan.kv_count(u), n * mesh.ulysses
    lse = q.new_empty((b, nq, rows), dtype=lse_dtype(q.dtype))
    if dv == d:  # q, k and v packed, as _to_heads sends them
        return out, lse, q.new_empty((b, rows, nq + 2 * nk, d)), q.new_empty(0), q.new_empty((b, rows, nq, dv))
    return out, lse, q.new_empty((b, rows, nq + nk, d)), q.new_empty((b, rows, nk, dv)), q.new_empty((b, rows, nq, dv))


@torch.library.custom_op("seqmesh::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
    out: torch.Tensor, lse: torch.Tensor, heads: torch.Tensor, v_apart: torch.Tensor, oh: torch.Tensor, mesh_name: str,
    causal: bool, layout: str, cu_seqlens: list[int] | None, seq_len: int | None, scale: float, backend: str,
    window: int | None, image_blocks: list[int] | None, chunk: int | None, softcap: float | None,
    alibi: list[float] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the inputs' shapes and dsinks (Hq,) (empty without sinks)."""
    mesh = mesh_by_name(mesh_name)
    with torch.autocast(q.device.type, enabled=False):
        call, schedule, choose = plan_attention(q, k, v, mesh, causal=causal, layout=layout, cu_seqlens=cu_seqlens,
                                                seq_len=seq_len, backend=backend, validate=False, window=window,
                                                sinks=sinks, image_blocks=_pairs(image_blocks), chunk=chunk,
                                                softcap=softcap, alibi=alibi)
        a, b = _own_heads(call, mesh, q.shape[2])
        own_sinks = None if sinks is None else sinks[a:b]
        schedule = for_heads(schedule, a, b)
        if mesh.ulysses == 1:
            dq, dk, dv, ds = _inner_backward(dout, q, k, v, out, lse, own_sinks, mesh, schedule, choose, None, scale)
        else:
            plan, u, group = call.heads, mesh.ulysses_rank, mesh.ulysses_group
            nq, nk = plan.q_count(u), plan.kv_count(u)
            chunks, counts = call.heads.query_sends()
            doh = scatter_heads([dout], chunks, counts, nq, group, "backward")  # (B, U*L, nq, Dv)
            qh, kh, vh = _split_heads(heads, v_apart, nq, nk)
            dqh, dkh, dvh, ds = _inner_backward(doh, qh, kh, vh, oh, lse, own_sinks, mesh, schedule, choose,
                                                plan.kv_map(u, q.device), scale)
            dq, dk, dv = _from_heads(dqh, dkh, dvh, (q.shape, k.shape, v.shape), plan, group)
        dsinks = q.new_empty(0)
        if sinks is not None:  # this rank's heads' part; the sequence group's sum is the caller's (see attention)
            dsinks = torch.zeros_like(sinks)
            dsinks[a:b] = ds
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, sinks, out, lse, heads, v_apart, oh, mesh_name, causal, layout, cu_seqlens,
                             seq_len, scale, backend, window, image_blocks, chunk, softcap, alibi):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


_SETTINGS = ("mesh_name", "causal", "layout", "cu_seqlens", "seq_len", "scale", "backend", "window", "image_blocks",
             "chunk", "softcap", "alibi")


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, mesh_name, causal, layout, cu_seqlens, seq_len, scale, backend, _, window, image_blocks, chunk, \
        softcap, alibi = inputs
    out, lse, heads, v_apart, oh = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, heads, v_apart, oh)
    ctx.settings = (mesh_name, causal, layout, cu_seqlens, seq_len, scale, backend, window, image_blocks, chunk, softcap,
                    alibi)
    ctx.has_sinks = sinks is not None


def _backward(ctx, dout, _dlse, _dheads, _dv_apart, _doh):
    q, k, v, sinks, out, lse, heads, v_apart, oh = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout.contiguous(), q, k, v, sinks, out, lse, heads, v_apart, oh,
                                            *ctx.settings)
    return dq, dk, dv, (dsinks if ctx.has_sinks else None), *(None,) * 13


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, *, causal: bool, layout: str | LayoutKind,
    cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int | None, softmax_scale: float | None, backend: str,
    validate: bool | None, window: int | None, sinks: torch.Tensor | None,
    image_blocks: Sequence[tuple[int, int]] | None = None, chunk: int | None = None, softcap: float | None = None,
    alibi: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`seqmesh.attention` through the ops above; the same arguments, ``(B, L, Hq, Dv)``."""
    if isinstance(cu_seqlens, torch.Tensor):
        raise ValueError("under torch.compile seqmesh.attention takes cu_seqlens as a tuple of ints (as shard_batch's "
                         "SequenceInfo holds them), not a tensor, whose values a graph cannot read without a break; "
                         "pass tuple(cu_seqlens.tolist()) outside the compiled region.")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kind = layout.value if isinstance(layout, LayoutKind) else str(layout)
    cu = None if cu_seqlens is None else list(cu_seqlens)  # ints, or SymInts once dynamo sees them change
    flat = [x for block in image_blocks for x in block] if image_blocks else None  # an op takes flat int lists
    out, *_ = attention_forward(q, k, v, sinks, mesh.name, causal, kind, cu, seq_len, float(scale), backend,
                                _VALIDATE_CODES[validate], window, flat, chunk,
                                None if softcap is None else float(softcap),
                                None if alibi is None else [float(s) for s in alibi])
    return out
