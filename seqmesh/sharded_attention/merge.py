"""Exact merging of partial attention results through their log-sum-exp, in float32 or wider, and
attention sinks folded into the merged result once."""

from __future__ import annotations

import torch


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial result into the accumulators, in place.

    ``acc_out`` (B, S, H, D) and ``acc_lse`` (B, H, S) are float32 (float64 for float64 inputs) and
    start at 0 and -inf; ``out`` (B, S, H, D) and ``lse`` (B, H, S) come from one kernel call over the
    same rows. Rows where both sides saw no key stay at (0, -inf)::

        lse' = log(e^acc_lse + e^lse),  acc_out' = acc_out * e^(acc_lse - lse') + out * e^(lse - lse')
    """
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    seen = torch.isfinite(new)
    zero = torch.zeros((), dtype=new.dtype, device=new.device)
    keep = torch.where(seen, torch.exp(acc_lse - new), zero).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    take = torch.where(seen, torch.exp(lse - new), zero).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(keep).add_(out.to(acc_out.dtype) * take)
    acc_lse.copy_(new)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a learned per-head logit to every row's softmax denominator (gpt-oss ``s_aux``): a key
    with score ``sinks[h]`` and a zero value. ``out`` (B, S, H, Dv) and ``lse`` (B, H, S) are the
    merged result of all keys; returns them with the sink, in ``lse``'s dtype::

        lse' = log(e^lse + e^sink),   out' = out * e^(lse - lse')

    Backward through the kernels stays exact when they are given ``out'`` and ``lse'``: the sink's
    zero value adds nothing to ``dout . out'``, the row term of every softmax gradient."""
    sink = sinks.to(lse.dtype)[None, :, None]  # (1, H, 1)
    new = torch.logaddexp(lse, sink)
    scale = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1); 0 for rows that saw no key
    return out.to(lse.dtype) * scale, new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d loss / d sinks`` (H,) from the rows held here, given the final ``out'`` and ``lse'`` of
    :func:`fold_sinks`. The sink's probability is ``p = e^(sink - lse')`` and its value is zero, so
    ``d sink = sum over rows of p * (0 - dout . out')``."""
    ct = lse.dtype
    p_sink = torch.exp(sinks.to(ct)[None, :, None] - lse)  # (B, H, S)
    row = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)  # (B, H, S)
    return -(p_sink * row).sum(dim=(0, 2)).to(sinks.dtype)
