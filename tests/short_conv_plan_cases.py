"""An LFM2 gated short-conv layer run on every rank of a spawned group (see conftest.Pools), its collectives counted
by ``seqmesh.comm.stats.comm_stats``: what the planner's byte formula is checked against."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from family_cases import build, family_config
from seqmesh.comm.stats import comm_stats
from seqmesh.hf.short_conv import gated_short_conv
from seqmesh.linear_attention import halo


def short_conv_layer_bytes(ulysses: int, ring: int, seq_len: int, batch: int, layout: str) -> dict:
    """Layer 0 of the tiny LFM2 (a gated short conv: hidden 32, width 3) in float32 on this rank's tokens, forward
    and backward: the bytes and calls of its all-gathers (forward) and reduce-scatters (backward), and the output's
    distance from transformers' layer on the whole sequence, relative to its largest value (a right run counted)."""
    mesh = get_mesh(ulysses, ring)
    layer = build(family_config("lfm2")).model.layers[0].conv.float()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, layer.conv.in_channels, generator=g)
    want = layer(hidden)  # transformers' own path on the whole sequence
    local = seqmesh.shard_sequence(hidden, mesh, layout=layout).clone().requires_grad_(True)
    place = halo.placement(mesh, local.shape[1], layout=layout, seq_len=seq_len, kernel=layer.conv.weight.shape[-1])
    with comm_stats() as stats:
        out = gated_short_conv(layer, local, place)
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout=layout, length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want.detach()).abs().max() / want.abs().max())}
