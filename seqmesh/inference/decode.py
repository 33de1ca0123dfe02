"""One new token's attention over a KV cache sharded by tokens: each rank attends to its share, the partial results
merge by log-sum-exp.

For the query ``q`` of the new token and rank ``r``'s share of keys ``K_r`` and values ``V_r``, the rank computes
``o_r = softmax(q K_r^T) V_r`` and ``l_r = logsumexp(q K_r^T)`` (float32 at least); one all-gather of ``[o_r | l_r]``
over the sequence group gives every rank all of them, and ``o = sum_r exp(l_r - L) o_r`` with ``L = logsumexp_r l_r``
is the attention over the whole cache, exactly. A learned sink (gpt-oss) is one more term of ``L`` with no value. A
sliding window and a soft cap act on each share's scores as on the whole row's. Every rank merges the same gathered
tensor in rank order, so every rank holds the same output bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.ranks import local_part
from ..kernels.base import BlockMask, lse_dtype
from ..kernels.gqa import expand_kv_heads
from ..kernels.reference import MathKernel
from ..mesh import SPMesh
from ..hf.mixer_kind import CHUNK_ATTR
from ..sharded_attention.merge import fold_sinks, merge_into


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                      visible: torch.Tensor | None = None, softcap: float | None = None,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token's query (B, 1, Hq, D) against one share, key (B, n, Hk, D) and value (B, n, Hk, Dv), by the math
    kernel (``seqmesh.kernels``: its GQA, soft cap and (out, lse) as every ring block's), the keys outside the window
    (``visible`` (n,) bool) left out first -> (out (B, 1, Hq, Dv), lse (B, Hq, 1); -inf where nothing is seen).
    ``bias`` (Hq, n): added to the scaled scores (ALiBi's, by each key's distance: keys of a share are not
    consecutive positions, so not the kernel's ``BlockMask.alibi``), the same products and merge otherwise."""
    if visible is not None:
        key, value = key[:, visible.to(key.device)], value[:, visible.to(value.device)]
        bias = None if bias is None else bias[:, visible.to(bias.device)]
    if bias is None:
        return MathKernel().forward(query, key, value, BlockMask(softcap=softcap), scale)
    ct = lse_dtype(query.dtype)
    q = query.transpose(1, 2).to(ct)  # (B, Hq, 1, D)
    k = expand_kv_heads(key.transpose(1, 2).to(ct), query.shape[2], dim=1)  # (B, Hq, n, D)
    v = expand_kv_heads(value.transpose(1, 2).to(ct), query.shape[2], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias.to(ct)[None, :, None, :]  # (B, Hq, 1, n)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, 1)
    out = torch.matmul(torch.softmax(scores, dim=-1) if scores.shape[-1] else scores, v)  # (B, Hq, 1, Dv)
    return out.transpose(1, 2).to(query.dtype), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor, mesh: SPMesh,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``(out (B, 1, Hq, Dv), lse (B, Hq, 1))`` of :func:`partial_attention`, merged by log-sum-exp over
    the sequence group (one all-gather; the ring's own :func:`~seqmesh.sharded_attention.merge.merge_into` and
    :func:`~seqmesh.sharded_attention.merge.fold_sinks`, in rank order on every rank); ``sinks`` (Hq,): a logit per head
    in the denominator only -> (B, 1, Hq, Dv) in float32 or wider."""
    packed = torch.cat([out.to(lse.dtype), lse.transpose(1, 2)[..., None]], dim=-1).contiguous()  # (B, 1, Hq, Dv+1)
    gathered = [torch.empty_like(packed) for _ in range(mesh.sp_size)]
    dist.all_gather(gathered, packed, group=mesh.sp_group)
    acc_out = torch.zeros_like(packed[..., :-1])
    acc_lse = torch.full_like(lse, float("-inf"))
    for part in gathered:
        merge_into(acc_out, acc_lse, part[..., :-1], part[..., -1].transpose(1, 2))
    return acc_out if sinks is None else fold_sinks(acc_out, acc_lse, sinks)[0]


def attend_step(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step, mesh: SPMesh,
                scaling: float | None, kwargs: dict) -> torch.Tensor:
    """The registered attention of a decode call (``step``: :class:`~.cache.DecodeStep`): the new token's query
    (B, Hq, 1, D), key and value (B, Hk, 1, D); the owner adds them to its share of ``module``'s cache; every rank
    attends to its share and the partials merge -> (B, 1, Hq, Dv), the same on every rank."""
    cache = step.cache
    if step.owner == mesh.sp_rank:
        cache.append(module, key, value)
    shared_key, shared_value = cache.share(module)
    window = kwargs.get("sliding_window")
    visible = cache.positions > step.position - window if window else None  # sees i - window < j <= i
    chunk = getattr(module, CHUNK_ATTR, None)  # Llama 4's chunked layers: the keys of the token's own chunk
    if chunk:
        same = cache.positions // chunk == step.position // chunk
        visible = same if visible is None else visible & same
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    slopes = kwargs.get("alibi")  # ALiBi (seqmesh.hf.own_attention): each key's score - slope x its distance
    bias = None if slopes is None else -torch.tensor(slopes, dtype=torch.float64)[:, None] * (
        step.position - cache.positions.to(torch.float64))[None, :]  # (Hq, n)
    # the cache keeps (B, Hk, n, D) as the layers hand keys over; the kernels take (B, n, Hk, D)
    out, lse = partial_attention(query.transpose(1, 2), shared_key.transpose(1, 2), shared_value.transpose(1, 2), scale,
                                 visible=visible, softcap=kwargs.get("softcap"),
                                 bias=None if bias is None else bias.to(query.device))
    sinks = kwargs.get("s_aux")
    return merge_partials(out, lse, mesh, None if sinks is None else local_part(sinks)).to(query.dtype)
