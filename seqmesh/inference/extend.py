"""Prefill onto a kept cache: new tokens (a conversation's next turn, or a long prompt's next chunk) whose attention
reads the keys and values the earlier tokens left sharded over the sequence group (:mod:`.cache`).

The new tokens are sharded by a training layout, as a prompt is; each rank's real new keys and values join its own
share first (so the shares stay balanced, each within a layout block), then each attention layer runs one of two
exact schedules (Yang et al., 2024, "context parallelism for inference"):

- **pass-KV**: each rank keeps its new queries; every rank's share (kept cache and new keys) travels round the ring,
  and each rank attends its queries to each share as it passes, merging by log-sum-exp. Every rank receives every
  other rank's share: ``(T - T_r) x Hk x (Dk + Dv)`` values a layer.
- **pass-Q**: the shares stay; one all-gather gives every rank every new query, each rank attends them all to its
  share, and one all-to-all returns each query's partial ``[out | lse]`` to the rank that holds it, which merges the
  ranks' partials in rank order. Each rank receives ``(P - 1) x L x Hq x (Dk + Dv + 1)`` values a layer.

:func:`choose` picks the schedule that moves fewer bytes, as the paper does: pass-Q when the new tokens are few beside
the cache. Both attend a query at position ``i`` to the keys at positions ``j <= i`` (inside a sliding window:
``i - W < j``), with ALiBi's ``-slope x (i - j)``, the soft cap, and a sink in the denominator, as training and decode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.p2p import RingExchange
from ..comm.ranks import local_part
from ..hf.mixer_kind import CHUNK_ATTR
from ..kernels.base import lse_dtype, widen
from ..kernels.cpu_flash import CpuFlashKernel
from ..kernels.gqa import expand_kv_heads
from ..mesh import SPMesh
from ..sharded_attention.merge import fold_sinks, merge_into
from ..rules.kv_cache import SCHEDULES

KEY_BLOCK = 4096  # keys a partial attends at once
BLOCK_SCORES = 1 << 25  # scores (B x Hq x queries x keys) a block holds at once: 128 MiB in float32


def chunk_partial(query: torch.Tensor, query_positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_positions: torch.Tensor, scale: float, *, window: int | None = None,
                  softcap: float | None = None, slopes: torch.Tensor | None = None,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, n, Hq, D) at ``query_positions`` (n,) against keys (B, m, Hk, D) and values (B, m, Hk, Dv) at
    ``key_positions`` (m,), each query seeing the keys at or before it (and inside ``window``; in its own ``chunk`` of
    positions, Llama 4's chunked layers); ``slopes`` (Hq,):
    ALiBi's bias ``-slope x distance`` -> (out (B, n, Hq, Dv) in float32 or wider, lse (B, Hq, n); -inf, and a zero
    output, where a query sees no key: a padding query, at position -1, sees none). In blocks of at most
    :data:`BLOCK_SCORES` scores, each block's by torch's CPU flash op with the block's mask as an additive bias where
    it applies (a CPU tensor of float32 or float64, no soft cap), else by the math below; merged by log-sum-exp."""
    ct = lse_dtype(query.dtype)
    b, n, heads, _ = query.shape
    out = query.new_zeros((b, n, heads, value.shape[-1]), dtype=ct)
    lse = query.new_full((b, heads, n), float("-inf"), dtype=ct)
    qpos_all, kpos_all = query_positions.to(query.device), key_positions.to(query.device)
    rows = max(1, BLOCK_SCORES // max(1, b * heads * min(key.shape[1], KEY_BLOCK)))
    flash = query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64) and softcap is None
    for q0 in range(0, n, rows):
        qpos = qpos_all[q0:q0 + rows, None]  # (n', 1)
        for k0 in range(0, key.shape[1], KEY_BLOCK):
            kpos = kpos_all[None, k0:k0 + KEY_BLOCK]  # (1, m')
            seen = kpos <= qpos
            if window:
                seen &= kpos > qpos - window
            if chunk:
                seen &= torch.div(kpos, chunk, rounding_mode="floor") == torch.div(qpos, chunk, rounding_mode="floor")
            if not bool(seen.any()):
                continue
            bias = None if slopes is None else -slopes.to(device=query.device, dtype=ct)[:, None, None] * (
                qpos - kpos).to(ct)  # (Hq, n', m')
            part = (_flash_block if flash else _math_block)(
                query[:, q0:q0 + rows], key[:, k0:k0 + KEY_BLOCK], value[:, k0:k0 + KEY_BLOCK], seen, bias, scale,
                softcap)
            merge_into(out[:, q0:q0 + rows], lse[:, :, q0:q0 + rows], *part)
    return out, lse


