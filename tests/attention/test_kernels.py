"""Local kernels, the block planner and the LSE merge, in one process, against float64 attention."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import explicit_mask, reference_attention
from seqmesh.sharded_attention.blocks import document_bounds
from seqmesh.bench.emulate import emulate_ring
from seqmesh.sharded_attention.schedule import RingSchedule
from seqmesh.kernels import KERNELS, kernel_chooser
from seqmesh.kernels.base import BlockMask
from seqmesh.kernels.windows import additive_bias, fa2_arguments, fa2_row_splits, flash_window, shift_rows, window_bands
from seqmesh.sequence.layout import SequenceLayout


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
    for mask in (BlockMask(causal=True, window=5), BlockMask(causal=True, window=7, segments=(0, 5, 20, 48))):
        out, lse = KERNELS["cuda_flash"].forward(q, k, k, mask, 0.125)  # window sizes through torch's FA2 op
        dq, dk, dv = KERNELS["cuda_flash"].backward(out, q, k, k, out, lse, mask, 0.125)
        assert out.shape == q.shape and lse.shape == (2, 8, 48) and dk.shape == k.shape
    mla_q, mla_k = (torch.empty(2, 48, h, 192, device="meta", dtype=torch.bfloat16) for h in (8, 2))
    mla_v = torch.empty(2, 48, 2, 128, device="meta", dtype=torch.bfloat16)  # MLA: FA2 on v padded to 192
    for mask in (BlockMask(causal=True), documents):
        out, lse = KERNELS["cuda_flash"].forward(mla_q, mla_k, mla_v, mask, 0.125)
        dq, dk, dv = KERNELS["cuda_flash"].backward(out, mla_q, mla_k, mla_v, out, lse, mask, 0.125)
        assert out.shape == (2, 48, 8, 128) and dq.shape == mla_q.shape and dk.shape == mla_k.shape
        assert dv.shape == mla_v.shape and lse.shape == (2, 8, 48)
    v = torch.empty(2, 48, 2, 32, device="meta", dtype=torch.bfloat16)  # cutlass takes v's own head dim
    for mask in (BlockMask(causal=True), documents, BlockMask(causal=True, window=5)):
        out, lse = KERNELS["cuda_efficient"].forward(q, k, v, mask, 0.125)
        assert out.shape == (2, 48, 8, 32) and lse.shape == (2, 8, 48)


def test_auto_backend_on_cpu_and_named_errors():
    q = torch.randn(1, 4, 2, 8)
    assert kernel_chooser("auto")(q, q, BlockMask(causal=True)).name == "cpu_flash"
    with pytest.raises(ValueError, match="cuda_flash.*not a CUDA device"):
        kernel_chooser("cuda_flash")(q, q, BlockMask())
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        kernel_chooser("fast")


def _explicit_mask(sq: int, sk: int, mask: BlockMask) -> torch.Tensor:
    return explicit_mask(sq, sk, causal=mask.causal, window=mask.window, offset=mask.offset, segments=mask.segments)


def _plain_attention(q, k, v, ok, scale, softcap=None):
    """float64 attention on an explicit (Sq, Sk) mask with autograd: out (B, Sq, Hq, Dv), lse (B, Hq, Sq);
    ``softcap``: the scaled scores capped as Gemma 2's eager attention does (``s / c``, tanh, ``* c``)."""
    h = q.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(h // k.shape[2], 2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~ok, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(h // k.shape[2], 2))
    return out, torch.logsumexp(s, -1)


def _check_against_plain(kernel, q, k, v, mask, scale, atol):
    """The kernel's out, lse and gradients equal plain float64 attention with the explicit mask."""
    ok = _explicit_mask(q.shape[1], k.shape[1], mask)
    assert ok.any(1).all(), "every row must see a key (as the block planner guarantees)"
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    out, lse = kernel.forward(q, k, v, mask, scale)
    grads = kernel.backward(dout, q, k, v, out, lse, mask, scale)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _plain_attention(qr, kr, vr, ok, scale, mask.softcap)
    ref_out.backward(dout.double())
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               (ref_out, ref_lse, qr.grad, kr.grad, vr.grad)):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want.detach(), atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("widths", [(24, 16), (16, 24)], ids=["qk24-v16", "qk16-v24"])
@pytest.mark.parametrize("params", [dict(causal=True), dict(causal=False, segments=(0, 1, 40, 150)),
                                    dict(causal=True, window=60, segments=(0, 100, 150))],
                         ids=["causal", "documents", "window+documents"])
