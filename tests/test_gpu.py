"""CUDA kernels against float64 attention. Skipped on machines without a CUDA device; run them on a
GPU with `make test` (or `pytest tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from reference import reference_attention
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.tools.emulate import emulate_ring
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.kernels import KERNELS, kernel_chooser
from seqmesh.kernels.base import BlockMask
from seqmesh.layout import SequenceLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_KERNELS = ["cuda_flash", "cuda_efficient", "cuda_cudnn", "flash_attn"]


@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("mask", [BlockMask(causal=True), BlockMask(), BlockMask(causal=True, segments=(0, 1, 100, 101, 256))],
                         ids=["causal", "full", "documents"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_cuda_kernel_matches_float64(name, mask, heads):
    torch.manual_seed(0)
    q = torch.randn(2, 256, heads[0], 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 256, heads[1], 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    kernel = KERNELS[name]
    reason = kernel.unsupported(q, k, mask)
    if reason:
        pytest.skip(reason)
    out, lse = kernel.forward(q, k, v, mask, 0.125)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, 0.125)
    cu = list(mask.segments) if mask.segments else None
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr.cpu(), kr.cpu(), vr.cpu(), causal=mask.causal, cu_seqlens=cu, scale=0.125)
    ref.backward(dout.double().cpu())
    # bf16 inputs: compare with the float64 result within bf16 resolution of unit-scale values
    for got, want in ((out, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape
        err = (got.double().cpu() - want.cpu()).abs().max().item()
        assert err < 0.05, (name, err)
    ref_lse = torch.logsumexp(
        torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(heads[0] // heads[1], 2)) * 0.125
        + torch.where(mask.allowed(256, 256, "cuda"), 0.0, float("-inf")).double(), dim=-1)
    assert (lse.double() - ref_lse).abs().max().item() < 0.02


@pytest.mark.parametrize("backend", ["auto", "cuda_flash", "cuda_efficient", "cuda_cudnn"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_on_gpu(causal, backend):
    """The emulated ring (planner + merge + kernels on sliced blocks with the merged lse) on the GPU
    stays at bf16 kernel accuracy, with packed documents (varlen or one call per document)."""
    torch.manual_seed(0)
    probe = torch.empty(1, 8, 8, 64, device="cuda", dtype=torch.bfloat16)
    if backend != "auto" and (reason := KERNELS[backend].unsupported(probe, probe, BlockMask(causal=causal))):
        pytest.skip(reason)
    cu = [0, 1, 300, 1024]
    layout = SequenceLayout.for_length("zigzag", 4, 1, 1024)
    q = torch.randn(1, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    schedule = RingSchedule(layout, document_bounds(1024, 1024, cu), causal)
    out, dq, dk, dv = emulate_ring(q, k, v, dout, schedule, kernel_chooser(backend), 0.125)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, cu_seqlens=cu, scale=0.125)
    ref.backward(dout.double())
    for got, want in ((out, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - want).abs().max().item() < 0.05
