"""Token-sparse attention in MLA's latent space: each query attends only to its own selection of a row's keys
(DeepSeek Sparse Attention's top-k), its heads sharing that selection.

    query (B, L, H, R + Dr)   the query through ``kv_b_proj``'s key half, beside its rotated part
    row   (B, T, R + Dr)      every key's latent (its key and its value at once) and rotated key
    picks (B, L, K) int64     each query's selected rows of ``row``; -1 where the query may not see the pick
    -> (B, L, H, R)           softmax(query . row[picks] * scale [, a sink per head]) @ row[picks, :R]

Three forms of the same math: :func:`sparse_latent_reference` in torch autograd (gathers the ``(B, L, K, R + Dr)``
selected rows at once; the probe's and the tests' reference), the torch form the layers run
(:mod:`.sparse_latent_blocks`: one autograd op over blocks of a few queries, keeping a log-sum-exp as flash attention
does), and a Triton kernel
(:mod:`.sparse_latent_triton`) that gathers inside the kernel and never writes that tensor. :func:`sparse_latent_attention`
takes the kernel on a CUDA device where Triton is installed and the kernel passes its probe (a few queries forward
and backward, once per device; one warning and the torch form otherwise), the blocks' torch form elsewhere.
"""

from __future__ import annotations

import torch

from .probe import Kernel, KernelProbe
from .sparse_latent_blocks import product_dtype, sparse_latent_blocks