def test_cpu_flash_takes_two_head_dims_exactly(widths, params):
    """MLA's q/k and v head dims differ (DeepSeek: 192 and 128): cpu_flash pads the narrower side with zeros and
    matches plain float64 attention, forward and backward, dense, per document and in bands; auto picks it."""
    dqk, dv = widths
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 150, 4, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(1, 150, 2, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(1, 150, 2, dv, generator=g, dtype=torch.float64)
    mask = BlockMask(**params)
    assert kernel_chooser("auto")(q, k, mask, v).name == "cpu_flash"
    _check_against_plain(KERNELS["cpu_flash"], q, k, v, mask, dqk**-0.5, atol=1e-12)


def test_auto_order_puts_cudnn_first_on_hopper_without_documents():
    """cuDNN first on sm 9.0 and later for calls without packed documents; the plain order elsewhere."""
    from seqmesh.kernels import AUTO_ORDER, auto_order

    plain, packed = BlockMask(causal=True), BlockMask(causal=True, segments=(0, 5, 9))
    assert auto_order(plain, None) == auto_order(plain, (8, 0)) == auto_order(packed, (9, 0)) == AUTO_ORDER
    hopper = auto_order(plain, (9, 0))
    assert hopper[0] == "cuda_cudnn" and sorted(hopper) == sorted(AUTO_ORDER) and auto_order(plain, (10, 0)) == hopper


def test_cudnn_one_token_documents_run_without_cudnn():
    """cuDNN refuses s_q = s_kv = 1 (seen on an H100 with one-token packed documents): such a document is
    computed in plain ops (out = its value, lse = its one score, no gradient to q or k), here on the CPU
    where no cuDNN call could hide in it; float32 lse, hence the tolerance."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 2, 8, dtype=torch.float64) for _ in range(2))
    _check_against_plain(KERNELS["cuda_cudnn"], q, k, v, BlockMask(causal=True, segments=(0, 1, 2, 3)), 0.3, atol=1e-5)


def _plain_with_grads(q, k, v, dout, ok, scale) -> list[torch.Tensor]:
    """[out, lse, dq, dk, dv] of :func:`_plain_attention` on ``ok``, computed in the inputs' dtype."""
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = _plain_attention(qr, kr, vr, ok, scale)
    out.backward(dout)
    return [out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad]


# (mask parameters, Sq, Sk): windows several bands long (a band is 128 rows at least), with documents (one of
# length 1) and with an offset; every row sees a key
BAND_CASES = {
    "window": (dict(causal=True, window=300), 700, 700),
    "window+documents": (dict(causal=True, window=90, segments=(0, 250, 251, 700)), 700, 700),
    "window,offset": (dict(causal=True, window=200, offset=150), 300, 300),
}


@pytest.mark.parametrize("case", list(BAND_CASES), ids=list(BAND_CASES))
def test_cpu_flash_bands_match_plain_attention(case):
    """cpu_flash runs a window as bands of rows with offsets and documents. Its out, lse and gradients, in
    float64 and float32, equal plain softmax attention on a dense mask that ``reference.explicit_mask``
    builds from the case's parameters (no seqmesh BlockMask in the reference), within 8x plain attention's
    own rounding: its float32 result against its float64 one, scaled by eps(dtype) / eps(float32).
    Measured (torch 2.13, CPU): cpu_flash's error is at most 2.2x that noise in either dtype; a mask one key
    too wide or a document starting one token late in seqmesh's BlockMask is off by 0.09 to 2.9. Its work
    count equals the dense mask's visible pairs."""
    params, sq, sk = BAND_CASES[case]
    ok = explicit_mask(sq, sk, **params)
    assert ok.any(1).all(), "every row must see a key (as the block planner guarantees)"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, sq, 4, 8, generator=g)  # float32 values, exact in float64: both dtypes see the same inputs
    k, v = (torch.randn(1, sk, 2, 8, generator=g) for _ in range(2))
    dout = torch.randn(1, sq, 4, 8, generator=g)
    exact = _plain_with_grads(*(t.double() for t in (q, k, v, dout)), ok, 0.3)
    noise = [float((a.double() - b).abs().max()) for a, b in zip(_plain_with_grads(q, k, v, dout, ok, 0.3), exact)]
    mask, kernel = BlockMask(**params), KERNELS["cpu_flash"]
    for dtype in (torch.float64, torch.float32):
        unit = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
        x = [t.to(dtype) for t in (q, k, v, dout)]
        out, lse = kernel.forward(*x[:3], mask, 0.3)
        grads = kernel.backward(x[3], *x[:3], out, lse, mask, 0.3)
        for name, got, want, rounding in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), exact, noise):
            assert got.shape == want.shape and got.dtype == dtype, (name, dtype)
            err = float((got.double() - want).abs().max())
            assert err <= 8 * unit * rounding, (name, dtype, err, unit * rounding)
    assert mask.score_entries(sq, sk) == int(ok.sum())


