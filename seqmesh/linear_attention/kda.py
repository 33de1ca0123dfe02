"""Kimi Delta Attention (KDA) on whole sequences, in plain PyTorch: the reference and the CPU path.

KDA is the gated delta rule of ``gated_delta.py`` with a decay per key channel instead of one per head.
Per head, a state ``S`` (Dk x Dv) runs over the sequence::

    S_t = diag(exp(g_t)) S_{t-1}                      # g_t (Dk,): log decay of each key channel, <= 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T    # delta rule
    o_t = S_t^T q_t                                   # q, k L2-normalised, q scaled by Dk^-1/2

The chunked form follows the scalar one (``gated_delta.chunk_gated_delta_rule_states``): inside a
chunk of ``C`` tokens, with ``G`` the log decay cumulated from the chunk's start (C, Dk), the
updates solve one unit-lower-triangular system, and the state is carried between chunks. What
changes is that every token pair now decays per channel, ``sum_d a_td b_sd exp(G_td - G_sd)``
(:func:`decayed_products`), which is no longer a (C x C) decay matrix times a product of two
matrices. It is computed without overflow by a second split into sub-chunks of ``c`` tokens:

- pairs in one sub-chunk: ``exp(G_t - G_s)`` per pair and channel, by the pairs' offset ``t - s`` (each
  offset's pairs one elementwise product over the sub-chunks), so no ``exp`` of a positive number is taken
  and only the ``c (c + 1) / 2`` pairs that count are computed;
- pairs across sub-chunks, ``s`` in sub-chunk ``j``, ``t`` in a later one ``i``: split at ``r_i``, the last token
  before sub-chunk ``i``, and at ``r_(j+1)``, the last token of sub-chunk ``j``:
  ``exp(G_t - G_ri) * exp(G_ri - G_r(j+1)) * exp(G_r(j+1) - G_s)``, each factor ``<= 1`` since
  ``s <= r_(j+1) <= r_i < t``, so a product of two matrices per pair of sub-chunks, computed only for the
  ``m (m - 1) / 2`` pairs below the diagonal (before, every sub-chunk took a decayed copy of the chunk's keys:
  ``m`` times the keys' size, half of it masked to zero).

Packed documents are segments (``bounds``) that each start a chunk, as in ``gated_delta.py``; each
may start from an initial state, and the state leaving each is returned (state passing's widened
run, ``kda_state_passing.py``).
"""

from __future__ import annotations

import torch

from .carry import carry_chunks
from .gated_delta import CHUNK, chunk_layout, compute_dtype, l2norm, without_autocast

SUB_CHUNK = 16  # tokens per sub-chunk of the pairwise decay


def _diagonal_map(sub: int, device: torch.device) -> torch.Tensor:
    """(sub * sub,): for the pair (t, s) of a sub-chunk, its place in the offsets laid end to end (offset ``j = t - s``
    holds ``sub - j`` pairs, pair ``(s + j, s)`` at ``s``), or the zero appended after them for ``s > t``."""
    t, s = torch.arange(sub, device=device)[:, None], torch.arange(sub, device=device)[None, :]
    j = t - s
    start = j * sub - j * (j - 1) // 2  # the offsets before j hold sub + (sub - 1) + ... + (sub - j + 1) pairs
    return torch.where(j >= 0, start + s, sub * (sub + 1) // 2).reshape(-1)


def _block_map(m: int, device: torch.device) -> torch.Tensor:
    """(m * m,): for sub-chunk block (i, j), its place among ``[zero, the pairs i > j in tril_indices order, the
    diagonal blocks]``."""
    i, j = torch.arange(m, device=device)[:, None], torch.arange(m, device=device)[None, :]
    below = i * (i - 1) // 2 + j + 1  # tril_indices(m, m, -1) lists row by row
    return torch.where(i > j, below, torch.where(i == j, 1 + m * (m - 1) // 2 + i, 0)).reshape(-1)


class _SubChunkPairs(torch.autograd.Function):
    """The pairs of each sub-chunk by offset: ``a``, ``b``, ``gc`` (..., m, c, D) -> (..., m, c (c + 1) / 2), offset
    ``j``'s ``c - j`` pairs ``(s + j, s)`` of ``sum_d a_(s+j) b_s exp(gc_(s+j) - gc_s)`` laid end to end. It keeps
    only its inputs: its backward recomputes each offset's decays. Autograd over the offsets kept every offset's
    decays and products (some 40 values of D a token for KDA's two calls) and wrote a zeroed whole-size gradient
    for every slice."""

    @staticmethod
    def forward(ctx, a, b, gc):
        sub = a.shape[-2]
        ctx.save_for_backward(a, b, gc)
        return torch.cat([(a[..., j:, :] * b[..., :sub - j, :] * (gc[..., j:, :] - gc[..., :sub - j, :]).exp()).sum(-1)
                          for j in range(sub)], -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_pairs):
        a, b, gc = ctx.saved_tensors
        sub = a.shape[-2]
        da, db, dgc = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(gc)
        for j, d_j in enumerate(d_pairs.split([sub - j for j in range(sub)], -1)):  # (..., m, c - j) each
            late, early = slice(j, sub), slice(0, sub - j)  # the pair's later token t = s + j, and s
            weighted = d_j[..., None] * (gc[..., late, :] - gc[..., early, :]).exp()  # (..., m, c - j, D)
            da[..., late, :] += weighted * b[..., early, :]
            term = weighted * a[..., late, :]
            db[..., early, :] += term
            term *= b[..., early, :]  # d out / d gc_t, and minus that for gc_s
            dgc[..., late, :] += term
            dgc[..., early, :] -= term
        return da, db, dgc


def decayed_products(a: torch.Tensor, b: torch.Tensor, gc: torch.Tensor, sub: int = SUB_CHUNK) -> torch.Tensor:
    """``out[..., t, s] = sum_d a[..., t, d] b[..., s, d] exp(gc[..., t, d] - gc[..., s, d])`` for ``s <= t``,
    zero above the diagonal. ``a``, ``b``, ``gc`` (..., C, D) with ``gc`` non-increasing along C (a cumulated
    log decay) and ``C`` a multiple of ``sub`` -> (..., C, C)."""
    *lead, c, d = a.shape
    if c % sub:
        raise ValueError(f"chunk of {c} tokens is not a multiple of the sub-chunk {sub}; pick a chunk that is.")
    m = c // sub
    a_s, b_s, gc_s = (x.reshape(*lead, m, sub, d) for x in (a, b, gc))  # (..., m, c, D)
    # within a sub-chunk: the pairs (t, t - j) of each offset j < sub, (..., m, sub - j), whose exponents are never
    # positive (only the c (c + 1) / 2 pairs that count), laid end to end, then placed by _diagonal_map
    pairs = torch.cat([_SubChunkPairs.apply(a_s, b_s, gc_s), a.new_zeros(*lead, m, 1)], -1)
    diag = pairs.index_select(-1, _diagonal_map(sub, a.device)).reshape(*lead, m, sub, sub)
    # across sub-chunks, only the blocks (i, j) with j < i: split at r_i, the last token before sub-chunk i, and at
    # r_{j+1}, the last of sub-chunk j; exp(G_t - G_s) = exp(G_t - G_ri) exp(G_ri - G_r(j+1)) exp(G_r(j+1) - G_s),
    # each factor <= 1 since s <= r_(j+1) <= r_i < t
    ends = gc_s[..., -1, :]  # (..., m, D): G at each sub-chunk's last token
    a_read = a_s[..., 1:, :, :] * (gc_s[..., 1:, :, :] - ends[..., :-1, None, :]).exp()  # (..., m-1, c, D), row i-1
    b_write = b_s[..., :-1, :, :] * (ends[..., :-1, None, :] - gc_s[..., :-1, :, :]).exp()  # (..., m-1, c, D), col j
    rows, cols = torch.tril_indices(m, m, -1, device=a.device)  # the P = m (m - 1) / 2 blocks below the diagonal
    between = (ends.index_select(-2, rows - 1) - ends.index_select(-2, cols)).exp()  # (..., P, D): exp(G_ri - G_r(j+1))
    # index_select, not indexing: its backward adds rows where indexing's accumulates one element at a time
    reads = a_read.index_select(-3, rows - 1) * between[..., None, :]  # (..., P, c, D)
    cross = reads @ b_write.index_select(-3, cols).transpose(-1, -2)  # (..., P, c, c)
    blocks = torch.cat([a.new_zeros(*lead, 1, sub, sub), cross, diag], -3)  # (..., 1 + P + m, c, c)
    out = blocks.index_select(-3, _block_map(m, a.device)).reshape(*lead, m, m, sub, sub)
    return out.transpose(-3, -2).reshape(*lead, c, c)


@without_autocast
def chunk_kda_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: tuple[int, ...],
    initial_state: torch.Tensor | None = None,
    *,
    chunk: int = CHUNK,
    sub: int = SUB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over segments: q, k (B, S, H, Dk) (not yet normalised), v (B, S, H, Dv), g (B, S, H, Dk) the log decay
    of each key channel (<= 0), beta (B, S, H); each of the ``N = len(bounds) - 1`` segments starts from
    ``initial_state[:, i]`` (B, N, H, Dk, Dv) (zero when None) -> ``(out (B, S, H, Dv) in v's dtype, final
    states (B, N, H, Dk, Dv) in the compute dtype)``. float64 inputs stay float64; half precision runs in float32."""
    out_dtype = v.dtype
    dt = compute_dtype(q.dtype)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    if g.shape != k.shape:
        raise ValueError(f"KDA's decay g has shape {tuple(g.shape)}; it needs one per key channel, {tuple(k.shape)}.")
    q = l2norm(q.to(dt)) * dk**-0.5
    k = l2norm(k.to(dt))
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)

    dest, total, first_chunks = chunk_layout(bounds, chunk, q.device)
    n = total // chunk

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, *D) -> (B, H, N, C, *D), segments chunk-aligned
        padded = x.new_zeros(b, total, *x.shape[2:]).index_copy(1, dest, x)
        return padded.transpose(1, 2).reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))
    gc = g.cumsum(-2)  # (B, H, N, C, Dk): log decay from the chunk start to each token, per channel
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    eye = torch.eye(chunk, dtype=dt, device=q.device)
    system = decayed_products(k_beta, k, gc, sub).tril(-1) + eye  # (B, H, N, C, C)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # (B, H, N, C, Dv)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp(), upper=False, unitriangular=True)  # (.., C, Dk)
    intra = decayed_products(q, k, gc, sub)  # (B, H, N, C, C), diagonal included
    q_read = q * gc.exp()  # reads the state entering the chunk
    k_write = k * (gc[..., -1:, :] - gc).exp()  # writes decayed to the chunk's end
    chunk_decay = gc[..., -1, :].exp()[..., None]  # (B, H, N, Dk, 1): each state row's decay over the chunk
    out, finals = carry_chunks(u, w, q_read, intra, k_write, chunk_decay, first_chunks, initial_state)
    return out.index_select(1, dest).to(out_dtype), finals  # (B, S, H, Dv), (B, N, H, Dk, Dv)
