"""From a whole batch to this rank's inputs: shift, find documents, pad, place by the layout, slice.

Everything that depends on the whole sequence is computed before slicing: the next-token labels
(so the label of each shard's last token, which lives on another rank, is not lost), the document
boundaries of packed sequences and the positions restarting per document (for RoPE). Only then is
each tensor padded to the layout's multiple and sliced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..mesh import SPMesh
from .layout import auto_layout
from .sharding import sequence_layout, sequence_positions, shard_sequence

IGNORE_INDEX = -100  # the target that scores nothing (transformers' convention); the loss reads it from here


class ValidatedMeshes:
    """The meshes whose ranks have agreed on a batch's inputs. Not a set: FSDP2's cast of a layer's forward inputs
    (mixed precision) rebuilds the containers it walks, which would hand every layer an empty copy and repeat the
    check once per layer; an object it does not know is passed on as it is."""

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add(self, mesh_id: int) -> None:
        self._ids.add(mesh_id)

    def __contains__(self, mesh_id: object) -> bool:
        return mesh_id in self._ids


@dataclass(frozen=True)
class SequenceInfo:
    """What attention needs to know about the whole sequence, carried beside the local inputs."""

    seq_len: int  # real tokens before the layout's padding
    cu_seqlens: tuple[int, ...] | None  # packed documents over the whole sequence, or None
    layout: str
    ignore_index: int = IGNORE_INDEX  # the target value that scores nothing; the loss reads it from here
    # [start, stop) over the whole sequence of each image block whose tokens see each other both ways (Gemma 3)
    image_blocks: tuple[tuple[int, int], ...] | None = None
    lengths: tuple[int, ...] | None = None  # real tokens per row (the batch's right padding), or None: rows are whole
    # the largest position of the whole batch, before the layout's padding: transformers decides a length-dependent
    # rotary scaling (dynamic NTK, longrope) from it, which no shard can see (None: not known, e.g. hand-built)
    max_position: int | None = None
    # who numbered the positions the model is given: "documents" (seqmesh: from 0 in each document), "caller"
    # (the batch's own position_ids) or "model" (the family's own rule on the whole sequence: RoBERTa-style offsets)
    positions: str = "documents"
    # meshes whose ranks have already agreed on these inputs (the first attention call checks, once)
    validated: ValidatedMeshes = field(default_factory=ValidatedMeshes, compare=False, repr=False)


def real_tokens(info: SequenceInfo | None, mesh: SPMesh | None, shape: tuple[int, int],
                device: torch.device | str = "cpu") -> torch.Tensor | None:
    """``shape`` ``(B, L)`` bool: which of this rank's tokens are the batch's own, neither the layout's padding
    nor past a row's real length (the batch's ``attention_mask``); None when all are (no padding anywhere)."""
    if info is None:
        return None
    if mesh is None:
        positions = torch.arange(shape[1], device=device)
    else:
        positions = sequence_positions(info.seq_len, mesh, layout=info.layout, device=device, cu_seqlens=info.cu_seqlens)
    if positions.shape[0] != shape[1]:
        raise ValueError(f"this rank holds {shape[1]} tokens but the layout {info.layout!r} of a {info.seq_len}-token "
                         f"sequence gives it {positions.shape[0]}: pass the SequenceInfo shard_batch returned with "
                         "the inputs it returned.")
    lengths = info.lengths if info.lengths is not None else (info.seq_len,) * shape[0]
    real = positions[None, :] < torch.tensor(lengths, device=device)[:, None]  # (B, L)
    return None if bool(real.all()) else real


def document_places(mesh: SPMesh, info: SequenceInfo, device: torch.device | str = "cpu"):
    """For each local token: its document's first index in the row and its index within the document (padding: the
    row's first token, index 0), as (L,) int64 tensors on ``device``; and the longest document's length."""
    positions = sequence_positions(info.seq_len, mesh, layout=info.layout, cu_seqlens=info.cu_seqlens).to(device)
    cuts = tuple(info.cu_seqlens or (0, info.seq_len))  # on the host: no device sync for the longest
    bounds = torch.tensor(cuts, device=device)
    positions = positions.masked_fill(positions >= info.seq_len, 0)
    start = bounds[torch.bucketize(positions, bounds[1:], right=True)]
    return start, positions - start, max(b - a for a, b in zip(cuts, cuts[1:]))


def documents_from_positions(position_ids: torch.Tensor) -> tuple[int, ...] | None:
    """Boundaries where positions do not continue by +1 (a new document starts); one tuple for all
    rows, which must agree."""
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1  # (B, S-1): token t+1 starts a document
    if not torch.equal(starts, starts[:1].expand_as(starts)):
        raise ValueError(
            "the rows of position_ids describe different packed documents; seqmesh attention shares one set of "
            "boundaries across the batch. Pack the documents into one row (batch size 1), or give every row the "
            "same document lengths."
        )
    inner = (starts[0].nonzero().flatten() + 1).tolist()
    return (0, *inner, position_ids.shape[1]) if inner else None


def real_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a right-padded mask (ones, then zeros)."""
    mask = attention_mask.to(torch.long)
    lengths = mask.sum(dim=1)
    expected = (torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]).long()
    if not torch.equal(mask, expected):
        raise ValueError(
            "attention_mask must be right padding (ones then zeros) in every row; for packed documents pass "
            "position_ids that restart at 0 at each document instead of a mask."
        )
    return lengths.tolist()


