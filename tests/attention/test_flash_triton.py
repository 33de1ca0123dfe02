"""seqmesh's Triton flash kernel (seqmesh.kernels.flash_triton_kernel), run on this CPU by Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU; on a GPU, compiled), against plain PyTorch on the
whole call in float64: every score, the ALiBi bias ``-slope * (offset + a - b)`` and the causal mask written out,
softmax, autograd. The output, the log-sum-exp (which carries the bias a ring block adds; a bias off by a constant
changes only it) and the gradients of q, k and v are held within a multiple of float32's own rounding of that
reference, measured in the same run. A distance off by one and a causal edge one key off are seen."""

from __future__ import annotations

import pytest
import torch

from seqmesh.kernels import BlockMask, KERNELS

pytest.importorskip("triton")

ROUNDING_MULTIPLE = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def plain_attention(q, k, v, mask: BlockMask, scale: float, distance: int = 0, edge: int = 0):
    """(out, lse) of one call by the definition, in q's dtype, through autograd (``distance`` and ``edge``: a
    mutation, the bias's distance or the causal edge that many positions further)."""
    hq, hk = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale  # (B, Hq, Sq, Sk)
    gap = mask.offset + torch.arange(q.shape[1])[:, None] - torch.arange(k.shape[1])[None, :]
    if mask.alibi is not None:
        scores = scores - torch.tensor(mask.alibi, dtype=q.dtype)[:, None, None] * (gap + distance).to(q.dtype)
    seen = torch.ones_like(gap, dtype=torch.bool)
    if mask.causal:
        seen &= gap + edge >= 0
    if mask.segments is not None:
        doc = torch.repeat_interleave(torch.arange(len(mask.segments) - 1),
                                      torch.tensor(mask.segments[1:]) - torch.tensor(mask.segments[:-1]))
        seen &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return (probs @ vh).transpose(1, 2), lse


class TritonCall(torch.autograd.Function):
    """The kernel's forward and backward as one op, on :data:`DEVICE`, results back on the CPU."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        kernel = KERNELS["triton_flash"]
        moved = [x.to(DEVICE) for x in (q, k, v)]
        out, lse = kernel.forward(*moved, mask, scale)
        ctx.save_for_backward(*moved, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out.cpu(), lse.cpu()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = KERNELS["triton_flash"].backward(dout.to(DEVICE, q.dtype), q, k, v, out, lse, ctx.mask, ctx.scale)
        return (*[g.cpu() for g in grads], None, None)


def _results(fn, inputs, dtype, mask, scale=0.3):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    out, lse = fn(*leaves, mask, scale)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out.double() * weights).sum().backward()
    return [out.detach().double(), lse.detach().double()] + [x.grad.double() for x in leaves]


def _inputs(sq, sk, hq, hk, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, h, w, generator=g, dtype=torch.float64)
            for s, h, w in ((sq, hq, d), (sk, hk, d), (sk, hk, dv))]


def _relative(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "the kernel hides other (query, key) pairs than the reference"
    return float((got[finite] - want[finite]).abs().max() / want[finite].abs().max())


SLOPES = tuple(2.0 ** -(i + 1) for i in range(4))  # BLOOM's slopes of 4 heads
CALLS = {
    # a Ulysses call or a ring diagonal block: 70 rows (a second, partial tile of the kernel's 64), GQA 4 on 2
    "causal-alibi": (70, 70, BlockMask(causal=True, alibi=SLOPES)),
    # a ring block whose keys lie 70 positions earlier (every key visible, the bias by the whole distance)
    "ring-block-alibi": (70, 70, BlockMask(offset=70, alibi=SLOPES)),
    # a causal block whose diagonal is not its top-left corner (torch's fused ops refuse it), and plain attention
    "offset-causal": (40, 90, BlockMask(causal=True, offset=50, alibi=SLOPES)),
    "causal-plain": (70, 70, BlockMask(causal=True)),
    # packed documents, one call each
    "documents-alibi": (70, 70, BlockMask(causal=True, segments=(0, 30, 33, 70), alibi=SLOPES)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_kernel_matches_plain_pytorch_within_float32_rounding(name):
    sq, sk, mask = CALLS[name]
    inputs = _inputs(sq, sk, 4, 2, 24, 20)  # head dims neither a power of two nor equal
    want = _results(plain_attention, inputs, torch.float64, mask)
    rounding = [_relative(a, b) for a, b in zip(_results(plain_attention, inputs, torch.float32, mask), want)]
    got = [_relative(a, b) for a, b in zip(_results(TritonCall.apply, inputs, torch.float32, mask), want)]
    for what, error, noise in zip(("out", "lse", "dq", "dk", "dv"), got, rounding):
        assert error <= ROUNDING_MULTIPLE * max(noise, 1e-7), (what, error, noise)


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="Triton's interpreter (3.9) multiplies bfloat16 operands wrongly (a tl.dot of two bf16 "
        "tiles is off by 1e10); fp16 runs the same code here, and on a GPU the kernel's probe holds bf16 too")),
], ids=["fp16", "bf16"])
def test_kernel_in_half_precision_stays_within_the_references_own_rounding(dtype):
    """Half inputs (the probabilities rounded to the half type before their products, as every flash kernel does):
    within a multiple of plain PyTorch's own error in that type."""
    sq, sk, mask = CALLS["causal-alibi"]
    inputs = _inputs(sq, sk, 4, 2, 32, 32, seed=1)
    want = _results(plain_attention, inputs, torch.float64, mask)
    rounding = [_relative(a, b) for a, b in zip(_results(plain_attention, inputs, dtype, mask), want)]
    got = [_relative(a, b) for a, b in zip(_results(TritonCall.apply, inputs, dtype, mask), want)]
    for what, error, noise in zip(("out", "lse", "dq", "dk", "dv"), got, rounding):
        assert error <= 4 * noise, (what, error, noise)


