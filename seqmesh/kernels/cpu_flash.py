"""torch's CPU flash-attention op (``aten._scaled_dot_product_flash_attention_for_cpu``).

It handles grouped-query heads natively, returns the log-sum-exp, and has a backward op that takes
the output and log-sum-exp, so it serves ring attention directly. Packed documents run as one call
per document (:class:`PerDocumentKernel`) rather than through a dense (S, S) mask. A row with no
visible key would come back with lse = 0 rather than -inf; the block planner never produces one.

Sliding windows run as bands: query rows in chunks of a quarter window (128 at least), each against the keys
its rows' windows reach, with an additive mask of that band (memory ~ S x window, never S x S).
The op needs one head dim for q, k and v.
"""

from __future__ import annotations

import torch

from .base import SUPPORTED_DTYPES, BlockMask, PerDocumentKernel, lse_dtype


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D) view


MIN_BAND_ROWS = 128  # query rows per banded call at least, so short windows still make sizeable calls


def _bands(mask: BlockMask, sq: int, sk: int) -> list[tuple[int, int, int, int]]:
    """``(q0, q1, k0, k1)`` chunks of a windowed call: rows and the keys their window reaches."""
    rows = max(MIN_BAND_ROWS, (mask.window or 0) // 4)  # keys per band: rows + window, ~1.25x the pairs kept
    return [(a, min(sq, a + rows), *mask.key_span(a, min(sq, a + rows), sk)) for a in range(0, sq, rows)]


class CpuFlashKernel(PerDocumentKernel):
    name = "cpu_flash"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if q.device.type != "cpu":
            return f"tensors are on {q.device}, not the CPU"
        if q.dtype not in SUPPORTED_DTYPES:
            return f"dtype {q.dtype} is not one of {SUPPORTED_DTYPES}"
        if v is not None and v.shape[-1] != q.shape[-1]:
            return f"torch's CPU flash op needs one head dim for q, k and v (got {q.shape[-1]} and {v.shape[-1]})"
        return None

    def forward(self, q, k, v, mask, scale):
        if mask.window is None:
            return super().forward(q, k, v, mask, scale)
        out = q.new_zeros(q.shape)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        for a, b, k0, k1 in _bands(mask, q.shape[1], k.shape[1]):
            if k1 > k0:  # every row keeps its whole window, so no row of a band is empty
                bias = self._bias(mask, a, b, k0, k1, q)
                o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    _bhsd(q[:, a:b]), _bhsd(k[:, k0:k1]), _bhsd(v[:, k0:k1]), 0.0, False, attn_mask=bias, scale=scale
                )
                out[:, a:b], lse[:, :, a:b] = o.transpose(1, 2), l
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if mask.window is None:
            return super().backward(dout, q, k, v, out, lse, mask, scale)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)
        for a, b, k0, k1 in _bands(mask, q.shape[1], k.shape[1]):
            if k1 > k0:
                bias = self._bias(mask, a, b, k0, k1, q)
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    _bhsd(dout[:, a:b]), _bhsd(q[:, a:b]), _bhsd(k[:, k0:k1]), _bhsd(v[:, k0:k1]),
                    _bhsd(out[:, a:b]), lse[:, :, a:b].to(lse_dtype(q.dtype)).contiguous(), 0.0, False,
                    attn_mask=bias, scale=scale,
                )
                dq[:, a:b] = gq.transpose(1, 2)
                dk[:, k0:k1] += gk.transpose(1, 2)  # bands overlap in keys: sum in lse precision
                dv[:, k0:k1] += gv.transpose(1, 2)
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def _bias(mask: BlockMask, a: int, b: int, k0: int, k1: int, q: torch.Tensor) -> torch.Tensor:
        """Additive (b - a, k1 - k0) mask in q's dtype, as the op requires: 0 where allowed, -inf not."""
        allowed = mask.allowed_part(a, b, k0, k1, q.device)
        return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))

    def dense_forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse.to(lse_dtype(q.dtype))

    def dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.to(lse_dtype(q.dtype)).contiguous(), 0.0,
            causal, scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
