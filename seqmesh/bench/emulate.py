"""Ring attention's block math for all ring ranks on one device, without communication.

Runs exactly the kernel calls and merges each ring rank would run (the same schedule and block
functions), with every K/V block at hand. Used to measure what splitting and merging costs against
one attention call, and to test the schedule for ring sizes no CPU machine can spawn.
"""

from __future__ import annotations

import torch

from ..kernels import ChooseKernel
from ..kernels.base import lse_dtype
from ..sharded_attention.ring import block_backward, block_forward
from ..sharded_attention.schedule import RingSchedule


def _blocks(x: torch.Tensor, schedule: RingSchedule) -> list[torch.Tensor]:
    """(B, S, H, D) in natural order -> one (B, Lr, H, D) block per ring rank, in layout order."""
    order = schedule.layout.indices(device=x.device)
    return list(x.index_select(1, order).chunk(schedule.layout.ring, dim=1))


def _natural(blocks: list[torch.Tensor], schedule: RingSchedule, dim: int = 1) -> torch.Tensor:
    restore = schedule.layout.indices(restore=True, device=blocks[0].device)
    return torch.cat(blocks, dim=dim).index_select(dim, restore)


def emulate_ring_forward(q, k, v, schedule: RingSchedule, choose: ChooseKernel, scale: float):
    """q (B, S, Hq, D), k/v (B, S, Hk, D) over the padded length, natural order ->
    per-rank ``(out, lse)`` blocks, ring-layout order."""
    ring = schedule.layout.ring
    qs, kvs = _blocks(q, schedule), _blocks(torch.cat([k, v], dim=-1), schedule)
    results = []
    for r in range(ring):
        b, n, h, _ = qs[r].shape
        acc_out = qs[r].new_zeros((b, n, h, v.shape[-1]), dtype=lse_dtype(q.dtype))
        acc_lse = qs[r].new_full((b, h, n), float("-inf"), dtype=lse_dtype(q.dtype))
        for step in schedule.steps:
            kv = kvs[schedule.source(r, step)]
            block_forward(qs[r], kv, schedule.pieces(r, step), choose, None, scale, acc_out, acc_lse)
        results.append((acc_out.to(q.dtype), acc_lse))
    return results


def emulate_ring(q, k, v, dout, schedule: RingSchedule, choose: ChooseKernel, scale: float):
    """Forward and backward of ring attention on one device; natural order
    ``(out, dq, dk, dv)`` over the padded length."""
    ring = schedule.layout.ring
    qs, dos = _blocks(q, schedule), _blocks(dout, schedule)
    kvs = _blocks(torch.cat([k, v], dim=-1), schedule)
    fwd = emulate_ring_forward(q, k, v, schedule, choose, scale)
    ct = lse_dtype(q.dtype)
    dqs = [torch.zeros_like(x, dtype=ct) for x in qs]
    dkvs = [torch.zeros_like(x, dtype=ct) for x in kvs]
    for r in range(ring):
        out, lse = fwd[r]
        for step in schedule.steps:
            j = schedule.source(r, step)
            block_backward(dos[r], qs[r], kvs[j], out, lse, schedule.pieces(r, step), choose, None, scale, dqs[r], dkvs[j])
    out = _natural([o for o, _ in fwd], schedule)
    dq = _natural(dqs, schedule).to(q.dtype)
    dk = _natural([x[..., : k.shape[-1]] for x in dkvs], schedule).to(k.dtype)
    dv = _natural([x[..., k.shape[-1] :] for x in dkvs], schedule).to(v.dtype)
    return out, dq, dk, dv
