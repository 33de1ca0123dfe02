"""Sequence layouts: which global positions each rank holds, as an invertible permutation.

A layout sends a padded sequence of ``padded_len`` tokens to the ``P = ring x ulysses`` ranks of a
sequence group. Concatenating the local shards in sequence-rank order (``ring_rank * ulysses +
ulysses_rank``) gives ``x[indices()]``; ``x_sharded[indices(restore=True)]`` undoes it.

``contiguous``: rank i holds positions ``[i*L, (i+1)*L)``.

``zigzag`` (causal load balancing, as in the USP paper): cut the sequence into ``2*ring`` chunks;
ring rank r holds chunks r and ``2*ring-1-r``; its Ulysses ranks split that pair into ``ulysses``
equal pieces. With ring=2, chunks c0..c3, the causal mask seen by the two ring ranks::

            keys:  c0 c1 c2 c3
    ring 0  c0     \\
    (c0,c3) c3     #  #  #  \\        each ring rank sees 1 + 2 + ... of the same total work
    ring 1  c1     #  \\
    (c1,c2) c2     #  #  \\

After the Ulysses all-to-all each ring rank holds its whole pair, so a ring step only ever meets
chunks whose positions are equal (the diagonal) or disjoint. With ring=1 zigzag equals contiguous.

``per_document`` (packed documents; see :mod:`seqmesh.sequence.runs`): zigzag inside every
document, so each ring rank holds the same share of every document's own causal triangle.
Without documents it equals zigzag. Documents shorter than ``2 * ring * min_chunk`` tokens stay
whole (``min_chunk`` is a field of the layout). :func:`auto_layout` picks zigzag or per_document.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from ..rules.padding import padded_length, padding_multiple
from .runs import DEFAULT_MIN_CHUNK, Run, per_document_runs


class LayoutKind(str, enum.Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    PER_DOCUMENT = "per_document"


def _parse_kind(layout: str | LayoutKind) -> LayoutKind:
    try:
        return LayoutKind(layout)
    except ValueError:
        names = ", ".join(repr(k.value) for k in LayoutKind)
        raise ValueError(f"unknown layout {layout!r}; choose one of {names}.") from None


def layout_multiple(kind: LayoutKind, ring: int, ulysses: int) -> int:
    """A padded length must be a multiple of this for ``kind`` on a ``ring x ulysses`` group."""
    return padding_multiple(kind.value, ring, ulysses)


@dataclass(frozen=True)
class SequenceLayout:
    """Where each of ``padded_len`` positions lives on a ``ring x ulysses`` sequence group.

    ``documents``: the packed documents' boundaries ``(0, e1, ..., en)`` with ``en <= padded_len``
    (flash-attn's ``cu_seqlens``), read by the ``per_document`` kind only (the others keep None).
    ``min_chunk``: the smallest chunk ``per_document`` cuts a document into (shorter documents stay
    whole); read by that kind only (the others keep the default)."""

    kind: LayoutKind
    ring: int
    ulysses: int
    padded_len: int
    documents: tuple[int, ...] | None = None
    min_chunk: int = DEFAULT_MIN_CHUNK

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse_kind(self.kind))
        if self.min_chunk < 1:
            raise ValueError(f"min_chunk must be at least 1 token, got {self.min_chunk}.")
        if self.kind is not LayoutKind.PER_DOCUMENT:  # equal permutations compare (and cache) equal
            object.__setattr__(self, "min_chunk", DEFAULT_MIN_CHUNK)
        if self.kind is not LayoutKind.PER_DOCUMENT or self.documents is None:
            object.__setattr__(self, "documents", None)
        else:
            docs = tuple(int(x) for x in self.documents)
            ascending = all(a < b for a, b in zip(docs, docs[1:]))
            if len(docs) < 2 or docs[0] != 0 or not ascending or docs[-1] > self.padded_len:
                raise ValueError(
                    f"documents must be boundaries (0, e1, ..., en) strictly increasing up to at most the padded "
                    f"length {self.padded_len}, got {docs[:8]}{'...' if len(docs) > 8 else ''}."
                )
            object.__setattr__(self, "documents", docs)
        multiple = layout_multiple(self.kind, self.ring, self.ulysses)
        if self.padded_len < 1 or self.padded_len % multiple:
            raise ValueError(
                f"a {self.kind.value} layout over ring={self.ring} x ulysses={self.ulysses} needs a "
                f"sequence length that is a positive multiple of {multiple}, got {self.padded_len}; "
                "pad the sequence (seqmesh.shard_sequence and seqmesh.shard_batch do it for you)."
            )

    @classmethod
    def for_length(
        cls,
        kind: str | LayoutKind,
        ring: int,
        ulysses: int,
        seq_len: int,
        documents: tuple[int, ...] | None = None,
        min_chunk: int = DEFAULT_MIN_CHUNK,
        tp: int = 1,
    ) -> SequenceLayout:
        """The layout of a ``seq_len``-token sequence padded to the next valid length (one whose local
        shares split into ``tp`` equal slices, for tensor parallelism's sequence-parallel regions)."""
        kind = _parse_kind(kind)
        return cls(kind, ring, ulysses, padded_length(seq_len, ulysses, ring, kind.value, tp), documents, min_chunk)

    @property
    def size(self) -> int:
        return self.ring * self.ulysses

    @property
    def local_len(self) -> int:
        """Tokens per rank of the sequence group."""
        return self.padded_len // self.size

    @property
    def ring_len(self) -> int:
        """Tokens per ring rank once its Ulysses group is gathered."""
        return self.padded_len // self.ring

    def ring_runs(self, ring_rank: int) -> tuple[Run, ...]:
        """Global positions of ring rank ``ring_rank``'s block (ascending, adjacent runs merged)."""
        if self.kind is LayoutKind.CONTIGUOUS or self.ring == 1:
            n = self.ring_len
            return (Run(ring_rank * n, n, 0),)
        if self.kind is LayoutKind.PER_DOCUMENT:
            return per_document_runs(self.documents, self.ring, self.padded_len, self.min_chunk)[ring_rank]
        c = self.padded_len // (2 * self.ring)
        first, second = ring_rank, 2 * self.ring - 1 - ring_rank
        return (Run(first * c, c, 0), Run(second * c, c, c))

    def indices(self, restore: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
        """``(padded_len,)`` int64 on ``device`` (default CPU). Shard order -> global position, or with
        ``restore`` the inverse. Built once per layout, direction and device and shared by every layer
        and caller that meets the same layout: read it, never write into it."""
        return _indices(self, restore, torch.device("cpu") if device is None else torch.device(device))

    def _order(self) -> torch.Tensor:
        """``indices()`` computed afresh on the CPU."""
        runs = [run for r in range(self.ring) for run in self.ring_runs(r)]
        if len(runs) <= 256:  # few runs (zigzag, contiguous): one arange each is the cheapest
            return torch.cat([torch.arange(run.start, run.stop) for run in runs])
        # a run per document chunk: shard slot i of a run holds start + (i - the run's first slot)
        starts = torch.tensor([run.start for run in runs], dtype=torch.long)
        lengths = torch.tensor([run.length for run in runs], dtype=torch.long)
        first_slot = lengths.cumsum(0) - lengths
        return torch.arange(self.padded_len) + torch.repeat_interleave(starts - first_slot, lengths)

    def local_positions(self, sp_rank: int) -> torch.Tensor:
        """``(local_len,)`` global positions of the tokens held by sequence rank ``sp_rank``."""
        n = self.local_len
        return self.indices()[sp_rank * n : (sp_rank + 1) * n].clone()  # the caller's own: it may write into it


# Per layout, direction and device. A few entries: a training step meets one layout per batch (a
# per_document layout changes with every batch), each entry is padded_len int64 (8 bytes a token).
@functools.lru_cache(maxsize=8)
def _indices(layout: SequenceLayout, restore: bool, device: torch.device) -> torch.Tensor:
    order = layout._order()
    if restore:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        order = inverse
    return order.to(device)


# zigzag is kept while its busiest ring rank does at most this much more causal work than the mean: the
# per-document layout balances further, but pays about one kernel call per cut document per ring step
ZIGZAG_IMBALANCE_LIMIT = 1.10


def causal_work_per_ring_rank(layout: SequenceLayout, bounds: tuple[int, ...]) -> list[int]:
    """(query, key) pairs each ring rank's queries see under causal attention within the documents
    ``bounds`` (``0 = b0 < ... = layout.padded_len``; the padding is a document of its own)."""
    edges = torch.tensor(bounds)
    sizes = edges[1:] - edges[:-1]
    starts = torch.repeat_interleave(edges[:-1], sizes)
    keys_seen = torch.arange(layout.padded_len) - starts + 1  # (padded_len,) causal keys of each query
    return keys_seen[layout.indices()].reshape(layout.ring, -1).sum(dim=1).tolist()


def auto_layout(ring: int, ulysses: int, seq_len: int, cu_seqlens: tuple[int, ...] | None) -> str:
    """``"zigzag"``, or ``"per_document"`` when packed documents leave zigzag's busiest ring rank more than
    ``ZIGZAG_IMBALANCE_LIMIT`` times the mean causal work (one long document among short ones: up to 2x)."""
    if cu_seqlens is None or ring == 1:  # a ring of one computes every position: nothing to balance
        return "zigzag"
    zigzag = SequenceLayout.for_length("zigzag", ring, ulysses, seq_len)
    bounds = tuple(cu_seqlens) + ((zigzag.padded_len,) if cu_seqlens[-1] < zigzag.padded_len else ())
    work = causal_work_per_ring_rank(zigzag, bounds)
    return "zigzag" if max(work) * len(work) <= ZIGZAG_IMBALANCE_LIMIT * sum(work) else "per_document"
