"""What to compute for one (query block, key block) pair: the block math's plan, no communication.

A block is a local buffer whose tokens are runs of consecutive global positions (see
``seqmesh.sequence.runs.Run``), ascending: two for zigzag, about two per document for ``per_document``. Two blocks on a ring are either the same block (the diagonal)
or hold disjoint positions. Packed documents are intervals of positions given by ``bounds``
(``0 = b0 < b1 < ... = padded_len``; the padding past the real length is a document of its own, so
real tokens never see it and padded tokens still see themselves).

``plan_block`` turns a block pair into a few dense kernel calls (:class:`Piece`), never a dense mask
over the whole block:

- diagonal: one call over the whole block, causal and/or split into segments where the document
  changes (positions ascend along the buffer, so position order is buffer order);
- disjoint runs: keys wholly before the queries are all visible (causal or not) but for documents;
  keys after are visible only without causality. A document is an interval, so at most one document
  spans the gap between two disjoint runs: each run pair is one full rectangle or nothing.

Full rectangles that share their rows and touch along keys (or share keys and touch along rows) are
merged, so zigzag without documents runs exactly one call per ring step.

A sliding window (causal only: query i sees keys ``i - window < j <= i``) plans every run pair on its
own, so each call's rows and columns are consecutive positions and its mask carries their distance
(``BlockMask.offset``). A rectangle is trimmed to the rows and keys the window reaches, skipped when
nothing is left, and stays a plain full call when the window covers all of it::

    keys before the queries, window w:    rows  qs .. qe-1,  keys ks .. ke-1  (ke <= qs)
    keys kept    ks' = max(ks, qs - w + 1)         (older keys are out of every row's window)
    rows kept    qe' = min(qe, ke - 1 + w)         (later rows see none of these keys)
    full call    when qe' - 1 - ks' < w            (the farthest pair is inside the window)

ALiBi (a bias by distance, causal only) needs the distance of every (query, key) pair of a call, so, as under a
window, each run pair is planned on its own: the diagonal's run against itself (offset 0), and each rectangle of
keys before the queries as a full call whose mask carries ``offset = qs - ks``. Zigzag then runs two calls a ring
step where it ran one, and three on the diagonal (its two runs are not consecutive positions).

Image blocks (Gemma 3: the tokens of one image see each other both ways) are intervals of positions,
each inside one document, given with causal attention. A query in a block sees, besides the keys
causality gives it, every later key of its own block: its highest visible key is the block's last
position instead of itself. The block's later keys are always inside a causal window (``j > i > i - w``)
as long as the block is no longer than the window, which the checks require. Keys before a query are
visible or not whatever the blocks, so pairs of disjoint runs are planned as without blocks, plus one
full rectangle for each image that reaches from the queries into later keys; a run against itself is cut
at block edges into parts, each part against itself (an image's one full call, text causal) and against
the run's keys before it. No kernel learns a new mask.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ..kernels.base import FULL, BlockMask
from ..sequence.runs import Run


@dataclass(frozen=True)
class Piece:
    """One kernel call: local query rows ``[q0, q1)`` against local key rows ``[k0, k1)``."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: BlockMask

    @property
    def work(self) -> int:
        """(query, key) pairs the call computes."""
        return self.mask.score_entries(self.q1 - self.q0, self.k1 - self.k0)


def _doc(bounds: Sequence[int], position: int) -> int:
    """Index of the document holding ``position``."""
    return bisect.bisect_right(bounds, position) - 1


def _segments(runs: Sequence[Run], bounds: Sequence[int]) -> tuple[int, ...] | None:
    """Local boundaries where the document changes along a block, or None for a single document."""
    cuts = [0]
    previous_doc = None
    for run in runs:
        first_doc = _doc(bounds, run.start)
        if previous_doc is not None and first_doc != previous_doc:
            cuts.append(run.offset)
        lo, hi = bisect.bisect_right(bounds, run.start), bisect.bisect_left(bounds, run.stop)
        cuts.extend(run.offset + b - run.start for b in bounds[lo:hi])
        previous_doc = _doc(bounds, run.stop - 1)
    total = runs[-1].offset + runs[-1].length
    cuts.append(total)
    return None if len(cuts) == 2 else tuple(cuts)


