"""torch's CUDA attention ops: flash (FA2), memory-efficient (cutlass) and cuDNN.

Conventions these wrappers rely on (torch 2.9 - 2.13 source):

- ``_flash_attention_forward`` takes (B, S, H, D) dense or (T, H, D) with int32 ``cu_seqlens``
  (varlen), supports grouped-query heads, returns lse (B, H, S) dense and (H, T) varlen, float32.
  Its backward chooses varlen when ``cum_seq_q`` is a tensor, so dense calls pass ``None``.
  Causal is bottom-right aligned; ``window_size_left/right`` follow FA2's convention, which
  :func:`~seqmesh.kernels.windows.flash_window` translates the mask into (or refuses; calls it reads
  differently run split by rows, :class:`~seqmesh.kernels.windows.RowSplitFa2`). One head dim
  for q, k and v (FA2 checks v against q's head size): MLA's two are padded to one
  (:class:`~seqmesh.kernels.base.PadsHeadDims`).
- ``_efficient_attention_forward`` takes (B, S, H, D), needs Hq == Hk, and pads lse to
  (B, H, ceil32(S)); its backward reads that padded shape (padding +inf). Its custom mask type 1 is
  causal top-left. It takes an additive ``bias`` of shape (B, H, Sq, Sk) in q's dtype with a
  contiguous last dim and a row stride aligned for the kernel (batch and head strides may be 0:
  an expanded (Sq, Sk) bias). Windows run as row bands with that bias (``windows.py``). v may
  have its own head dim (torch's sdpa dispatch checks only q's against k's; both aligned).
- ``_scaled_dot_product_cudnn_attention`` takes (B, H, S, D) and returns lse (B, H, S, 1).
- The efficient and cuDNN ops take no document boundaries here: packed documents run one call per
  document (``PerDocumentKernel``); the flash op takes them natively (varlen).

All backward ops use ``out`` only for rowsum(dout * out) and recompute probabilities from the lse
they are given, so the merged output and lse of ring attention give exact block gradients.
"""

from __future__ import annotations

import functools

import torch

from .base import HALF_DTYPES, AttentionKernel, BlockMask, PadsHeadDims, PerDocumentKernel, alibi_problem
from .gqa import expand_kv_heads, fold_kv_heads
from .windows import BandedWindowKernel, RowSplitFa2, fa2_arguments, fa2_row_splits


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def cuda_problem(
    q: torch.Tensor, dtypes: tuple[torch.dtype, ...], max_dim: int, align: int, v: torch.Tensor | None = None,
    one_head_dim: bool = True,
) -> str | None:
    """Why a fused CUDA kernel cannot run a call for its device, dtype or head dims, or None. With
    ``one_head_dim`` it needs v's head dim equal to q's; either way both obey ``max_dim`` and ``align``.
    Masks are each kernel's own check."""
    dims = (q.shape[-1],) if v is None else (q.shape[-1], v.shape[-1])
    if one_head_dim and len(set(dims)) > 1:
        return f"it needs one head dim for q, k and v (got {dims[0]} and {dims[1]})"
    if q.device.type != "cuda":
        return f"tensors are on {q.device}, not a CUDA device"
    if q.dtype not in dtypes:
        return f"dtype {q.dtype} is not one of {dtypes}"
    for d in dims:
        if d > max_dim or d % align:
            return f"head dim {d} must be a multiple of {align} and at most {max_dim}"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs an sm80 (Ampere) or newer GPU"
    return None


def square_causal_problem(mask: BlockMask, sq: int, sk: int) -> str | None:
    """Why a kernel with only a top-left causal flag (and no window) cannot run ``mask``, or None."""
    if mask.window is not None:
        return "this op takes no sliding window"
    if mask.causal and (mask.offset != 0 or sq != sk):
        return f"its causal flag is the square diagonal (got Sq={sq}, Sk={sk}, offset {mask.offset})"
    return None


