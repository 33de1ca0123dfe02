"""Cross-entropy whose value and gradient equal one device's, whatever the split of the tokens.

The loss of a step is the mean over every valid target of the whole batch (all data-parallel
samples, all sequence shards), as one device computing the whole batch would report it. Each rank
computes the *sum* over its own targets; one all-reduce of ``(sum, count)`` over the pooling group
gives the global mean. The returned tensor has that mean as its value on every rank, and as its
gradient ``d(local sum) / global count``, so that summing gradients over the ranks (FSDP with a
divide factor of 1, or :func:`seqmesh.model.fsdp.sync_gradients`) gives exactly the one-device gradient.
A group without a single valid target gets loss 0 and zero gradients.

``chunked_linear_cross_entropy`` computes the LM head and the loss tile by tile, so the
``(tokens, vocab)`` logits of the local shard never exist at once (for a 128K vocabulary they are
the largest tensor of training); each tile's gradients are made in the same pass, so the logits are made once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.collectives import all_reduce_
from ..tensor_values import has_values
from ..sequence.batch import IGNORE_INDEX



def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Losses accumulate in float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def invalid_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """``labels``-shaped bool: targets that are neither ``ignore_index`` nor a class in ``[0, vocab)``."""
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab))


def _describe_invalid(labels: torch.Tensor, bad: torch.Tensor, total_bad: int, vocab: int, ignore_index: int) -> str:
    example = f" (this rank holds e.g. {int(labels[bad][0])})" if bool(bad.any()) else ""
    return (
        f"{total_bad} target label(s) across the group are outside [0, {vocab}) and not the ignore index "
        f"{ignore_index}{example}. Labels must be token ids below the vocabulary size, or {ignore_index} for "
        "positions not to score; if your data marks those with another value, pass that value as ignore_index "
        "to seqmesh.shard_batch and to the loss alike."
    )


def pool_sum(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Value: ``local`` summed over ``group`` (one all-reduce of its detached copy); gradient: d(local) only,
    so each rank's gradient flows through its own tokens and summing gradients over the ranks gives the
    whole batch's. The one pooling rule of every loss term (cross-entropy, router load balancing)."""
    totals = local.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        all_reduce_(totals, group)
    return local + (totals - local.detach())


def pool_mean(
    local_sum: torch.Tensor, local_count: torch.Tensor, group: dist.ProcessGroup | None,
    local_invalid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Value: sum over ``group`` / count over ``group``; gradient: d(local_sum) / count over ``group``.
    Also returns the group's total of ``local_invalid`` (bad labels), pooled in the same all-reduce."""
    wide = wide_dtype(local_sum.dtype)
    invalid = local_invalid if local_invalid is not None else torch.zeros((), device=local_sum.device)
    totals = pool_sum(torch.stack([local_sum.to(wide), local_count.detach().to(wide), invalid.detach().to(wide)]), group)
    # a fake tensor (seqmesh rehearse) has no labels to count: none are reported bad
    return totals[0] / totals[1].detach().clamp(min=1.0), int(totals[2]) if has_values(totals) else 0


def checked_mean(
    local_sum: torch.Tensor, labels: torch.Tensor, bad: torch.Tensor, group: dist.ProcessGroup | None,
    vocab: int, ignore_index: int,
) -> torch.Tensor:
    """Pool the loss and the count of bad labels in one all-reduce; raise on every rank if any is bad."""
    mean, total_bad = pool_mean(local_sum, ((labels != ignore_index) & ~bad).sum(), group, bad.sum())
    if total_bad:
        raise ValueError(_describe_invalid(labels, bad, total_bad, vocab, ignore_index))
    return mean


def sequence_parallel_cross_entropy(
    logits: torch.Tensor, shift_labels: torch.Tensor, group: dist.ProcessGroup | None, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean next-token loss over the valid targets of every rank of ``group``.

    ``logits`` ``(B, L, V)`` and ``shift_labels`` ``(B, L)`` are this rank's tokens, labels already
    shifted (``seqmesh.shard_batch`` does it before slicing). Computed in float32 (float64 for float64).
    """
    flat = shift_labels.reshape(-1)
    vocab = logits.shape[-1]
    bad = invalid_labels(flat, vocab, ignore_index)  # masked here, reported on every rank after the pooling
    safe = flat.masked_fill(bad, ignore_index)
    local_sum = F.cross_entropy(logits.reshape(-1, vocab).to(wide_dtype(logits.dtype)), safe, ignore_index=ignore_index, reduction="sum")
    return checked_mean(local_sum, flat, bad, group, vocab, ignore_index)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The LM head's matmul dtype: autocast's when it is on (as ``F.linear`` would use), else the
    inputs' common dtype. Forward and the backward's recomputation must agree on it."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in place (Gemma 2's final soft-cap), or ``logits`` as they are."""
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, wide: torch.dtype) -> torch.Tensor:
    """One tile's logits in ``wide``: ``h @ w.T`` in the matmul dtype, plus the head's bias (Phi's) where it has one,
    added as ``F.linear`` adds it, in the matmul dtype."""
    return (h @ w.t() if bias is None else torch.addmm(bias, h, w.t())).to(wide)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy of ``hidden @ weight.T + bias`` (soft-capped where asked), tile by tile, with its
    gradients made in the same pass: each tile's logits are made once, their softmax less the one-hot target is the
    tile's logit gradient, and its two products go straight into ``d(hidden)`` and ``d(weight)`` (``d(bias)``, through
    the cap's ``1 - tanh^2``). Backward only scales them by the loss's incoming gradient, a scalar: the logits are
    never made a second time (the head's work is 6 FLOPs a weight and token, as with full logits, not 8).

    ``grads`` ``(hidden, weight, bias)``: which of the three want a gradient; with none (evaluation, ``no_grad``) the
    forward makes only the loss. The unscaled gradients are saved for backward (``d(weight)`` in float32)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, softcap=None, bias=None,  # type: ignore[override]
                grads=(False, False, False)):
        # hidden (N, H), weight (V, H), labels (N,), bias (V,) or None
        wide = wide_dtype(hidden.dtype)
        mm = matmul_dtype(hidden, weight)
        w = weight.to(mm)
        b = None if bias is None else bias.to(mm)
        want_hidden, want_weight, want_bias = grads[0], grads[1], grads[2] and bias is not None
        # the logits' gradient, unscaled: backward multiplies by the incoming scalar (its adjoint)
        d_hidden = torch.empty_like(hidden) if want_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_weight else None
        d_bias = torch.zeros(bias.shape, dtype=wide, device=bias.device) if want_bias else None
        total = hidden.new_zeros((), dtype=wide)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen explicitly above
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk].to(mm)
                target = labels[start : start + chunk]
                valid = target != ignore_index
                logits = _capped(_logits(h, w, b, wide), softcap)  # (n, V)
                tile_lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += ((tile_lse - picked) * valid).sum()
                if not (want_hidden or want_weight or want_bias):
                    del logits  # freed before the next tile's are made
                    continue
                # one (n, V) buffer, updated in place: softmax, minus one-hot, masked
                slope = None if softcap is None else 1 - (logits / softcap).square_()  # d(capped) / d(logits)
                d_logits = logits.sub_(tile_lse.unsqueeze(1)).exp_()
                d_logits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -valid.unsqueeze(1).to(wide))
                d_logits.mul_(valid.unsqueeze(1))
                if slope is not None:
                    d_logits.mul_(slope)
                if d_bias is not None:
                    d_bias += d_logits.sum(0)
                d_logits = d_logits.to(mm)  # tensor-core matmuls; d_weight accumulates wider
                del logits, slope  # in bf16, the float32 tile is freed before the matmuls below rather than after
                add_tile_products(d_logits, h, w, d_hidden, d_weight, slice(start, start + chunk))
                del d_logits  # freed before the next tile's logits are made
        ctx.save_for_backward(d_hidden, d_weight, d_bias)  # released after the backward unless the graph is retained
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        return (scaled(d_hidden, grad), scaled(d_weight, grad, weight_dtype), None, None, None, None,
                scaled(d_bias, grad, bias_dtype), None)


