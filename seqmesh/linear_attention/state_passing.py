"""Gated DeltaNet with the sequence sharded over ``P = ring x ulysses`` ranks by passing the recurrent
state, exactly: the second design beside the all-to-all of ``sequence_parallel.py``.

Every rank keeps all heads of its own tokens. Over a run of consecutive positions the delta rule is
affine in the state entering it (each column of the (Dk x Dv) state evolves alone)::

    S_out = A S_in + B         A (Dk x Dk): the run's gated (I - beta k k^T) factors; B: its state from zero
    o_t   = o_t(0) + S_in^T G_t   G_t = A_t^T q_t, A_t the factors up to t

One pass of the recurrence over the rank's runs with the values widened to ``[v | 0]`` and the
initial state ``[0 | I]`` gives all of it at once: outputs ``[o(0) | G]`` and final states
``[B | A]``. So, with no rank waiting for another::

    1. all-gather the conv tails (the kernel-1 positions before each run start; zero at documents)
    2. conv, gates, the widened recurrence on the rank's runs                    (all ranks at once)
    3. all-gather every run's [B | A] (B, Hv, Dk, Dv + Dk), float32             (one collective)
    4. scan the runs in global order: S_in(j) = A_{j-1} S_in(j-1) + B_{j-1}, zero at segment starts
    5. o += S_in^T G on each run that does not start a segment

Backward is autograd through the same steps; the all-gathers' adjoints (reduce-scatter) carry the
state's and the tails' gradients back to the ranks that produced them.

Cost against the all-to-all design, per layer and rank (``R`` runs per rank: 2 zigzag, 1 contiguous):
traffic ``(P - 1) R B Hv Dk (Dk + Dv)`` float32 received for the states plus the tails, whatever the
sequence length (the all-to-all moves ``~ B S (P - 1) / P^2`` channels of every head); compute: the
recurrence with ``Dv + Dk`` value columns instead of ``Dv`` (about twice the FLOPs of the rule, which
is a fraction of the layer's). No limit on heads: P may exceed the value heads. The choice between
the two designs is :func:`seqmesh.linear_attention.choice.choose_design`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm.collectives import all_gather
from ..mesh import SPMesh
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sequence.sharding import sequence_layout
from .chain import chain_for, rank_chain
from .gated_delta import segment_bounds
from .kernels import causal_conv, gated_delta_rule_states
from .sequence_parallel import GateParams, LinearHeads, gated_delta_heads, rule_inputs


class _Tie(torch.autograd.Function):
    """Forward: ``out`` unchanged; backward: ``out``'s gradient, and zeros for ``tied``. A rank whose
    output does not read the gathered states (its runs all start segments) still runs the gather's
    adjoint, which the other ranks wait for."""

    @staticmethod
    def forward(ctx, out, tied):  # type: ignore[override]
        ctx.shape, ctx.dtype = tied.shape, tied.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def _pad_rows(x: torch.Tensor, rows: int, dim: int = 1) -> torch.Tensor:
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim=dim)


def state_passing_gated_delta(
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
    """As :func:`seqmesh.linear_attention.sequence_parallel.sequence_parallel_gated_delta` (same arguments,
    same result): ``packed`` (B, L, channels) in the layout's order -> (B, L, Hv, Dv). ``heads.ranks`` is
    ignored: every rank runs every head of its own tokens."""
    p = mesh.sp_size
    whole = dataclasses.replace(heads, ranks=1)
    b, n, c = packed.shape
    if c != whole.channels:
        raise ValueError(f"packed input has {c} channels; the layer's q | k | v | b | a have {whole.channels}.")
    padded = n * p
    bounds = segment_bounds(padded, cu_seqlens, seq_len)
    if p == 1:
        return gated_delta_heads(packed, params, whole, 0, bounds)
    rank, group, device = mesh.sp_rank, mesh.sp_group, packed.device
    kernel = params.conv_weight.shape[-1]
    chain = chain_for(sequence_layout(mesh, padded, layout, cu_seqlens, min_chunk), bounds, kernel)
    mine = rank_chain(chain, rank, kernel)
    dk, dv, hv = whole.key_dim, whole.value_dim, whole.value_heads

    # 1. conv over the rank's runs, each preceded by its tail from the ranks that hold it
    conv_in, beta_in, a_in = packed.split([whole.conv_dim, hv, hv], dim=-1)
    source = conv_in
    if chain.max_tail:
        send = torch.tensor(chain.tail_send[rank], dtype=torch.long, device=device)
        tails = _pad_rows(conv_in.index_select(1, send), chain.max_tail)  # (B, max_tail, conv_dim)
        source = torch.cat([conv_in, all_gather(tails, group, dim=1)], dim=1)  # (B, L + P * max_tail, conv_dim)
    extended = source.index_select(1, mine.conv_source.to(device))  # (B, E, conv_dim): runs with their tails
    mixed = causal_conv(extended, params.conv_weight, params.conv_bias, mine.conv_bounds, params.activation)
    mixed = mixed.index_select(1, mine.own.to(device))  # (B, L, conv_dim), shard order

    # 2. the widened recurrence: values [v | 0], runs that receive a state start from [0 | I]
    q, k, v, g, beta = rule_inputs(mixed, beta_in, a_in, params, whole, 0)
    widened = torch.cat([v, v.new_zeros(b, n, hv, dk)], dim=-1)  # (B, L, Hv, Dv + Dk)
    segments = len(mine.segment_bounds) - 1
    initial = torch.zeros(segments, dk, dv + dk, dtype=torch.float64, device=device)
    initial[list(mine.incoming), :, dv:] = torch.eye(dk, dtype=torch.float64, device=device)
    initial = initial[None, :, None].expand(b, segments, hv, dk, dv + dk)
    out, finals = gated_delta_rule_states(q, k, widened, g, beta, mine.segment_bounds, initial)
    out, lift = out.split([dv, dk], dim=-1)  # o(0) (B, L, Hv, Dv), G (B, L, Hv, Dk)

    # 3. every run's [B | A], gathered in group-rank order
    leaving = _pad_rows(finals[:, list(mine.last_segment)], chain.max_runs)  # (B, R, Hv, Dk, Dv + Dk)
    every = all_gather(leaving, group, dim=1)  # (B, P * R, Hv, Dk, Dv + Dk)

    # 4. the scan, up to this rank's last run
    state = every.new_zeros(b, hv, dk, dv)
    entering = {}
    last = max(j for j, (r, _) in enumerate(chain.order) if r == rank)
    for r, j in chain.order[: last + 1]:
        if r == rank:
            entering[j] = state
        run = every[:, r * chain.max_runs + j]
        state = run[..., dv:] @ state + run[..., :dv]  # (B, Hv, Dk, Dv)

    # 5. each run's incoming state read through G (zero past the first segment start inside the run)
    pieces, at = [], 0
    for segment, j in zip(mine.incoming, mine.run_of_incoming):
        a, e = mine.segment_bounds[segment], mine.segment_bounds[segment + 1]
        correction = torch.einsum("bthk,bhkv->bthv", lift[:, a:e].to(state.dtype), entering[j])
        pieces += [out[:, at:a], (out[:, a:e] + correction).to(out.dtype)]
        at = e
    out = torch.cat(pieces + [out[:, at:]], dim=1) if pieces else out
    return _Tie.apply(out, every) if every.requires_grad else out
