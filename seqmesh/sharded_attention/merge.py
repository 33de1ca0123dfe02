"""Exact merging of partial attention results through their log-sum-exp, in float32 or wider."""

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
