"""Async Ulysses: the all-to-alls overlapped with the q/k/v and output projections.

The local tokens are cut into ``pieces`` contiguous pieces. Each piece's q/k/v projection (with the
model's own norms and rotary embedding) is followed at once by its all-to-all, launched without waiting,
so the next piece is projected while it is in flight; the inverse all-to-all of every piece of the
attention output is launched at once, and each piece's output projection runs as soon as it has arrived,
while the later pieces are still in flight::

    project 1 | project 2 | project 3 |                        attention |            | o_proj 1 | o_proj 2 | o_proj 3
              | a2a 1 ----| a2a 2 ----| a2a 3 --|                        | a2a 1 | a2a 2 --| a2a 3 ---|

Backward runs the mirror image (see ``seqmesh.comm.async_collectives``). Pieces of tokens rather than groups
of heads: every piece's all-to-all is a full all-to-all over the same HeadPlan (uneven heads, GQA kv heads
replicated to several ranks) with a 1/pieces share of the tokens, the projections need no slicing of
weights, and per-token norms and rotary embeddings apply to a piece exactly as to the whole.

    hidden (B, L, E) -- pieces --> q (B, l, Hq, D), k, v (B, l, Hk, D) -- a2a --> (B, U*l, hq + 2 hk, D) per piece
      -- reassembled --> (B, U*L, ...) -- inner attention --> o (B, U*L, hq, D)
      -- pieces, inverse a2a --> (B, l, Hq, D) -- output projection --> (B, l, E') -- concatenated --> (B, L, E')
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.async_collectives import head_to_seq_start, seq_to_head_start
from ..rules.heads import even_split
from ..mesh import SPMesh
from .heads import HeadPlan
from .ulysses import InnerAttention

# project(hidden piece (B, l, E), its token range) -> q (B, l, Hq, D), k (B, l, Hk, D), v (B, l, Hk, D)
Projection = Callable[[torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# output(o piece (B, l, Hq, D)) -> (B, l, E')
OutputProjection = Callable[[torch.Tensor], torch.Tensor]
# prepare(q, k, v of the whole local length: expanded views, shapes only) -> (head plan, inner attention)
Prepare = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[HeadPlan, InnerAttention]]


def token_pieces(tokens: int, pieces: int) -> list[slice]:
    """``tokens`` local tokens in at most ``pieces`` contiguous non-empty pieces, as even as possible."""
    bounds, start = [], 0
    for size in even_split(tokens, max(1, min(pieces, tokens))):
        bounds.append(slice(start, start + size))
        start += size
    return bounds


def async_ulysses_attention(
    hidden: torch.Tensor, project: Projection, output: OutputProjection, prepare: Prepare, mesh: SPMesh,
    pieces: int = 2,
) -> torch.Tensor:
    """Ulysses attention of ``hidden`` (B, L, E) from the projections to the output projection, its all-to-alls
    overlapped with the projections of other pieces; ``(B, L, E')``, equal to projecting, running
    ``seqmesh.attention`` and projecting the output. ``mesh.ulysses`` must exceed 1."""
    if pieces < 1:
        raise ValueError(f"async Ulysses needs at least 1 piece of tokens, got pieces={pieces}.")
    b, n, _ = hidden.shape
    u, world, group = mesh.ulysses_rank, mesh.ulysses, mesh.ulysses_group
    plan = inner = None
    pending = []
    for tokens in token_pieces(n, pieces):
        q, k, v = project(hidden[:, tokens], tokens)  # (B, l, H, D) each
        if plan is None:  # the checks see the whole local length; only shapes are read
            if v.shape[-1] != q.shape[-1]:
                raise ValueError(f"async Ulysses packs q, k and v into one all-to-all and needs one head dim; got q/k "
                                 f"{q.shape[-1]} and v {v.shape[-1]} (MLA-style heads). Turn async_ulysses off.")
            plan, inner = prepare(*(t[:, :1].expand(b, n, -1, -1) for t in (q, k, v)))
            nq, nk = plan.q_count(u), plan.kv_count(u)
        pending.append(seq_to_head_start([q, k, v], group, plan.send_chunks(), plan.send_heads(), nq + 2 * nk))
    arrived = [p.wait() for p in pending]  # (B, U*l, h, D) each, source-rank-major
    h, d = nq + 2 * nk, q.shape[-1]
    gathered = torch.cat([a.view(b, world, -1, h, d) for a in arrived], dim=2).view(b, world * n, h, d)
    qh, kh, vh = gathered.split([nq, nk, nk], dim=2)
    out = inner(qh, kh, vh, plan.kv_map(u, hidden.device))  # (B, U*L, hq, D)

    out = out.view(b, world, n, nq, out.shape[-1])
    chunks, counts = plan.query_sends()
    back = []
    for tokens in token_pieces(n, pieces):  # every piece launched before the first output projection
        piece = out[:, :, tokens].reshape(b, -1, nq, out.shape[-1])  # (B, U*l, hq, D)
        shape = torch.Size((b, piece.shape[1] // world, plan.q_heads, out.shape[-1]))
        back.append(head_to_seq_start(piece, group, chunks, counts, nq, shape))
    return torch.cat([output(p.wait()) for p in back], dim=1)  # (B, L, E')