def add_tile_products(d_logits: torch.Tensor, h: torch.Tensor, w: torch.Tensor, d_hidden: torch.Tensor | None,
                      d_weight: torch.Tensor | None, rows: slice) -> None:
    """One tile's logit gradient ``d_logits`` ``(n, V)`` (unscaled, in the matmul dtype of ``h`` ``(n, H)`` and ``w``
    ``(V, H)``) through the head: ``d_logits @ w`` into ``d_hidden[rows]`` and ``d_logits^T @ h`` added to
    ``d_weight`` (float32). Either gradient may be None (not wanted). The one tile step of the chunked and the
    vocabulary-parallel loss."""
    if d_hidden is not None:
        d_hidden[rows] = (d_logits @ w).to(d_hidden.dtype)
    if d_weight is not None:
        d_weight += (d_logits.t() @ h).to(d_weight.dtype)


def scaled(gradient: torch.Tensor | None, grad: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``gradient * grad`` (the loss's incoming scalar) as a new tensor in ``dtype`` (default: ``gradient``'s),
    computed wide and rounded once, or None for None: the backward of a loss whose forward made its gradients, the
    saved ones left as they were for a second backward through a retained graph."""
    if gradient is None:
        return None
    out = torch.empty(gradient.shape, dtype=dtype or gradient.dtype, device=gradient.device)
    return torch.mul(gradient, grad, out=out)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    chunk: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sequence_parallel_cross_entropy` of ``hidden @ weight.T + bias`` without materialising the logits;
    ``softcap``: the logits capped as ``softcap * tanh(z / softcap)`` first (Gemma 2's final soft-cap); ``bias``
    ``(V,)``: the LM head's (Phi's), or None.

    ``hidden`` ``(B, L, H)``, ``weight`` ``(V, H)`` (the LM head), ``shift_labels`` ``(B, L)``;
    at most ``chunk`` tokens' logits exist at a time.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}.")
    flat_labels = shift_labels.reshape(-1)
    bad = invalid_labels(flat_labels, weight.shape[0], ignore_index)  # masked here, reported after pooling
    safe = flat_labels.masked_fill(bad, ignore_index)
    grads = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
    local_sum = ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, safe, chunk, ignore_index,
                                                softcap, bias, grads)
    return checked_mean(local_sum, flat_labels, bad, group, weight.shape[0], ignore_index)
