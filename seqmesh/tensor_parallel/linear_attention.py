"""Gated DeltaNet layers (Qwen3.5's) under tensor parallelism: heads dealt by TP, then the sequence-parallel
all-to-all over the rest.

Tensor-parallel rank ``t`` of ``T`` runs key heads ``[t Hk/T, (t+1) Hk/T)`` and the value heads they serve,
``[t Hv/T, (t+1) Hv/T)`` (each key head serves ``Hv/Hk`` consecutive value heads, so both blocks are
contiguous and the pairing stays on the rank). On a rank holding a sequence shard of ``L`` tokens::

    input                  (B, L/T, hidden) -> (B, L, hidden)                    all-gather
    q, k, v, z, b, a       this rank's rows of each projection, on the L tokens
    conv + recurrence      seqmesh.linear_attention over the sequence group, Hk/T and Hv/T heads
    gated norm             per head, its weight shared by all heads
    out_proj               this rank's value heads' columns -> a partial sum     reduce-scatter -> (B, L/T, hidden)

The layer's weights stay whole on every rank of the group (replicated DTensors, which FSDP2 then shards over
the data and sequence ranks): the projections interleave q, k and v per layer, so a rank's rows are not one
slice a DTensor placement could name, and each rank reads its rows when it computes. Its compute and
activations are 1/T; its weights' gradients (zero outside a rank's rows) are summed over the group, as a
norm's are.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..linear_attention.sequence_parallel import GateParams, LinearHeads, sequence_parallel_gated_delta
from ..comm.ranks import partial_local, summed_to_slices
from ..mesh import SPMesh


def supports(module: nn.Module) -> bool:
    """Whether seqmesh's tensor parallelism runs this Gated DeltaNet layer: Qwen3.5's separate q/k/v, z, b and a
    projections (Qwen3-Next fuses them per key head, OLMo-hybrid names them otherwise; both are refused)."""
    return all(hasattr(module, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"))


def check_heads(module: nn.Module, tp: int, sp: int) -> None:
    """Raise a ValueError, naming the degrees that would work, if ``tp`` cannot deal the layer's heads."""
    hk, hv = module.num_k_heads, module.num_v_heads
    if hk % tp or hv % tp:
        options = [t for t in range(1, hk + 1) if hk % t == 0 and hv % t == 0]
        raise ValueError(f"tp={tp} does not divide the Gated DeltaNet layers' {hk} key and {hv} value heads; "
                         f"use tp in {options}.")
    LinearHeads(hk // tp, hv // tp, module.head_k_dim, module.head_v_dim, sp)  # raises if sp exceeds Hv / tp


def _rows(module: nn.Module, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices of this rank's rows: of the q/k/v projection (and conv), of z, and its value heads."""
    hk, hv, dk, dv = module.num_k_heads // tp, module.num_v_heads // tp, module.head_k_dim, module.head_v_dim
    key_dim = module.num_k_heads * dk
    q = torch.arange(rank * hk * dk, (rank + 1) * hk * dk)
    v = torch.arange(rank * hv * dv, (rank + 1) * hv * dv)
    return torch.cat([q, key_dim + q, 2 * key_dim + v]), v, torch.arange(rank * hv, (rank + 1) * hv)


def _rows_on(module: nn.Module, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`_rows` of this rank, kept on ``device`` after the first step (not copied there every step)."""
    rows = module._seqmesh_tp_rows
    if rows[0].device != device:
        rows = module._seqmesh_tp_rows = tuple(r.to(device) for r in rows)
    return rows


def _make_forward(mesh: SPMesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp_mesh = mesh.tp_mesh

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        info = kwargs.get("seqmesh")
        if info is None or cache_params is not None or kwargs.get("cache") is not None or attention_mask is not None:
            raise ValueError(f"{type(self).__name__} runs tensor- and sequence-parallel: call the model with "
                             "seqmesh.shard_batch's output, without a cache or a padding mask.")
        qkv_rows, v_rows, v_heads = _rows_on(self, hidden_states.device)
        x = partial_local(hidden_states.redistribute(tp_mesh, [Replicate()]))  # (B, L, hidden)
        b, n, _ = x.shape
        mixed = F.linear(x, partial_local(self.in_proj_qkv.weight)[qkv_rows])  # (B, L, this rank's conv channels)
        z = F.linear(x, partial_local(self.in_proj_z.weight)[v_rows])  # (B, L, Hv/T * Dv)
        beta_in = F.linear(x, partial_local(self.in_proj_b.weight)[v_heads])  # (B, L, Hv/T)
        a_in = F.linear(x, partial_local(self.in_proj_a.weight)[v_heads])
        conv = partial_local(self.conv1d.weight).squeeze(1)[qkv_rows]
        bias = partial_local(self.conv1d.bias)[qkv_rows] if self.conv1d.bias is not None else None
        params = GateParams(conv, bias, partial_local(self.A_log)[v_heads], partial_local(self.dt_bias)[v_heads], self.activation)
        heads = LinearHeads(self.num_k_heads // mesh.tp, self.num_v_heads // mesh.tp, self.head_k_dim, self.head_v_dim,
                            mesh.sp_size)
        core = sequence_parallel_gated_delta(torch.cat([mixed, beta_in, a_in], dim=-1), params, heads, mesh,
                                             layout=info.layout, seq_len=info.seq_len, cu_seqlens=info.cu_seqlens)
        rows = lambda t: DTensor.from_local(t.reshape(-1, self.head_v_dim), tp_mesh, [Shard(0)])  # noqa: E731
        normed = self.norm(rows(core), rows(z)).to_local().reshape(b, n, -1)  # per head; the weight replicated
        out = F.linear(normed, partial_local(self.out_proj.weight)[:, v_rows])  # (B, L, hidden), this rank's heads' share
        return summed_to_slices(out, tp_mesh)

    return forward


def shard_gated_delta(module: nn.Module, mesh: SPMesh) -> None:
    """Make ``module`` (a Qwen3.5 Gated DeltaNet layer already given seqmesh's sequence-parallel forward) run
    its share of the heads on this tensor-parallel rank (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    check_heads(module, mesh.tp, mesh.sp_size)
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            whole = DTensor.from_local(p.data, mesh.tp_mesh, [Replicate()], run_check=False)  # the same on every rank
            sub.register_parameter(name, nn.Parameter(whole, requires_grad=p.requires_grad))
    module._seqmesh_tp_rows = _rows(module, mesh.tp_rank, mesh.tp)
    module.forward = types.MethodType(_make_forward(mesh), module)