def _math_block(query, key, value, seen, bias, scale, softcap):
    """One block by plain products in float32 or wider -> (out (B, n, Hq, Dv), lse (B, Hq, n))."""
    ct, heads = lse_dtype(query.dtype), query.shape[2]
    q = query.transpose(1, 2).to(ct)  # (B, Hq, n, D)
    k = expand_kv_heads(key.transpose(1, 2).to(ct), heads, dim=1)  # (B, Hq, m, D)
    v = expand_kv_heads(value.transpose(1, 2).to(ct), heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hq, n, m)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, n)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(scores - safe[..., None]), v).transpose(1, 2), lse


def _flash_block(query, key, value, seen, bias, scale, softcap):
    """One block by torch's CPU flash op, the mask (and ALiBi's bias) additive; a row that sees no key gets
    lse -inf and a zero output (the op would give lse 0). MLA's narrower values padded to the keys' width."""
    width, dv = max(query.shape[-1], value.shape[-1]), value.shape[-1]
    additive = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill_(~seen, float("-inf"))
    additive = additive[None, None] if bias is None else (additive + bias.to(query.dtype))[None]
    any_seen = seen.any(dim=-1)  # (n,)
    additive = additive.masked_fill(~any_seen[:, None], 0.0)  # such a row's result is replaced below
    out, lse = CpuFlashKernel().biased_forward(widen(query, width), widen(key, width), widen(value, width), additive,
                                               scale)
    lse = lse.masked_fill(~any_seen, float("-inf"))
    return out[..., :dv].masked_fill(~any_seen[None, :, None, None], 0.0), lse


def pass_q_bytes(queries: int, heads: int, key_dim: int, value_dim: int, ranks: int, element: int) -> int:
    """Bytes a rank receives in one layer's pass-Q: every other rank's ``queries`` (its share of the new tokens, the
    layout's padding included) at ``heads x key_dim`` values, and their partials ``[out | lse]`` for its own in float32
    (float64 for float64 inputs)."""
    partial = 8 if element == 8 else 4
    return (ranks - 1) * queries * heads * (key_dim * element + (value_dim + 1) * partial)


def pass_kv_bytes(counts: list[int], kv_heads: int, key_dim: int, value_dim: int, element: int) -> int:
    """Bytes a rank receives in one layer's pass-KV: every other rank's share (``counts``, the new tokens joined,
    each block padded to the largest) of keys and values and their positions."""
    return (len(counts) - 1) * max(counts) * (kv_heads * (key_dim + value_dim) * element + 8)


def choose(schedule: str, queries: int, heads: int, kv_heads: int, key_dim: int, value_dim: int, counts: list[int],
           element: int) -> str:
    """``schedule`` unless ``"auto"``: then the one whose layer receives fewer bytes (the same on every rank: each knows
    every count and shape)."""
    if schedule != "auto":
        return schedule
    ranks = len(counts)
    q = pass_q_bytes(queries, heads, key_dim, value_dim, ranks, element)
    kv = pass_kv_bytes(counts, kv_heads, key_dim, value_dim, element)
    return "pass_q" if q < kv else "pass_kv"


