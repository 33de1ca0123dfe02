"""``triton_flash``: seqmesh's Triton flash attention (:mod:`.flash_triton`) behind the kernel signature, on CUDA.

It takes what torch's fused CUDA ops refuse and the math kernel would compute with a whole ``(rows, keys)`` score
block per call: ALiBi (BLOOM, MPT: the bias by distance on every ring block, the log-sum-exp including it) and a
causal block whose diagonal is not its top-left corner. Not a soft-cap nor a sliding window (the fused ops and
:mod:`.windows` take those). Packed documents run one call per document (each a square causal block, offset 0).

Before its first call on a device the kernel runs once on a few tokens, forward and backward, held to the math
kernel (:data:`PROBE`): a Triton that fails or answers otherwise on this GPU leaves it refused there, with one
warning, and ``auto`` takes the math kernel as before. Under fake tensors (``seqmesh rehearse``) it launches
nothing and returns its outputs' storage, so a rehearsal counts what the GPU's run holds.
"""

from __future__ import annotations

import torch

from .base import AttentionKernel, BlockMask
from .probe import Kernel, KernelProbe
from .reference import MathKernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # the widest head a program's (64 or 32, head) tiles hold in registers


def _is_fake(x: torch.Tensor) -> bool:
    return torch._subclasses.fake_tensor.is_fake(x)


def _slopes(mask: BlockMask, device: torch.device) -> torch.Tensor | None:
    return None if mask.alibi is None else torch.tensor(mask.alibi, dtype=torch.float32, device=device)


def _documents(mask: BlockMask, length: int) -> list[tuple[int, int]]:
    bounds = mask.segments if mask.segments is not None else (0, length)
    return list(zip(bounds[:-1], bounds[1:]))


class TritonFlashKernel(AttentionKernel):
    name = "triton_flash"

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> str | None:
        if q.device.type != "cuda":
            return "seqmesh's Triton flash kernel runs on CUDA (on the CPU: the CPU flash op and the math kernel)"
        if q.dtype not in KERNEL_DTYPES:
            return f"seqmesh's Triton flash kernel takes bf16, fp16 and fp32, not {q.dtype}"
        if mask.softcap is not None or mask.window is not None:
            return "seqmesh's Triton flash kernel neither soft-caps scores nor takes a sliding window"
        widest = max(q.shape[-1], v.shape[-1] if v is not None else 0)
        if widest > MAX_HEAD_DIM:
            return f"seqmesh's Triton flash kernel takes heads up to {MAX_HEAD_DIM} wide, not {widest}"
        if not _is_fake(q) and not PROBE.works("triton_flash", q.device):
            return "seqmesh's Triton flash kernel is not installed (Triton) or failed its probe on this device"
        return None

    def forward(self, q, k, v, mask, scale):
        b, sq, hq, _ = q.shape
        if _is_fake(q):
            return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)
        from . import flash_triton

        slopes, parts = _slopes(mask, q.device), []
        for a, z in _documents(mask, sq):  # with segments: Sq == Sk and offset 0
            keys = slice(a, z) if mask.segments is not None else slice(None)
            parts.append(flash_triton.forward(q[:, a:z].contiguous(), k[:, keys].contiguous(),
                                              v[:, keys].contiguous(), slopes, mask.causal, mask.offset, scale))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if _is_fake(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        from . import flash_triton

        slopes, parts = _slopes(mask, q.device), []
        for a, z in _documents(mask, q.shape[1]):
            keys = slice(a, z) if mask.segments is not None else slice(None)
            parts.append(flash_triton.backward(
                dout[:, a:z].contiguous(), q[:, a:z].contiguous(), k[:, keys].contiguous(), v[:, keys].contiguous(),
                out[:, a:z].contiguous(), lse[:, :, a:z], slopes, mask.causal, mask.offset, scale))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))  # type: ignore[return-value]


def _loaded():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return TritonFlashKernel()


def _probe(kernel: TritonFlashKernel, device: torch.device, generator: torch.Generator) -> None:
    """bf16, 2 query heads on 1 kv head of 24, forward and backward, against the math kernel: a causal call with
    ALiBi (70 queries: a partial second tile) and a ring block 70 positions later; a kernel that runs but answers
    otherwise fails its probe too."""
    reference = MathKernel()
    q, k, v, dout = (torch.randn(1, 70, heads, 24, generator=generator, device=device).to(torch.bfloat16)
                     for heads in (2, 1, 1, 2))
    for mask in (BlockMask(causal=True, alibi=(0.5, 0.125)), BlockMask(offset=70, alibi=(0.5, 0.125))):
        got = kernel.forward(q, k, v, mask, 0.2)
        want = reference.forward(q, k, v, mask, 0.2)
        got += kernel.backward(dout, q, k, v, *want, mask, 0.2)
        want += reference.backward(dout, q, k, v, *want, mask, 0.2)
        for a, b in zip(got, want):
            error = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
            if not error < 0.05:
                raise RuntimeError(f"the kernel's results are {error:.3g} (relative) from the math kernel's")


PROBE = KernelProbe({"triton_flash": Kernel("triton", _loaded, _probe)})
