"""One new token through a DeepSeek Sparse Attention layer (``seqmesh.hf.indexed_attention``) over a cache sharded by
tokens.

What a rank keeps of such a layer is MLA's own compact cache: each of its tokens' latent and rotated key
(``kv_lora_rank + qk_rope_head_dim`` values) and, where the layer has an indexer, the indexer's key
(``index_head_dim``); GLM-5's and HY-V4's shared layers keep no indexer key. A decode step runs the new token on every
rank alike; the rank that owns it appends its rows. Then:

1. **selection**: each rank scores its share's keys as the indexer does (``sum_h w_h relu(q_h . k)``, float32) and
   takes its own top ``k``; one all-gather of those ``P x k`` (score, position) pairs, laid out in row order, and the
   top ``min(k, T)`` of them are the top ``k`` of the whole row (a key outside a rank's own top ``k`` is outside the
   row's). At an exact tie of scores the pick may differ from transformers' (``torch.topk`` promises no order for
   ties; the candidates are in row order, as its row is). A shared layer takes the previous layer's picks;
2. **attention**: each rank attends to the picked keys of its share in latent space (the query's no-RoPE part through
   ``kv_b_proj``'s key half), and the partial results merge by log-sum-exp in one all-gather
   (:func:`.decode.merge_partials`, with HY-V4's sinks); the merged latent goes through the value half.

Two small collectives a layer with an indexer, one without; nothing per head crosses a link but the merge's partials.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..hf import indexed_layouts as layouts
from ..hf.indexed_attention import latent_output, latent_query
from ..kernels.base import lse_dtype
from ..mesh import SPMesh
from . import decode


def global_top(scores: torch.Tensor, positions: torch.Tensor, k: int, total: int, mesh: SPMesh) -> torch.Tensor:
    """The row's top ``min(k, total)`` keys from every rank's share: ``scores`` (B, n) this rank's index scores of its
    share's keys at ``positions`` (n,) in the row -> (B, min(k, total)) positions, the same on every rank."""
    b, n = scores.shape
    mine = min(k, n)
    values, index = scores.topk(mine, dim=-1) if mine else (scores[:, :0], scores[:, :0].long())
    where = positions.to(scores.device)[index]  # (B, mine)
    pad = k - mine  # every rank sends k candidates: -inf at position -1 where its share holds fewer
    values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    where = torch.nn.functional.pad(where, (0, pad), value=-1)
    packed = torch.stack([values.double(), where.double()], dim=-1).contiguous()  # (B, k, 2): positions exact
    gathered = [torch.empty_like(packed) for _ in range(mesh.sp_size)]
    dist.all_gather(gathered, packed, group=mesh.sp_group)
    every = torch.cat(gathered, dim=1)  # (B, P k, 2)
    where = every[..., 1].long()
    # in row order, as transformers' row is; the empty slots last
    order = torch.where(where < 0, torch.iinfo(torch.long).max, where).argsort(dim=-1, stable=True)
    values = every[..., 0].gather(1, order).to(scores.dtype)
    where = where.gather(1, order)
    return where.gather(1, values.topk(min(k, total), dim=-1).indices)


def _chosen_rows(rows: torch.Tensor, positions: torch.Tensor, picks: torch.Tensor, total: int) -> torch.Tensor:
    """Which of this rank's share (``rows`` (B, n, C) at ``positions`` (n,)) the row's ``picks`` (B, k) name:
    (B, n) bool."""
    named = torch.zeros(picks.shape[0], total, dtype=torch.bool, device=rows.device)
    named.scatter_(1, picks, True)
    return named[:, positions.to(rows.device)]


def _partial(module: nn.Module, query: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor,
             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent query (B, 1, H, C) against the chosen of this share's rows (B, n, C) -> (the weighted latents
    (B, 1, H, R), their log-sum-exp (B, H, 1)), float32 or wider; -inf and zeros where none is chosen here."""
    ct = lse_dtype(query.dtype)
    picked = [rows[i, chosen[i]] for i in range(rows.shape[0])]  # the share's picked rows of each batch row
    width = max((p.shape[0] for p in picked), default=0)
    kept = rows.new_zeros(rows.shape[0], width, rows.shape[-1])
    seen = torch.zeros(rows.shape[0], width, dtype=torch.bool, device=rows.device)
    for i, p in enumerate(picked):
        kept[i, :p.shape[0]], seen[i, :p.shape[0]] = p, True
    scores = torch.einsum("blhc,bnc->blhn", query.to(ct), kept.to(ct)) * module.scaling  # (B, 1, H, m)
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, 1, H)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - finite[..., None])  # the unseen: exp(-inf) = 0
    out = torch.einsum("blhn,bnr->blhr", probs, kept[..., :rank].to(ct))
    return out, lse.transpose(1, 2)


def indexed_step(module: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, q_pass: torch.Tensor,
                 q_rot: torch.Tensor, row: torch.Tensor, position_embeddings, prev_picks: torch.Tensor | None, step,
                 mesh: SPMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """The new token's attention in ``module`` (every rank alike): hidden (B, 1, E), its query q_pass (B, 1, H, Dn)
    and rotated q_rot (B, 1, H, Dr), its cache row (B, 1, R + Dr) -> ((B, 1, H, Dv), its picks (B, 1, k), positions
    in the row, for a shared layer after it). ``step``: the call's :class:`~.cache.DecodeStep`."""
    cache = step.cache
    indexer = getattr(module, "indexer", None)
    if indexer is not None:
        rule = layouts.indexer_rule(indexer)
        index_q, index_key = layouts.indexer_keys(indexer, rule, hidden, q_resid, position_embeddings)
    else:
        index_key = row[..., :0]
    if step.owner == mesh.sp_rank:
        cache.append(module, row[:, None], index_key[:, None])  # (B, 1, 1, C): the cache's (B, heads, n, D)
    rows, keys = (t[:, 0] for t in cache.share(module))  # (B, n, R + Dr), (B, n, Di)
    total = step.position + 1  # the row's tokens, the new one included
    if indexer is not None:
        weights = layouts.head_weights(indexer, rule, hidden)  # (B, 1, H)
        scores = layouts.index_scores(indexer, rule, index_q, keys.float().transpose(-1, -2)[:, None], weights)
        picks = global_top(scores[:, 0], cache.positions, indexer.index_topk, total, mesh)  # (B, k)
    else:
        picks = prev_picks[:, 0].long()
    rank = rows.shape[-1] - q_rot.shape[-1]
    out, lse = _partial(module, latent_query(module, q_pass, q_rot), rows, _chosen_rows(rows, cache.positions, picks,
                                                                                         total), rank)
    merged = decode.merge_partials(out, lse, mesh, layouts.sinks(module))  # (B, 1, H, R)
    return latent_output(module, merged.to(row.dtype)), picks[:, None]
