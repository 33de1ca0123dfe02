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

from ..mesh import SPMesh
from ..sharded_attention.merge import fold_sinks, merge_into


def partial_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, scale: float, *,
                      visible: torch.Tensor | None = None, softcap: float | None = None,
                      value_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, Hq, 1, D) against one share: key (B, Hk, n, D), value (B, Hk, n, Dv) (None: an empty share),
    ``visible`` (n,) bool or None -> (out (B, Hq, 1, Dv), lse (B, Hq, 1)) in float32 or wider."""
    precise = torch.promote_types(query.dtype, torch.float32)
    b, heads = query.shape[:2]
    if key is None or key.shape[2] == 0:
        dv = value_dim if value is None else value.shape[-1]
        return (query.new_zeros(b, heads, 1, dv, dtype=precise),
                query.new_full((b, heads, 1), float("-inf"), dtype=precise))
    group = heads // key.shape[1]  # GQA: each key head serves ``group`` query heads
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query.to(precise), key.to(precise).transpose(-1, -2)) * scale  # (B, Hq, 1, n)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, 1); -inf where nothing is visible
    probs = torch.exp(scores - lse.masked_fill(~torch.isfinite(lse), 0.0)[..., None])
    return torch.matmul(probs, value.to(precise)), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor, mesh: SPMesh,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``(out (B, Hq, 1, Dv), lse (B, Hq, 1))`` of :func:`partial_attention`, merged by log-sum-exp over
    the sequence group (one all-gather; the ring's own :func:`~seqmesh.sharded_attention.merge.merge_into` and
    :func:`~seqmesh.sharded_attention.merge.fold_sinks`, in rank order on every rank); ``sinks`` (Hq,): a logit per head
    in the denominator only -> (B, 1, Hq, Dv)."""
    packed = torch.cat([out, lse[..., None]], dim=-1).contiguous()  # (B, Hq, 1, Dv + 1)
    gathered = [torch.empty_like(packed) for _ in range(mesh.sp_size)]
    dist.all_gather(gathered, packed, group=mesh.sp_group)
    acc_out = torch.zeros_like(out.transpose(1, 2))  # (B, 1, Hq, Dv)
    acc_lse = torch.full_like(lse, float("-inf"))  # (B, Hq, 1)
    for part in gathered:
        merge_into(acc_out, acc_lse, part[..., :-1].transpose(1, 2), part[..., -1])
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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, lse = partial_attention(query, shared_key, shared_value, scale, visible=visible, softcap=kwargs.get("softcap"),
                                 value_dim=value.shape[-1])
    return merge_partials(out, lse, mesh, kwargs.get("s_aux")).to(query.dtype)
