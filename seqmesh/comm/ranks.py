"""Small rank-aware helpers shared by the training modules, each a no-op (or the obvious answer) when no
process group is initialised, so the same code runs in one process and under torchrun."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    """(this rank, world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def is_rank0() -> bool:
    return rank_world()[0] == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a one-element list in one process)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(value: object) -> object:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (tensor parallelism's, or FSDP2's sharded parameter)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def partial_local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local copy, whose gradient is this rank's part of a sum over the DTensor's mesh: what
    a rank computes from a weight or input every rank of a tensor-parallel group holds whole, when each uses it
    for its own share (its heads, columns, tokens)."""
    from torch.distributed.tensor import Partial

    return t.to_local(grad_placements=[Partial()])


def summed_to_slices(partial: torch.Tensor, mesh) -> torch.Tensor:
    """Each rank's ``(B, L, ...)`` share of a sum over the 1-D ``mesh`` (a row-parallel output), summed and cut
    along the sequence: the DTensor of ``(B, L/T, ...)`` slices (a reduce-scatter; its adjoint an all-gather)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Shard(1)])


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``p``: a DTensor's local shard, or the tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def full_value(p: torch.Tensor) -> torch.Tensor:
    """The whole of ``p``: a DTensor gathered (a collective every rank of its mesh joins), or the tensor itself.

    FSDP2 over tensor-parallel shards of the same dimension nests the two cuts, which torch gathers in two
    steps and logs a warning for on every rank; the gather is still exact, and its callers gather whole weights
    once (export, verify) or a scalar each step (``gradient_norm``), none a hot path's tensor, so that warning is
    silenced here."""
    if not hasattr(p, "full_tensor"):
        return p
    # a filter, not setLevel: each setLevel clears the cache of every logger of the process (thousands once many
    # transformers models are imported), twice a call, and gradient_norm calls this every step
    log, quiet = logging.getLogger("torch.distributed.tensor._redistribute"), _ErrorsOnly()
    log.addFilter(quiet)
    try:
        return p.full_tensor()
    finally:
        log.removeFilter(quiet)


class _ErrorsOnly(logging.Filter):
    """Lets a logger's errors through, nothing below them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR
