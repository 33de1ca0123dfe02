"""The Ulysses head deal on tensors: which local kv head each local query head reads.

Which heads each rank works on is :mod:`seqmesh.rules.heads` (``HeadDeal``), the one rule the engine and
the planner share; :class:`HeadPlan` adds what only the kernels need.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..rules.heads import HeadDeal


@dataclass(frozen=True)
class HeadPlan(HeadDeal):
    """:class:`seqmesh.rules.heads.HeadDeal` (the rule, shared with the planner) with the kernel's kv head map."""

    def kv_map(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Local kv head of each local query head, or None when they group evenly (the kernel's own
        grouped-query support then applies). Built and copied to ``device`` once per plan and rank."""
        return _kv_map(self, rank, torch.device(device))


@functools.lru_cache(maxsize=64)
def _kv_map(plan: HeadPlan, rank: int, device: torch.device) -> torch.Tensor | None:
    (qa, qb), (ka, _) = plan.q_range(rank), plan.kv_range(rank)
    local = [h // plan.group - ka for h in range(qa, qb)]
    nq, nk = qb - qa, plan.kv_count(rank)
    if nq % nk == 0 and local == [j // (nq // nk) for j in range(nq)]:
        return None
    return torch.tensor(local, dtype=torch.long, device=device)
