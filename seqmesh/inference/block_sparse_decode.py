"""One new token through a MiniMax-M3 block-sparse layer (``seqmesh.hf.block_sparse_attention``) over a cache sharded
by tokens.

A rank keeps, for its tokens, the layer's keys and values (as every attention layer) and the indexer's key
(``index_head_dim``, filed under the indexer module). A decode step runs the new token on every rank alike; the
owner appends its rows. Then:

1. **selection**: a block's score is its best key's, and a block's keys may lie on several ranks (new tokens go to
   whichever rank holds fewest): each rank takes the best of its own keys of each block, one all-reduce (max) of
   those ``Hi x blocks`` scores gives every block's, the query's own ``index_local_blocks`` are forced in, and the top
   ``index_topk_blocks`` are the blocks each indexer head's query heads see, the same on every rank;
2. **attention**: each rank attends to its keys in those blocks, and the partial results merge by log-sum-exp in one
   all-gather (:func:`.decode.merge_partials`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..hf.indexed_layouts import module_function
from ..kernels.base import lse_dtype
from ..mesh import SPMesh
from . import decode


def block_scores(scores: torch.Tensor, positions: torch.Tensor, block_size: int, blocks: int,
                 mesh: SPMesh) -> torch.Tensor:
    """Each block's score, the best of its keys' on every rank: ``scores`` (B, Hi, n) this rank's keys' at
    ``positions`` (n,) -> (B, Hi, blocks), the same on every rank (-inf: a block without keys)."""
    b, heads, _ = scores.shape
    best = scores.new_full((b, heads, blocks), float("-inf"))
    where = (positions.to(scores.device) // block_size).expand(b, heads, -1)
    best = best.scatter_reduce(-1, where, scores, reduce="amax", include_self=True)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=mesh.sp_group)
    return best


def block_sparse_step(module: nn.Module, hidden: torch.Tensor, position_embeddings, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, step, mesh: SPMesh) -> torch.Tensor:
    """The new token's attention in ``module`` (every rank alike): hidden (B, 1, E) and its rotary (cos, sin); its
    query (B, Hq, 1, D), key and value (B, Hkv, 1, D), rotated -> (B, 1, Hq, D). ``step``: the call's
    :class:`~.cache.DecodeStep`."""
    cache, indexer = step.cache, module.indexer
    b, di, bs = hidden.shape[0], indexer.head_dim, indexer.block_size
    rotate = module_function(module, "apply_rotary_pos_emb")
    cos, sin = position_embeddings
    index_q = indexer.q_norm(indexer.q_proj(hidden).view(b, 1, -1, di)).transpose(1, 2)  # (B, Hi, 1, Di)
    index_k = indexer.k_norm(indexer.k_proj(hidden).view(b, 1, 1, di)).transpose(1, 2)  # (B, 1, 1, Di)
    index_q, index_k = rotate(index_q, index_k, cos[..., :di], sin[..., :di])
    if step.owner == mesh.sp_rank:
        cache.append(module, key, value)
        cache.append(indexer, index_k, index_k[..., :0])
    keys, values = cache.share(module)  # (B, Hkv, n, D)
    row_index_keys = cache.share(indexer)[0][:, 0]  # (B, n, Di)
    positions = cache.positions.to(hidden.device)
    blocks = -(-(step.position + 1) // bs)
    scores = torch.matmul(index_q.float(), row_index_keys.float().transpose(-1, -2)[:, None])[:, :, 0]  # (B, Hi, n)
    best = block_scores(scores, positions, bs, blocks, mesh)
    if indexer.local_blocks > 0:
        local = (step.position // bs - torch.arange(indexer.local_blocks, device=hidden.device)).clamp(min=0)
        best[..., local] = float("inf")
    values_top, chosen = best.topk(min(indexer.topk_blocks, blocks), dim=-1)
    chosen = chosen.masked_fill(values_top == float("-inf"), -1)  # (B, Hi, k)
    seen = (positions // bs)[None, None, :, None].eq(chosen[:, :, None, :]).any(-1)  # (B, Hi, n)
    heads, kv_heads = query.shape[1], keys.shape[1]
    seen = seen.repeat_interleave(heads // seen.shape[1], dim=1).view(b, kv_heads, -1, seen.shape[-1])  # (B, Hkv, G, n)
    ct = lse_dtype(query.dtype)
    grouped = query.to(ct).view(b, kv_heads, -1, query.shape[-1])  # (B, Hkv, G, D): each key head's query heads
    logits = torch.matmul(grouped, keys.to(ct).transpose(-1, -2)) * module.scaling  # (B, Hkv, G, n), no head copies
    logits = logits.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # (B, Hkv, G)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.matmul(torch.exp(logits - finite[..., None]), values.to(ct))  # (B, Hkv, G, D)
    out, lse = out.reshape(b, heads, 1, -1), lse.reshape(b, heads, 1)
    return decode.merge_partials(out.transpose(1, 2), lse, mesh).to(query.dtype)