@functools.lru_cache(maxsize=256)  # the same boundaries recur in every layer and in backward
def varlen_args(segments: tuple[int, ...], batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """For a (B*S)-token varlen call: int32 boundaries of every batch row's segments, and the longest."""
    one = torch.tensor(segments, dtype=torch.int32)
    rows = [one[:-1] + b * length for b in range(batch)] + [torch.tensor([batch * length], dtype=torch.int32)]
    longest = max(y - x for x, y in zip(segments[:-1], segments[1:]))
    return torch.cat(rows).to(device, non_blocking=True), longest


def _no_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the dropout RNG state, which the kernels never read with dropout 0."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, dtype=torch.uint64, device=device)


class CudaFlashKernel(PadsHeadDims, RowSplitFa2, AttentionKernel):
    """FA2 as vendored in torch: fp16/bf16, one head dim <= 256 for q, k and v (MLA's two padded to one, exactly:
    ``PadsHeadDims``), grouped-query heads, varlen documents, sliding windows as FA2 window sizes (split by rows
    where FA2 reads them differently)."""

    name = "cuda_flash"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if q.device.type == "cuda" and not torch.backends.cuda.is_flash_attention_available():
            return "this torch build has no flash attention"
        if not torch.backends.cuda.flash_sdp_enabled():
            return "flash attention is disabled (torch.backends.cuda.enable_flash_sdp)"
        if mask.softcap is not None:
            return "torch's FA2 op does not soft-cap scores (the flash-attn package does)"
        if reason := alibi_problem(mask, "torch's FA2 op"):
            return reason
        splits = fa2_row_splits(mask, q.shape[1], k.shape[1])
        return splits if isinstance(splits, str) else cuda_problem(q, HALF_DTYPES, 256, 8, v, one_head_dim=False)

    def call_forward(self, q, k, v, mask, scale):
        b, sq, h, d = q.shape
        sk = k.shape[1]
        causal, left, right = fa2_arguments(mask, sq, sk)
        window = {"window_size_left": left, "window_size_right": right}
        if mask.segments is None:
            out, lse, *_ = torch.ops.aten._flash_attention_forward(
                _last_contiguous(q), _last_contiguous(k), _last_contiguous(v), None, None, sq, sk, 0.0,
                causal, False, scale=scale, **window,
            )
            return out, lse  # (B, Sq, H, D), (B, H, Sq)
        cu, longest = varlen_args(mask.segments, b, sq, q.device)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q.reshape(b * sq, h, d), k.reshape(b * sk, k.shape[2], d), v.reshape(b * sk, v.shape[2], d),
            cu, cu, longest, longest, 0.0, causal, False, scale=scale, **window,
        )
        return out.view(b, sq, h, d), lse.view(h, b, sq).permute(1, 0, 2)  # lse (H, B*S) -> (B, H, S)

    def call_backward(self, dout, q, k, v, out, lse, mask, scale):
        b, sq, h, d = q.shape
        sk = k.shape[1]
        causal, left, right = fa2_arguments(mask, sq, sk)
        window = {"window_size_left": left, "window_size_right": right}
        rng, unused = _no_rng(q.device)
        if mask.segments is None:
            return torch.ops.aten._flash_attention_backward(
                _last_contiguous(dout), _last_contiguous(q), _last_contiguous(k), _last_contiguous(v),
                _last_contiguous(out), lse.float().contiguous(), None, None, sq, sk, 0.0, causal, rng, unused,
                scale=scale, **window,
            )
        cu, longest = varlen_args(mask.segments, b, sq, q.device)
        hk = k.shape[2]
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.reshape(b * sq, h, d), q.reshape(b * sq, h, d), k.reshape(b * sk, hk, d), v.reshape(b * sk, hk, d),
            out.reshape(b * sq, h, d), lse.float().permute(1, 0, 2).reshape(h, b * sq).contiguous(),
            cu, cu, longest, longest, 0.0, causal, rng, unused, scale=scale, **window,
        )
        return dq.view(b, sq, h, d), dk.view(b, sk, hk, d), dv.view(b, sk, hk, d)


class CudaEfficientKernel(BandedWindowKernel):
    """cutlass memory-efficient attention: fp32/fp16/bf16, v's head dim free; kv heads are expanded for
    grouped queries; packed documents run one call per document; windows as row bands with a bias."""

    name = "cuda_efficient"
    bias_align = 16  # elements: what torch's sdpa pads its masks to for this kernel (any dtype's alignment)

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if not torch.backends.cuda.mem_efficient_sdp_enabled():
            return "memory-efficient attention is disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
        if mask.softcap is not None:
            return "torch's memory-efficient attention does not soft-cap scores"
        if reason := alibi_problem(mask, "seqmesh's call of torch's memory-efficient attention"):
            return reason
        if mask.window is None and (reason := square_causal_problem(mask, q.shape[1], k.shape[1])):
            return reason
        align = 4 if q.dtype == torch.float32 else 8
        return cuda_problem(q, (torch.float32, *HALF_DTYPES), 512, align, v, one_head_dim=False)

    def _forward(self, q, k, v, bias, causal, scale):
        b, sq, h, _ = q.shape
        if bias is not None:
            bias = bias.expand(b, h, sq, k.shape[1])  # (rows, keys) -> (B, H, rows, keys), strides 0
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            _last_contiguous(q), _last_contiguous(expand_kv_heads(k, h)), _last_contiguous(expand_kv_heads(v, h)),
            bias, None, None, None, None, 0.0, int(causal), True, scale=scale,  # custom mask type 1: causal, top-left
        )
        return out, lse[:, :, :sq]  # (B, Sq, H, Dv), (B, H, Sq)

    def _backward(self, dout, q, k, v, out, lse, bias, causal, scale):
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        if bias is not None:
            bias = bias.expand(b, h, sq, sk)
        padded = torch.full((b, h, -(-sq // 32) * 32), float("inf"), dtype=torch.float32, device=q.device)
        padded[:, :, :sq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout.contiguous(), _last_contiguous(q), _last_contiguous(expand_kv_heads(k, h)),
            _last_contiguous(expand_kv_heads(v, h)), bias, out.to(q.dtype).contiguous(), None, None, sq, sk, padded,
            0.0, seed, seed, int(causal), False, scale=scale,
        )
        return dq, fold_kv_heads(dk, k.shape[2]), fold_kv_heads(dv, k.shape[2])

    def dense_forward(self, q, k, v, causal, scale):
        return self._forward(q, k, v, None, causal, scale)

    def dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        return self._backward(dout, q, k, v, out, lse, None, causal, scale)

    def biased_forward(self, q, k, v, bias, scale):
        return self._forward(q, k, v, bias, False, scale)

    def biased_backward(self, dout, q, k, v, out, lse, bias, scale):
        return self._backward(dout, q, k, v, out, lse, bias, False, scale)


class CudaCudnnKernel(PerDocumentKernel):
    """cuDNN fused attention: fp16/bf16, one head dim <= 128; kv heads are expanded for grouped queries;
    packed documents run one call per document (a one-token document, which cuDNN refuses, in plain ops).
    No windows: ``auto`` passes them to the next kernel."""

    name = "cuda_cudnn"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if mask.softcap is not None:  # first: whatever the machine, the call itself is out of reach
            return "torch's cuDNN attention does not soft-cap scores"
        if reason := alibi_problem(mask, "torch's cuDNN attention"):
            return reason
        if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
            return "cuDNN 9 or newer is not available"
        if not torch.backends.cuda.cudnn_sdp_enabled():
            return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp)"
        return square_causal_problem(mask, q.shape[1], k.shape[1]) or cuda_problem(q, HALF_DTYPES, 128, 8, v)

    def dense_forward(self, q, k, v, causal, scale):
        h = q.shape[2]
        if q.shape[1] == k.shape[1] == 1:  # cuDNN refuses s_q = s_kv = 1 (a one-token document): one key, softmax 1
            lse = (q.float() * expand_kv_heads(k, h).float()).sum(-1).transpose(1, 2) * scale  # (B, H, 1)
            return expand_kv_heads(v, h).to(q.dtype), lse
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), expand_kv_heads(k, h).transpose(1, 2), expand_kv_heads(v, h).transpose(1, 2),
            None, True, 0.0, causal, False, scale=scale,
        )
        return out.transpose(1, 2), lse.view(lse.shape[0], lse.shape[1], lse.shape[2])  # (B, H, S, 1) -> (B, H, S)

    def dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        h = q.shape[2]
        if q.shape[1] == k.shape[1] == 1:  # out = v whatever q and k are
            return torch.zeros_like(q), torch.zeros_like(k), fold_kv_heads(dout.float(), k.shape[2]).to(v.dtype)
        ke, ve = expand_kv_heads(k, h), expand_kv_heads(v, h)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
            out.transpose(1, 2), lse.float().unsqueeze(-1).contiguous(), seed, seed, None, None, None,
            q.shape[1], k.shape[1], 0.0, causal, scale=scale,
        )
        return dq.transpose(1, 2), fold_kv_heads(dk.transpose(1, 2), k.shape[2]), fold_kv_heads(dv.transpose(1, 2), k.shape[2])
