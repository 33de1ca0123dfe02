"""Local attention kernels behind one signature (see ``base.py``) and the choice among them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import CAUSAL, FULL, AttentionKernel, BlockMask, lse_dtype
from .cpu_flash import CpuFlashKernel
from .cuda import CudaCudnnKernel, CudaEfficientKernel, CudaFlashKernel
from .flash_attn import FlashAttnKernel
from .reference import MathKernel

KERNELS: dict[str, AttentionKernel] = {
    k.name: k
    for k in (FlashAttnKernel(), CudaFlashKernel(), CudaCudnnKernel(), CudaEfficientKernel(), CpuFlashKernel(), MathKernel())
}
# backend="auto" takes the first kernel in this order that supports a call.
AUTO_ORDER: tuple[str, ...] = ("flash_attn", "cuda_flash", "cuda_cudnn", "cuda_efficient", "cpu_flash", "math")
BACKENDS: tuple[str, ...] = ("auto", *AUTO_ORDER)

# choose(q, k, mask, v=None) -> kernel; v is passed where its head dim may differ from q's
ChooseKernel = Callable[..., AttentionKernel]


def kernel_chooser(backend: str = "auto") -> ChooseKernel:
    """A function ``(q, k, mask, v=None) -> kernel`` for ``backend``; it raises if a named backend cannot
    run a call, and ``"auto"`` falls through the kernels in :data:`AUTO_ORDER`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if backend == "auto":

        def choose_auto(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> AttentionKernel:
            for name in AUTO_ORDER:
                kernel = KERNELS[name]
                if kernel.unsupported(q, k, mask, v) is None:
                    return kernel
            raise ValueError(f"no attention kernel supports q {tuple(q.shape)} {q.dtype} on {q.device}.")

        return choose_auto

    kernel = KERNELS[backend]

    def choose_named(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, v: torch.Tensor | None = None) -> AttentionKernel:
        reason = kernel.unsupported(q, k, mask, v)
        if reason is not None:
            raise ValueError(f"attention backend {backend!r} cannot run this call: {reason}. Use backend='auto'.")
        return kernel

    return choose_named


__all__ = [
    "AttentionKernel", "BlockMask", "CAUSAL", "FULL", "KERNELS", "AUTO_ORDER", "BACKENDS",
    "kernel_chooser", "lse_dtype",
]