class GatherRows(torch.autograd.Function):
    """``rows[b, index[b, i, j]]``: rows (B, T, C), index (B, l, k) -> (B, l, k, C), one ``index_select`` of whole
    rows; backward adds each gathered row's gradient back into its row with ``index_add_`` (advanced indexing's
    backward, ``index_put_`` with accumulation, sorts the indices first: half of a DSA layer's CPU time)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        b, t, c = rows.shape
        flat = (index + torch.arange(b, device=index.device)[:, None, None] * t).reshape(-1)
        ctx.save_for_backward(flat)
        ctx.rows_shape = rows.shape
        return rows.reshape(b * t, c).index_select(0, flat).view(*index.shape, c)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (flat,) = ctx.saved_tensors
        b, t, c = ctx.rows_shape
        summed = grad.new_zeros(b * t, c).index_add_(0, flat, grad.reshape(-1, c))
        return summed.view(b, t, c), None


def sparse_latent_reference(query: torch.Tensor, row: torch.Tensor, picks: torch.Tensor, scale: float, rank: int,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch form (module docstring's shapes). Scores in the inputs' dtype, scaled, then softmax in at least
    float32, as transformers' DeepSeek-V3.2 eager attention; ``sinks`` (H,) a logit per head no value answers."""
    valid = picks >= 0
    chosen = GatherRows.apply(row, picks.clamp(min=0))  # (B, L, K, R + Dr): each selected key's latent and rotated key
    scores = torch.einsum("blhc,blkc->blhk", query, chosen) * scale  # both halves of the key in one product
    precise = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(precise).masked_fill(~valid[:, :, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(row.dtype)
    else:
        sink = sinks.to(precise)[:, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(row.dtype)
    return torch.einsum("blhk,blkr->blhr", probs, chosen[..., :rank])


class SparseLatentTriton(torch.autograd.Function):
    """The Triton kernel's forward and backward as one autograd op (inputs as :func:`sparse_latent_reference`'s)."""

    @staticmethod
    def forward(ctx, query, row, picks, sinks, scale: float, rank: int):
        from . import sparse_latent_triton as kernel

        dtype = product_dtype(query, row)  # the kernel's products take one dtype
        ctx.dtypes = query.dtype, row.dtype
        query, row, picks = query.to(dtype).contiguous(), row.to(dtype).contiguous(), picks.contiguous()
        out, lse = kernel.forward(query, row, picks, scale, rank, sinks)
        ctx.save_for_backward(query, row, picks, out, lse, sinks)
        ctx.scale, ctx.rank = scale, rank
        return out

    @staticmethod
    def backward(ctx, grad):
        from . import sparse_latent_triton as kernel

        query, row, picks, out, lse, sinks = ctx.saved_tensors
        grad = grad.to(out.dtype).contiguous()
        d_query, d_row = kernel.backward(query, row, picks, out, grad, lse, ctx.scale, ctx.rank)
        d_sinks = None
        if sinks is not None:  # the sink's probability times minus each (query, head)'s sum of out . d out
            delta = (out.float() * grad.float()).sum(-1)  # (B, L, H)
            d_sinks = -(torch.exp(sinks.float() - lse) * delta).sum((0, 1)).to(sinks.dtype)
        return d_query.to(ctx.dtypes[0]), d_row.to(ctx.dtypes[1]), None, d_sinks, None, None


def _triton_loaded():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return SparseLatentTriton.apply


def _probe(fn, device: torch.device, generator: torch.Generator) -> None:
    """The kernel in bf16, forward and backward, held to the torch form (output and every gradient): 4 queries of 3
    heads, 5 picks of 8 rows (one hidden), once with a rotated part and once without one but with sinks (DeepSeek-V4's
    layout): a kernel that runs but answers otherwise on this device fails its probe too."""
    for width, rank, with_sinks in ((24, 16, False), (16, 16, True)):
        def rand(*shape):
            return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16).requires_grad_()

        query, row = rand(1, 4, 3, width), rand(1, 8, width)
        sinks = torch.randn(3, generator=generator, device=device).requires_grad_() if with_sinks else None
        picks = torch.randint(0, 8, (1, 4, 5), generator=generator, device=device)
        picks[0, :, 0] = -1
        out = fn(query, row, picks, sinks, 0.2, rank)
        out.float().sum().backward()
        leaves = [x.detach().float().requires_grad_() for x in (query, row)]
        wide_sinks = sinks.detach().clone().requires_grad_() if with_sinks else None
        expected = sparse_latent_reference(leaves[0], leaves[1], picks, 0.2, rank, wide_sinks)
        expected.sum().backward()
        pairs = [(out, expected), (query.grad, leaves[0].grad), (row.grad, leaves[1].grad)]
        pairs += [(sinks.grad, wide_sinks.grad)] if with_sinks else []
        for got, want in pairs:
            got, want = got.detach().float(), want.detach()
            error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            if not error < 0.05:
                raise RuntimeError(f"the kernel's results are {error:.3g} (relative) from the torch form's")


def index_scores_kernel(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                        limit: torch.Tensor) -> torch.Tensor:
    """The indexer's scores on the Triton kernel: q (B, l, H, D), keys (B, T, D), weights (B, l, H), limit (l,) each
    query's first unscored key -> (B, l, T) float32, ``sum_h w_h relu(scale q_h . k)`` (-inf from the limit on).
    q and keys both bf16 (or both fp16) are multiplied as such (on tensor cores; their products are exact in float32),
    anything else in float32; every sum is float32's."""
    from . import sparse_latent_triton as kernel

    narrow = q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16)
    dtype = q.dtype if narrow else torch.float32
    return kernel.index_scores(q.to(dtype).contiguous(), keys.to(dtype).contiguous(), weights.float().contiguous(),
                               scale, limit.contiguous())


def _index_reference(q, keys, weights, scale, limit):
    scores = torch.relu(torch.einsum("blhd,btd->blht", q, keys) * scale)
    out = torch.einsum("blh,blht->blt", weights, scores)
    return out.masked_fill(torch.arange(keys.shape[1], device=q.device) >= limit[:, None], float("-inf"))


def _triton_index_loaded():
    return index_scores_kernel if _triton_loaded() is not None else None


def _probe_index(fn, device: torch.device, generator: torch.Generator, narrow: torch.dtype = torch.bfloat16) -> None:
    """The indexer kernel on 40 queries of 3 heads against 70 keys (tiles cut at both ends), in float32 and in
    ``narrow`` (a bf16 model's values: tensor-core products), held to torch's float32 scores of the same values."""
    q, keys = (torch.randn(*shape, generator=generator, device=device) for shape in ((1, 40, 3, 24), (1, 70, 24)))
    weights = torch.randn(1, 40, 3, generator=generator, device=device)
    limit = torch.arange(30, 70, device=device)
    for dtype in (torch.float32, narrow):
        q, keys = q.to(dtype), keys.to(dtype)
        got = fn(q, keys, weights, 0.3, limit)
        want = _index_reference(q.float(), keys.float(), weights, 0.3, limit)
        if not torch.equal(got.isinf(), want.isinf()) or not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
            raise RuntimeError(f"the indexer kernel's scores in {dtype} differ from torch's")


PROBE = KernelProbe({"sparse_latent": Kernel("triton", _triton_loaded, _probe),
                     "index_scores": Kernel("triton", _triton_index_loaded, _probe_index)})


def uses_kernel(x: torch.Tensor, name: str = "sparse_latent") -> bool:
    """Whether the Triton kernel ``name`` (``"sparse_latent"``: :func:`sparse_latent_attention`'s; ``"index_scores"``:
    :func:`index_scores_kernel`) runs for tensors like ``x``: on CUDA, in bf16, fp16 or fp32 (float64 runs the torch
    form), Triton installed, its probe passed there; never on fake tensors (a rehearsal measures the torch form's
    memory), nor, for ``"sparse_latent"``, whose backward adds each row's gradient with atomic adds, under
    ``torch.use_deterministic_algorithms`` (the torch form's ``index_add_`` is deterministic there)."""
    if x.device.type != "cuda" or torch._subclasses.fake_tensor.is_fake(x) or x.dtype not in KERNEL_DTYPES:
        return False
    if name == "sparse_latent" and torch.are_deterministic_algorithms_enabled():
        return False
    return PROBE.works(name, x.device)


# the dtypes the kernels keep their sums in float32 for (a float64 model runs the torch form, in float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def sparse_latent_attention(query: torch.Tensor, row: torch.Tensor, picks: torch.Tensor, scale: float, rank: int,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L, H, R + Dr), (B, T, R + Dr), (B, L, K) -> (B, L, H, R): the module docstring's attention, on the Triton
    kernel where :func:`uses_kernel`, else in torch by blocks of queries (:mod:`.sparse_latent_blocks`)."""
    if uses_kernel(row):
        return SparseLatentTriton.apply(query, row, picks, sinks, scale, rank)
    return sparse_latent_blocks(query[..., :rank], query[..., rank:], row, picks, scale, sinks)
