"""Kimi Delta Attention with the sequence sharded over ``P = ring x ulysses`` ranks by an all-to-all over heads,
exactly: Gated DeltaNet's first design (``sequence_parallel.py``) for KDA, and the rule that picks between it and
state passing (``kda_state_passing.py``).

Every rank receives the whole sequence of a contiguous range of heads (``seqmesh.rules.heads.HeadDeal``: KDA has as
many key heads as value heads, so nothing is replicated), runs the conv and the recurrence there with no further
communication, and sends each token's output back to the rank that holds it::

    [q | k | v | beta] (B, L, C), g (B, L, H, Dk)   this rank's tokens, layout order
      --two all-to-alls over P (g in its own dtype: transformers' Kimi gate is float32)--> the rank's heads,
        whole sequence, layout order -> natural order
      --conv (the rank's channels of q | k | v), chunked KDA (kernels.kda_rule_states)--> (B, S, h_r, Dv)
      --natural -> layout order, inverse all-to-all--> (B, L, H, Dv)

Bytes each rank sends forward, heads split evenly (the adjoints send the same backward)::

    B S (P - 1) / P^2 H ((2 Dk + 2 Dv + 1) dtype_bytes + Dk g_bytes)

against state passing's ``(P - 1) B (R H Dk (Dk + Dv) state_bytes + T (K - 1) 3 H D dtype_bytes)``, which does not
grow with S but runs Dk more value columns in the recurrence. :func:`choose_kda_design` weighs the two as
``choice.choose_design`` does for Gated DeltaNet. ``P`` must not exceed the heads.
"""

from __future__ import annotations

import torch

from ..comm.collectives import head_to_seq, seq_to_head
from ..rules.degrees import Degrees
from ..rules.heads import HeadDeal
from ..mesh import SPMesh
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sequence.sharding import sequence_layout
from .choice import (H100_NVLINK_BANDWIDTH, H100_RECURRENCE_FLOPS, LinearDesign, LinearShape, parse_design,
                     state_passing_extra_flops)
from .gated_delta import segment_bounds
from .kernels import kda_rule_states
from .kda_state_passing import KdaHeads, kda_state_passing_bytes
from .kernels import causal_conv


def kda_all_to_all_bytes(heads: KdaHeads, *, batch: int, seq_len: int, ranks: int, dtype_bytes: int,
                         g_bytes: int = 4) -> int:
    """Bytes each rank sends forward in the all-to-all design, heads split evenly."""
    per_head = (2 * heads.key_dim + 2 * heads.value_dim + 1) * dtype_bytes + heads.key_dim * g_bytes
    return batch * seq_len * (ranks - 1) * heads.heads * per_head // (ranks * ranks)


def choose_kda_design(heads: KdaHeads, mesh: SPMesh | Degrees, design: str | LinearDesign, *, batch: int,
                      seq_len: int, layout: str, kernel: int, dtype_bytes: int, g_bytes: int = 4,
                      bandwidth: float = H100_NVLINK_BANDWIDTH, flops: float = H100_RECURRENCE_FLOPS) -> LinearDesign:
    """``design`` unless ``auto``: then the design of fewer seconds, bytes over ``bandwidth`` plus state passing's
    extra recurrence over ``flops`` (the all-to-all on a tie, state passing when the heads are fewer than the
    ranks). An explicit all-to-all with more ranks than heads is refused, naming the fix. ``mesh``: its ulysses
    and ring degrees (the planner passes a layout's :class:`~seqmesh.rules.degrees.Degrees`)."""
    design, p = parse_design(design), mesh.ulysses * mesh.ring
    if design is LinearDesign.ALL_TO_ALL and p > heads.heads:
        raise ValueError(f"the KDA layers have {heads.heads} heads, fewer than the {p} ranks of the sequence group: "
                         f"the all-to-all design needs a sequence degree of at most {heads.heads}; choose "
                         "linear_attention='state_passing' (or 'auto'), which keeps every head on every rank.")
    if design is not LinearDesign.AUTO:
        return design
    if p == 1 or p > heads.heads:  # one rank: both are the one-device computation
        return LinearDesign.STATE_PASSING
    state_bytes = 8 if dtype_bytes == 8 else 4
    shape = LinearShape(heads.heads, heads.heads, heads.key_dim, heads.value_dim, kernel, seq_len, batch,
                        mesh.ulysses, mesh.ring, layout, dtype_bytes, state_bytes)
    passing = kda_state_passing_bytes(heads, batch=batch, ulysses=mesh.ulysses, ring=mesh.ring, layout=layout,
                                      kernel=kernel, dtype_bytes=dtype_bytes, state_bytes=state_bytes) / bandwidth \
        + state_passing_extra_flops(shape) / flops
    a2a = kda_all_to_all_bytes(heads, batch=batch, seq_len=seq_len, ranks=p, dtype_bytes=dtype_bytes,
                               g_bytes=g_bytes) / bandwidth
    return LinearDesign.STATE_PASSING if passing < a2a else LinearDesign.ALL_TO_ALL