def positions_in_documents(seq_len: int, cu_seqlens: tuple[int, ...] | None) -> torch.Tensor:
    """``(seq_len,)`` position of each token inside its document (0 at every document start; tokens
    past the last boundary keep their global position)."""
    positions = torch.arange(seq_len)
    if cu_seqlens is None:
        return positions
    cu = torch.tensor(cu_seqlens, dtype=torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu.diff())  # (cu[-1],) first position of each token's document
    return positions - torch.nn.functional.pad(starts, (0, seq_len - cu_seqlens[-1]))


def shift_labels(
    labels: torch.Tensor, cu_seqlens: tuple[int, ...] | None, lengths: list[int] | None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Targets for next-token prediction over the whole sequence: ``target[t] = labels[t + 1]``.

    Ignored: the last token, the last token of each document (its successor belongs to another
    document, which attention cannot see), and every target at or past a row's real length."""
    target = torch.full_like(labels, ignore_index)
    target[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        ends = torch.tensor(cu_seqlens[1:], dtype=torch.long) - 1
        target[:, ends[ends < labels.shape[1]]] = ignore_index
    if lengths is not None:  # one slice per row (not per token): cheaper than a (B, S) mask
        for row, n in enumerate(lengths):
            target[row, max(n - 1, 0) :] = ignore_index
    return target


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    mesh: SPMesh,
    *,
    layout: str = "auto",
    ignore_index: int = IGNORE_INDEX,
    own_positions: torch.Tensor | None = None,
) -> dict:
    """This rank's inputs for a causal LM from the whole batch (the same on every sequence rank).

    Args:
        batch: ``input_ids`` ``(B, S)``; optional ``labels`` ``(B, S)`` (not shifted, as in
            transformers; defaults to ``input_ids``); optional ``position_ids`` ``(B, S)`` that restart
            at each packed document, or ``attention_mask`` ``(B, S)`` of right padding.
        mesh: the mesh; the batch is split over its sequence group.
        layout: ``"auto"`` (``"per_document"`` when ``position_ids`` pack documents that leave zigzag's
            busiest ring rank over 1.10x the mean causal work, so each rank gets the same share of every
            document's; ``"zigzag"`` otherwise, sparing per_document's extra kernel calls), or a
            :class:`~seqmesh.sequence.layout.LayoutKind` name.
        own_positions: ``(B, S)`` the positions the model's family numbers itself from the whole sequence when the
            batch gives none (RoBERTa-style: from ``padding_idx + 1``, padding tokens kept at ``padding_idx``;
            :func:`seqmesh.hf.positions.own_positions`); they go to the model as they are and describe no documents.

    Returns:
        ``input_ids``, ``position_ids`` (the caller's, or positions from 0 in each document, for RoPE) and
        ``shift_labels`` (targets, ``ignore_index`` where nothing is to be predicted), each
        ``(B, padded_len / P)`` in the layout's local order, and ``seqmesh``: the
        :class:`SequenceInfo` that ``seqmesh.hf`` attention reads from the model's kwargs (with the
        layout chosen).
    """
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}.")
    b, s = input_ids.shape
    if s < mesh.sp_size:
        raise ValueError(
            f"the sequence has {s} tokens but the sequence-parallel degree is {mesh.sp_size}; every rank needs "
            f"at least one token. Use sequences of at least {mesh.sp_size} tokens or a smaller degree."
        )
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}.")
    cu = None
    if batch.get("position_ids") is not None:
        cu = documents_from_positions(batch["position_ids"])
    lengths = real_lengths(batch["attention_mask"]) if batch.get("attention_mask") is not None else None

    targets = shift_labels(labels, cu, lengths, ignore_index)
    if batch.get("position_ids") is not None:  # the caller's positions (they may not start at 0) go to RoPE
        positions, numbered = batch["position_ids"].to(torch.long).expand(b, s), "caller"
        largest = int(positions.max())  # the ids were read already (documents_from_positions)
    elif own_positions is not None:
        if own_positions.shape != input_ids.shape:
            raise ValueError(f"own_positions {tuple(own_positions.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}.")
        positions, numbered = own_positions.to(torch.long), "model"
        largest = int(positions.max())
    else:
        positions, numbered = torch.arange(s, device=input_ids.device).expand(b, s), "documents"  # no documents
        largest = s - 1
    if layout == "auto":
        layout = auto_layout(mesh.ring, mesh.ulysses, s, cu)
    lay = sequence_layout(mesh, s, layout, cu)
    pad = lay.padded_len - s
    if pad:  # padding: token 0, nothing to predict, positions continuing past the end
        input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
        targets = torch.nn.functional.pad(targets, (0, pad), value=ignore_index)
        tail = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
        positions = torch.cat([positions, tail], dim=1)
    shard = lambda t: shard_sequence(t, mesh, dim=1, layout=layout, cu_seqlens=cu)  # noqa: E731
    return {
        "input_ids": shard(input_ids),
        "position_ids": shard(positions.contiguous()),
        "shift_labels": shard(targets),
        "seqmesh": SequenceInfo(seq_len=s, cu_seqlens=cu, layout=layout, ignore_index=ignore_index,
                                lengths=tuple(lengths) if lengths is not None else None, max_position=largest,
                                positions=numbered),
    }
