"""A Mamba2 layer run on every rank of a spawned group (see conftest.Pools), its collectives counted by
``seqmesh.comm.stats.comm_stats``: what the planner's byte formula is checked against."""

from __future__ import annotations

import torch

import seqmesh
from dist_cases import get_mesh
from family_cases import build, family_config
from seqmesh.comm.stats import comm_stats
from seqmesh.hf.mamba2 import mamba2_forward
from seqmesh.sequence.batch import SequenceInfo


def mamba2_layer_bytes(ulysses: int, ring: int, seq_len: int, batch: int, layout: str, design: str) -> dict:
    """Layer 0 of the tiny Nemotron-H (a Mamba2 mixer: 4 heads of 16, state 8, 2 groups, conv 4) in float32 on this
    rank's tokens by ``design``, forward and backward: the bytes and calls of its all-gathers and all-to-alls
    (forward) and of its reduce-scatters and all-to-alls (backward), and the output's distance from the layer on the
    whole sequence, relative to its largest value (so the run counted is a right one)."""
    mesh = get_mesh(ulysses, ring)
    mixer = build(family_config("nemotron-h")).model.layers[0].mixer.float()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, mixer.hidden_size, generator=g)
    want = mixer(hidden)  # transformers' own torch path on the whole sequence
    local = seqmesh.shard_sequence(hidden, mesh, layout=layout).clone().requires_grad_(True)
    info = SequenceInfo(seq_len=seq_len, cu_seqlens=None, layout=layout)
    with comm_stats() as stats:
        out = mamba2_forward(mixer, local, mesh, info, design)
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout=layout, length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want.detach()).abs().max() / want.abs().max())}