@pytest.fixture
def fake_flash_attn_package(monkeypatch):
    """tests/fake_flash_attn.py installed as the flash_attn package (2.7.4) for one test; yields seqmesh's wrapper."""
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
    yield wrapper
    wrapper._interface.cache_clear()


# (mask, Sq, Sk): the block planner's shapes (diagonal, documents, a ring block of earlier keys trimmed to
# the window, with Sq < Sk and Sq > Sk) and a few it does not make (causal with an offset, non-causal window)
STUB_MASKS = {
    "causal": (BlockMask(causal=True), 19, 19),
    "full": (BlockMask(), 19, 19),
    "documents": (BlockMask(causal=True, segments=(0, 1, 7, 19)), 19, 19),
    "window": (BlockMask(causal=True, window=5), 19, 19),
    "window+documents": (BlockMask(causal=True, window=4, segments=(0, 1, 7, 19)), 19, 19),
    "window,offset,sq<sk": (BlockMask(causal=True, window=9, offset=11), 7, 11),
    "window,offset,sq>sk": (BlockMask(causal=True, window=8, offset=5), 6, 5),
    # a ring block of two query chunks against one key chunk: FA2 widens the open right side to Sk keys, so
    # the call runs as two calls on row ranges
    "window,offset,sq>sk+1": (BlockMask(causal=True, window=17, offset=12), 16, 12),
    "window,offset,sq>2sk+1": (BlockMask(causal=True, window=35, offset=12), 30, 12),
    "causal,offset": (BlockMask(causal=True, offset=3), 4, 6),
    "window,noncausal": (BlockMask(window=6), 19, 19),
    "causal,softcap": (BlockMask(causal=True, softcap=0.8), 19, 19),  # Gemma 2: scores capped before the softmax
    "documents,softcap": (BlockMask(causal=True, segments=(0, 1, 7, 19), softcap=0.8), 19, 19),
    "window,offset,softcap": (BlockMask(causal=True, window=9, offset=11, softcap=0.8), 7, 11),
}


@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("case", list(STUB_MASKS), ids=list(STUB_MASKS))
def test_flash_attn_wrapper_against_a_stub_package(fake_flash_attn_package, case, heads):
    """seqmesh's flash-attn wrapper drives a stand-in package with flash-attn 2.7's entry points (torch
    custom ops, like the real package, with flash-attn's documented window convention): layouts, the
    varlen (H, total) lse, in-place gradients and the window sizes give plain attention's results."""
    mask, sq, sk = STUB_MASKS[case]
    torch.manual_seed(0)
    q = torch.randn(2, sq, heads[0], 8, dtype=torch.float64)
    k, v = (torch.randn(2, sk, heads[1], 8, dtype=torch.float64) for _ in range(2))
    _check_against_plain(KERNELS["flash_attn"], q, k, v, mask, 0.3, atol=1e-5)  # the stub's lse is float32


