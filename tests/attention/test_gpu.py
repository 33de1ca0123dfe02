"""CUDA kernels against float64 attention. Skipped on machines without a CUDA device; run them on a
GPU with `make test` (or `pytest tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from reference import explicit_mask, reference_attention
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.bench.emulate import emulate_ring
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.kernels import KERNELS, kernel_chooser
from seqmesh.kernels.base import BlockMask
from seqmesh.sequence.layout import SequenceLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_KERNELS = ["cuda_flash", "cuda_efficient", "cuda_cudnn", "flash_attn", "triton_flash"]


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


@pytest.mark.parametrize("backend", ["auto", "cuda_flash", "cuda_efficient", "cuda_cudnn", "triton_flash"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 100)], ids=["causal", "full", "window"])
def test_ring_blocks_on_gpu(causal, window, backend):
    """The emulated ring (planner + merge + kernels on sliced blocks with the merged lse) on the GPU
    stays at bf16 kernel accuracy, with packed documents (varlen or one call per document) and a
    window (the planner's trimmed blocks with offsets)."""
    torch.manual_seed(0)
    probe = torch.empty(1, 8, 8, 64, device="cuda", dtype=torch.bfloat16)
    probe_mask = BlockMask(causal=causal, window=window)
    if backend != "auto" and (reason := KERNELS[backend].unsupported(probe, probe, probe_mask)):
        pytest.skip(reason)
    cu = [0, 1, 300, 1024]
    layout = SequenceLayout.for_length("zigzag", 4, 1, 1024)
    q = torch.randn(1, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    schedule = RingSchedule(layout, document_bounds(1024, 1024, cu), causal, window)
    out, dq, dk, dv = emulate_ring(q, k, v, dout, schedule, kernel_chooser(backend), 0.125)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal, cu_seqlens=cu, scale=0.125, window=window)
    ref.backward(dout.double())
    for got, want in ((out, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - want).abs().max().item() < 0.05


def _plain_attention(q, k, v, dout, ok, scale, dtype):
    """Attention on the explicit (Sq, Sk) mask with plain ops in ``dtype`` (no upcast), by autograd:
    out, lse, dq, dk, dv. In float64 it is the truth; in the inputs' dtype, its distance from the
    truth is the rounding noise a kernel is allowed (a small multiple of)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(group, 2))
    out.backward(dout.to(dtype))
    return out.detach(), torch.logsumexp(s.detach(), -1), q.grad, k.grad, v.grad


# (mask, Sq, Sk): a window on the diagonal, with documents, and the ring's trimmed blocks of earlier
# keys (offset = distance between the first query and the first key; Sq < Sk and Sq > Sk)
WINDOW_CASES = {
    "window": (BlockMask(causal=True, window=100), 512, 512),
    "window+documents": (BlockMask(causal=True, window=64, segments=(0, 1, 200, 201, 512)), 512, 512),
    "offset,sq<sk": (BlockMask(causal=True, window=300, offset=400), 256, 384),
    "offset,sq>sk": (BlockMask(causal=True, window=400, offset=256), 384, 256),
}


@pytest.mark.parametrize("name", ["cuda_flash", "cuda_efficient", "flash_attn"])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dv", [64, 32], ids=["dv=dk", "dv<dk"])
def test_cuda_kernel_windows_and_value_head_dims(name, case, dtype, dv):
    """Windowed calls (offsets included) and a v head dim unlike q's on the CUDA kernels, forward and
    backward with grouped-query heads, against float64 attention on the explicit mask, within 4x the
    rounding noise of the same attention in the inputs' dtype (cutlass runs a window as row bands and
    rounds a key's dk/dv once per band it falls in; torch's banded CPU op measures up to ~3.1x here).
    FA2 kernels must refuse dv != dk (auto then picks cutlass); cutlass must take every case."""
    mask, sq, sk = WINDOW_CASES[case]
    torch.manual_seed(0)
    q = torch.randn(2, sq, 8, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, sk, 2, 64, device="cuda", dtype=dtype)
    v = torch.randn(2, sk, 2, dv, device="cuda", dtype=dtype)
    kernel = KERNELS[name]
    reason = kernel.unsupported(q, k, mask, v)
    if name == "cuda_efficient":
        assert reason is None, reason
    elif reason is not None and dv != 64 and "one head dim" in reason:
        assert kernel_chooser("auto")(q, k, mask, v).name == "cuda_efficient"
        return
    elif reason is not None:
        pytest.skip(reason)  # fp32 on FA2, flash-attn not installed, flash disabled in this build
    dout = torch.randn(2, sq, 8, dv, device="cuda", dtype=dtype)
    out, lse = kernel.forward(q, k, v, mask, 0.125)
    got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, mask, 0.125))
    ok = explicit_mask(sq, sk, causal=mask.causal, window=mask.window, offset=mask.offset,
                       segments=mask.segments).cuda()
    truth = _plain_attention(q, k, v, dout, ok, 0.125, torch.float64)
    rough = _plain_attention(q, k, v, dout, ok, 0.125, dtype)
    floor = 2e-5 if dtype == torch.float32 else 2e-3  # relative to the largest value, for near-exact cases
    for label, g, t, r in zip(("out", "lse", "dq", "dk", "dv"), got, truth, rough):
        assert g.shape == t.shape, label
        noise = (r.double() - t).abs().max().item()
        err = (g.double() - t).abs().max().item()
        assert err <= 4 * noise + floor * max(1.0, t.abs().max().item()), (label, err, noise)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gated_delta_states_on_gpu(dtype):
    """State passing's one kernel call on CUDA (flash-linear-attention's chunked rule when installed, else the
    torch reference): segments that start from given states, widened values [v | 0] and initial [0 | I], the
    final state of each segment; output, final states and the gradients of q, k, v, g, beta and the initial
    states against the float64 reference on the CPU, within 4x the reference's own error in ``dtype`` (the same
    rounding of the inputs, computed in float32, its outputs rounded to ``dtype``)."""
    from seqmesh.linear_attention.gated_delta import chunk_gated_delta_rule_states
    from seqmesh.linear_attention.kernels import gated_delta_rule_states

    g = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 300, 4, 64, 64
    bounds = (0, 1, 130, 200, s)
    q, k = (torch.randn(b, s, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.cat([torch.randn(b, s, h, dv, generator=g, dtype=torch.float64),
                   torch.zeros(b, s, h, dk, dtype=torch.float64)], dim=-1)
    decay = -torch.rand(b, s, h, generator=g, dtype=torch.float64) * 0.1
    beta = torch.rand(b, s, h, generator=g, dtype=torch.float64)
    initial = torch.zeros(b, len(bounds) - 1, h, dk, dv + dk, dtype=torch.float64)
    initial[:, 0, :, :, :dv] = torch.randn(b, h, dk, dv, generator=g, dtype=torch.float64) * 0.3
    initial[:, 2, :, :, dv:] = torch.eye(dk, dtype=torch.float64)
    dout = torch.randn(b, s, h, dv + dk, generator=g, dtype=torch.float64)
    dfinal = torch.randn(b, len(bounds) - 1, h, dk, dv + dk, generator=g, dtype=torch.float64)
    inputs = (q, k, v, decay, beta, initial)

    def run(fn, device, in_dtype):
        leaves = [x.to(device=device, dtype=in_dtype if i < 5 else torch.float32 if in_dtype != torch.float64
                       else in_dtype).requires_grad_() for i, x in enumerate(inputs)]
        out, final = fn(*leaves[:5], bounds, leaves[5])
        loss = (out.double() * dout.to(device)).sum() + (final.double() * dfinal.to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        return [t.detach().double().cpu() for t in (out, final, *grads)]

    exact = run(chunk_gated_delta_rule_states, "cpu", torch.float64)
    rounded = run(chunk_gated_delta_rule_states, "cpu", dtype)
    got = run(gated_delta_rule_states, "cuda", dtype)
    eps = torch.finfo(dtype).eps
    for name, e, r, x in zip(("out", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"), exact, rounded, got):
        bound = 4 * max(float((r - e).abs().max()), eps * float(e.abs().max()))
        assert float((x - e).abs().max()) <= bound, (name, float((x - e).abs().max()), bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decay_scan_states_on_gpu(dtype):
    """Mamba2's and lightning attention's scan on CUDA (flash-linear-attention's chunk_simple_gla when installed, else
    the torch reference): segments from given states, each segment's final state; output, final states and the
    gradients of q, k, v, g and the initial states against the float64 reference on the CPU, within 4x the
    reference's own error in ``dtype``."""
    from seqmesh.linear_attention.decay_scan import chunk_decay_scan, decay_scan_states

    g = torch.Generator().manual_seed(1)
    b, s, h, dk, dv = 2, 300, 4, 32, 48
    bounds = (0, 1, 130, 200, s)
    q, k = (torch.randn(b, s, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(b, s, h, generator=g, dtype=torch.float64) * 0.1
    initial = torch.randn(b, len(bounds) - 1, h, dk, dv, generator=g, dtype=torch.float64) * 0.3
    dout = torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
    dfinal = torch.randn(b, len(bounds) - 1, h, dk, dv, generator=g, dtype=torch.float64)
    inputs = (q, k, v, decay, initial)

    def run(fn, device, in_dtype):
        leaves = [x.to(device=device, dtype=in_dtype if i < 3 else torch.float32 if in_dtype != torch.float64
                       else in_dtype).requires_grad_() for i, x in enumerate(inputs)]
        out, final = fn(*leaves[:4], bounds, leaves[4])
        loss = (out.double() * dout.to(device)).sum() + (final.double() * dfinal.to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        return [t.detach().double().cpu() for t in (out, final, *grads)]

    exact = run(chunk_decay_scan, "cpu", torch.float64)
    rounded = run(chunk_decay_scan, "cpu", dtype)
    got = run(decay_scan_states, "cuda", dtype)
    eps = torch.finfo(dtype).eps
    for name, e, r, x in zip(("out", "final", "dq", "dk", "dv", "dg", "dinitial"), exact, rounded, got):
        bound = 4 * max(float((r - e).abs().max()), eps * float(e.abs().max()))
        assert float((x - e).abs().max()) <= bound, (name, float((x - e).abs().max()), bound)


def test_async_ulysses_exchange_on_cuda():
    """The async all-to-all pair on one GPU (NCCL, its own stream; a matmul queued on the current stream while it
    is in flight) equals the synchronous all-to-all forward and backward, bit for bit: both move the same bytes."""
    from async_cases import cuda_exchange_parity
    from seqmesh.comm.launch import WorkerPool

    with WorkerPool(1, backend="nccl") as pool:
        for r in pool.run(cuda_exchange_parity):
            assert r["diffs"] == [0.0, 0.0, 0.0, 0.0], r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_async_ulysses_on_two_gpus():
    """Ulysses 2 over NCCL: a float32 Llama with async Ulysses against the synchronous path (float32 rounding of
    projections on pieces of tokens) and the float64 single-process model (as close as the synchronous path)."""
    from async_cases import cuda_async_parity, cuda_exchange_parity
    from seqmesh.comm.launch import WorkerPool

    with WorkerPool(2, backend="nccl") as pool:
        for r in pool.run(cuda_exchange_parity):
            assert r["diffs"] == [0.0, 0.0, 0.0, 0.0], r
        for r in pool.run(cuda_async_parity, "llama-uneven"):
            assert r["logits_vs_sync"] < 1e-5 and r["grad_vs_sync"] < 1e-4, r
            assert r["logits_vs_reference"] < 4 * r["sync_logits_vs_reference"] + 1e-6, r


@pytest.mark.parametrize("documents", [None, (0, 100, 101, 256)], ids=["causal", "documents"])
def test_compiled_attention_on_cuda_matches_eager_accuracy(documents):
    """seqmesh.attention compiled with inductor (fullgraph) on one GPU: out and gradients as close to float64
    as the eager path's (bf16: twice its error, plus one bf16 unit of rounding of unit-scale values)."""
    from compile_cases import compiled_attention_on_device
    from seqmesh.comm.launch import WorkerPool

    with WorkerPool(1, backend="nccl") as pool:
        errors = pool.run(compiled_attention_on_device, "cuda", documents, timeout=600)[0]
    for key, eager in errors["eager"].items():
        assert errors["compiled"][key] <= 2 * eager + 2**-8, (key, errors)


def test_atomic_kernels_yield_to_deterministic_mode():
    """Under ``torch.use_deterministic_algorithms`` the Triton kernels whose backward adds with atomics (the sparse
    latent attention's row gradient, the delta rule's carry) give way to their torch forms, and the sparse
    attention's gradients are then the same bits run to run."""
    from seqmesh.kernels.sparse_latent import sparse_latent_attention, uses_kernel
    from seqmesh.linear_attention.carry import carry_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(1, 64, 4, 24, generator=g, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(1, 256, 24, generator=g, device="cuda", dtype=torch.bfloat16)
    picks = torch.randint(0, 256, (1, 64, 32), generator=g, device="cuda")
    pytest.importorskip("triton")
    assert uses_kernel(row) and carry_kernel(row.float()) is not None  # else this test would show nothing
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not uses_kernel(row) and carry_kernel(row.float()) is None

        def grads():
            q, r = query.clone().requires_grad_(), row.clone().requires_grad_()
            sparse_latent_attention(q, r, picks, 0.2, 16).float().square().sum().backward()
            return q.grad, r.grad

        first, second = grads(), grads()
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    finally:
        torch.use_deterministic_algorithms(before)
