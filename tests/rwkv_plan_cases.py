"""An RWKV-4 block's two token mixes, and an xLSTM mLSTM layer, run on every rank of a spawned group (see
conftest.Pools), their collectives counted by ``seqmesh.comm.stats.comm_stats``: what the planner's byte formulas are
checked against."""

from __future__ import annotations

import types

import torch

import seqmesh
from dist_cases import get_mesh
from family_cases import build, family_config
from seqmesh.comm.stats import comm_stats
from seqmesh.hf import rwkv
from seqmesh.sequence.batch import SequenceInfo


def rwkv_block_bytes(ulysses: int, ring: int, seq_len: int, batch: int, layout: str) -> dict:
    """Block 0 of the tiny RWKV in float32 on this rank's tokens: its time mix, then its channel mix (each on the
    block's input, as seqmesh runs them), forward and backward; the bytes and calls of the all-gathers (forward) and
    reduce-scatters (backward), and the mixes' distance from transformers' own on the whole sequence, relative to
    their largest value (a right run counted)."""
    mesh = get_mesh(ulysses, ring)
    block = build(family_config("rwkv")).rwkv.blocks[0].float()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, block.attention.key.in_features, generator=g)
    want = torch.cat([block.attention(hidden)[0], block.feed_forward(hidden)[0]], dim=-1).detach()
    local = seqmesh.shard_sequence(hidden, mesh, layout=layout).clone().requires_grad_(True)
    info = SequenceInfo(seq_len=seq_len, cu_seqlens=None, layout=layout)
    mixes = [types.MethodType(rwkv._make_forward(m, mesh, "auto"), m) for m in (block.attention, block.feed_forward)]
    with comm_stats() as stats:
        out = torch.cat([mix(local, seqmesh=info)[0] for mix in mixes], dim=-1)
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout=layout, length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want).abs().max() / want.abs().max())}


def mlstm_layer_bytes(ring: int, seq_len: int, batch: int) -> dict:
    """Block 0's mLSTM layer of the tiny xLSTM in float32 on this rank's tokens (zigzag), forward and backward: the
    bytes and calls of its all-gathers (forward) and reduce-scatters (backward), and its distance from transformers'
    own layer on the whole sequence, relative to its largest value (a right run counted)."""
    from seqmesh.hf import xlstm

    mesh = get_mesh(1, ring)
    model = build(family_config("xlstm")).float()
    model.train()
    layer = model.backbone.blocks[0].mlstm_layer
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, seq_len, model.config.hidden_size, generator=g)
    want = layer(hidden)[0].detach()
    local = seqmesh.shard_sequence(hidden, mesh, layout="zigzag").clone().requires_grad_(True)
    info = SequenceInfo(seq_len=seq_len, cu_seqlens=None, layout="zigzag")
    mix = types.MethodType(xlstm._make_forward(layer, mesh, "auto"), layer)
    with comm_stats() as stats:
        out = mix(local, seqmesh=info)[0]
        out.pow(2).sum().backward()
    got = seqmesh.gather_sequence(out.detach(), mesh, layout="zigzag", length=seq_len)
    sent = {(kind, ph): stats.sent(kind, ph) for kind in ("all_gather", "reduce_scatter", "all_to_all")
            for ph in ("forward", "backward")}
    calls = {(kind, ph): stats.count(kind, ph) for kind, ph in sent}
    return {"sent": sent, "calls": calls, "error": float((got - want).abs().max() / want.abs().max())}
