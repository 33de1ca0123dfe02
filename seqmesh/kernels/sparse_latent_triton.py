"""DeepSeek Sparse Attention's Triton kernels: the token-sparse attention in MLA's latent space (forward, backward;
the math of :func:`seqmesh.kernels.sparse_latent.sparse_latent_reference`), and the lightning indexer's scores
(:func:`index_scores`, no gradient).

Each program takes one query token and a block of ``BLOCK_H`` of its heads (the heads share the token's selection,
so they are the rows of every product, as in FlashMLA's sparse kernels), walks the token's ``K`` selected keys in
blocks of ``BLOCK_K``, gathers their latent rows (``R`` values: key and value at once) and rotated keys (``Dr``) from
the whole row inside the kernel, and keeps an online softmax in float32. Nothing of size ``(queries, K, R)`` is ever
written: the torch form gathers that tensor (the DeepSeek-V3.2 layer at 32K tokens: 32K x 2048 x 576 values).

The backward recomputes each block's probabilities from the forward's log-sum-exp and adds the keys' gradients into
a float32 row gradient with atomic adds (their order varies run to run: float32 rounding, as torch's CUDA
``index_add_``).

:mod:`.sparse_latent` imports this module on the kernel's first use, so a process that never calls it never imports
Triton; Triton decides at import whether the kernels run interpreted, so a test sets ``TRITON_INTERPRET=1`` first
and runs them on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # heads a program takes (tl.dot needs 16 rows at least; fewer heads are masked)
# selected keys a program gathers at once, forward and backward: on Hopper at DeepSeek's 512 latents, 159 and 217
# registers a thread without spills (the backward at 32 spilled 80 bytes)
BLOCK_K, BACKWARD_BLOCK_K = 32, 16


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


@triton.jit
def _forward(Q, ROW, IDX, SINK, O, LSE, T, L, H, K, scale,
             C: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
             BH: tl.constexpr, BK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_ROT: tl.constexpr, PREC: tl.constexpr):
    # HAS_ROT (DR > 0): a rotated part of the key beside its latent (DeepSeek's MLA); none in DeepSeek-V4's keys
    token = tl.program_id(0).to(tl.int64)  # b * L + i
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    b = token // L
    r, d, j0 = tl.arange(0, BR), tl.arange(0, BD), tl.arange(0, BK)
    hm = heads < H
    q_at = Q + token * H * C + heads[:, None] * C
    q_lat = tl.load(q_at + r[None, :], mask=hm[:, None] & (r < R)[None, :], other=0.0)  # (BH, BR)
    if HAS_ROT:
        q_rot = tl.load(q_at + R + d[None, :], mask=hm[:, None] & (d < DR)[None, :], other=0.0)  # (BH, BD)
    if HAS_SINK:
        m = tl.load(SINK + heads, mask=hm, other=0.0).to(tl.float32)
        total = tl.full((BH,), 1.0, tl.float32)  # the sink's own exp(sink - m)
    else:
        m = tl.full((BH,), float("-inf"), tl.float32)
        total = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BR), tl.float32)
    for start in range(0, K, BK):
        j = start + j0
        idx = tl.load(IDX + token * K + j, mask=j < K, other=-1)
        ok = idx >= 0
        at = ROW + (b * T + idx) * C
        lat = tl.load(at[:, None] + r[None, :], mask=ok[:, None] & (r < R)[None, :], other=0.0)  # (BK, BR)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PREC)  # (BH, BK) float32
        if HAS_ROT:
            rot = tl.load(at[:, None] + R + d[None, :], mask=ok[:, None] & (d < DR)[None, :], other=0.0)  # (BK, BD)
            s += tl.dot(q_rot, tl.trans(rot), input_precision=PREC)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PREC)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    out = acc / total[:, None]
    o_at = O + token * H * R + heads[:, None] * R + r[None, :]
    tl.store(o_at, out.to(O.dtype.element_ty), mask=hm[:, None] & (r < R)[None, :])
    tl.store(LSE + token * H + heads, shift + tl.log(total), mask=hm)


@triton.jit
def _backward(Q, ROW, IDX, O, DO, LSE, DQ, DROW, T, L, H, K, scale,
              C: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
              BH: tl.constexpr, BK: tl.constexpr, HAS_ROT: tl.constexpr, PREC: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    b = token // L
    r, d, j0 = tl.arange(0, BR), tl.arange(0, BD), tl.arange(0, BK)
    hm = heads < H
    lat_mask, rot_mask = hm[:, None] & (r < R)[None, :], hm[:, None] & (d < DR)[None, :]
    q_at = Q + token * H * C + heads[:, None] * C
    q_lat = tl.load(q_at + r[None, :], mask=lat_mask, other=0.0)
    if HAS_ROT:
        q_rot = tl.load(q_at + R + d[None, :], mask=rot_mask, other=0.0)
    o_at = token * H * R + heads[:, None] * R + r[None, :]
    out = tl.load(O + o_at, mask=lat_mask, other=0.0)
    dout = tl.load(DO + o_at, mask=lat_mask, other=0.0)  # (BH, BR)
    lse = tl.load(LSE + token * H + heads, mask=hm, other=0.0)
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)  # (BH,): d loss / d (each score) shifts by it
    dq_lat = tl.zeros((BH, BR), tl.float32)
    dq_rot = tl.zeros((BH, BD), tl.float32)
    for start in range(0, K, BK):
        j = start + j0
        idx = tl.load(IDX + token * K + j, mask=j < K, other=-1)
        ok = idx >= 0
        at = ROW + (b * T + idx) * C
        grad_at = DROW + (b * T + idx) * C
        lat = tl.load(at[:, None] + r[None, :], mask=ok[:, None] & (r < R)[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PREC)
        if HAS_ROT:
            rot = tl.load(at[:, None] + R + d[None, :], mask=ok[:, None] & (d < DR)[None, :], other=0.0)
            s += tl.dot(q_rot, tl.trans(rot), input_precision=PREC)
        p = tl.where(ok[None, :] & hm[:, None], tl.exp(s * scale - lse[:, None]), 0.0)  # (BH, BK)
        dp = tl.dot(dout, tl.trans(lat), input_precision=PREC)  # d loss / d p
        ds = p * (dp - delta[:, None]) * scale  # d loss / d (the unscaled product)
        dq_lat += tl.dot(ds.to(lat.dtype), lat, input_precision=PREC)
        ds_t = tl.trans(ds).to(q_lat.dtype)
        d_lat = tl.dot(tl.trans(p).to(dout.dtype), dout, input_precision=PREC)  # (BK, BR): as values
        d_lat += tl.dot(ds_t, q_lat, input_precision=PREC)  # and as keys
        tl.atomic_add(grad_at[:, None] + r[None, :], d_lat, mask=ok[:, None] & (r < R)[None, :])
        if HAS_ROT:
            dq_rot += tl.dot(ds.to(rot.dtype), rot, input_precision=PREC)
            d_rot = tl.dot(ds_t, q_rot, input_precision=PREC)  # (BK, BD)
            tl.atomic_add(grad_at[:, None] + R + d[None, :], d_rot, mask=ok[:, None] & (d < DR)[None, :])
    dq_at = DQ + token * H * C + heads[:, None] * C
    tl.store(dq_at + r[None, :], dq_lat.to(DQ.dtype.element_ty), mask=lat_mask)
    if HAS_ROT:
        tl.store(dq_at + R + d[None, :], dq_rot.to(DQ.dtype.element_ty), mask=rot_mask)


@triton.jit
def _index_scores(Q, KEYS, W, LIMIT, OUT, L, T, H, scale,
                  D: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    # one tile of BM queries by BN keys of one row: sum over heads of w * relu(scale * q . k), in float32; each
    # product accumulated over slices of BE of the head dim (whole (BM, D) and (BN, D) tiles spill registers)
    tile_q, tile_k, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    m = tile_q * BM + tl.arange(0, BM)
    n = tile_k * BN + tl.arange(0, BN)
    e = tl.arange(0, BE)
    qm = m < L
    limit = tl.load(LIMIT + m, mask=qm, other=0)  # each query scores the keys before its limit
    acc = tl.zeros((BM, BN), tl.float32)
    if tile_k * BN < tl.max(limit, 0):  # a tile past every query's limit is all -inf: not scored
        for h in range(0, H):
            s = tl.zeros((BM, BN), tl.float32)
            for start in range(0, D, BE):
                d = start + e
                q = tl.load(Q + ((b * L + m[:, None]) * H + h) * D + d[None, :], mask=qm[:, None] & (d < D)[None, :],
                            other=0.0)  # (BM, BE)
                keys = tl.load(KEYS + (b * T + n[:, None]) * D + d[None, :], mask=(n < T)[:, None] & (d < D)[None, :],
                               other=0.0)  # (BN, BE)
                s += tl.dot(q, tl.trans(keys), input_precision=PREC)
            w = tl.load(W + (b * L + m) * H + h, mask=qm, other=0.0)
            acc += w[:, None] * tl.maximum(s * scale, 0.0)
    acc = tl.where(n[None, :] < limit[:, None], acc, float("-inf"))
    tl.store(OUT + (b * L + m[:, None]) * T + n[None, :], acc, mask=qm[:, None] & (n < T)[None, :])


# the indexer kernel's tile (queries by keys), its slice of the head dim and warps: on Hopper, 194 registers and no
# spills at DeepSeek-V3.2's 128-wide indexer heads in float32 (whole (64, 128) float32 tiles spilled 9.8 KB a thread);
# bf16 or fp16 values take slices of up to NARROW_INDEX_BE, a whole 128-wide head at once (tensor-core products, 190
# registers at 8 warps by Triton 3.9 for sm_90; slices of 64 spilled 80 bytes, of 32 none at 179)
INDEX_BM, INDEX_BN, INDEX_BE, INDEX_WARPS = 64, 64, 16, 8
NARROW_INDEX_BE = 128


def index_sizes(dtype: torch.dtype, dim: int) -> dict:
    """The indexer kernel's launch settings for values of ``dtype`` and heads ``dim`` wide (the compile check in
    tests/kernel_compile_cases.py reads the same)."""
    narrow = dtype in (torch.bfloat16, torch.float16)
    width = min(_pow2(dim), NARROW_INDEX_BE) if narrow else INDEX_BE
    return dict(D=dim, BE=width, BM=INDEX_BM, BN=INDEX_BN, PREC="ieee", num_warps=INDEX_WARPS)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                 limit: torch.Tensor) -> torch.Tensor:
    """q (B, l, H, D), keys (B, T, D) of one dtype (float32, or bf16 / fp16: products on tensor cores, PREC unread),
    weights (B, l, H) float32, all contiguous; limit (l,) int: each query scores the keys before it -> (B, l, T)
    float32, ``sum_h w_h relu(scale q_h . k)``, -inf from each limit on; every sum in float32."""
    b, length, heads, dim = q.shape
    total = keys.shape[1]
    out = q.new_empty(b, length, total, dtype=torch.float32)
    grid = (-(-length // INDEX_BM), -(-total // INDEX_BN), b)
    _index_scores[grid](q, keys, weights, limit, out, length, total, heads, scale, **index_sizes(q.dtype, dim))
    return out


def _grid(tokens: int, heads: int) -> tuple[int, int]:
    return tokens, -(-heads // BLOCK_H)


def _sizes(query: torch.Tensor, rank: int, block_k: int = BLOCK_K) -> dict:
    c = query.shape[-1]
    # float32 products in IEEE float32 (torch's matmul default), not TF32
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # tf32: unread for bf16/fp16
    # a program holds (BH, BR) and (BK, BR) tiles: at DeepSeek's 512 latents, 8 warps' registers rather than 4's
    warps = 8 if _pow2(rank) >= 256 else 4
    return dict(C=c, R=rank, DR=c - rank, BR=_pow2(rank), BD=_pow2(c - rank), BH=BLOCK_H, BK=block_k,
                HAS_ROT=c > rank, PREC=precision,
                num_warps=warps)


def forward(query: torch.Tensor, row: torch.Tensor, picks: torch.Tensor, scale: float, rank: int,
            sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, L, H, C), row (B, T, C), picks (B, L, K) int (-1: none), all contiguous -> the attended latents
    (B, L, H, rank) in ``row``'s dtype and each (query, head)'s log-sum-exp (B, L, H) float32."""
    b, length, heads, _ = query.shape
    out = query.new_empty(b, length, heads, rank, dtype=row.dtype)
    lse = query.new_empty(b, length, heads, dtype=torch.float32)
    sink = sinks if sinks is not None else lse  # unread without HAS_SINK
    _forward[_grid(b * length, heads)](
        query, row, picks, sink, out, lse, row.shape[1], length, heads, picks.shape[-1], scale,
        HAS_SINK=sinks is not None, **_sizes(query, rank))
    return out, lse


def backward(query: torch.Tensor, row: torch.Tensor, picks: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
             lse: torch.Tensor, scale: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`forward`'s output for ``grad`` (B, L, H, rank): (query's, row's in float32)."""
    b, length, heads, _ = query.shape
    d_query = torch.empty_like(query)
    d_row = torch.zeros(row.shape, dtype=torch.float32, device=row.device)
    _backward[_grid(b * length, heads)](
        query, row, picks, out, grad, lse, d_query, d_row, row.shape[1], length, heads, picks.shape[-1], scale,
        **_sizes(query, rank, BACKWARD_BLOCK_K))
    return d_query, d_row