def test_flash_attn_refusals_fall_back(fake_flash_attn_package, monkeypatch):
    """Masks FA2 cannot express and a v head dim unlike q's are refused with a reason, and ``auto``
    computes them with the next kernel; expressible ones choose flash_attn (its device check is
    lifted here, as if the tensors were on a GPU)."""
    monkeypatch.setattr(fake_flash_attn_package, "cuda_problem", lambda *args, **kwargs: None)
    choose, kernel = kernel_chooser("auto"), KERNELS["flash_attn"]
    torch.manual_seed(0)
    for case in ("window", "window+documents", "window,offset,sq<sk", "causal,offset"):
        mask, sq, sk = STUB_MASKS[case]
        q, k = torch.randn(1, sq, 2, 8), torch.randn(1, sk, 2, 8)
        assert kernel.unsupported(q, k, mask) is None and choose(q, k, mask).name == "flash_attn", case
    refused = [  # (mask, Sq, Sk, Dv, what the reason says)
        (BlockMask(causal=True), 4, 6, 8, "left of FA2's bottom-right corner"),  # top-left causal, Sq < Sk
        (BlockMask(causal=True, window=3), 4, 6, 8, "left of FA2's bottom-right corner"),
        (BlockMask(causal=True), 6, 3, 8, "no bound"),  # right = 3 >= Sk: FA2 would drop the bound
        (BlockMask(causal=True, window=5), 9, 9, 4, "one head dim"),
    ]
    for mask, sq, sk, dv, words in refused:
        q, k, v = torch.randn(1, sq, 2, 8, dtype=torch.float64), torch.randn(1, sk, 1, 8, dtype=torch.float64), \
            torch.randn(1, sk, 1, dv, dtype=torch.float64)
        assert words in (kernel.unsupported(q, k, mask, v) or ""), (mask, sq, sk)
        fallback = choose(q, k, mask, v)
        assert fallback.name in ("cpu_flash", "math")
        _check_against_plain(fallback, q, k, v, mask, 0.3, atol=1e-10)


def _fa2_masks(sq: int, sk: int) -> set[bytes]:
    """Every mask FA2 makes for an (Sq, Sk) call as its sizes read (the stub's documented convention), as
    bytes: sizes whose open side FA2 widens to Sk keys count only where widening changes nothing."""
    from fake_flash_attn import documented_mask

    sizes = range(-1, sk + 2)
    masks = set()
    for c, l, r in itertools.product((False, True), sizes, sizes):
        made = documented_mask(sq, sk, c, l, r)
        if torch.equal(made, documented_mask(sq, sk, c, l, r, widen_open_side=False)):
            masks.add(made.numpy().tobytes())
    return masks


def test_flash_window_is_exact_and_refuses_only_the_inexpressible():
    """For every small call shape, offset, window and causal flag: the sizes flash_window gives make
    FA2's documented mask equal to the explicit one, and it refuses only masks no FA2 sizes make."""
    from fake_flash_attn import documented_mask

    refused = 0
    for sq, sk in itertools.product(range(1, 6), range(1, 6)):
        expressible = _fa2_masks(sq, sk)
        for offset, causal, window in itertools.product(range(-3, 9), (False, True), (None, 1, 2, 3, 5)):
            mask = BlockMask(causal=causal, window=window, offset=offset)
            want = _explicit_mask(sq, sk, mask)
            if isinstance(flash_window(mask, sq, sk), str):
                refused += 1
                assert want.numpy().tobytes() not in expressible, (mask, sq, sk)
            else:
                c, left, right = fa2_arguments(mask, sq, sk)
                assert torch.equal(documented_mask(sq, sk, c, left, right), want), (mask, sq, sk)
    assert refused > 0


