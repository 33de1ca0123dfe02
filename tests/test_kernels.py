"""Local kernels, the block planner and the LSE merge, in one process, against float64 attention."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import reference_attention
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.tools.emulate import emulate_ring
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.kernels import KERNELS, kernel_chooser
from seqmesh.kernels.base import BlockMask
from seqmesh.layout import SequenceLayout


def _reference_lse(q, k, causal, cu, scale):
    b, s, h, d = q.shape
    kf = k.double().repeat_interleave(h // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf) * scale
    docs = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b_ - a for a, b_ in zip(cu[:-1], cu[1:])]))
    ok = docs[:, None] == docs[None, :]
    if causal:
        ok &= torch.ones(s, s, dtype=torch.bool).tril()
    return torch.logsumexp(scores.masked_fill(~ok, float("-inf")), dim=-1)


@pytest.mark.parametrize("name,dtype,tol", [("math", torch.float64, 1e-12), ("cpu_flash", torch.float64, 1e-12),
                                            ("cpu_flash", torch.float32, 2e-6), ("math", torch.float32, 2e-6)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [None, (0, 1, 6, 7, 19)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_kernel_matches_reference(name, dtype, tol, causal, segments, heads):
    torch.manual_seed(0)
    s, d = 19, 16
    q = torch.randn(2, s, heads[0], d, dtype=dtype)
    k, v = (torch.randn(2, s, heads[1], d, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    kernel, mask, scale = KERNELS[name], BlockMask(causal=causal, segments=segments), 0.3
    out, lse = kernel.forward(q, k, v, mask, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, scale)

    cu = list(segments) if segments else [0, s]
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, cu_seqlens=cu, scale=scale)
    ref.backward(dout.double())
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(lse.double(), _reference_lse(q, k, causal, cu, scale), atol=tol * 10, rtol=0)
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want.detach(), atol=tol * 10, rtol=0)


@pytest.mark.parametrize("ring,kind,causal,cu", [
    (r, kind, causal, cu)
    for r, kind, causal, cu in itertools.product(
        (2, 3, 8), ("zigzag", "contiguous"), (True, False), (None, (0, 1, 2, 30, 31, 77, 95))
    )
])
def test_ring_blocks_on_one_device(ring, kind, causal, cu):
    """Every ring rank's kernel calls and merges, emulated on one device, give exact attention:
    the block planner, the LSE merge and the kernels' backward with a merged output and lse."""
    torch.manual_seed(1)
    seq_len = 95
    layout = SequenceLayout.for_length(kind, ring, 1, seq_len)
    n = layout.padded_len
    q = torch.randn(1, n, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    dout[:, (cu[-1] if cu else seq_len):] = 0  # padding carries no gradient
    schedule = RingSchedule(layout, document_bounds(n, seq_len, cu), causal)
    out, dq, dk, dv = emulate_ring(q, k, v, dout, schedule, kernel_chooser("auto"), 8**-0.5)

    real = cu[-1] if cu else seq_len
    qr, kr, vr = (t[:, :real].clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, cu_seqlens=list(cu) if cu else None)
    ref.backward(dout[:, :real])
    for got, want in ((out, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got[:, :real], want, atol=1e-12, rtol=0)


def test_cuda_wrappers_shapes_on_meta():
    """The CUDA wrappers' reshapes agree with torch's own shape rules for those ops (meta tensors):
    out (B, S, H, D), lse (B, H, S) float32, dk/dv with the kv heads, dense and varlen."""
    q = torch.empty(2, 48, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 48, 2, 64, device="meta", dtype=torch.bfloat16)
    documents = BlockMask(causal=True, segments=(0, 5, 20, 48))  # varlen (flash) or one call per document
    for name, masks in (("cuda_flash", [BlockMask(causal=True), documents]),
                        ("cuda_cudnn", [BlockMask(causal=True), BlockMask(), documents])):
        for mask in masks:
            out, lse = KERNELS[name].forward(q, k, k, mask, 0.125)
            assert out.shape == q.shape and lse.shape == (2, 8, 48) and lse.dtype == torch.float32
            dq, dk, dv = KERNELS[name].backward(out, q, k, k, out, lse, mask, 0.125)
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    for mask in (BlockMask(causal=True), documents):
        out, lse = KERNELS["cuda_efficient"].forward(q, k, k, mask, 0.125)
        assert out.shape == q.shape and lse.shape == (2, 8, 48)


def test_auto_backend_on_cpu_and_named_errors():
    q = torch.randn(1, 4, 2, 8)
    assert kernel_chooser("auto")(q, q, BlockMask(causal=True)).name == "cpu_flash"
    with pytest.raises(ValueError, match="cuda_flash.*not a CUDA device"):
        kernel_chooser("cuda_flash")(q, q, BlockMask())
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        kernel_chooser("fast")


@pytest.mark.parametrize("mask", [BlockMask(causal=True), BlockMask(), BlockMask(causal=True, segments=(0, 1, 7, 19))],
                         ids=["causal", "full", "documents"])
def test_flash_attn_wrapper_against_a_stub_package(monkeypatch, mask):
    """seqmesh's flash-attn wrapper drives a stand-in package with flash-attn 2.7's entry points (as
    torch custom ops, like the real package): layouts, the varlen (H, total) lse, in-place gradients."""
    import sys
    import types

    import fake_flash_attn
    import seqmesh.kernels.flash_attn as wrapper

    package = types.ModuleType("flash_attn")
    package.__version__ = "2.7.4"
    package.flash_attn_interface = fake_flash_attn
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fake_flash_attn)
    wrapper._interface.cache_clear()
    try:
        torch.manual_seed(0)
        q = torch.randn(2, 19, 4, 8, dtype=torch.float64)
        k, v = (torch.randn(2, 19, 2, 8, dtype=torch.float64) for _ in range(2))
        dout = torch.randn_like(q)
        kernel = KERNELS["flash_attn"]
        out, lse = kernel.forward(q, k, v, mask, 0.3)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, mask, 0.3)
        got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        want_out, want_lse = KERNELS["math"].forward(q, k, v, mask, 0.3)
        want = dict(zip(("dq", "dk", "dv"), KERNELS["math"].backward(dout, q, k, v, want_out, want_lse, mask, 0.3)))
        want.update(out=want_out, lse=want_lse)
        for name in got:
            assert got[name].shape == want[name].shape, name
            torch.testing.assert_close(got[name].double(), want[name].double(), atol=1e-5, rtol=0, msg=name)
    finally:
        wrapper._interface.cache_clear()
