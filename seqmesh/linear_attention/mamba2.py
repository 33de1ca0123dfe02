"""Mamba2's token mixer (conv, then the state space dual) with the sequence sharded over ``P = ring x ulysses``
ranks, exactly, by either design::

    state_passing: every rank keeps every head of its own tokens; the conv reads its halo (one all-gather of
                   K - 1 rows per run), the scan runs the rank's runs from zero, then one all-gather of every
                   run's [S_0 | exp(sum g)] and the scan over ranks (decay_scan.pass_decay_states)
    all_to_all:    one all-to-all gives each rank the whole sequence of some heads (their x and dt channels, and
                   the B and C of the groups they read); conv and scan run there; one all-to-all brings each
                   token's output home. Needs P <= heads.

Per layer and rank, forward (backward sends the same through the adjoints), ``c = d_inner + 2 G N`` conv
channels, elements of the activation dtype unless said::

    state_passing: (P - 1) B (runs H P_h N + runs H) state elements (float32) + (P - 1) B tails (K - 1) c
    all_to_all:    B S (P - 1) / P^2 (c + H + d_inner)      (even split, groups not replicated)

State passing's bytes do not grow with the sequence; ``choose_ssd_design`` takes the cheaper.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm.collectives import head_to_seq, seq_to_head
from ..rules.heads import HeadDeal
from ..mesh import SPMesh
from ..model.hybrid_shape import ssd_widths
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sequence.sharding import sequence_layout
from .choice import LinearDesign, halo_bytes, parse_design
from .decay_scan import decay_scan_states, decay_state_bytes, pass_decay_states
from .decode import conv_step, last_token_keep
from .gated_delta import segment_bounds
from .halo import halo_causal_conv, placement
from .kernels import causal_conv


@dataclass(frozen=True)
class SSDHeads:
    """One Mamba2 layer's sizes: ``heads`` of ``head_dim`` reading the B and C of ``groups`` groups of ``state``."""

    heads: int
    head_dim: int
    groups: int
    state: int

    @property
    def inner(self) -> int:
        return ssd_widths(self.heads, self.head_dim, self.groups, self.state)[0]

    @property
    def conv_dim(self) -> int:
        return ssd_widths(self.heads, self.head_dim, self.groups, self.state)[1]


@dataclass(frozen=True)
class SSDParams:
    """The layer's own parameters that act on the sequence: conv (C, K) and bias, dt_bias, A_log, D (H,)."""

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str | None = "silu"