def attend_chunk(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, entry, mesh: SPMesh,
                 scaling: float | None, kwargs: dict) -> torch.Tensor:
    """The registered attention of an extension call (``entry``: :class:`~.cache.Extension`): this rank's new
    queries (B, Hq, L, D), keys and values (B, Hk, L, D), padding included; the real keys and values join the rank's
    share of ``module``'s cache, then the chosen schedule -> (B, L, Hq, Dv) in the query's dtype."""
    cache = entry.cache
    real = entry.real.to(key.device)
    cache.append(module, key[:, :, real], value[:, :, real])
    shared_key, shared_value = cache.share(module)  # (B, Hk, n, D)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    slopes = kwargs.get("alibi")
    options = dict(window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
                   slopes=None if slopes is None else torch.tensor(slopes, dtype=torch.float64),
                   chunk=getattr(module, CHUNK_ATTR, None))
    q = query.transpose(1, 2)  # (B, L, Hq, D)
    schedule = choose(entry.schedule, q.shape[1], q.shape[2], key.shape[1], key.shape[-1], value.shape[-1],
                      cache.counts, query.element_size())
    entry.chosen.add(schedule)
    if schedule == "pass_q":
        out, lse = _pass_q(q, entry.query_positions, shared_key, shared_value, cache.positions, scale, mesh, options)
    else:
        out, lse = _pass_kv(q, entry.query_positions[mesh.sp_rank], shared_key, shared_value, cache.positions,
                            max(cache.counts), scale, mesh, options)
    sinks = kwargs.get("s_aux")  # under tensor parallelism, this rank's heads'
    return (out if sinks is None else fold_sinks(out, lse, local_part(sinks))[0]).to(query.dtype)


def _pass_q(query, query_positions, key, value, key_positions, scale, mesh, options):
    """Every rank's queries gathered, attended to this rank's share, and each rank's partials returned to it by one
    all-to-all; this rank's queries' partials merged in rank order -> (out (B, L, Hq, Dv), lse (B, Hq, L))."""
    p, (b, n, heads, _) = mesh.sp_size, query.shape
    gathered = [torch.empty_like(query) for _ in range(p)]
    dist.all_gather(gathered, query.contiguous(), group=mesh.sp_group)
    every = torch.cat(gathered, dim=1)  # (B, P x L, Hq, D), rank r's queries at [r L, (r + 1) L)
    out, lse = chunk_partial(every, query_positions.flatten(), key.transpose(1, 2), value.transpose(1, 2),
                             key_positions, scale, **options)
    packed = torch.cat([out, lse.transpose(1, 2)[..., None]], dim=-1)  # (B, P x L, Hq, Dv + 1)
    send = packed.view(b, p, n, heads, -1).transpose(0, 1).contiguous()  # (P, B, L, Hq, Dv + 1): block r to rank r
    received = torch.empty_like(send)  # block r: rank r's partials of this rank's queries
    dist.all_to_all_single(received, send, group=mesh.sp_group)
    acc_out = torch.zeros_like(received[0, ..., :-1])
    acc_lse = torch.full((b, heads, n), float("-inf"), dtype=received.dtype, device=received.device)
    for part in received:
        merge_into(acc_out, acc_lse, part[..., :-1], part[..., -1].transpose(1, 2))
    return acc_out, acc_lse


def _pass_kv(query, query_positions, key, value, key_positions, largest, scale, mesh, options):
    """This rank's queries attended to each rank's share as the shares travel round the ring (each padded to the
    largest, its padding at a position no query sees), merged by log-sum-exp -> (out (B, L, Hq, Dv), lse (B, Hq, L))."""
    pad = largest - key.shape[2]
    block = torch.cat([key, value], dim=-1)  # (B, Hk, n, Dk + Dv)
    block = torch.nn.functional.pad(block, (0, 0, 0, pad))
    where = torch.cat([key_positions, torch.full((pad,), torch.iinfo(torch.long).max)]).to(block.device)
    dk = key.shape[-1]
    blocks, places = RingExchange(mesh.sp_group, "forward", tag=0), RingExchange(mesh.sp_group, "forward", tag=1)
    acc_out = acc_lse = None
    for step in range(mesh.sp_size):
        if step < mesh.sp_size - 1:  # the next share in flight while this one is attended
            incoming, incoming_where = blocks.start(block), places.start(where)
        out, lse = chunk_partial(query, query_positions, block[..., :dk].transpose(1, 2),
                                 block[..., dk:].transpose(1, 2), where, scale, **options)
        if acc_out is None:
            acc_out, acc_lse = out, lse
        else:
            merge_into(acc_out, acc_lse, out, lse)
        if step < mesh.sp_size - 1:
            block, where = incoming.wait(), incoming_where.wait()
    return acc_out, acc_lse
