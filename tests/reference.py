"""Independent single-device references: explicit float64 attention on the whole sequence."""

from __future__ import annotations

import torch


def document_ids(seq_len: int, cu_seqlens: list[int] | None) -> torch.Tensor:
    """(seq_len,) document index per position; positions past the last boundary get -1."""
    ids = torch.full((seq_len,), -1, dtype=torch.long)
    bounds = cu_seqlens if cu_seqlens is not None else [0, seq_len]
    for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ids[a:b] = d
    return ids


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, cu_seqlens: list[int] | None = None,
    scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None,
    image_blocks: list[tuple[int, int]] | None = None, chunk: int | None = None, softcap: float | None = None,
    alibi: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """q (B, S, Hq, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> (B, S, Hq, Dv), in float64 with plain ops.

    Query head h reads kv head h // (Hq / Hk). Tokens see keys of their own document (and, if
    causal, not later ones; with ``window``, only keys j with i - window < j, as transformers'
    sliding_window_causal). Tokens outside every document see only themselves, so they stay
    finite. ``sinks`` (Hq,): an extra logit per head in the softmax, with a zero value (gpt-oss).
    ``image_blocks``: ``[start, stop)`` intervals whose tokens see each other whatever causality says (Gemma 3's
    images, as transformers' ``blockwise_overlay``: OR'ed with the causal mask, AND'ed with the window).
    ``chunk``: keys of the query's own chunk only, chunks counted from its document's start (transformers'
    chunked mask, Llama 4, evaluated on packed documents' own positions), AND'ed with the rest. ``softcap``: the
    scaled scores capped as Gemma 2's eager attention does (``s / c``, tanh, ``* c``) before the mask. ``alibi``
    (Hq,): ALiBi's slopes, ``slope * key position`` added to each head's scores as BLOOM does (a constant per row
    away from ``-slope * distance``, which the softmax does not see).
    """
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qf = q.double().transpose(1, 2)
    kf = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    docs = document_ids(s, cu_seqlens)
    pos = torch.arange(s)
    allowed = (docs[:, None] == docs[None, :]) & (docs[:, None] >= 0)
    allowed |= torch.eye(s, dtype=torch.bool)
    if causal:
        block = torch.full((s,), -1, dtype=torch.long)
        for i, (a, e) in enumerate(image_blocks or ()):
            block[a:e] = i
        allowed &= (pos[None, :] <= pos[:, None]) | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    if chunk is not None:
        starts = torch.tensor([0] + list(cu_seqlens or [])[:-1] if cu_seqlens else [0])
        own = pos - starts[(pos[:, None] >= starts[None, :]).sum(1) - 1]  # position inside its document
        allowed &= (own[:, None] // chunk) == (own[None, :] // chunk)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi is not None:
        scores = scores + torch.tensor(alibi, dtype=scores.dtype)[:, None, None] * pos.to(scores.dtype)[None, None, :]
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))  # the mask is built on the CPU
    if sinks is not None:  # one more column, then dropped: it only enlarges the denominator
        column = sinks.double()[None, :, None, None].expand(b, hq, s, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ vf).transpose(1, 2)


def explicit_mask(
    sq: int, sk: int, *, causal: bool, window: int | None = None, offset: int = 0,
    segments: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """(sq, sk) bool for one kernel call, from positions: query a sits at ``offset + a``, key b at b;
    causal keeps keys not after the query, ``window`` those less than ``window`` before it, and
    ``segments`` (local bounds, sq == sk) those of the query's own segment."""
    qpos, kpos = torch.arange(sq)[:, None] + offset, torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= kpos <= qpos
    if window is not None:
        ok &= qpos - kpos < window
    if segments is not None:
        doc = torch.bucketize(torch.arange(sq), torch.tensor(segments[1:-1]), right=True)
        ok &= doc[:, None] == doc[None, :]
    return ok
