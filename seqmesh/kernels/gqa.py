"""Grouped-query heads, once: expanding kv heads to the query heads a kernel needs, and the adjoint
that sums query-head gradients back into their kv heads.

Two mappings exist. The grouped one (query head h reads kv head ``h // (Hq / Hk)``) is what every
model and kernel means by GQA. The explicit one (``kv_map[h]`` = kv head of query head h) serves
Ulysses ranks whose query heads do not group evenly over the kv heads they received.
"""

from __future__ import annotations

import torch


def expand_kv_heads(x: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    """Grouped expansion along ``dim``: ``Hk`` kv heads -> ``heads`` query heads (``Hk | heads``)."""
    return x if x.shape[dim] == heads else x.repeat_interleave(heads // x.shape[dim], dim=dim)


def fold_kv_heads(g: torch.Tensor, kv_heads: int, dim: int = 2) -> torch.Tensor:
    """Adjoint of :func:`expand_kv_heads`: sum each run of query-head gradients into its kv head."""
    if g.shape[dim] == kv_heads:
        return g
    shape = list(g.shape)
    grouped = shape[:dim] + [kv_heads, shape[dim] // kv_heads] + shape[dim + 1 :]
    return g.reshape(grouped).sum(dim=dim + 1)


def select_kv_heads(x: torch.Tensor, kv_map: torch.Tensor | None) -> torch.Tensor:
    """(B, S, Hk, D) -> (B, S, len(kv_map), D) by an explicit map; ``None`` leaves ``x`` as it is."""
    return x if kv_map is None else x.index_select(2, kv_map)


def fold_selected_heads(g: torch.Tensor, kv_map: torch.Tensor | None, kv_heads: int) -> torch.Tensor:
    """Adjoint of :func:`select_kv_heads`: (B, S, Hq, D) -> (B, S, kv_heads, D)."""
    if kv_map is None:
        return g
    out = g.new_zeros(g.shape[0], g.shape[1], kv_heads, g.shape[3])
    return out.index_add_(2, kv_map, g)