@pytest.mark.parametrize("wrong", ["distance+1", "causal-edge+1"])
def test_a_kernel_off_by_one_would_be_seen(wrong):
    """What the comparison above sees: a kernel whose ALiBi distance were one longer (the log-sum-exp moves by each
    head's slope, the output not at all) or whose causal edge were one key further (every output moves) lies far
    outside its tolerance. Here the reference takes the mutation; checked once by hand in the kernel too."""
    sq, sk, mask = CALLS["causal-alibi"]
    inputs = _inputs(sq, sk, 4, 2, 24, 20)
    want = _results(plain_attention, inputs, torch.float64, mask)
    noise = [_relative(a, b) for a, b in zip(_results(plain_attention, inputs, torch.float32, mask), want)]
    got = _results(TritonCall.apply, inputs, torch.float32, mask)
    shift = {"distance": 1} if wrong == "distance+1" else {"edge": 1}
    mutated = _results(lambda *a: plain_attention(*a, **shift), inputs, torch.float64, mask)
    index = 1 if wrong == "distance+1" else 0  # lse, out
    finite = torch.isfinite(mutated[index]) & torch.isfinite(got[index])
    error = float((got[index][finite] - mutated[index][finite]).abs().max() / mutated[index][finite].abs().max())
    assert error > 100 * ROUNDING_MULTIPLE * max(noise[index], 1e-7)


def test_auto_takes_the_kernel_for_alibi_on_cuda_only():
    """On the CPU ``auto`` keeps the CPU flash op and the math kernel; the Triton kernel says why it declines."""
    from seqmesh.kernels import kernel_chooser

    q = torch.zeros(1, 8, 4, 16, dtype=torch.bfloat16)
    mask = BlockMask(causal=True, alibi=SLOPES)
    assert "CUDA" in KERNELS["triton_flash"].unsupported(q, q[:, :, :2], mask)
    assert kernel_chooser("auto")(q, q[:, :, :2], mask).name == "math"


@pytest.mark.parametrize("documents", [None, (0, 100, 256)], ids=["one-document", "two-documents"])
def test_a_zigzag_ring_of_four_on_the_kernel_is_whole_sequence_alibi(documents):
    """Every kernel call of a zigzag ring of 4 over 256 tokens on this kernel (each block told its distance, the
    partial results merged by their log-sum-exp, the backward given the merged one), against plain PyTorch on the
    whole sequence: the ring's offsets and merge reach the kernel as they do on a GPU."""
    from seqmesh.bench.emulate import emulate_ring
    from seqmesh.sequence.layout import SequenceLayout
    from seqmesh.sharded_attention.blocks import document_bounds
    from seqmesh.sharded_attention.schedule import RingSchedule

    length = 256
    layout = SequenceLayout.for_length("zigzag", 4, 1, length)
    schedule = RingSchedule(layout, document_bounds(length, length, documents), True, alibi=SLOPES)
    whole = BlockMask(causal=True, segments=documents, alibi=SLOPES)
    q, k, v = _inputs(length, length, 4, 2, 16, 16, seed=2)
    dout = torch.randn(2, length, 4, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def reference(dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, _ = plain_attention(*leaves, whole, 0.25)
        out.backward(dout.to(dtype))
        return [out.detach().double()] + [x.grad.double() for x in leaves]

    def on_the_kernel(q, k, v, mask):
        return KERNELS["triton_flash"]

    want = reference(torch.float64)
    noise = [_relative(a, b) for a, b in zip(reference(torch.float32), want)]
    got = emulate_ring(*(x.float().to(DEVICE) for x in (q, k, v, dout)), schedule, on_the_kernel, 0.25)
    for what, a, b, n in zip(("out", "dq", "dk", "dv"), got, want, noise):
        error = _relative(a.double().cpu(), b)
        assert error <= ROUNDING_MULTIPLE * max(n, 1e-7), (what, error, n)


def test_sizes_triton_cannot_compile_fall_back_to_the_math_kernel_with_one_warning(monkeypatch):
    """A device whose shared memory or registers cannot hold the kernel's tiles for some sizes (Triton raises before
    any launch): that call and every later one of the same sizes run on the math kernel, with one warning, and the
    kernel declines those sizes from then on."""
    import warnings

    from triton.runtime.errors import OutOfResources

    from seqmesh.kernels import flash_triton
    from seqmesh.kernels.flash_triton_kernel import TritonFlashKernel
    from seqmesh.kernels.reference import MathKernel

    def no_room(*args):
        raise OutOfResources(232448, 166912, "shared memory")

    monkeypatch.setattr(flash_triton, "forward", no_room)
    kernel, mask = TritonFlashKernel(), CALLS["causal-alibi"][2]
    q, k, v = (x.float() for x in _inputs(70, 70, 4, 2, 24, 20))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, lse = kernel.forward(q, k, v, mask, 0.3)
    want = MathKernel().forward(q, k, v, mask, 0.3)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert len(seen) == 1 and "math kernel" in str(seen[0].message), [str(w.message) for w in seen]
    assert kernel._config(q, v, mask) in kernel._failed
