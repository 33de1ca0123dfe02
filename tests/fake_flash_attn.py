"""A stand-in for the flash-attn package (2.7 API) on the CPU.

Its four entry points follow flash-attn's contract (layouts, the (H, total) lse of varlen calls,
gradients written into dq/dk/dv, grouped-query heads) and are wrapped in torch.library.custom_op as
the real package wraps them, so seqmesh's wrapper can be exercised without a GPU. The arithmetic is
seqmesh's math kernel (tested against float64 attention elsewhere); what is under test here is the
wrapper's plumbing."""

from __future__ import annotations

import torch

from seqmesh.kernels.base import BlockMask
from seqmesh.kernels.math import MathKernel

_MATH = MathKernel()


def _dense(q, k, v, causal, scale):
    out, lse = _MATH.forward(q, k, v, BlockMask(causal=causal), scale)
    return out, lse.float()


@torch.library.custom_op("fake_flash_attn::fwd", mutates_args=())
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and window_size_left == -1 and softcap == 0.0 and not return_softmax
    out, lse = _dense(q, k, v, causal, softmax_scale)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("fake_flash_attn::bwd", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                         dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
                         window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                         deterministic: bool, rng_state: torch.Tensor | None = None) -> torch.Tensor:
    grads = _MATH.backward(dout, q, k, v, out, softmax_lse, BlockMask(causal=causal), softmax_scale)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    return softmax_lse.clone()


def _segments(cu: torch.Tensor):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


@torch.library.custom_op("fake_flash_attn::varlen_fwd", mutates_args=())
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)  # (H, total)
    for a, b in _segments(cu_seqlens_q):
        o, l = _dense(q[None, a:b], k[None, a:b], v[None, a:b], causal, softmax_scale)
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
    for a, b in _segments(cu_seqlens_q):
        one = lambda t: t[None, a:b]  # noqa: E731
        lse = softmax_lse[:, a:b][None]  # (1, H, n)
        grads = _MATH.backward(one(dout), one(q), one(k), one(v), one(out), lse, BlockMask(causal=causal), softmax_scale)
        dq[a:b], dk[a:b], dv[a:b] = (g[0] for g in grads)
    return softmax_lse.clone()
