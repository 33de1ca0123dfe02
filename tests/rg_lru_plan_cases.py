"""A RecurrentGemma recurrent block run on every rank of a spawned group (see conftest.Pools), its collectives counted
by ``seqmesh.comm.stats.comm_stats``: what the planner's byte formulas are checked against."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from family_cases import build, family_config
from seqmesh.comm.stats import comm_stats
from seqmesh.hf.rg_lru import rg_lru_block
from seqmesh.linear_attention import halo


def rg_lru_layer_bytes(ulysses: int, ring: int, seq_len: int, batch: int, layout: str) -> dict:
    """Layer 0 of the tiny RecurrentGemma (a recurrent block: hidden 32, lru_width 48, conv width 4) in float32 on
    this rank's tokens, forward and backward: the bytes and calls of its all-gathers (forward) and reduce-scatters
    (backward), and the output's distance from transformers' block on the whole sequence, relative to its largest
    value (a right run counted)."""
    mesh = get_mesh(ulysses, ring)
    block = build(family_config("recurrent_gemma")).model.layers[0].temporal_block.float()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, block.hidden_size, generator=g)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    want = block(hidden, positions, None, use_cache=False)[0]  # transformers' own path on the whole sequence
    local = seqmesh.shard_sequence(hidden, mesh, layout=layout).clone().requires_grad_(True)
    local_positions = seqmesh.shard_sequence(positions, mesh, layout=layout)
    place = halo.placement(mesh, local.shape[1], layout=layout, seq_len=seq_len, kernel=block.conv1d_width)
    with comm_stats() as stats:
        out = rg_lru_block(block, local, local_positions, place)
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout=layout, length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want.detach()).abs().max() / want.abs().max())}
