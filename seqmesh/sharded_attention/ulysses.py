"""Ulysses around any inner attention: all-to-all from sequence shards to head shards and back.

::

    q (B, L, Hq, D), k, v (B, L, Hk, D)       this rank's tokens, every head
      -- one all-to-all (q, k, v packed) in the Ulysses group -->
    q (B, U*L, hq, D), k, v (B, U*L, hk, D)     U ranks' tokens, this rank's heads (HeadPlan)
      -- inner attention (a ring of one is plain local attention) -->
    o (B, U*L, hq, D)
      -- inverse all-to-all -->
    o (B, L, Hq, D)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.collectives import head_to_seq, seq_to_head
from ..mesh import SPMesh
from .heads import HeadPlan

# inner(q, k, v, kv_map) -> out, on the gathered tokens of this rank's heads
InnerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: SPMesh, plan: HeadPlan, inner: InnerAttention
) -> torch.Tensor:
    """Scatter heads and gather tokens over ``mesh``'s Ulysses group, run ``inner`` on this rank's
    heads, and bring the output back to this rank's tokens; ``(B, L, Hq, D)``."""
    u = mesh.ulysses_rank
    nq, nk = plan.q_count(u), plan.kv_count(u)
    group = mesh.ulysses_group
    if v.shape[-1] == q.shape[-1]:  # one packed all-to-all
        packed = seq_to_head([q, k, v], group, plan.send_chunks(), plan.send_heads(), nq + 2 * nk)
        qh, kh, vh = packed.split([nq, nk, nk], dim=2)  # (B, U*L, h, D) each
    else:  # MLA-style heads: q and k packed, v (B, L, Hk, Dv) on its own
        (qk_chunks, qk_heads), (v_chunks, v_heads) = plan.split_sends()
        qh, kh = seq_to_head([q, k], group, qk_chunks, qk_heads, nq + nk).split([nq, nk], dim=2)
        vh = seq_to_head([v], group, v_chunks, v_heads, nk)
    out = inner(qh, kh, vh, plan.kv_map(u, q.device))  # (B, U*L, hq, Dv)
    chunks, heads = plan.query_sends()
    return head_to_seq(out, group, chunks, heads, nq, torch.Size((*q.shape[:3], v.shape[-1])))