def _cross(q: Run, k: Run, bounds: Sequence[int], causal: bool) -> Piece | None:
    """The visible rectangle between two runs of disjoint positions, if any."""
    if k.stop <= q.start:  # keys before queries: visible unless a document boundary lies between
        d = _doc(bounds, k.stop - 1)
        if bounds[d + 1] <= q.start:
            return None
        qs, qe = q.start, min(q.stop, bounds[d + 1])
        ks, ke = max(k.start, bounds[d]), k.stop
    elif q.stop <= k.start:  # keys after queries
        if causal:
            return None
        d = _doc(bounds, q.stop - 1)
        if bounds[d + 1] <= k.start:
            return None
        qs, qe = max(q.start, bounds[d]), q.stop
        ks, ke = k.start, min(k.stop, bounds[d + 1])
    else:
        raise ValueError(f"runs overlap without being the same block: queries {q}, keys {k}")
    return Piece(q.offset + qs - q.start, q.offset + qe - q.start, k.offset + ks - k.start, k.offset + ke - k.start, FULL)


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge full rectangles that share rows and touch along keys, or share keys and touch along rows
    (sweeps over the pieces sorted by rows, then by keys, until nothing merges)."""
    by_rows = lambda p: (p.q0, p.q1, p.k0)  # noqa: E731
    by_keys = lambda p: (p.k0, p.k1, p.q0)  # noqa: E731
    while True:
        count = len(pieces)
        for order in (by_rows, by_keys):
            merged: list[Piece] = []
            for p in sorted(pieces, key=order):
                last = merged[-1] if merged else None
                if last is not None and last.mask == FULL and p.mask == FULL:
                    if order is by_rows and (last.q0, last.q1) == (p.q0, p.q1) and last.k1 == p.k0:
                        merged[-1] = Piece(last.q0, last.q1, last.k0, p.k1, FULL)
                        continue
                    if order is by_keys and (last.k0, last.k1) == (p.k0, p.k1) and last.q1 == p.q0:
                        merged[-1] = Piece(last.q0, p.q1, last.k0, last.k1, FULL)
                        continue
                merged.append(p)
            pieces = merged
        if len(pieces) == count:
            return sorted(pieces, key=lambda p: (p.q0, p.k0))


def _diagonal_window(run: Run, bounds: Sequence[int], window: int) -> Piece:
    """One run against itself under a causal window (no window mask when it spans the run)."""
    segments = _segments((Run(run.start, run.length, 0),), bounds)
    within = window if window < run.length else None
    end = run.offset + run.length
    return Piece(run.offset, end, run.offset, end, BlockMask(causal=True, segments=segments, window=within))


def _cross_window(q: Run, k: Run, bounds: Sequence[int], window: int) -> Piece | None:
    """The visible rectangle between two runs of disjoint positions under a causal window, trimmed."""
    p = _cross(q, k, bounds, causal=True)
    if p is None:
        return None
    qs, qe = q.start + p.q0 - q.offset, q.start + p.q1 - q.offset  # global positions
    ks, ke = k.start + p.k0 - k.offset, k.start + p.k1 - k.offset
    ks, qe = max(ks, qs - window + 1), min(qe, ke - 1 + window)
    if ks >= ke or qe <= qs:
        return None
    mask = FULL if qe - 1 - ks < window else BlockMask(causal=True, window=window, offset=qs - ks)
    return Piece(q.offset + qs - q.start, q.offset + qe - q.start, k.offset + ks - k.start,
                 k.offset + ke - k.start, mask)


def _cross_distance(q: Run, k: Run, bounds: Sequence[int]) -> Piece | None:
    """The visible rectangle between two runs of disjoint positions under causal ALiBi, its mask carrying the
    distance of its first row to its first key (rows and keys are consecutive positions)."""
    p = _cross(q, k, bounds, causal=True)
    if p is None:
        return None
    qs, ks = q.start + p.q0 - q.offset, k.start + p.k0 - k.offset  # global positions of the first row and key
    return Piece(p.q0, p.q1, p.k0, p.k1, BlockMask(offset=qs - ks))


def _split_at_blocks(run: Run, blocks: Sequence[tuple[int, int]]) -> list[tuple[Run, bool]]:
    """``run`` cut at the image blocks' starts and stops, each part with whether a block holds it."""
    starts = [a for a, _ in blocks]
    first = max(0, bisect.bisect_right(starts, run.start) - 1)
    cuts = {run.start, run.stop}
    for a, b in blocks[first : bisect.bisect_left(starts, run.stop)]:
        cuts.update(x for x in (a, b) if run.start < x < run.stop)
    edges = sorted(cuts)
    parts = []
    for a, b in zip(edges, edges[1:]):
        i = bisect.bisect_right(starts, a) - 1
        parts.append((Run(a, b - a, run.offset + a - run.start), i >= 0 and a < blocks[i][1]))
    return parts


