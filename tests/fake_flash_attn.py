"""A stand-in for the flash-attn package (2.7 API) on the CPU.

Its four entry points follow flash-attn's contract (layouts, the (H, total) lse of varlen calls,
gradients written into dq/dk/dv, grouped-query heads, one head dim for q, k and v) and are wrapped in
torch.library.custom_op as the real package wraps them, so seqmesh's wrapper can be exercised without
a GPU. The mask is built here from flash-attn's documented convention alone, never from seqmesh's
code: query i of a (seqlen_q, seqlen_k) call sees keys j with

    i + seqlen_k - seqlen_q - window_size[0]  <=  j  <=  i + seqlen_k - seqlen_q + window_size[1]

(a negative size leaves that side open), causal is the bottom-right aligned ``j <= i + seqlen_k -
seqlen_q``, and, as flash_api.cpp does before launching, a size >= seqlen_k becomes -1 and causal
sets the right size to 0. The arithmetic is plain float64 attention on that explicit mask.
"""

from __future__ import annotations

import torch


def documented_mask(sq: int, sk: int, causal: bool, left: int, right: int, clamp: int | None = None,
                    widen_open_side: bool = True) -> torch.Tensor:
    """(sq, sk) bool: which keys each query sees under flash-attn's causal flag and window sizes; sizes
    >= ``clamp`` (seqlen_k, or max_seqlen_k for varlen calls) are read as -1, and an open side beside a
    bounded one is read as ``clamp`` keys wide (flash-attn's ``set_params_fprop``; seen on an H100, where an
    open right side hid keys from the first rows of an Sq > Sk call); ``widen_open_side=False`` leaves it open."""
    clamp = sk if clamp is None else clamp
    if left >= clamp:
        left = -1
    if right >= clamp:
        right = -1
    if causal:
        right = 0
    # set_params_fprop: beside a bounded side, an open one becomes seqlen_k (max_seqlen_k for varlen calls) keys wide
    if widen_open_side and left < 0 <= right:
        left = clamp
    elif widen_open_side and right < 0 <= left:
        right = clamp
    i = torch.arange(sq)[:, None] + (sk - sq)  # each row's bottom-right aligned diagonal
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.double().repeat_interleave(heads // x.shape[2], dim=2)  # (B, S, Hk, D) -> (B, S, Hq, D)


def _capped(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """flash-attn's softcap (2.6+): the scaled scores as ``softcap * tanh(s / softcap)``; 0.0 leaves them."""
    return s if softcap == 0.0 else torch.tanh(s / softcap) * softcap


def _attend(q, k, v, scale, ok, softcap=0.0):
    """One call in float64: out (B, Sq, H, Dv) and lse (B, H, Sq) float32; a row seeing nothing gives
    out 0 and lse +inf, as flash-attn's softmax.h writes it."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2 checks v against q's head size"
    s = _capped(torch.einsum("bqhd,bkhd->bhqk", q.double(), _expand(k, q.shape[2])) * scale, softcap)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(posinf=0.0, neginf=0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.shape[2]))
    return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf")).float()


def _attend_backward(dout, q, k, v, out, lse, scale, ok, softcap=0.0):
    """Gradients from the given out and lse (as flash-attn's backward recomputes them), kv heads summed."""
    h, hk = q.shape[2], k.shape[2]
    s = _capped(torch.einsum("bqhd,bkhd->bhqk", q.double(), _expand(k, h)) * scale, softcap)
    p = torch.exp(s.masked_fill(~ok, float("-inf")) - lse.double()[..., None])  # (B, H, Sq, Sk)
    do = dout.double()
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]  # (B, H, Sq, 1)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, _expand(v, h))
    ds = p * (dp - delta)
    if softcap != 0.0:
        ds = ds * (1 - (s / softcap) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand(k, h)) * scale
    fold = lambda g: g.reshape(g.shape[0], g.shape[1], hk, h // hk, g.shape[3]).sum(3)  # noqa: E731
    dk = fold(torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale)
    dv = fold(torch.einsum("bhqk,bqhd->bkhd", p, do))
    return dq, dk, dv


@torch.library.custom_op("fake_flash_attn::fwd", mutates_args=())
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and alibi_slopes is None and not return_softmax
    ok = documented_mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    out, lse = _attend(q, k, v, softmax_scale, ok, softcap)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("fake_flash_attn::bwd", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                         dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                         window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                         deterministic: bool, rng_state: torch.Tensor | None = None) -> torch.Tensor:
    ok = documented_mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    for target, grad in zip((dq, dk, dv), _attend_backward(dout, q, k, v, out, softmax_lse, softmax_scale, ok, softcap)):
        target.copy_(grad)
    return softmax_lse.clone()


def _pairs(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """Each varlen sequence's (q0, q1, k0, k1)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return list(zip(bq[:-1], bq[1:], bk[:-1], bk[1:]))


@torch.library.custom_op("fake_flash_attn::varlen_fwd", mutates_args=())
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and alibi_slopes is None and not return_softmax
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)  # (H, total)
    for a, b, c, d in _pairs(cu_seqlens_q, cu_seqlens_k):
        # flash_api.cpp clamps the sizes against max_seqlen_k; each sequence aligns to its own corner
        ok = documented_mask(b - a, d - c, causal, window_size_left, window_size_right, max_seqlen_k)
        o, l = _attend(q[None, a:b], k[None, c:d], v[None, c:d], softmax_scale, ok, softcap)
        out[a:b], lse[:, a:b] = o[0], l[0]
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("fake_flash_attn::varlen_bwd", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                                dv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                                causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                                alibi_slopes: torch.Tensor | None, deterministic: bool,
                                rng_state: torch.Tensor | None = None) -> torch.Tensor:
    for a, b, c, d in _pairs(cu_seqlens_q, cu_seqlens_k):
        ok = documented_mask(b - a, d - c, causal, window_size_left, window_size_right, max_seqlen_k)
        lse = softmax_lse[:, a:b][None]  # (1, H, n)
        grads = _attend_backward(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b], lse,
                                 softmax_scale, ok, softcap)
        dq[a:b], dk[c:d], dv[c:d] = (g[0] for g in grads)
    return softmax_lse.clone()
