"""A ring rank's block as runs of consecutive global positions, and the runs of the ``per_document``
layout: zigzag inside every packed document. Torch-free; :class:`~seqmesh.sequence.layout.SequenceLayout`
turns runs into its permutation.

Zigzag balances causal work over the whole sequence, but with packed documents a token only sees
its own document, so the work is the sum of each document's own triangle and ranks holding the
start of a long document get little of it. Here every document ``[a, b)`` of ``n`` tokens is cut
into ``2 * ring`` chunks of ``c = n // (2 * ring)`` tokens: ring rank r holds chunk r (counted from
the document's start) and chunk ``2 * ring - 1 - r`` (counted from its end), so every ring rank
does the same share of every triangle.

The ``n - 2 * ring * c < 2 * ring`` tokens between the head and tail chunks (the *middle*), every
whole document too short for chunks of ``min_chunk`` tokens (``c < min_chunk``; the layout's field,
:data:`DEFAULT_MIN_CHUNK` unless set), and the padding past the last document (a document of its own)
join one middle stream in global order, placed by zigzag in its turn: cut into ``2 * ring`` equal
consecutive pieces, ring rank r takes pieces r and ``2 * ring - 1 - r``. Each ring rank then holds
its positions in ascending order (adjacent runs merged), and its Ulysses ranks split that block into
``ulysses`` equal pieces, as in zigzag.

With ring=2 (4 chunks a document), a document A of 8 tokens, B of 5, and 3 tokens of padding,
drawn with chunks of one token allowed (``min_chunk=1``; the default keeps documents this short
whole)::

    position  0 1 2 3 4 5 6 7 | 8 9 10 11 12 | 13 14 15
    document  A A A A A A A A | B B B  B  B  | padding
    chunk     0 0 1 1 2 2 3 3 | 0 1 mid 2  3 | mid mid mid      c = 2 for A, 1 for B, 0 for padding
    middle stream: 10 | 13 | 14 | 15 (4 pieces: ring 0 takes the first and last, ring 1 the others)

    ring 0: A 0 1 . . . . 6 7 | B 8 . 10 .  12 | .  .  15     A's chunks 0 and 3, B's 0 and 3
    ring 1: A . . 2 3 4 5 . . | B . 9 .  11 .  | 13 14 .      A's chunks 1 and 2, B's 1 and 2

    A's causal triangle (rows: queries, # = computed), split by ring rank:
          keys 0 1 2 3 4 5 6 7
    q 0  r0    #                     ring 0 rows: 1 + 2 + 7 + 8 = 18 pairs
    q 1  r0    # #                   ring 1 rows: 3 + 4 + 5 + 6 = 18 pairs
    q 2  r1    # # #
    q 3  r1    # # # #
    q 4  r1    # # # # #
    q 5  r1    # # # # # #
    q 6  r0    # # # # # # #
    q 7  r0    # # # # # # # #

The layout is a permutation like every other (``SequenceLayout.indices``). Attention stays exact
because the ring's block plan works from each block's runs of global positions and the document
bounds, whatever the runs are; the cost is more kernel calls per ring step (about one per cut
document that a step's two blocks share) where zigzag has one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The layout's default smallest chunk a document is cut into: a shorter document stays whole in the
# middle stream. Each chunk of a cut document costs a kernel call per ring step, and chunks below the
# 64-token tiles of flash kernels waste them. Whole short documents cost a little balance (bench
# balance, 128K tokens of 64..2048-token documents at ring 8: max/mean 1.02-1.04 here, 1.01 with 32,
# 1.11 for zigzag).
DEFAULT_MIN_CHUNK = 64


@dataclass(frozen=True)
class Run:
    """Consecutive global positions ``[start, start + length)`` stored at ``[offset, offset + length)``
    of a local buffer."""

    start: int
    length: int
    offset: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def _document_pieces(
    bounds: tuple[int, ...], ring: int, min_chunk: int
) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int]]]:
    """Per ring rank, the ``(start, stop)`` head and tail chunks of every document; and the middle
    stream as ``(start, stop)`` intervals in global order."""
    chunks: list[list[tuple[int, int]]] = [[] for _ in range(ring)]
    middle: list[tuple[int, int]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * ring)
        c = c if c >= min_chunk else 0
        if c:
            for r in range(ring):
                chunks[r].append((a + r * c, a + (r + 1) * c))
                chunks[r].append((b - (r + 1) * c, b - r * c))
        if a + ring * c < b - ring * c:
            middle.append((a + ring * c, b - ring * c))
    return chunks, middle


def _cut(intervals: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """Cut a list of disjoint intervals (their total a multiple of ``parts``) into ``parts``
    consecutive pieces of equal length."""
    total = sum(b - a for a, b in intervals)
    share = total // parts
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    filled, piece = 0, 0
    for a, b in intervals:
        while a < b:
            take = min(b - a, share - filled)
            pieces[piece].append((a, a + take))
            a, filled = a + take, filled + take
            if filled == share and piece < parts - 1:
                piece, filled = piece + 1, 0
    return pieces


@functools.lru_cache(maxsize=64)
def per_document_runs(
    documents: tuple[int, ...] | None, ring: int, padded_len: int, min_chunk: int = DEFAULT_MIN_CHUNK
) -> tuple[tuple[Run, ...], ...]:
    """Runs of every ring rank (ascending, adjacent runs merged) of the ``per_document`` layout."""
    bounds = list(documents) if documents is not None else [0]
    if bounds[-1] < padded_len:
        bounds.append(padded_len)  # the padding is a document of its own
    chunks, middle = _document_pieces(tuple(bounds), ring, min_chunk)
    pieces = _cut(middle, 2 * ring)
    for r in range(ring):
        chunks[r].extend(pieces[r] + pieces[2 * ring - 1 - r])
    result = []
    for intervals in chunks:
        runs: list[Run] = []
        for a, b in sorted(intervals):
            if runs and runs[-1].stop == a:
                last = runs.pop()
                runs.append(Run(last.start, last.length + b - a, last.offset))
            else:
                runs.append(Run(a, b - a, runs[-1].offset + runs[-1].length if runs else 0))
        result.append(tuple(runs))
    return tuple(result)
