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

``per_document`` (packed documents; see :mod:`seqmesh.document_layout`): zigzag inside every
document, so each ring rank holds the same share of every document's own causal triangle.
Without documents it equals zigzag.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from .padding import padded_length, padding_multiple


class LayoutKind(str, enum.Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    PER_DOCUMENT = "per_document"


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
    (flash-attn's ``cu_seqlens``), read by the ``per_document`` kind only (the others keep None)."""

    kind: LayoutKind
    ring: int
    ulysses: int
    padded_len: int
    documents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse_kind(self.kind))
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
        cls, kind: str | LayoutKind, ring: int, ulysses: int, seq_len: int, documents: tuple[int, ...] | None = None
    ) -> SequenceLayout:
        """The layout of a ``seq_len``-token sequence padded to the next valid length."""
        kind = _parse_kind(kind)
        return cls(kind, ring, ulysses, padded_length(seq_len, ulysses, ring, kind.value), documents)

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
            from . import document_layout

            runs = document_layout.per_document_runs(
                self.documents, self.ring, self.padded_len, document_layout.MIN_CHUNK)
            return runs[ring_rank]
        c = self.padded_len // (2 * self.ring)
        first, second = ring_rank, 2 * self.ring - 1 - ring_rank
        return (Run(first * c, c, 0), Run(second * c, c, c))

    def indices(self, restore: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
        """``(padded_len,)`` int64 on ``device`` (default CPU). Shard order -> global position, or with
        ``restore`` the inverse. Built once per layout, direction and device and shared by every layer
        and caller that meets the same layout: read it, never write into it."""
        from . import document_layout

        # per_document runs read MIN_CHUNK when computed, so it is part of the key: a changed chunk size
        # must never meet indices cached under the old one while ring_runs() answers with the new
        return _indices(self, restore, torch.device("cpu") if device is None else torch.device(device),
                        document_layout.MIN_CHUNK)

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
def _indices(layout: SequenceLayout, restore: bool, device: torch.device, min_chunk: int) -> torch.Tensor:
    order = layout._order()
    if restore:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        order = inverse
    return order.to(device)

