"""Ring attention: queries stay, key/value blocks travel, partial results merge through the LSE.

Forward, on ring rank r, for the schedule's steps t (0 .. ring-1 without a window; a window drops
the steps where no rank sees anything): post a K/V message (:attr:`RingSchedule.kv_shifts`), compute
the pieces of block ``(r - t) mod ring`` while the next block travels, merge them into the float32
accumulators, then take the received block.

Backward fetches the blocks the same way and sends each dK/dV partial on (:attr:`dkv_shifts`). When
the steps are 0, 1, ..., k (the whole ring, contiguous windows) the blocks *relay*: r passes the block
it holds to r+1, and the block's partial gradient travels with it, each holder adding its share,
until one last hop takes it home, as in the classic ring-attention backward. When a window leaves a
gap in the steps (zigzag), every block goes straight from its owner to its holder and every partial
straight back, so skipped steps cost nothing. The partials are float32 (float64 for float64
inputs), so no precision is lost between hops. Attention sinks are folded in once, after the last
merge, and the kernels' backward is given the output and log-sum-exp with the sinks.

The schedule (which pieces, from :class:`RingSchedule`) is separate from the block math (a kernel
call per piece and :func:`merge_into`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..comm.p2p import RingExchange
from ..kernels import ChooseKernel
from ..kernels.base import lse_dtype
from ..kernels.gqa import fold_selected_heads, select_kv_heads
from .kept import computed_or_kept
from .merge import fold_sinks, merge_into, sink_grad
from .blocks import Piece
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


def _split_kv(kv: torch.Tensor, dk: int, p: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's keys (B, n, Hk, Dk) and values (B, n, Hk, Dv) from a packed K/V block."""
    rows = kv[:, p.k0 : p.k1]
    return rows[..., :dk], rows[..., dk:]


def block_forward(q, kv, pieces, choose, kv_map, scale, acc_out, acc_lse) -> None:
    """Attention of ``q`` (B, Lr, Hq, Dk) over one K/V block ``kv`` (B, Lr, Hk, Dk + Dv), piece by
    piece, merged into the accumulators ``acc_out`` (B, Lr, Hq, Dv) and ``acc_lse`` (B, Hq, Lr)."""
    for p in pieces:
        ks, vs = _split_kv(kv, q.shape[-1], p)
        qs, ks, vs = q[:, p.q0 : p.q1], select_kv_heads(ks, kv_map), select_kv_heads(vs, kv_map)
        out, lse = choose(qs, ks, p.mask, vs).forward(qs, ks, vs, p.mask, scale)
        merge_into(acc_out[:, p.q0 : p.q1], acc_lse[:, :, p.q0 : p.q1], out, lse)


def block_backward(dout, q, kv, out, lse, pieces, choose, kv_map, scale, dq, dkv) -> None:
    """Gradients of one block's pieces given the final ``out`` and ``lse`` of the whole row: added
    into ``dq`` (B, Lr, Hq, Dk) and ``dkv`` (B, Lr, Hk, Dk + Dv)."""
    hk, dk = kv.shape[2], q.shape[-1]
    for p in pieces:
        ks, vs = _split_kv(kv, dk, p)
        qs, ks, vs = q[:, p.q0 : p.q1], select_kv_heads(ks, kv_map), select_kv_heads(vs, kv_map)
        dq_p, dk_p, dv_p = choose(qs, ks, p.mask, vs).backward(
            dout[:, p.q0 : p.q1], qs, ks, vs, out[:, p.q0 : p.q1], lse[:, :, p.q0 : p.q1], p.mask, scale
        )
        dq[:, p.q0 : p.q1] += dq_p
        dkv[:, p.k0 : p.k1, :, :dk] += fold_selected_heads(dk_p, kv_map, hk)
        dkv[:, p.k0 : p.k1, :, dk:] += fold_selected_heads(dv_p, kv_map, hk)


def _with_sinks(out, lse, sinks):
    """``(out, lse)`` with the sinks folded in once (after every merge), or as they are."""
    return (out, lse) if sinks is None else fold_sinks(out, lse, sinks)


