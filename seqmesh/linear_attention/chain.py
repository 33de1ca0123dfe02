"""The schedule of Gated DeltaNet state passing: which global positions each rank holds as runs, in
what order the runs' states chain, and which tokens travel as conv tails. Pure index arithmetic on a
layout, built once per (layout, segment bounds, conv kernel) and shared by every layer.

A rank of the sequence group holds its tokens as *runs*: maximal pieces of consecutive global
positions (zigzag: two per ring rank, split over its Ulysses ranks; contiguous: one; per_document: a
piece of every cut document). Sorted by start, the runs of all ranks tile the padded sequence; run
``j`` receives the state run ``j - 1`` leaves, unless it starts a segment (a document, or the
layout's padding), where the state restarts from zero.

The conv of a run's first ``kernel - 1`` tokens reads the ``kernel - 1`` positions before the run's
start, held by other ranks: those positions (the *tails*) are what each rank contributes to one
all-gather, padded to the busiest rank's count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..sequence.layout import SequenceLayout
from ..tensor_values import real_tensors


@dataclass(frozen=True)
class Run:
    start: int  # first global position
    length: int
    offset: int  # where it begins in the rank's shard


@dataclass(frozen=True, eq=False)  # compared (and cached) by identity: chain_for builds each once
class Chain:
    """Runs of every rank, their global order and the conv tails, for one layout and segment bounds."""

    runs: tuple[tuple[Run, ...], ...]  # per rank, in shard order
    order: tuple[tuple[int, int], ...]  # (rank, run index) of every run, by global start
    bounds: frozenset[int]  # global segment starts (0, documents, the padding's start)
    tail_send: tuple[tuple[int, ...], ...]  # per rank: the shard slots of its positions that are tails
    tail_slot: dict  # global position of a tail -> its row in the all-gathered tails (owner * max_tail + slot)

    @property
    def max_runs(self) -> int:
        return max(len(r) for r in self.runs)

    @property
    def max_tail(self) -> int:
        return max(len(t) for t in self.tail_send)


def _rank_runs(layout: SequenceLayout) -> list[tuple[Run, ...]]:
    """Per rank of the sequence group, its runs in shard order: ring rank r's block (its ring runs, in
    order) split into ``ulysses`` equal pieces of ``local_len`` slots, adjacent pieces of consecutive
    positions merged. Plain integers, so torch.compile traces it as constants."""
    n, ranks = layout.local_len, []
    for r in range(layout.ring):
        block = layout.ring_runs(r)
        for u in range(layout.ulysses):
            lo, hi, mine = u * n, (u + 1) * n, []
            for run in block:  # run.offset: its first slot in the ring block
                a, b = max(lo, run.offset), min(hi, run.offset + run.length)
                if a >= b:
                    continue
                start = run.start + a - run.offset
                if mine and mine[-1].start + mine[-1].length == start:
                    mine[-1] = Run(mine[-1].start, mine[-1].length + b - a, mine[-1].offset)
                else:
                    mine.append(Run(start, b - a, a - lo))
            ranks.append(tuple(mine))
    return ranks


@functools.lru_cache(maxsize=16)
def chain_for(layout: SequenceLayout, bounds: tuple[int, ...], kernel: int) -> Chain:
    """The :class:`Chain` of ``layout`` whose tokens fall into the segments ``bounds`` (0, ..., padded_len)."""
    p, n = layout.size, layout.local_len
    runs = _rank_runs(layout)
    by_start = sorted(((run.start, r, j) for r, mine in enumerate(runs) for j, run in enumerate(mine)))
    tails = sorted({t for _, r, j in by_start for t in range(max(0, runs[r][j].start - kernel + 1), runs[r][j].start)})
    owners: list[list[int]] = [[] for _ in range(p)]
    where = {}
    for t in tails:  # the rank and shard slot holding global position t: the last run starting at or before it
        for start, r, j in by_start:  # a scan, not bisect, which torch.compile cannot trace
            if start > t:
                break
            held = (r, j)
        r, j = held
        where[t] = (r, len(owners[r]))
        owners[r].append(runs[r][j].offset + t - runs[r][j].start)
    width = max(len(o) for o in owners)
    return Chain(tuple(runs), tuple((r, j) for _, r, j in by_start), frozenset(bounds[:-1]),
                 tuple(tuple(o) for o in owners), {t: owner * width + i for t, (owner, i) in where.items()})


@dataclass(frozen=True)
class RankChain:
    """One rank's share of a :class:`Chain`, as index tensors on the CPU (moved to the activations' device)."""

    conv_source: torch.Tensor  # (E,) rows of cat(own shard, all-gathered tails) laid out run by run with tails
    conv_bounds: tuple[int, ...]  # segments of that extended sequence (a run's tail starts one)
    own: torch.Tensor  # (L,) rows of the extended sequence that are this rank's tokens, in shard order
    segment_bounds: tuple[int, ...]  # segments of the shard: run starts and segment starts inside runs
    incoming: tuple[int, ...]  # segments that receive a run's incoming state (runs not starting a segment)
    run_of_incoming: tuple[int, ...]  # their run
    last_segment: tuple[int, ...]  # per run: its last segment (whose final state the run leaves)


@functools.lru_cache(maxsize=16)
def rank_chain(chain: Chain, rank: int, kernel: int) -> RankChain:
    local = sum(run.length for run in chain.runs[rank])
    source, conv_bounds, own, cuts, incoming, run_of, last = [], {0}, [], {0, local}, [], [], []
    inner = sorted(chain.bounds)
    for j, run in enumerate(chain.runs[rank]):
        first = max(0, run.start - kernel + 1)
        conv_bounds.add(len(source))
        source += [local + chain.tail_slot[t] for t in range(first, run.start)]
        own += range(len(source), len(source) + run.length)
        for b in inner:  # a segment starting inside the run (or its tail) restarts the conv
            if first < b < run.start + run.length:
                conv_bounds.add(len(source) + b - run.start)
        source += range(run.offset, run.offset + run.length)
        cuts.add(run.offset)
        cuts.update(run.offset + b - run.start for b in inner if run.start < b < run.start + run.length)
    segment_bounds = tuple(sorted(cuts))
    for j, run in enumerate(chain.runs[rank]):
        segment = segment_bounds.index(run.offset)
        if run.start not in chain.bounds:
            incoming.append(segment)
            run_of.append(j)
        last.append(segment_bounds.index(min(b for b in segment_bounds if b > run.offset + run.length - 1)) - 1)
    conv_bounds.add(len(source))
    with real_tensors():  # host index tensors of the layout, cached: real even when first made in a rehearsal's step
        source_rows, own_rows = torch.tensor(source, dtype=torch.long), torch.tensor(own, dtype=torch.long)
    return RankChain(source_rows, tuple(sorted(conv_bounds)), own_rows, segment_bounds, tuple(incoming),
                     tuple(run_of), tuple(last))
