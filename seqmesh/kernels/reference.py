"""Plain matrix-product attention with an explicit backward: any device, any float dtype, any mask.

It materialises the (Sq, Sk) score matrix, so it is the reference and the fallback, not the fast
path. Computation runs in float32 (float64 for float64 inputs). A query with no visible key gets a
zero output and ``lse = -inf`` and contributes nothing to a merge.
"""

from __future__ import annotations

import torch

from .base import AttentionKernel, BlockMask, lse_dtype
from .gqa import expand_kv_heads, fold_kv_heads


class MathKernel(AttentionKernel):
    name = "math"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        return None if q.is_floating_point() else f"dtype {q.dtype} is not a float type"

    def _scores(self, q, k, mask: BlockMask, scale: float):
        """Upcast q, k (kv heads expanded) and the masked scaled scores (B, Hq, Sq, Sk), soft-capped where the
        mask says so."""
        ct = lse_dtype(q.dtype)
        qf = q.transpose(1, 2).to(ct)  # (B, Hq, Sq, D)
        kf = expand_kv_heads(k.transpose(1, 2).to(ct), q.shape[2], dim=1)  # (B, Hq, Sk, D)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if mask.softcap is not None:
            scores = torch.tanh(scores / mask.softcap) * mask.softcap
        if mask.alibi is not None:  # a constant per (head, row, key): the backward is unchanged
            scores = scores + mask.distance_bias(q.shape[1], k.shape[1], ct, q.device)
        allowed = mask.allowed(q.shape[1], k.shape[1], q.device)
        return qf, kf, scores.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # rows that see nothing
        return torch.exp(scores - safe.unsqueeze(-1))  # exp(-inf) = 0 on masked entries

    def forward(self, q, k, v, mask, scale):
        _, _, scores = self._scores(q, k, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, Sq); -inf where nothing is visible
        probs = self._probs(scores, lse)
        vf = expand_kv_heads(v.transpose(1, 2).to(probs.dtype), q.shape[2], dim=1)
        out = torch.matmul(probs, vf)  # (B, Hq, Sq, Dv)
        return out.transpose(1, 2).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        qf, kf, scores = self._scores(q, k, mask, scale)
        ct = qf.dtype
        probs = self._probs(scores, lse.to(ct))  # with the lse given, which may be a merged one
        vf = expand_kv_heads(v.transpose(1, 2).to(ct), q.shape[2], dim=1)
        do = dout.transpose(1, 2).to(ct)
        delta = (do * out.transpose(1, 2).to(ct)).sum(-1, keepdim=True)  # (B, Hq, Sq, 1)
        dv = torch.matmul(probs.transpose(-1, -2), do)
        ds = probs * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
        if mask.softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh^2; masked entries have ds = 0 already
            if mask.alibi is not None:  # the capped scores, without the bias added after the cap
                scores = scores - mask.distance_bias(q.shape[1], k.shape[1], ct, q.device)
            capped = torch.nan_to_num(scores / mask.softcap, neginf=0.0)
            ds = ds * (1 - capped * capped)
        dq = torch.matmul(ds, kf) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
        hk = k.shape[2]
        return (
            dq.transpose(1, 2).to(q.dtype),
            fold_kv_heads(dk, hk, dim=1).transpose(1, 2).to(k.dtype),
            fold_kv_heads(dv, hk, dim=1).transpose(1, 2).to(v.dtype),
        )