def _diagonal_with_blocks(run: Run, bounds: Sequence[int], window: int | None,
                          blocks: Sequence[tuple[int, int]]) -> list[Piece | None]:
    """One run against itself: each part against itself (an image's both ways, text causal) and against the
    run's keys before it (as without blocks: a key before the query is visible whatever the blocks)."""
    pieces: list[Piece | None] = []
    for part, image in _split_at_blocks(run, blocks):
        end = part.offset + part.length
        if image:  # inside one document, and no longer than the window (checked)
            pieces.append(Piece(part.offset, end, part.offset, end, FULL))
        elif window is not None:
            pieces.append(_diagonal_window(part, bounds, window))
        else:
            segments = _segments((Run(part.start, part.length, 0),), bounds)
            pieces.append(Piece(part.offset, end, part.offset, end, BlockMask(causal=True, segments=segments)))
        if part.start > run.start:
            prefix = Run(run.start, part.start - run.start, run.offset)
            pieces.append(_cross_window(part, prefix, bounds, window) if window is not None
                          else _cross(part, prefix, bounds, causal=True))
    return pieces


def _later_in_blocks(q: Run, k: Run, blocks: Sequence[tuple[int, int]]) -> list[Piece]:
    """Keys after the queries (``q.stop <= k.start``) that an image holding both gives them: one full
    rectangle per such image."""
    starts = [a for a, _ in blocks]
    pieces = []
    for a, b in blocks[max(0, bisect.bisect_right(starts, q.start) - 1) : bisect.bisect_left(starts, q.stop)]:
        if a < q.stop and b > k.start:  # the image reaches from the queries into the keys
            qs, ke = max(a, q.start), min(b, k.stop)
            pieces.append(Piece(q.offset + qs - q.start, q.offset + q.length, k.offset, k.offset + ke - k.start, FULL))
    return pieces


def _plan_with_blocks(q_runs: Sequence[Run], k_runs: Sequence[Run], bounds: Sequence[int], window: int | None,
                      blocks: Sequence[tuple[int, int]]) -> list[Piece]:
    """Causal attention (optionally windowed) with image blocks. Keys before a query are visible or not
    whatever the blocks, so they are planned on whole runs as without blocks; blocks add only each image's
    later keys. Linear in the runs and blocks (a batch of many images plans in milliseconds)."""
    pieces: list[Piece | None] = []
    for q in q_runs:
        for k in k_runs:
            if q == k:
                pieces += _diagonal_with_blocks(q, bounds, window, blocks)
            elif k.stop <= q.start:
                pieces.append(_cross_window(q, k, bounds, window) if window is not None else _cross(q, k, bounds, True))
            else:  # the keys lie after the queries
                pieces += _later_in_blocks(q, k, blocks)
    return [p for p in pieces if p is not None]


