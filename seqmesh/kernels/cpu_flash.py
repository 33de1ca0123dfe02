"""torch's CPU flash-attention op (``aten._scaled_dot_product_flash_attention_for_cpu``).

It handles grouped-query heads natively, returns the log-sum-exp, and has a backward op that takes
the output and log-sum-exp, so it serves ring attention directly. Packed documents run as one call
per document (:class:`PerDocumentKernel`) rather than through a dense (S, S) mask. A row with no
visible key would come back with lse = 0 rather than -inf; the block planner never produces one.

Sliding windows run as bands: query rows in chunks of a quarter window (128 at least), each against the keys
its rows' windows reach, with an additive mask of that band (memory ~ S x window, never S x S; ``windows.py``).

The op needs one head dim for q, k and v; MLA's two (DeepSeek's q/k 192, v 128) are padded to one, exactly
(``base.PadsHeadDims``). Before, such a call fell to the math kernel, which holds the (S, S) scores: DeepSeek-V3's
shape at 4,096 tokens took 28 times the dense Llama's step of the same width on the CPU (``seqmesh bench families``).
"""

from __future__ import annotations

import torch

from .base import HALF_DTYPES, SUPPORTED_DTYPES, BlockMask, PadsHeadDims, alibi_problem, lse_dtype
from .windows import BandedWindowKernel


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D) view


class CpuFlashKernel(PadsHeadDims, BandedWindowKernel):
    name = "cpu_flash"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if q.device.type != "cpu":
            return f"tensors are on {q.device}, not the CPU"
        if q.dtype not in SUPPORTED_DTYPES:
            return f"dtype {q.dtype} is not one of {SUPPORTED_DTYPES}"
        if mask.softcap is not None:
            return "torch's CPU flash op does not soft-cap scores"
        if mask.alibi is not None and q.dtype in HALF_DTYPES:  # its bias is in q's dtype: slope x distance rounded
            return alibi_problem(mask, f"torch's CPU flash op in {q.dtype}")
        return None

    def biased_forward(self, q, k, v, bias, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, False, attn_mask=bias, scale=scale
        )
        return out.transpose(1, 2), lse.to(lse_dtype(q.dtype))

    def biased_backward(self, dout, q, k, v, out, lse, bias, scale):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.to(lse_dtype(q.dtype)).contiguous(), 0.0,
            False, attn_mask=bias, scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

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
