"""seqmesh's own flash attention in Triton, for the calls no fused CUDA op takes: ALiBi's distance bias (BLOOM, MPT)
on every ring block. The math of :class:`seqmesh.kernels.reference.MathKernel` for a call without a window or a
soft-cap: query ``a`` sees key ``b`` where ``offset + a - b >= 0`` (causal) or everywhere, and each scaled score gets
``-slope_h * (offset + a - b)`` with ALiBi. Without it, this is plain flash attention with the block's offset.

Shapes as :mod:`.base` (contiguous): q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) with Hq % Hk == 0.

- forward: one program per block of ``BM`` queries of one (row, query head); it walks the keys the block can see in
  blocks of ``BN`` with an online softmax in float32 and writes the output and the log-sum-exp (bias included, so
  the partial results of ring blocks merge exactly). The keys past a causal block's last visible one are skipped.
- backward, two kernels, no atomics: one program per block of ``BN`` keys of one kv head adds every query head of
  its group into the keys' and values' gradients; one program per block of queries sums the queries' gradient. Both
  recompute each tile's probabilities from the log-sum-exp they are given (ring attention gives the merged one).

A row of products runs in the inputs' dtype with float32 sums: bf16 and fp16 on the tensor cores; float32 in IEEE
float32 (torch's matmul default), never TF32. Each backward row's ``dout . out`` is summed by a pre-pass kernel in
float32 (no float32 copy of either). :mod:`.flash_triton_kernel` imports this module on first use, so a
process that never calls it never imports Triton; tests set ``TRITON_INTERPRET=1`` and run it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scores(q, k, slope, a, n, offset, scale, Sk, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr,
            PREC: tl.constexpr):
    # (BM, BN) float32: the tile's scaled scores with the distance bias, -inf where the key is hidden or past Sk
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    gap = offset + a[:, None] - n[None, :]  # how many positions key n lies before query a
    if HAS_ALIBI:
        s -= slope * gap.to(tl.float32)
    ok = (n < Sk)[None, :]
    if CAUSAL:
        ok &= gap >= 0
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _key_tiles(K, V, b, hk, n, Sk, Hk, d, e, D: tl.constexpr, DV: tl.constexpr):
    # the (BN, BD) keys and (BN, BDV) values of kv head hk at rows n of row b, zeros past Sk and the head widths
    rows = (b * Sk + n[:, None]) * Hk + hk
    k = tl.load(K + rows * D + d[None, :], mask=(n < Sk)[:, None] & (d < D)[None, :], other=0.0)
    v = tl.load(V + rows * DV + e[None, :], mask=(n < Sk)[:, None] & (e < DV)[None, :], other=0.0)
    return k, v


@triton.jit
def _key_stop(start_m, offset, Sk, BM: tl.constexpr, CAUSAL: tl.constexpr):
    # the keys queries [start_m, start_m + BM) may see end before this column
    if CAUSAL:
        return tl.maximum(tl.minimum(Sk, offset + start_m + BM), 0)
    return Sk


@triton.jit
def _forward(Q, K, V, SLOPE, O, LSE, Sq, Sk, Hq, Hk, offset, scale,
             D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, PREC: tl.constexpr):
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1).to(tl.int64)  # b * Hq + h
    b, h = bh // Hq, bh % Hq
    hk = h // (Hq // Hk)
    a = start_m + tl.arange(0, BM)
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    am = a < Sq
    q = tl.load(Q + ((b * Sq + a[:, None]) * Hq + h) * D + d[None, :], mask=am[:, None] & (d < D)[None, :], other=0.0)
    slope = tl.load(SLOPE + h).to(tl.float32) if HAS_ALIBI else 0.0
    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BDV), tl.float32)
    for start_n in range(0, _key_stop(start_m, offset, Sk, BM, CAUSAL), BN):
        n = start_n + tl.arange(0, BN)
        k, v = _key_tiles(K, V, b, hk, n, Sk, Hk, d, e, D, DV)
        s = _scores(q, k, slope, a, n, offset, scale, Sk, CAUSAL, HAS_ALIBI, PREC)
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]  # a row that sees no key: zeros, log-sum-exp -inf
    lse = tl.where(seen, tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(O + ((b * Sq + a[:, None]) * Hq + h) * DV + e[None, :], out.to(O.dtype.element_ty),
             mask=am[:, None] & (e < DV)[None, :])
    tl.store(LSE + bh * Sq + a, lse, mask=am)


@triton.jit
def _backward_kv(Q, K, V, SLOPE, DO, LSE, DELTA, DK, DV_OUT, Sq, Sk, Hq, Hk, offset, scale,
                 D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, PREC: tl.constexpr):
    start_n = tl.program_id(0) * BN
    bhk = tl.program_id(1).to(tl.int64)  # b * Hk + kv head
    b, hk = bhk // Hk, bhk % Hk
    group = Hq // Hk
    n = start_n + tl.arange(0, BN)
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    nm = n < Sk
    rows = (b * Sk + n[:, None]) * Hk + hk
    k, v = _key_tiles(K, V, b, hk, n, Sk, Hk, d, e, D, DV)
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BDV), tl.float32)
    first = 0
    if CAUSAL:  # queries before key start_n's own position see none of these keys
        first = tl.maximum(start_n - offset, 0) // BM * BM
    for g in range(0, group):
        h = hk * group + g
        slope = tl.load(SLOPE + h).to(tl.float32) if HAS_ALIBI else 0.0
        for start_m in range(first, Sq, BM):
            a = start_m + tl.arange(0, BM)
            am = a < Sq
            at = (b * Sq + a[:, None]) * Hq + h
            q = tl.load(Q + at * D + d[None, :], mask=am[:, None] & (d < D)[None, :], other=0.0)
            do = tl.load(DO + at * DV + e[None, :], mask=am[:, None] & (e < DV)[None, :], other=0.0)
            lse = tl.load(LSE + (b * Hq + h) * Sq + a, mask=am, other=0.0)
            delta = tl.load(DELTA + (b * Hq + h) * Sq + a, mask=am, other=0.0)
            s = _scores(q, k, slope, a, n, offset, scale, Sk, CAUSAL, HAS_ALIBI, PREC)
            lse = tl.where(lse == float("-inf"), 0.0, lse)  # a row that sees no key: its s are -inf too
            p = tl.where(am[:, None], tl.exp(s - lse[:, None]), 0.0)  # (BM, BN)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    tl.store(DK + rows * D + d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=nm[:, None] & (d < D)[None, :])
    tl.store(DV_OUT + rows * DV + e[None, :], dv.to(DV_OUT.dtype.element_ty), mask=nm[:, None] & (e < DV)[None, :])


@triton.jit
def _backward_q(Q, K, V, SLOPE, DO, LSE, DELTA, DQ, Sq, Sk, Hq, Hk, offset, scale,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_ALIBI: tl.constexpr, PREC: tl.constexpr):
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hq, bh % Hq
    hk = h // (Hq // Hk)
    a = start_m + tl.arange(0, BM)
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    am = a < Sq
    at = (b * Sq + a[:, None]) * Hq + h
    q = tl.load(Q + at * D + d[None, :], mask=am[:, None] & (d < D)[None, :], other=0.0)
    do = tl.load(DO + at * DV + e[None, :], mask=am[:, None] & (e < DV)[None, :], other=0.0)
    lse = tl.load(LSE + bh * Sq + a, mask=am, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + bh * Sq + a, mask=am, other=0.0)
    slope = tl.load(SLOPE + h).to(tl.float32) if HAS_ALIBI else 0.0
    dq = tl.zeros((BM, BD), tl.float32)
    for start_n in range(0, _key_stop(start_m, offset, Sk, BM, CAUSAL), BN):
        n = start_n + tl.arange(0, BN)
        k, v = _key_tiles(K, V, b, hk, n, Sk, Hk, d, e, D, DV)
        s = _scores(q, k, slope, a, n, offset, scale, Sk, CAUSAL, HAS_ALIBI, PREC)
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + at * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=am[:, None] & (d < D)[None, :])


@triton.jit
def _row_dots(O, DO, DELTA, Sq, Hq, DV: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr):
    # DELTA[b, h, a] = sum_e out[b, a, h, e] * dout[b, a, h, e] in float32: d loss / d (each score) shifts by it
    start_m = tl.program_id(0) * BM
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hq, bh % Hq
    a = start_m + tl.arange(0, BM)
    e = tl.arange(0, BDV)
    at = ((b * Sq + a[:, None]) * Hq + h) * DV + e[None, :]
    ok = (a < Sq)[:, None] & (e < DV)[None, :]
    out = tl.load(O + at, mask=ok, other=0.0).to(tl.float32)
    dout = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * Sq + a, tl.sum(out * dout, 1), mask=a < Sq)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def _sizes(q: torch.Tensor, v: torch.Tensor, causal: bool, alibi: bool) -> dict:
    d, dv = q.shape[-1], v.shape[-1]
    # tiles of 64 x 64 in half precision at head dims to 128 (BLOOM's and MPT's); 32 beyond, and in float32, whose
    # tiles take twice the shared memory (the key block's backward at 64 x 128 in float32: 214 KB, past an A100's)
    block = 64 if max(d, dv) <= 128 and q.dtype != torch.float32 else 32
    # IEEE float32 for float32 inputs (never TF32); half inputs ignore it
    return dict(D=d, DV=dv, BD=_pow2(d), BDV=_pow2(dv), BM=block, BN=block, CAUSAL=causal, HAS_ALIBI=alibi,
                PREC="ieee", num_warps=4 if block == 64 else 8)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None, causal: bool,
            offset: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), slopes (Hq,) float32 or None -> out
    (B, Sq, Hq, Dv) in q's dtype, lse (B, Hq, Sq) float32."""
    b, sq, hq, _ = q.shape
    sizes = _sizes(q, v, causal, slopes is not None)
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=torch.float32)
    grid = (triton.cdiv(sq, sizes["BM"]), b * hq)
    _forward[grid](q, k, v, slopes if slopes is not None else lse, out, lse, sq, k.shape[1], hq, k.shape[2], offset,
                   scale, **sizes)
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, slopes: torch.Tensor | None, causal: bool, offset: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v (their dtypes) for ``dout`` (B, Sq, Hq, Dv), given the output and the
    log-sum-exp (B, Hq, Sq) of the whole row (all contiguous)."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    sizes = _sizes(q, v, causal, slopes is not None)
    delta = q.new_empty(b, hq, sq, dtype=torch.float32)  # (B, Hq, Sq): each row's dout . out
    _row_dots[(triton.cdiv(sq, sizes["BM"]), b * hq)](out, dout, delta, sq, hq, DV=sizes["DV"], BDV=sizes["BDV"],
                                                       BM=sizes["BM"])
    lse = lse.float().contiguous()
    slope_arg = slopes if slopes is not None else lse
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _backward_kv[(triton.cdiv(sk, sizes["BN"]), b * hk)](q, k, v, slope_arg, dout, lse, delta, dk, dv, sq, sk, hq, hk,
                                                          offset, scale, **sizes)
    _backward_q[(triton.cdiv(sq, sizes["BM"]), b * hq)](q, k, v, slope_arg, dout, lse, delta, dq, sq, sk, hq, hk,
                                                         offset, scale, **sizes)
    return dq, dk, dv
