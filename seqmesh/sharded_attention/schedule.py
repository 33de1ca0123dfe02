"""The ring schedule: which key block each ring rank meets at each step, and what it computes.

Ring rank r holds its query block for the whole pass; at step t it holds the key/value block of
ring rank ``(r - t) mod ring``. Every rank computes the same schedule from the layout, the
document boundaries, the window and the image blocks (Gemma 3: positions that see their whole image,
later keys included), so no plan is ever exchanged: a step whose only work is an image's later keys
on another rank is a step with work like any other.

A sliding window leaves some steps empty on every rank; :attr:`RingSchedule.steps` lists the others,
the only ones the ring runs and sends blocks for. With a window shorter than a chunk, contiguous
keeps steps (0, 1) and zigzag (0, 1, ring-1): each rank needs only its neighbours' blocks.

Who sends what when (:attr:`RingSchedule.relay`, :attr:`kv_shifts`, :attr:`dkv_shifts`):

- **relay**, when the steps are 0, 1, ..., k (the whole ring; contiguous under any window): each rank
  passes the K/V block it holds on to r+1 and takes the next from r-1, and in backward the block's
  dK/dV partial travels with it, each holder adding its share, then one last hop takes it home
  (``-k``, which is r+1 for the whole ring). Every message but that last one goes to a neighbour, so a
  ring laid over nodes crosses each node boundary once per hop and NCCL opens neighbour links only.
- **direct**, when a window leaves a gap (zigzag: (0, 1, ..., ring-1) minus the middle steps):
  each K/V block goes straight from its owner to the rank that needs it next (shift ``steps[i+1]``)
  and each dK/dV partial straight home (``-t``), so the skipped steps cost no transfer. With a window
  shorter than a chunk the steps are (0, 1, ring-1), whose shifts 1, ring-1 and their inverses are
  neighbours anyway; a wider one, (0, 1, 2, ring-2, ring-1), also sends two ranks away. A relay
  would have to carry blocks through the skipped steps, the transfers the window saves.
"""


from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ..kernels.base import BlockMask
from ..sequence.layout import SequenceLayout
from .blocks import Piece, plan_block


@dataclass(frozen=True)
class RingSchedule:
    layout: SequenceLayout
    bounds: tuple[int, ...]  # document boundaries over the padded sequence (padding included)
    causal: bool
    window: int | None = None  # causal sliding window in tokens; None: none
    blocks: tuple[tuple[int, int], ...] = ()  # image blocks [start, stop): bidirectional inside (causal only)
    softcap: float | None = None  # scores capped as softcap * tanh(s / softcap) in every kernel call (Gemma 2)
    alibi: tuple[float, ...] | None = None  # ALiBi's slope of each query head the calls compute (BLOOM, MPT)
    _plans: dict[tuple[int, int], tuple[Piece, ...]] = field(default_factory=dict, compare=False, repr=False)

    def source(self, ring_rank: int, step: int) -> int:
        """Ring rank whose key/value block ``ring_rank`` holds at ``step``."""
        return (ring_rank - step) % self.layout.ring

    def pieces(self, ring_rank: int, step: int) -> tuple[Piece, ...]:
        """The kernel calls of ``ring_rank`` at ``step`` (computed once per schedule)."""
        key = (ring_rank, step)
        if key not in self._plans:
            runs = self.layout.ring_runs
            plan = plan_block(runs(ring_rank), runs(self.source(ring_rank, step)), self.bounds, self.causal,
                              self.window, self.blocks, distance=self.alibi is not None)
            if self.softcap is not None or self.alibi is not None:  # the same calls, each told to cap or bias
                plan = tuple(replace(p, mask=replace(p.mask, softcap=self.softcap, alibi=self.alibi)) for p in plan)
            self._plans[key] = plan
        return self._plans[key]

    @functools.cached_property
    def steps(self) -> tuple[int, ...]:
        """Ring steps where some rank computes something (always step 0, the diagonal), ascending. The
        same on every rank, so every rank issues the same exchanges in the same order."""
        ring = self.layout.ring
        return tuple(t for t in range(ring) if t == 0 or any(self.pieces(r, t) for r in range(ring)))

    @functools.cached_property
    def kernel_calls(self) -> tuple[tuple[BlockMask, int, int], ...]:
        """The distinct kernel calls of the whole pass, ``(mask, query rows, key columns)`` over every
        rank and step (a handful, or one per document chunk): what a named backend must accept before
        any rank sends."""
        ring = self.layout.ring
        return tuple(dict.fromkeys((p.mask, p.q1 - p.q0, p.k1 - p.k0)
                                   for r in range(ring) for t in self.steps for p in self.pieces(r, t)))

    @functools.cached_property
    def relay(self) -> bool:
        """True when the steps are 0, 1, ..., k: blocks and their partials go neighbour to neighbour."""
        return self.steps == tuple(range(len(self.steps)))

    @functools.cached_property
    def kv_shifts(self) -> tuple[int, ...]:
        """For every step but the last, how far the K/V message posted during it travels (it brings the
        next step's block): 1 in a relay (the held block moves on), ``steps[i + 1]`` direct (the owner's
        block goes straight to its next holder)."""
        return (1,) * (len(self.steps) - 1) if self.relay else self.steps[1:]

    @functools.cached_property
    def dkv_shifts(self) -> tuple[int | None, ...]:
        """For every step, how far the dK/dV partial posted at its end travels (None: it stays). Relay:
        on to the block's next holder, then home from the last step (``-steps[-1]``). Direct: straight
        home (``-t``), except at step 0 where the block is the rank's own."""
        n = len(self.steps)
        if self.relay:
            return (None,) if n == 1 else (1,) * (n - 1) + (-self.steps[-1],)
        return tuple(-t if t else None for t in self.steps)

    def work(self, ring_rank: int) -> int:
        """(query, key) pairs ring rank ``ring_rank`` computes over the whole pass (per head)."""
        return sum(p.work for step in self.steps for p in self.pieces(ring_rank, step))

    def balance(self) -> float:
        """max / mean work across ring ranks: 1.0 is perfect balance."""
        works = [self.work(r) for r in range(self.layout.ring)]
        return max(works) * len(works) / sum(works)


@functools.lru_cache(maxsize=256)
def ring_schedule(
    layout: SequenceLayout, bounds: tuple[int, ...], causal: bool, window: int | None = None,
    blocks: tuple[tuple[int, int], ...] = (), softcap: float | None = None, alibi: tuple[float, ...] | None = None,
) -> RingSchedule:
    """The schedule for a layout, document boundaries, causality, window, image blocks, soft-cap and ALiBi slopes,
    built once and shared by every layer and step that meets them (its block plans are filled in on first use)."""
    return RingSchedule(layout, bounds, causal, window, blocks, softcap, alibi)


def for_heads(schedule: RingSchedule, first: int, stop: int) -> RingSchedule:
    """``schedule`` for the query heads ``[first, stop)`` of the call it was made for (a Ulysses rank's): the same
    schedule unless it carries per-head ALiBi slopes."""
    if schedule.alibi is None or (first, stop) == (0, len(schedule.alibi)):
        return schedule
    return ring_schedule(schedule.layout, schedule.bounds, schedule.causal, schedule.window, schedule.blocks,
                         schedule.softcap, schedule.alibi[first:stop])