def local_forward(q, k, v, sinks, schedule, choose, kv_map, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring of one: q (B, L, Hq, Dk), k (B, L, Hk, Dk), v (B, L, Hk, Dv), sinks (Hq,) or None ->
    out (B, L, Hq, Dv) in q's dtype and lse (B, Hq, L) in lse precision, sinks folded in."""
    ks, vs = select_kv_heads(k, kv_map), select_kv_heads(v, kv_map)
    outs, lses = [], []
    for piece in schedule.pieces(0, 0):  # the diagonal: causal and/or documents and/or window pieces
        qp, kp, vp = q[:, piece.q0 : piece.q1], ks[:, piece.k0 : piece.k1], vs[:, piece.k0 : piece.k1]
        out, lse = choose(qp, kp, piece.mask, vp).forward(qp, kp, vp, piece.mask, scale)
        outs.append(out)
        lses.append(lse)
    out, lse = _local_result(schedule, outs, lses, q, v)
    out, lse = _with_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def local_backward(dout, q, k, v, out, lse, sinks, schedule, choose, kv_map, scale):
    """Gradients of :func:`local_forward` given its ``out`` and ``lse``: dq, dk, dv in the inputs'
    dtypes and dsinks (or None)."""
    ks, vs = select_kv_heads(k, kv_map), select_kv_heads(v, kv_map)
    pieces = schedule.pieces(0, 0)
    grads = []
    for p in pieces:
        qp, kp, vp = q[:, p.q0 : p.q1], ks[:, p.k0 : p.k1], vs[:, p.k0 : p.k1]
        grads.append(choose(qp, kp, p.mask, vp).backward(
            dout[:, p.q0 : p.q1], qp, kp, vp, out[:, p.q0 : p.q1], lse[:, :, p.q0 : p.q1], p.mask, scale
        ))
    whole = len(pieces) == 1 and (pieces[0].q1 - pieces[0].q0, pieces[0].k1 - pieces[0].k0) == (q.shape[1], ks.shape[1])
    if whole:  # one call covers the block: its gradients as they are
        dq, dk, dv = grads[0]
    else:  # window pieces overlap in keys: sum their partials in lse precision, as the ring does
        ct = lse.dtype
        dq, dk, dv = (torch.zeros_like(t, dtype=ct) for t in (q, ks, vs))
        for p, (gq, gk, gv) in zip(pieces, grads):
            dq[:, p.q0 : p.q1] += gq
            dk[:, p.k0 : p.k1] += gk
            dv[:, p.k0 : p.k1] += gv
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    hk = k.shape[2]
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq, fold_selected_heads(dk, kv_map, hk), fold_selected_heads(dv, kv_map, hk), dsinks


class LocalAttention(torch.autograd.Function):
    """A ring of one (pure Ulysses, or one process): a single kernel call over the whole block,
    without the ring's float32 accumulators. Forward: the kernel (then the sinks), or, in the recompute of a
    checkpointed layer that keeps its attention, the output its forward kept (``kept``); backward:
    its backward with the final output and log-sum-exp (and the sinks' gradient)."""

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, sinks, schedule, choose, kv_map, scale):  # type: ignore[override]
        out, lse = computed_or_kept(lambda: local_forward(q, k, v, sinks, schedule, choose, kv_map, scale))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale = schedule, choose, kv_map, scale
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = local_backward(dout, q, k, v, out, lse, sinks, ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale)
        return (*grads, None, None, None, None)


def _local_result(schedule, outs, lses, q, v):
    """One call: its result as it is. Several (a window split the diagonal by runs): merged in lse
    precision (pieces of one row never overlap in keys)."""
    if len(outs) == 1:
        return outs[0], lses[0]
    b, n, hq = q.shape[0], q.shape[1], q.shape[2]
    ct = lse_dtype(q.dtype)
    acc_out = q.new_zeros((b, n, hq, v.shape[-1]), dtype=ct)
    acc_lse = q.new_full((b, hq, n), float("-inf"), dtype=ct)
    for p, out, lse in zip(schedule.pieces(0, 0), outs, lses):
        merge_into(acc_out[:, p.q0 : p.q1], acc_lse[:, :, p.q0 : p.q1], out, lse)
    return acc_out, acc_lse