def plan_block(
    q_runs: Sequence[Run], k_runs: Sequence[Run], bounds: Sequence[int], causal: bool, window: int | None = None,
    blocks: Sequence[tuple[int, int]] = (), distance: bool = False,
) -> tuple[Piece, ...]:
    """Kernel calls that compute attention of the ``q_runs`` block over the ``k_runs`` block, with an
    optional causal sliding ``window`` and image ``blocks`` (``[start, stop)`` intervals of positions,
    ascending, each inside one document and no longer than ``window``; read with causal attention only,
    as without causality every key of a document is visible already). ``distance``: every call's mask carries
    its rows' distance to its keys (ALiBi; causal, without a window or image blocks)."""
    if window is not None and not causal:
        raise ValueError("sliding windows are causal here; non-causal windowed attention is not supported.")
    if distance:
        if not causal or window is not None or blocks:
            raise ValueError("ALiBi is planned for causal attention without a window or image blocks.")
        whole = bounds[-1]  # a window no run pair reaches past: the diagonal's plain causal call
        pieces = [(_diagonal_window(q, bounds, whole) if q == k else _cross_distance(q, k, bounds))
                  for q in q_runs for k in k_runs if q == k or k.stop <= q.start]
        return tuple(sorted((p for p in pieces if p is not None), key=lambda p: (p.q0, p.k0)))
    if blocks and causal:
        return tuple(_coalesce(_plan_with_blocks(q_runs, k_runs, bounds, window, blocks)))
    if window is not None:
        pieces = [
            (_diagonal_window(q, bounds, window) if q == k else _cross_window(q, k, bounds, window))
            for q in q_runs for k in k_runs
        ]
        return tuple(_coalesce([p for p in pieces if p is not None]))
    if tuple(q_runs) == tuple(k_runs):
        n = q_runs[-1].offset + q_runs[-1].length
        return (Piece(0, n, 0, n, BlockMask(causal=causal, segments=_segments(q_runs, bounds))),)
    # runs ascend, so the key runs a query run can see are a slice: those ending after the start of
    # its first document and starting before its own start (causal) or the end of its last document
    k_starts, k_stops = [k.start for k in k_runs], [k.stop for k in k_runs]
    pieces = []
    for q in q_runs:
        lo = bounds[_doc(bounds, q.start)]
        hi = q.start if causal else bounds[_doc(bounds, q.stop - 1) + 1]
        for k in k_runs[bisect.bisect_right(k_stops, lo) : bisect.bisect_left(k_starts, hi)]:
            if (p := _cross(q, k, bounds, causal)) is not None:
                pieces.append(p)
    return tuple(_coalesce(pieces))


def document_bounds(padded_len: int, seq_len: int, cu_seqlens: Sequence[int] | None) -> tuple[int, ...]:
    """Document boundaries over the padded sequence: the user's ``cu_seqlens`` (or one document of
    ``seq_len`` tokens), then the padding as a document of its own."""
    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, seq_len]
    if bounds[-1] < padded_len:
        bounds.append(padded_len)
    return tuple(bounds)


def chunk_bounds(bounds: Sequence[int], chunk: int) -> tuple[int, ...]:
    """``bounds`` (from :func:`document_bounds`) with a boundary every ``chunk`` positions of each document added:
    chunked attention (Llama 4) as documents, for the mask only. Chunks count from each document's start, as
    transformers' chunked mask does on packed documents (it reads their positions)."""
    return tuple(sorted({a + i for a, b in zip(bounds[:-1], bounds[1:]) for i in range(0, b - a, chunk)} | {bounds[-1]}))
