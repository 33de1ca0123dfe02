"""The ring schedule: which key block each ring rank meets at each step, and what it computes.

Ring rank r holds its query block for the whole pass; at step t it holds the key/value block of
ring rank ``(r - t) mod ring``. Every rank computes the same schedule from the layout and the
document boundaries, so no plan is ever exchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..layout import SequenceLayout
from .blocks import Piece, plan_block


@dataclass(frozen=True)
class RingSchedule:
    layout: SequenceLayout
    bounds: tuple[int, ...]  # document boundaries over the padded sequence (padding included)
    causal: bool
    _plans: dict[tuple[int, int], tuple[Piece, ...]] = field(default_factory=dict, compare=False, repr=False)

    def source(self, ring_rank: int, step: int) -> int:
        """Ring rank whose key/value block ``ring_rank`` holds at ``step``."""
        return (ring_rank - step) % self.layout.ring

    def pieces(self, ring_rank: int, step: int) -> tuple[Piece, ...]:
        """The kernel calls of ``ring_rank`` at ``step`` (computed once per schedule)."""
        key = (ring_rank, step)
        if key not in self._plans:
            runs = self.layout.ring_runs
            self._plans[key] = plan_block(runs(ring_rank), runs(self.source(ring_rank, step)), self.bounds, self.causal)
        return self._plans[key]

    def work(self, ring_rank: int) -> int:
        """(query, key) pairs ring rank ``ring_rank`` computes over the whole pass (per head)."""
        return sum(p.work for step in range(self.layout.ring) for p in self.pieces(ring_rank, step))

    def balance(self) -> float:
        """max / mean work across ring ranks: 1.0 is perfect balance."""
        works = [self.work(r) for r in range(self.layout.ring)]
        return max(works) * len(works) / sum(works)


@functools.lru_cache(maxsize=256)
def ring_schedule(layout: SequenceLayout, bounds: tuple[int, ...], causal: bool) -> RingSchedule:
    """The schedule for a layout, document boundaries and causality, built once and shared by every
    layer and step that meets them (its block plans are filled in on first use)."""
    return RingSchedule(layout, bounds, causal)
