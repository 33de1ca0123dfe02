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


@functools.lru_cache(maxsize=16)
def chain_for(layout: SequenceLayout, bounds: tuple[int, ...], kernel: int) -> Chain:
    """The :class:`Chain` of ``layout`` whose tokens fall into the segments ``bounds`` (0, ..., padded_len)."""
    p, n = layout.size, layout.local_len
    order = layout.indices().reshape(p, n)  # (P, L) global position of every shard slot
    runs = []
    for positions in order:
        cuts = ((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist()  # slots that start a run
        firsts, starts = [0] + cuts, positions[[0] + cuts].tolist()
        runs.append(tuple(Run(start, end - first, first) for start, first, end in zip(starts, firsts, cuts + [n])))
    by_start = sorted(((run.start, r, j) for r, mine in enumerate(runs) for j, run in enumerate(mine)))
    tails = sorted({t for _, r, j in by_start for t in range(max(0, runs[r][j].start - kernel + 1), runs[r][j].start)})
    restore = layout.indices(restore=True)
    owners: list[list[int]] = [[] for _ in range(p)]
    where = {}
    for t in tails:
        slot = int(restore[t])
        where[t] = (slot // n, len(owners[slot // n]))
        owners[slot // n].append(slot % n)
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
    return RankChain(torch.tensor(source, dtype=torch.long), tuple(sorted(conv_bounds)),
                     torch.tensor(own, dtype=torch.long), segment_bounds, tuple(incoming), tuple(run_of), tuple(last))
