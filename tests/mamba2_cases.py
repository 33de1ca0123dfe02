"""What spawned ranks run for tests/hf/test_mamba2.py's traffic test: one Mamba2 layer's sequence mixer by each
design on random float64 inputs, the bytes its collectives send counted by seqmesh.comm.stats."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from seqmesh.comm.stats import comm_stats
from seqmesh.linear_attention.mamba2 import SSDHeads, SSDParams, ssd_all_to_all, ssd_state_passing

HEADS = SSDHeads(heads=4, head_dim=6, groups=2, state=5)
KERNEL = 4


def design_traffic(ulysses: int, ring: int, seq_len: int, layout: str) -> dict:
    """Bytes this rank sends forward by each design (all-to-alls for one, all-gathers for the other), and the
    collectives' counts."""
    mesh = get_mesh(ulysses, ring)
    g = torch.Generator().manual_seed(3)
    xbc = torch.randn(1, seq_len, HEADS.conv_dim, generator=g, dtype=torch.float64)
    dt = torch.randn(1, seq_len, HEADS.heads, generator=g, dtype=torch.float64)
    params = SSDParams(torch.randn(HEADS.conv_dim, KERNEL, generator=g, dtype=torch.float64), None,
                       torch.zeros(HEADS.heads, dtype=torch.float64), torch.zeros(HEADS.heads, dtype=torch.float64),
                       torch.ones(HEADS.heads, dtype=torch.float64))
    local_xbc, local_dt = (seqmesh.shard_sequence(t, mesh, layout=layout) for t in (xbc, dt))
    out = {}
    for name, run in (("state_passing", ssd_state_passing), ("all_to_all", ssd_all_to_all)):
        with comm_stats() as stats, torch.no_grad():
            run(local_xbc, local_dt, params, HEADS, mesh, layout=layout, seq_len=seq_len)
        out[name] = {"all_gather": stats.sent("all_gather", "forward"), "all_to_all": stats.sent("all_to_all", "forward"),
                     "calls": stats.count("all_gather") + stats.count("all_to_all")}
    return out
