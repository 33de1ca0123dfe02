"""Ring attention: queries stay, key/value blocks travel, partial results merge through the LSE.

Forward, on ring rank r, for steps t = 0 .. ring-1: post the current K/V block to r+1 (and a
receive from r-1), compute the pieces of block ``(r - t) mod ring`` while it travels, merge them into
the float32 accumulators, then take the received block.

Backward runs the same rotation once more. The gradient of each K/V block travels with it: at step
t rank r adds its contribution to the partial gradient of block ``r - t`` that r-1 just passed on,
and sends the sum to r+1; after the last step every partial has gone round and lands at home. The
partials are float32 (float64 for float64 inputs), so no precision is lost between hops.

The schedule (which pieces, from :class:`RingSchedule`) is separate from the block math (a kernel
call per piece and :func:`merge_into`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..comm.ring import RingExchange
from ..kernels import ChooseKernel
from ..kernels.base import lse_dtype
from ..kernels.gqa import fold_selected_heads, select_kv_heads
from .merge import merge_into
from .schedule import RingSchedule

KV_TAG, DKV_TAG = 11, 12


def _without_autocast(method):
    """Run an attention Function's forward or backward with autocast off (a backward called inside an
    autocast region would otherwise run under it): the kernels pick their own compute dtypes, and the
    merges are fp32, so an active autocast must not recast them."""

    @functools.wraps(method)
    def wrapped(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return method(ctx, first, *args)

    return wrapped


def block_forward(q, kv, pieces, choose, kv_map, scale, acc_out, acc_lse) -> None:
    """Attention of ``q`` (B, Lr, Hq, D) over one K/V block ``kv`` (2, B, Lr, Hk, D), piece by
    piece, merged into the accumulators ``acc_out`` (B, Lr, Hq, D) and ``acc_lse`` (B, Hq, Lr)."""
    for p in pieces:
        qs, ks, vs = q[:, p.q0 : p.q1], kv[0, :, p.k0 : p.k1], kv[1, :, p.k0 : p.k1]
        ks, vs = select_kv_heads(ks, kv_map), select_kv_heads(vs, kv_map)
        out, lse = choose(qs, ks, p.mask).forward(qs, ks, vs, p.mask, scale)
        merge_into(acc_out[:, p.q0 : p.q1], acc_lse[:, :, p.q0 : p.q1], out, lse)


def block_backward(dout, q, kv, out, lse, pieces, choose, kv_map, scale, dq, dkv) -> None:
    """Gradients of one block's pieces given the final ``out`` and ``lse`` of the whole row: added
    into ``dq`` (B, Lr, Hq, D) and ``dkv`` (2, B, Lr, Hk, D)."""
    hk = kv.shape[3]
    for p in pieces:
        qs, ks, vs = q[:, p.q0 : p.q1], kv[0, :, p.k0 : p.k1], kv[1, :, p.k0 : p.k1]
        ks, vs = select_kv_heads(ks, kv_map), select_kv_heads(vs, kv_map)
        dq_p, dk_p, dv_p = choose(qs, ks, p.mask).backward(
            dout[:, p.q0 : p.q1], qs, ks, vs, out[:, p.q0 : p.q1], lse[:, :, p.q0 : p.q1], p.mask, scale
        )
        dq[:, p.q0 : p.q1] += dq_p
        dkv[0, :, p.k0 : p.k1] += fold_selected_heads(dk_p, kv_map, hk)
        dkv[1, :, p.k0 : p.k1] += fold_selected_heads(dv_p, kv_map, hk)


class LocalAttention(torch.autograd.Function):
    """A ring of one (pure Ulysses, or one process): a single kernel call over the whole block,
    without the ring's float32 accumulators. Forward: the kernel; backward: its backward."""

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, schedule, choose, kv_map, scale):  # type: ignore[override]
        (piece,) = schedule.pieces(0, 0)  # the diagonal: the whole block, causal and/or documents
        ks, vs = select_kv_heads(k, kv_map), select_kv_heads(v, kv_map)
        kernel = choose(q, ks, piece.mask)
        out, lse = kernel.forward(q, ks, vs, piece.mask, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.mask, ctx.kv_map, ctx.scale = kernel, piece.mask, kv_map, scale
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ks, vs = select_kv_heads(k, ctx.kv_map), select_kv_heads(v, ctx.kv_map)
        dq, dk, dv = ctx.kernel.backward(dout, q, ks, vs, out, lse, ctx.mask, ctx.scale)
        hk = k.shape[2]
        return dq, fold_selected_heads(dk, ctx.kv_map, hk), fold_selected_heads(dv, ctx.kv_map, hk), None, None, None, None


class RingAttention(torch.autograd.Function):
    """Forward: attention of the local query block over every ring rank's K/V, merged by LSE;
    backward: dQ locally, dK/dV travel the ring back to their owners."""

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, group, schedule, choose, kv_map, scale):  # type: ignore[override]
        # q (B, Lr, Hq, D); k, v (B, Lr, Hk, D): this ring rank's block, positions per schedule.layout
        ring, rank = schedule.layout.ring, dist.get_rank(group)  # ring > 1: see ring_attention
        b, n, hq, d = q.shape
        ct = lse_dtype(q.dtype)
        acc_out = q.new_zeros((b, n, hq, d), dtype=ct)
        acc_lse = q.new_full((b, hq, n), float("-inf"), dtype=ct)
        kv = torch.stack([k, v])  # (2, B, Lr, Hk, D): one message per hop
        exchange = RingExchange(group, "forward", KV_TAG)
        for step in range(ring):
            pending = exchange.start(kv) if step < ring - 1 else None
            block_forward(q, kv, schedule.pieces(rank, step), choose, kv_map, scale, acc_out, acc_lse)
            if pending is not None:
                kv = pending.wait()
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale = group, schedule, choose, kv_map, scale
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        schedule, choose, kv_map, scale = ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale
        ring, rank = schedule.layout.ring, dist.get_rank(ctx.group)
        ct = lse.dtype
        dq = torch.zeros_like(q, dtype=ct)
        kv = torch.stack([k, v])
        kv_exchange = RingExchange(ctx.group, "backward", KV_TAG)
        dkv_exchange = RingExchange(ctx.group, "backward", DKV_TAG)
        incoming = None  # partial dK/dV of the block held this step, from the previous rank
        # Order invariant: at every step every rank posts the K/V exchange, then the dK/dV one, and no
        # rank skips either. NCCL ignores P2P tags and pairs messages by issue order alone, so this
        # order (not KV_TAG/DKV_TAG, which only gloo reads) is what keeps the two streams apart.
        for step in range(ring):
            pending = kv_exchange.start(kv) if step < ring - 1 else None
            dkv = torch.zeros_like(kv, dtype=ct)
            block_backward(dout, q, kv, out, lse, schedule.pieces(rank, step), choose, kv_map, scale, dq, dkv)
            if incoming is not None:
                dkv += incoming.wait()
            incoming = dkv_exchange.start(dkv)  # after the last step this sends each block home
            if pending is not None:
                kv = pending.wait()
        dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    schedule: RingSchedule,
    choose: ChooseKernel,
    scale: float,
    kv_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this ring rank's block over the whole ring; ``(B, Lr, Hq, D)``."""
    if schedule.layout.ring == 1:
        return LocalAttention.apply(q, k, v, schedule, choose, kv_map, scale)
    return RingAttention.apply(q, k, v, group, schedule, choose, kv_map, scale)
