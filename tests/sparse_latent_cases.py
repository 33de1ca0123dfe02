"""The dense reference of token-sparse latent attention (seqmesh.kernels.sparse_latent's math) in plain PyTorch,
shared by the tests of its Triton kernel and of its torch form."""

from __future__ import annotations

import torch


def dense_reference(query, row, picks, scale, rank, sinks=None):
    """query (B, L, H, C), row (B, T, C), picks (B, L, K) (-1: none) -> (B, L, H, rank): every key scored, the
    unselected masked out, one softmax (with a sink logit per head), the selected latents summed."""
    b, length, _ = picks.shape
    seen = torch.zeros(b, length, row.shape[1] + 1, dtype=torch.bool)
    seen.scatter_(2, torch.where(picks >= 0, picks, row.shape[1]), True)  # -1 lands in a spare column
    scores = torch.einsum("blhc,btc->blht", query, row) * scale
    scores = scores.masked_fill(~seen[:, :, None, :-1], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None].expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : row.shape[1]]
    return torch.einsum("blht,btr->blhr", probs, row[..., :rank])
