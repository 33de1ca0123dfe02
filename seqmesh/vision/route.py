"""The route of the tower's outputs to their tokens: which rows each rank sends where, and where the
rows it receives go. Computed on every rank from the whole batch, so no counts are exchanged; the
exchange itself is ``seqmesh.comm.collectives.exchange_rows``."""

from __future__ import annotations

import dataclasses

import torch

from ..comm.collectives import exchange_rows
from ..mesh import SPMesh
from ..sequence.batch import SequenceInfo
from ..sequence.layout import SequenceLayout

Routing = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], torch.Tensor]


def routing(unit_of_token: torch.Tensor, place_units: torch.Tensor, per_rank: int, lay: SequenceLayout, p: int,
            me: int) -> Routing:
    """Which of this rank's tower outputs it sends where, and where the rows it receives go.

    ``unit_of_token``: ``(B, padded_len)`` the unit each token takes (-1: none), in natural order;
    ``place_units``: ``(places,)`` the unit each place of the tower's sequence yields (-1: none, as a
    class token); rank ``s`` holds places ``[s*per_rank, (s+1)*per_rank)``. Returns ``(send_index,
    send_rows, recv_rows, recv_order)``: this rank's local places to send, sorted by destination rank
    and then by the token's place there; rows per destination and per source; and the permutation that
    puts the received rows into this rank's token order."""
    b = unit_of_token.shape[0]
    local = lay.local_len
    placed = unit_of_token[:, lay.indices()]  # (B, padded_len) in shard order
    units = int(unit_of_token.max()) + 1 if unit_of_token.numel() else 0
    owner = torch.full((units,), -1, dtype=torch.long)  # rank holding the unit's placeholder token
    slot = torch.full((units,), -1, dtype=torch.long)  # its place in that rank's (B, L) tokens, row-major
    rows, places = (placed >= 0).nonzero(as_tuple=True)
    unit = placed[rows, places]
    owner[unit] = places // local
    slot[unit] = rows * local + places % local
    routed = (place_units >= 0).nonzero().flatten()  # tower places that yield a unit
    source = routed // per_rank
    dest, dest_slot = owner[place_units[routed]], slot[place_units[routed]]
    mine = source == me
    key = dest[mine] * (b * local) + dest_slot[mine]
    send_index = routed[mine][key.argsort()] - me * per_rank
    send_rows = torch.bincount(dest[mine], minlength=p).tolist()
    to_me = dest == me
    arrival = (source[to_me] * (b * local) + dest_slot[to_me]).argsort()  # by source, then slot, as each sends
    recv_rows = torch.bincount(source[to_me], minlength=p).tolist()
    recv_order = dest_slot[to_me][arrival].argsort()
    return send_index, tuple(send_rows), tuple(recv_rows), recv_order


def route_rows(rows: torch.Tensor, shard, mesh: SPMesh | None) -> torch.Tensor:
    """``(V, D)``: the rows of this rank's tower outputs ``rows`` (one per place of its share, ``(places, D)``)
    that yield a placeholder token, sent to the ranks holding those tokens (one uneven all-to-all over the
    sequence group, :func:`routing`'s plan in ``shard``), and the rows this rank receives, in the order of
    its own ``V`` placeholder tokens."""
    rows = rows[shard.send_index]  # (sent, D) sorted by destination rank
    if mesh is not None and mesh.sp_size > 1:
        rows = exchange_rows(rows, mesh.sp_group, shard.send_rows, shard.recv_rows)
    return rows[shard.recv_order]


def moved(shard, device: torch.device | str):
    """A frozen shard dataclass with every tensor field (and pair of tensors) on ``device``."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            return tuple(v.to(device, non_blocking=True) for v in value)
        return value

    return dataclasses.replace(shard, **{f.name: move(getattr(shard, f.name)) for f in dataclasses.fields(shard)})


@dataclasses.dataclass(frozen=True)
class FixedSizeShard:
    """This rank's share of a fixed-size-image tower (LLaVA's, Gemma 3's, InternVL's: ``n`` places of its
    sequence) and the routing of its rows."""

    patches: torch.Tensor  # (n, C, p, p) pixels of each place (zeros for class tokens and padding)
    is_class: torch.Tensor  # (n,) bool: the place holds its image's class token
    positions: torch.Tensor  # (n,) the place's row of the learned position table (the class token's 0 if any)
    images: SequenceInfo  # one document per image over the tower's sequence (and one per class window's padding)
    send_index: torch.Tensor
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    recv_order: torch.Tensor
    visual_mask: torch.Tensor  # (B, L) bool: this rank's image placeholder tokens
    has_media: bool

    def to(self, device: torch.device | str) -> FixedSizeShard:
        """The same shard with every tensor on ``device``."""
        return moved(self, device)