def ring_forward(q, k, v, sinks, group, schedule, choose, kv_map, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring loop: q (B, Lr, Hq, Dk); k (B, Lr, Hk, Dk), v (B, Lr, Hk, Dv) this ring rank's block ->
    out (B, Lr, Hq, Dv) in q's dtype and lse (B, Hq, Lr) in lse precision, sinks folded in."""
    rank, steps = dist.get_rank(group), schedule.steps  # ring > 1: see ring_attention
    b, n, hq, _ = q.shape
    ct = lse_dtype(q.dtype)
    acc_out = q.new_zeros((b, n, hq, v.shape[-1]), dtype=ct)
    acc_lse = q.new_full((b, hq, n), float("-inf"), dtype=ct)
    home = torch.cat([k, v], dim=-1)  # (B, Lr, Hk, Dk + Dv): one message per step
    exchange = RingExchange(group, "forward", KV_TAG)
    kv, shifts = home, schedule.kv_shifts
    for i, step in enumerate(steps):
        sent = kv if schedule.relay else home  # relay: pass the held block on; direct: my own, to its next holder
        pending = exchange.start(sent, shift=shifts[i]) if i < len(shifts) else None
        block_forward(q, kv, schedule.pieces(rank, step), choose, kv_map, scale, acc_out, acc_lse)
        if pending is not None:
            kv = pending.wait()
    out, lse = _with_sinks(acc_out, acc_lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, sinks, group, schedule, choose, kv_map, scale):
    """Gradients of :func:`ring_forward` given its ``out`` and ``lse``: dq, dk, dv in the inputs' dtypes
    and dsinks (or None); each dK/dV partial carried (relay) or sent (direct) home."""
    rank, steps = dist.get_rank(group), schedule.steps
    ct = lse.dtype
    dq = torch.zeros_like(q, dtype=ct)
    home = torch.cat([k, v], dim=-1)
    relay, kv_shifts, dkv_shifts = schedule.relay, schedule.kv_shifts, schedule.dkv_shifts
    dkv_home = torch.zeros_like(home, dtype=ct)
    kv_exchange = RingExchange(group, "backward", KV_TAG)
    dkv_exchange = RingExchange(group, "backward", DKV_TAG)
    # incoming: relay, the partial of the block held now, from r-1; direct, the partial of my own
    # block, from the rank that held it at the previous step
    kv, incoming = home, None
    # Order invariant: at every step of ``steps`` (the same list on every rank) every rank posts the
    # K/V exchange, then the dK/dV one, and whether either is posted depends on the step alone, never
    # on the rank. NCCL ignores P2P tags and pairs messages by issue order alone, so this order (not
    # KV_TAG/DKV_TAG, which only gloo reads) is what keeps the two streams apart.
    for i, step in enumerate(steps):
        pending = kv_exchange.start(kv if relay else home, shift=kv_shifts[i]) if i < len(kv_shifts) else None
        dkv = dkv_home if step == 0 else torch.zeros_like(home, dtype=ct)
        block_backward(dout, q, kv, out, lse, schedule.pieces(rank, step), choose, kv_map, scale, dq, dkv)
        if incoming is not None:
            (dkv if relay else dkv_home).add_(incoming.wait())
        shift = dkv_shifts[i]
        incoming = dkv_exchange.start(dkv, shift=shift) if shift is not None else None
        if pending is not None:
            kv = pending.wait()
    if incoming is not None:  # relay: my block's finished partial, home from its last holder
        received = incoming.wait()
        dkv_home = received if relay else dkv_home.add_(received)
    dk, dv = dkv_home[..., : k.shape[-1]], dkv_home[..., k.shape[-1] :]
    dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class RingAttention(torch.autograd.Function):
    """Forward: attention of the local query block over every needed ring rank's K/V, merged by LSE
    (then the sinks), or the output a checkpointed layer kept (no block travels); backward: dQ locally, each dK/dV
    partial carried (relay) or sent (direct) home."""

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, sinks, group, schedule, choose, kv_map, scale):  # type: ignore[override]
        out, lse = computed_or_kept(lambda: ring_forward(q, k, v, sinks, group, schedule, choose, kv_map, scale))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale = group, schedule, choose, kv_map, scale
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = ring_backward(dout, q, k, v, out, lse, sinks, ctx.group, ctx.schedule, ctx.choose, ctx.kv_map, ctx.scale)
        return (*grads, None, None, None, None, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    schedule: RingSchedule,
    choose: ChooseKernel,
    scale: float,
    kv_map: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this ring rank's block over the whole ring; ``(B, Lr, Hq, Dv)``. ``sinks``
    (Hq,): this rank's query heads' sink logits, or None."""
    if schedule.layout.ring == 1:
        return LocalAttention.apply(q, k, v, sinks, schedule, choose, kv_map, scale)
    return RingAttention.apply(q, k, v, sinks, group, schedule, choose, kv_map, scale)
