"""Where a recurrent mixer's tokens sit on the sequence group, and the short causal conv across ranks.

Every token mixer that is not attention (Gated DeltaNet, Mamba, Mamba2, KDA, LFM's gated conv,
lightning attention) reads the sequence in order. On a shard, a rank holds its tokens as *runs* of
consecutive positions (:mod:`seqmesh.linear_attention.chain`); packed documents and the layout's
padding are *segments*, at whose starts every recurrence and every conv restarts.

A depthwise causal conv of width ``K`` needs, for a run's first ``K - 1`` tokens, the ``K - 1``
positions before the run's start: the *halo*, held by other ranks (zigzag: the rank with the
neighbouring chunk). Each rank contributes the positions others need to one all-gather; its
adjoint, a reduce-scatter, returns their gradients::

    x (B, L, C) shard order --all-gather the halo rows--> runs with their halos (B, E, C)
      --conv restarting at segment starts and halo starts--> (B, E, C) --own rows--> (B, L, C)

A halo never crosses a segment start: the conv restarts there, so a document's first token reads
no other document's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.collectives import all_gather
from ..mesh import SPMesh
from ..sequence.runs import DEFAULT_MIN_CHUNK
from ..sequence.sharding import sequence_layout
from .chain import Chain, RankChain, chain_for, rank_chain
from .gated_delta import segment_bounds
from .kernels import causal_conv


@dataclass(frozen=True)
class Placement:
    """One rank's tokens as runs and segments, and the schedule its conv halo and state pass follow."""

    chain: Chain
    mine: RankChain
    rank: int
    group: object  # the sequence group (ring x Ulysses ranks, flat)
    bounds: tuple[int, ...]  # segments of the padded sequence: (0, document starts, padding start, padded)
    kernel: int  # the widest conv the placement serves (1: no halo)


def placement(mesh: SPMesh, local_len: int, *, layout: str, seq_len: int, cu_seqlens: tuple[int, ...] | None = None,
              min_chunk: int = DEFAULT_MIN_CHUNK, kernel: int = 1) -> Placement:
    """The :class:`Placement` of this rank's ``local_len`` tokens, placed by ``seqmesh.shard_sequence`` with
    ``layout``, ``cu_seqlens`` and ``min_chunk``; ``seq_len`` real tokens (the rest is padding)."""
    padded = local_len * mesh.sp_size
    bounds = segment_bounds(padded, cu_seqlens, seq_len)
    chain = chain_for(sequence_layout(mesh, padded, layout, cu_seqlens, min_chunk), bounds, kernel)
    return Placement(chain, rank_chain(chain, mesh.sp_rank, kernel), mesh.sp_rank, mesh.sp_group, bounds, kernel)


def pad_rows(x: torch.Tensor, rows: int, dim: int = 1) -> torch.Tensor:
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim=dim)


def halo_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, place: Placement,
                     activation: str | None = "silu") -> torch.Tensor:
    """The depthwise causal conv of the whole sequence at this rank's tokens: ``x`` (B, L, C) in shard order,
    ``weight`` (C, K) with ``K <= place.kernel`` -> (B, L, C). One all-gather of the halo rows forward (none
    when ``K == 1`` or one rank), its reduce-scatter backward."""
    kernel = weight.shape[-1]
    if kernel > place.kernel:
        raise ValueError(f"a conv of width {kernel} needs a placement built with kernel >= {kernel} "
                         f"(this one serves {place.kernel}).")
    return with_halo(x, place, lambda extended, bounds: causal_conv(extended, weight, bias, bounds, activation))


def with_halo(x: torch.Tensor, place: Placement, causal: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]
              ) -> torch.Tensor:
    """``causal`` applied to the whole sequence, at this rank's tokens: ``x`` (B, L, C) in shard order; ``causal``
    maps runs preceded by their halos (B, E, C) and that sequence's segment bounds to (B, E, C') where each row reads
    at most the ``place.kernel - 1`` rows before it, within its segment (a causal conv, a shift by one token)
    -> (B, L, C'). One all-gather of the halo rows forward (none with one rank), its reduce-scatter backward."""
    extended = extend(x, place)  # (B, E, C): runs preceded by their halos
    return causal(extended, place.mine.conv_bounds).index_select(1, place.mine.own.to(x.device))  # (B, L, C')


def extend(x: torch.Tensor, place: Placement) -> torch.Tensor:
    """``x`` (B, L, C) in shard order -> (B, E, C): this rank's runs, each preceded by the ``place.kernel - 1``
    positions before its start (its halo, from whichever ranks hold them; fewer at the row's start), run by run;
    :func:`extended_positions` numbers its rows. One all-gather (none with one rank), its reduce-scatter backward."""
    chain = place.chain
    source = x
    if chain.max_tail:
        send = torch.tensor(chain.tail_send[place.rank], dtype=torch.long, device=x.device)
        tails = pad_rows(x.index_select(1, send), chain.max_tail)  # (B, max_tail, C)
        source = torch.cat([x, all_gather(tails, place.group, dim=1)], dim=1)  # (B, L + P * max_tail, C)
    return source.index_select(1, place.mine.conv_source.to(x.device))


def extended_positions(chain: Chain, rank: int, kernel: int) -> list[int]:
    """The global position of each row of :func:`extend`'s result for ``rank`` of ``chain`` with halos of
    ``kernel - 1`` (positions at or past the real tokens are the layout's padding), as ``rank_chain`` lays them."""
    positions = []
    for run in chain.runs[rank]:
        positions += range(max(0, run.start - kernel + 1), run.start + run.length)
    return positions
