"""What expert parallelism moves, as pure functions of counts and shapes (no torch): the runtime's counted bytes
(``seqmesh.comm.stats``) equal :func:`exchange_bytes` of the routing it saw, and the planner calls
:func:`expected_exchange_bytes` with a uniform routing. Both sides read these lines, so the formula is written once.

One MoE layer's forward on one rank of an expert-parallel group of ``ep`` ranks (dropless):

1. counts: an all-to-all of ``ep x experts_per_rank`` int64 (how many of this rank's token-expert pairs go to each
   expert of each rank);
2. dispatch: the pairs' hidden rows (``hidden`` elements each) to the ranks holding their experts;
3. combine: each received row's expert output back to the rank it came from.

Backward runs 2 and 3 again with the roles swapped (the same bytes); 1 is not repeated. A pair whose expert is on
its own rank is not sent (the all-to-all copies it locally, and seqmesh counts what leaves the rank only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INT64 = 8


@dataclass(frozen=True)
class ExchangeBytes:
    """Bytes one rank sends in one MoE layer, by collective and pass."""

    counts: int  # the count all-to-all (forward only)
    dispatch: int  # rows out, forward (the same again in backward, as the combine's adjoint)
    combine: int  # rows back, forward (the same again in backward, as the dispatch's adjoint)

    @property
    def forward(self) -> int:
        return self.counts + self.dispatch + self.combine

    @property
    def backward(self) -> int:
        return self.dispatch + self.combine

    @property
    def total(self) -> int:
        return self.forward + self.backward


def exchange_bytes(sent_pairs: Sequence[int], received_pairs: Sequence[int], rank: int, hidden: int,
                   element_bytes: int, experts_per_rank: int) -> ExchangeBytes:
    """The bytes rank ``rank`` of the group sends for one layer, given how many token-expert pairs it sends to
    each rank (``sent_pairs[r]``) and receives from each (``received_pairs[r]``)."""
    ep = len(sent_pairs)
    if len(received_pairs) != ep or not 0 <= rank < ep:
        raise ValueError(f"{len(sent_pairs)} send counts, {len(received_pairs)} receive counts, rank {rank}.")
    row = hidden * element_bytes
    counts = (ep - 1) * experts_per_rank * INT64
    out = (sum(sent_pairs) - sent_pairs[rank]) * row
    back = (sum(received_pairs) - received_pairs[rank]) * row
    return ExchangeBytes(counts, out, back)


def expected_exchange_bytes(tokens: int, top_k: int, ep: int, hidden: int, element_bytes: int,
                            experts_per_rank: int) -> ExchangeBytes:
    """:func:`exchange_bytes` for ``tokens`` tokens on every rank whose ``top_k`` picks spread evenly over the
    ``ep`` ranks' experts (a balanced router: what the planner assumes)."""
    if ep == 1:
        return ExchangeBytes(0, 0, 0)
    pairs = tokens * top_k
    off = pairs * (ep - 1) // ep
    row = hidden * element_bytes
    return ExchangeBytes((ep - 1) * experts_per_rank * INT64, off * row, off * row)
