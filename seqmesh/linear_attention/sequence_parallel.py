"""Gated DeltaNet with the sequence sharded over ``P = ring x ulysses`` ranks, exactly.

Design: one all-to-all over the *whole* sequence group (ring and Ulysses ranks together) trades
sequence for heads. Every rank then holds the whole sequence, in natural order, for a subset of
the value heads (and the key heads they read), and runs the causal conv and the recurrence there
with no further communication; the inverse all-to-all returns each token's output to the rank
that holds it in the layout (zigzag or contiguous). The ring axis is not used by these layers, so
Ulysses, ring and USP meshes are all exact by the same code::

    local tokens (B, L, hidden) --projections (local)--> [q | k | v | b | a] (B, L, C)
      --all-to-all over P (channels of each rank's heads)--> (B, S, C_r), layout order -> natural
      --conv (rank's channel slice), gates (A_log, dt_bias sliced), recurrence--> (B, S, h_r, Dv)
      --natural -> layout order, inverse all-to-all--> (B, L, Hv, Dv)
      --gated norm with z (never communicated), out projection (local)--> (B, L, hidden)

Heads are dealt as Ulysses deals attention heads (``sharded_attention.heads.HeadPlan``, value heads
in the role of query heads): value heads in contiguous ranges, each rank receiving the key heads
those read. With fewer key heads than ``P``, neighbouring ranks receive the same key head
(replication); the backward of the all-to-all sums its gradients. ``P`` must not exceed the value
heads.

Traffic per layer and rank, with ``L = S / P`` local tokens, ``h_u`` value heads and ``k_u`` key
heads on rank ``u``, ``c_u = 2 k_u Dk + h_u (Dv + 2)`` its input channels (elements of the
activation dtype)::

    forward:  B * L * (sum_{u != me} c_u  +  (P - 1) h_me Dv)
    backward: B * L * ((P - 1) c_me  +  (Hv - h_me) Dv)
    even split, no replication, each: B * S * (P - 1) / P^2 * (2 Hk Dk + Hv (2 Dv + 2))

(``seqmesh.planner.traffic.linear_attention_traffic`` derives it independently; tests check it
against ``comm_stats``.) With Qwen3.5-9B's heads (Hk = 16, Hv = 32, Dk = Dv = 128), S = 128K, P = 8
and bf16 that is 354 MB per layer and rank forward (and again backward): the bytes of a Ulysses
attention layer of the same model (352 MB for its 16 + 2 x 4 + 16 heads of 256).

Memory: each rank holds ``1/P`` of the layer's channels over the whole sequence, the same size as
its share of the local activations; the recurrence keeps one float32 (Dk x Dv) state per head and
64-token chunk for backward (the planner's ``GatedDeltaNet.saved_bytes``). Latency: two all-to-alls
each way, no sequential dependence between ranks.

The alternative keeps heads whole and passes the recurrent state between the ranks instead
(``state_passing.py``: bytes independent of ``S``, no limit on heads, about twice the recurrence's
FLOPs); ``choice.choose_design`` picks between the two per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm.collectives import head_to_seq, seq_to_head
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sequence.sharding import sequence_layout
from ..mesh import SPMesh
from ..sharded_attention.heads import HeadPlan
from .gated_delta import segment_bounds
from .kernels import causal_conv, gated_delta_rule


@dataclass(frozen=True)
class LinearHeads:
    """The head shapes of one Gated DeltaNet layer, dealt to ``ranks`` ranks."""

    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    ranks: int

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ValueError(f"{self.value_heads} linear value heads are not a multiple of {self.key_heads} key heads.")
        if self.ranks > self.value_heads:
            raise ValueError(
                f"the Gated DeltaNet layers have {self.value_heads} value heads, fewer than the {self.ranks} ranks of the "
                f"sequence group (ulysses x ring): each rank runs the recurrence of at least one head. Use a sequence "
                f"degree of at most {self.value_heads}."
            )

    @property
    def plan(self) -> HeadPlan:
        return HeadPlan(self.value_heads, self.key_heads, self.ranks)

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def channels(self) -> int:
        """Channels of the packed input: q, k, v (the conv's), then b and a (one per value head)."""
        return self.conv_dim + 2 * self.value_heads

    def send_chunks(self) -> list[tuple[int, int, int]]:
        """Destination-major channel ranges of the packed input each rank receives."""
        kd, dk, dv, plan = self.key_heads * self.key_dim, self.key_dim, self.value_dim, self.plan
        chunks = []
        for u in range(self.ranks):
            (k0, k1), (v0, v1) = plan.kv_range(u), plan.q_range(u)
            chunks += [(0, k0 * dk, k1 * dk), (0, kd + k0 * dk, kd + k1 * dk), (0, 2 * kd + v0 * dv, 2 * kd + v1 * dv),
                       (0, self.conv_dim + v0, self.conv_dim + v1),
                       (0, self.conv_dim + self.value_heads + v0, self.conv_dim + self.value_heads + v1)]
        return chunks

    def in_channels(self, rank: int) -> int:
        plan = self.plan
        return 2 * plan.kv_count(rank) * self.key_dim + plan.q_count(rank) * (self.value_dim + 2)

    def route(self, rank: int, device: torch.device | str = "cpu") -> Route:
        """What ``rank`` sends, receives and indexes for these heads, built once per heads, rank and device."""
        return _route(self, rank, torch.device(device))


@dataclass(frozen=True)
class Route:
    """One rank's share of a :class:`LinearHeads` deal: the all-to-all chunks and counts both ways, and
    the index tensors its conv and recurrence read (on the device of its activations)."""

    send_chunks: tuple[tuple[int, int, int], ...]  # input all-to-all: destination-major channel ranges
    sends: tuple[int, ...]  # input channels each rank receives
    out_chunks: tuple[tuple[int, int, int], ...]  # output all-to-all: each rank's value-head range
    out_counts: tuple[int, ...]  # value heads of each rank
    key_heads: int  # this rank's key heads
    value_heads: tuple[int, int]  # this rank's value heads [v0, v1)
    conv_channels: torch.Tensor  # (conv channels of the rank,) indices into q | k | v, in the order received
    key_of: torch.Tensor  # (value heads of the rank,) the local key head each reads


@functools.lru_cache(maxsize=64)
def _route(heads: LinearHeads, rank: int, device: torch.device) -> Route:
    plan = heads.plan
    chunks = heads.send_chunks()
    (k0, k1), (v0, v1) = plan.kv_range(rank), plan.q_range(rank)
    group = heads.value_heads // heads.key_heads
    return Route(
        send_chunks=tuple(chunks),
        sends=tuple(heads.in_channels(u) for u in range(heads.ranks)),
        out_chunks=tuple((0, *plan.q_range(u)) for u in range(heads.ranks)),
        out_counts=tuple(plan.q_count(u) for u in range(heads.ranks)),
        key_heads=k1 - k0,
        value_heads=(v0, v1),
        conv_channels=torch.cat([torch.arange(a, b) for _, a, b in chunks[5 * rank : 5 * rank + 3]]).to(device),
        key_of=torch.tensor([h // group - k0 for h in range(v0, v1)], dtype=torch.long, device=device),
    )


@dataclass(frozen=True)
class GateParams:
    """The layer's own parameters that act on the communicated channels."""

    conv_weight: torch.Tensor  # (conv_dim, K)
    conv_bias: torch.Tensor | None  # (conv_dim,)
    A_log: torch.Tensor  # (Hv,)
    dt_bias: torch.Tensor  # (Hv,)
    activation: str = "silu"
    beta_scale: float = 1.0  # 2.0 lets beta reach (0, 2) (negative eigenvalues, OLMo-hybrid)


def gated_delta_heads(
    packed: torch.Tensor, params: GateParams, heads: LinearHeads, rank: int, bounds: tuple[int, ...]
) -> torch.Tensor:
    """The token mixer on whole sequences for ``rank``'s heads: ``packed`` (B, S, in_channels(rank))
    in natural order -> (B, S, h_rank, Dv)."""
    route = heads.route(rank, packed.device)
    nk, (v0, v1) = route.key_heads, route.value_heads
    conv_in, beta_in, a_in = packed.split([2 * nk * heads.key_dim + (v1 - v0) * heads.value_dim, v1 - v0, v1 - v0], dim=-1)
    weight = params.conv_weight.index_select(0, route.conv_channels)
    bias = None if params.conv_bias is None else params.conv_bias.index_select(0, route.conv_channels)
    mixed = causal_conv(conv_in, weight, bias, bounds, params.activation)  # (B, S, conv channels of the rank)
    return gated_delta_rule(*rule_inputs(mixed, beta_in, a_in, params, heads, rank), bounds)


def rule_inputs(
    mixed: torch.Tensor, beta_in: torch.Tensor, a_in: torch.Tensor, params: GateParams, heads: LinearHeads, rank: int
) -> tuple[torch.Tensor, ...]:
    """The recurrence's inputs for ``rank``'s heads from the conv's output ``mixed`` (B, S, conv channels of
    the rank) and the gate channels (B, S, h_rank) each: q, k (B, S, h, Dk), v (B, S, h, Dv), g, beta (B, S, h)."""
    b, s, _ = mixed.shape
    route = heads.route(rank, mixed.device)
    nk, (v0, v1) = route.key_heads, route.value_heads
    nv = v1 - v0
    q, k, v = mixed.split([nk * heads.key_dim, nk * heads.key_dim, nv * heads.value_dim], dim=-1)
    q = q.reshape(b, s, nk, heads.key_dim).index_select(2, route.key_of)  # (B, S, h, Dk): one key head per value head
    k = k.reshape(b, s, nk, heads.key_dim).index_select(2, route.key_of)
    v = v.reshape(b, s, nv, heads.value_dim)
    beta = beta_in.sigmoid() * params.beta_scale if params.beta_scale != 1.0 else beta_in.sigmoid()
    g = -params.A_log[v0:v1].float().exp() * F.softplus(a_in.float() + params.dt_bias[v0:v1])  # (B, S, h)
    return q, k, v, g, beta


def sequence_parallel_gated_delta(
    packed: torch.Tensor,
    params: GateParams,
    heads: LinearHeads,
    mesh: SPMesh,
    *,
    layout: str,
    seq_len: int,
    cu_seqlens: tuple[int, ...] | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
) -> torch.Tensor:
    """``packed`` (B, L, channels): this rank's tokens in the layout's order, channels q | k | v | b | a
    before the conv -> (B, L, Hv, Dv), the recurrence's output for those tokens (before the gated norm).

    ``seq_len``: real tokens (later positions are the layout's padding); ``cu_seqlens``: packed
    documents over the whole sequence. The state and the conv restart at each document. ``layout``,
    ``cu_seqlens`` and ``min_chunk`` are those the tokens were placed with (``seqmesh.shard_sequence``)."""
    p = mesh.sp_size
    if heads.ranks != p:
        raise ValueError(f"heads dealt to {heads.ranks} ranks, but the sequence group has {p}.")
    b, n, c = packed.shape
    if c != heads.channels:
        raise ValueError(f"packed input has {c} channels; the layer's q | k | v | b | a have {heads.channels}.")
    padded = n * p
    bounds = segment_bounds(padded, cu_seqlens, seq_len)
    if p == 1:
        return gated_delta_heads(packed, params, heads, 0, bounds)
    rank, group = mesh.sp_rank, mesh.sp_group
    lay = sequence_layout(mesh, padded, layout, cu_seqlens, min_chunk)  # per_document places tokens by the documents
    route = heads.route(rank, packed.device)
    gathered = seq_to_head([packed.unsqueeze(-1)], group, route.send_chunks, route.sends, route.sends[rank])  # (B, S, c_r, 1)
    natural = gathered.squeeze(-1).index_select(1, lay.indices(restore=True, device=packed.device))
    out = gated_delta_heads(natural, params, heads, rank, bounds)  # (B, S, h_r, Dv)
    out = out.index_select(1, lay.indices(device=out.device))  # layout order
    return head_to_seq(out, group, route.out_chunks, route.out_counts, route.out_counts[rank],
                       torch.Size((b, n, heads.value_heads, heads.value_dim)))