@pytest.mark.parametrize("align", [1, 16])
def test_additive_bias_and_bands_are_the_mask(align):
    """The bias is 0 on visible pairs and -inf elsewhere, in the dtype asked, with the row stride the
    cutlass kernel needs; the bands of a windowed call cover each row once and every visible pair."""
    for mask, sq, sk in [(BlockMask(causal=True, window=200), 600, 600),
                         (BlockMask(causal=True, window=50, segments=(0, 130, 131, 600)), 600, 600),
                         (BlockMask(causal=True, window=300, offset=260), 270, 250)]:
        want = _explicit_mask(sq, sk, mask)
        covered = torch.zeros(sq, sk, dtype=torch.bool)
        rows_seen = torch.zeros(sq, dtype=torch.int64)
        for a, b, k0, k1 in window_bands(mask, sq, sk):
            bias = additive_bias(mask, (a, b), (k0, k1), torch.bfloat16, align=align)
            assert bias.dtype == torch.bfloat16 and bias.shape == (b - a, k1 - k0)
            assert bias.stride(-1) == 1 and bias.stride(0) % align == 0
            part = want[a:b, k0:k1]
            assert torch.equal(bias == 0, part) and bool(torch.isneginf(bias[~part]).all())
            assert bool(part.any(1).all()), "no band row is empty"
            covered[a:b, k0:k1] = True
            rows_seen[a:b] += 1
        assert bool((rows_seen == 1).all()) and not bool((want & ~covered).any())


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_ring_window_pieces_are_fa2_masks(kind):
    """Every kernel call the ring plans under a window (all ranks, steps, with and without documents)
    is one FA2 computes exactly, as one call or split by rows, so the FA2 kernels never refuse a planned piece."""
    from fake_flash_attn import documented_mask

    split_seen = False
    for ring, window, cu in itertools.product((2, 4), (3, 17, 40), (None, (0, 5, 60, 95))):
        layout = SequenceLayout.for_length(kind, ring, 1, 95)
        schedule = RingSchedule(layout, document_bounds(layout.padded_len, 95, cu), True, window)
        for r, step in itertools.product(range(ring), schedule.steps):
            for p in schedule.pieces(r, step):
                sq, sk = p.q1 - p.q0, p.k1 - p.k0
                splits = fa2_row_splits(p.mask, sq, sk)
                assert not isinstance(splits, str), (p, ring, window, cu)
                if p.mask.segments is None:  # varlen pieces: each segment is a square diagonal call
                    split_seen |= len(splits) > 1
                    fa2 = torch.cat([documented_mask(b - a, sk, *fa2_arguments(shift_rows(p.mask, a), b - a, sk))
                                     for a, b in splits])
                    assert torch.equal(fa2, _explicit_mask(sq, sk, p.mask)), (p, ring, window, cu)
    assert split_seen, "some ring piece has Sq > Sk + 1 beside a window (FA2 reads it differently)"


SOFTCAP_MASKS = ("causal,softcap", "documents,softcap", "window,offset,softcap")


@pytest.mark.parametrize("case", SOFTCAP_MASKS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_math_kernel_soft_caps(case, dtype, atol):
    """The math kernel's soft-capped scores (cap small enough to bite: 0.8 against scores of about 1): out, lse and
    every gradient equal plain float64 attention on capped scores."""
    mask, sq, sk = STUB_MASKS[case]
    torch.manual_seed(0)
    q = torch.randn(2, sq, 4, 8, dtype=dtype) * 2
    k, v = (torch.randn(2, sk, 2, 8, dtype=dtype) for _ in range(2))
    _check_against_plain(KERNELS["math"], q, k, v, mask, 0.5, atol=atol)


def test_soft_capping_is_computed_or_refused_by_every_kernel(fake_flash_attn_package, monkeypatch):
    """torch's CPU and CUDA ops refuse a soft-capped call by name and ``auto`` falls through to one that caps (the
    flash-attn package where installed, else math); leaving the cap out moves the output far past the rounding."""
    mask, sq, sk = STUB_MASKS["causal,softcap"]
    q = torch.randn(1, sq, 2, 8, dtype=torch.float64) * 2
    k = torch.randn(1, sk, 2, 8, dtype=torch.float64)
    for name in ("cpu_flash", "cuda_flash", "cuda_efficient", "cuda_cudnn"):  # each names the cap, not the device
        reason = KERNELS[name].unsupported(q, k, mask)
        assert reason is not None and "soft-cap" in reason, (name, reason)
    assert kernel_chooser("auto")(q, k, mask).name == "math"  # the stub's device check says: not on a GPU
    monkeypatch.setattr(fake_flash_attn_package, "cuda_problem", lambda *args, **kwargs: None)
    assert kernel_chooser("auto")(q.float(), k.float(), mask).name == "flash_attn"
    uncapped, _ = KERNELS["math"].forward(q, k, k, BlockMask(causal=True), 0.5)
    capped, _ = KERNELS["math"].forward(q, k, k, mask, 0.5)
    assert float((capped - uncapped).abs().max()) > 1e-3