@functools.lru_cache(maxsize=64)
def _group_of(heads: SSDHeads, h: tuple[int, int], g: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(h1 - h0,) the local group each of heads [h0, h1) reads, built once per deal and device (not per layer call:
    on CUDA each build is a host-to-device copy)."""
    return torch.tensor([hh * heads.groups // heads.heads - g[0] for hh in range(*h)], device=device)


def _scan_inputs(xbc: torch.Tensor, dt: torch.Tensor, params: SSDParams, heads: SSDHeads, h: tuple[int, int],
                 g: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """The scan's q = C, k = B, v = dt x, log decay dt A and x for heads ``[h0, h1)`` reading groups ``[g0, g1)``,
    from the conv's output ``xbc`` (B, T, x of the heads | B of the groups | C of the groups) and ``dt`` (B, T, h)."""
    b, t, _ = xbc.shape
    nh, ng = h[1] - h[0], g[1] - g[0]
    x, bm, cm = xbc.split([nh * heads.head_dim, ng * heads.state, ng * heads.state], dim=-1)
    x = x.reshape(b, t, nh, heads.head_dim)
    group_of = _group_of(heads, h, g, xbc.device)
    bm = bm.reshape(b, t, ng, heads.state).index_select(2, group_of)  # (B, T, h, N)
    cm = cm.reshape(b, t, ng, heads.state).index_select(2, group_of)
    low, high = params.dt_limit
    dt = F.softplus(dt + params.dt_bias[h[0]:h[1]]).clamp(min=low, max=high)  # (B, T, h)
    a = -params.A_log[h[0]:h[1]].float().exp()
    decay = dt * a.to(dt.dtype) if dt.dtype == torch.float64 else dt.float() * a  # (B, T, h)
    return cm, bm, x * dt[..., None].to(x.dtype), decay, x


def ssd_state_passing(xbc: torch.Tensor, dt: torch.Tensor, params: SSDParams, heads: SSDHeads, mesh: SPMesh, *,
                      layout: str, seq_len: int, cu_seqlens: tuple[int, ...] | None = None,
                      min_chunk: int = DEFAULT_MIN_CHUNK, keep: dict | None = None) -> torch.Tensor:
    """``xbc`` (B, L, conv_dim) before the conv and ``dt`` (B, L, H) before softplus, this rank's tokens in the
    layout's order -> y (B, L, H, head_dim), D x included. ``keep`` (a prefill's): given ``keep["state"]``, the scan's
    state (B, H, N, head_dim) after the row's last real token, on every rank (:func:`.passing.pass_states`)."""
    place = placement(mesh, xbc.shape[1], layout=layout, seq_len=seq_len, cu_seqlens=cu_seqlens, min_chunk=min_chunk,
                      kernel=params.conv_weight.shape[-1])
    mixed = halo_causal_conv(xbc, params.conv_weight, params.conv_bias, place, params.activation)
    q, k, v, g, x = _scan_inputs(mixed, dt, params, heads, (0, heads.heads), (0, heads.groups))
    if keep is not None:  # the row's last real token, on the rank that holds it
        keep.update(last_token_keep(mesh, layout=layout, seq_len=seq_len))
    return pass_decay_states(q, k, v, g, place, keep=keep) + params.D[:, None].to(x.dtype) * x


def ssd_step(xbc: torch.Tensor, dt: torch.Tensor, params: SSDParams, heads: SSDHeads, state: torch.Tensor,
             tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens on every rank alike from ``state`` (B, H, N, head_dim) and the conv's last ``K - 1`` inputs ``tail``
    (B, K - 1, conv_dim): ``xbc`` (B, T, conv_dim) before the conv, ``dt`` (B, T, H) before softplus (one token in a
    decode step, a chunk's every token in a prefill onto a kept cache) -> (y (B, T, H, head_dim) with D x, the state
    after them, the next tail)."""
    mixed, tail = conv_step(tail, xbc, params.conv_weight, params.conv_bias, params.activation)
    q, k, v, g, x = _scan_inputs(mixed, dt, params, heads, (0, heads.heads), (0, heads.groups))
    dtype, ys = state.dtype, []
    for t in range(xbc.shape[1]):  # the recurrence a token at a time
        state = torch.exp(g[:, t].to(dtype))[..., None, None] * state \
            + k[:, t].to(dtype)[..., :, None] * v[:, t].to(dtype)[..., None, :]  # (B, H, N, P)
        ys.append(torch.einsum("bhn,bhnp->bhp", q[:, t].to(dtype), state))
    y = torch.stack(ys, dim=1)
    return y.to(x.dtype) + params.D[:, None].to(x.dtype) * x, state, tail


@functools.lru_cache(maxsize=32)
def _deal(heads: SSDHeads, ranks: int, rank: int, device: torch.device):
    """Each rank's head and group ranges, the input chunks (destination-major: x, B, C, dt of each rank's share),
    their channel counts, and this rank's conv rows (indices into xBC, in the order received)."""
    deal = HeadDeal(heads.heads, heads.groups, ranks)
    inner, gn, p, n = heads.inner, heads.groups * heads.state, heads.head_dim, heads.state
    chunks, counts = [], []
    for u in range(ranks):
        (h0, h1), (g0, g1) = deal.q_range(u), deal.kv_range(u)
        mine = [(0, h0 * p, h1 * p), (0, inner + g0 * n, inner + g1 * n), (0, inner + gn + g0 * n, inner + gn + g1 * n),
                (0, heads.conv_dim + h0, heads.conv_dim + h1)]
        chunks += mine
        counts.append(sum(e - a for _, a, e in mine))
    rows = torch.cat([torch.arange(a, e) for _, a, e in chunks[4 * rank: 4 * rank + 3]]).to(device)
    out_chunks = tuple((0, *deal.q_range(u)) for u in range(ranks))
    out_counts = tuple(deal.q_count(u) for u in range(ranks))
    return deal.q_range(rank), deal.kv_range(rank), tuple(chunks), tuple(counts), rows, out_chunks, out_counts


def ssd_all_to_all(xbc: torch.Tensor, dt: torch.Tensor, params: SSDParams, heads: SSDHeads, mesh: SPMesh, *,
                   layout: str, seq_len: int, cu_seqlens: tuple[int, ...] | None = None,
                   min_chunk: int = DEFAULT_MIN_CHUNK) -> torch.Tensor:
    """As :func:`ssd_state_passing` (same arguments, same result), by the all-to-all over heads."""
    p = mesh.sp_size
    if p > heads.heads:
        raise ValueError(f"the Mamba2 layers have {heads.heads} heads, fewer than the {p} ranks of the sequence group: "
                         f"the all-to-all design needs a sequence degree of at most {heads.heads}; choose "
                         "linear_attention='state_passing' (or 'auto').")
    b, n, _ = xbc.shape
    padded = n * p
    bounds = segment_bounds(padded, cu_seqlens, seq_len)
    h, g, chunks, counts, rows, out_chunks, out_counts = _deal(heads, p, mesh.sp_rank, xbc.device)
    packed = torch.cat([xbc, dt], dim=-1).unsqueeze(-1)  # (B, L, conv_dim + H, 1)
    lay = sequence_layout(mesh, padded, layout, cu_seqlens, min_chunk)
    whole = seq_to_head([packed], mesh.sp_group, chunks, counts, counts[mesh.sp_rank]).squeeze(-1)  # (B, S, c_r)
    whole = whole.index_select(1, lay.indices(restore=True, device=xbc.device))  # natural order
    conv_in, dt_in = whole.split([whole.shape[-1] - (h[1] - h[0]), h[1] - h[0]], dim=-1)
    bias = None if params.conv_bias is None else params.conv_bias.index_select(0, rows)
    mixed = causal_conv(conv_in, params.conv_weight.index_select(0, rows), bias, bounds, params.activation)
    q, k, v, decay, x = _scan_inputs(mixed, dt_in, params, heads, h, g)
    y = decay_scan_states(q, k, v, decay, bounds)[0] + params.D[h[0]:h[1], None].to(x.dtype) * x  # (B, S, h, P)
    y = y.index_select(1, lay.indices(device=y.device))  # layout order
    return head_to_seq(y, mesh.sp_group, out_chunks, out_counts, out_counts[mesh.sp_rank],
                       torch.Size((b, n, heads.heads, heads.head_dim)))


def ssd_design_bytes(heads: SSDHeads, kernel: int, *, seq_len: int, batch: int, ulysses: int, ring: int, layout: str,
                     dtype_bytes: int, state_bytes: int = 4) -> dict[LinearDesign, int]:
    """Bytes each rank sends forward in one Mamba2 layer by each design (the module docstring's formulas); the
    all-to-all's is infinite where the ranks outnumber the heads."""
    p = ulysses * ring
    if p == 1:
        return {LinearDesign.STATE_PASSING: 0, LinearDesign.ALL_TO_ALL: 0}
    passing = (decay_state_bytes(heads.heads, heads.state, heads.head_dim, batch=batch, ulysses=ulysses, ring=ring,
                                 layout=layout, state_bytes=state_bytes)
               + halo_bytes(heads.conv_dim, kernel, batch=batch, ulysses=ulysses, ring=ring, layout=layout,
                            dtype_bytes=dtype_bytes))
    a2a = batch * seq_len * (p - 1) * (heads.conv_dim + heads.heads + heads.inner) * dtype_bytes // (p * p)
    return {LinearDesign.STATE_PASSING: passing, LinearDesign.ALL_TO_ALL: a2a if p <= heads.heads else float("inf")}


def choose_ssd_design(heads: SSDHeads, kernel: int, design: str | LinearDesign = LinearDesign.AUTO, **shape) -> LinearDesign:
    """``design`` itself unless ``auto``: then the design that sends fewer bytes (:func:`ssd_design_bytes`, given
    ``shape``: seq_len, batch, ulysses, ring, layout, dtype_bytes); state passing on a tie and on one rank."""
    design = parse_design(design)
    if design is not LinearDesign.AUTO:
        return design
    sent = ssd_design_bytes(heads, kernel, **shape)
    return LinearDesign.ALL_TO_ALL if sent[LinearDesign.ALL_TO_ALL] < sent[LinearDesign.STATE_PASSING] \
        else LinearDesign.STATE_PASSING