def all_to_all_kda(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    heads: KdaHeads,
    mesh: SPMesh,
    *,
    layout: str,
    seq_len: int,
    cu_seqlens: tuple[int, ...] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    activation: str | None = "silu",
) -> torch.Tensor:
    """As :func:`seqmesh.linear_attention.kda_state_passing.state_passing_kda` (same arguments, same result):
    ``qkv`` (B, L, 3 H D), ``g`` (B, L, H, Dk), ``beta`` (B, L, H) in the layout's order -> (B, L, H, Dv)."""
    b, n, _ = qkv.shape
    h, dk, dv, p = heads.heads, heads.key_dim, heads.value_dim, mesh.sp_size
    deal, rank = HeadDeal(h, h, p), mesh.sp_rank
    ranges = [deal.q_range(u) for u in range(p)]
    counts = [e - a for a, e in ranges]
    # [q | k | v | beta] channels of each rank's heads, destination-major
    offsets = (0, h * dk, 2 * h * dk, 0)
    widths = (dk, dk, dv, 1)
    chunks = [(int(i == 3), o + a * w, o + e * w) for a, e in ranges for i, (o, w) in enumerate(zip(offsets, widths))]
    sends = [c * (2 * dk + dv + 1) for c in counts]
    received = seq_to_head([qkv.unsqueeze(-1), beta.unsqueeze(-1)], mesh.sp_group, chunks, sends, sends[rank])
    g_mine = seq_to_head([g], mesh.sp_group, [(0, a, e) for a, e in ranges], counts, counts[rank])  # (B, S, h_r, Dk)

    padded = n * p
    bounds = segment_bounds(padded, cu_seqlens, seq_len)
    lay = sequence_layout(mesh, padded, layout, cu_seqlens, min_chunk)
    natural = lay.indices(restore=True, device=qkv.device)
    received, g_mine = received.squeeze(-1).index_select(1, natural), g_mine.index_select(1, natural)
    h_r, (a, e) = counts[rank], ranges[rank]
    conv_in, beta_mine = received.split([h_r * (2 * dk + dv), h_r], dim=-1)
    rows = torch.cat([torch.arange(a * dk, e * dk), torch.arange(h * dk + a * dk, h * dk + e * dk),
                      torch.arange(2 * h * dk + a * dv, 2 * h * dk + e * dv)]).to(qkv.device)
    bias = None if conv_bias is None else conv_bias.index_select(0, rows)
    mixed = causal_conv(conv_in, conv_weight.index_select(0, rows), bias, bounds, activation).to(qkv.dtype)
    q, k, v = mixed.split([h_r * dk, h_r * dk, h_r * dv], dim=-1)
    s = padded
    out, _ = kda_rule_states(q.reshape(b, s, h_r, dk), k.reshape(b, s, h_r, dk), v.reshape(b, s, h_r, dv), g_mine,
                             beta_mine, bounds)  # (B, S, h_r, Dv)
    out = out.index_select(1, lay.indices(device=out.device))  # layout order
    return head_to_seq(out, mesh.sp_group, [(0, a, e) for a, e in ranges], counts, counts[rank],
                       torch.Size((b, n, h, dv)))
