"""One collective timeout for every process group of a job.

``init_process_group(timeout=...)`` sets the default group's timeout only. Every group created later
without its own (``new_group``, ``split_group``, and so every axis and flattened sub-mesh a
``DeviceMesh`` makes) gets torch's default instead: 30 minutes on gloo, 10 on NCCL. A job whose
collectives ran on such groups (tensor parallelism's DTensor collectives, FSDP2 over a sub-mesh, the
Ulysses all-to-alls and the ring's sends on a mesh of more ranks than one axis) waited that long for a
stopped rank, whatever ``--timeout`` said. seqmesh's meshes therefore set the timeout on each group
they hold (:func:`seqmesh.mesh.init_mesh`'s ``timeout``).

On gloo the timeout bounds each wait (a collective, a send, a receive) and raises in the waiting rank.
On NCCL it is the age at which NCCL's watchdog thread declares a collective timed out; with
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at torch's default it then tears the process down (the Python code
never sees an exception), and torchrun ends the other ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch.distributed as dist


def as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    """``timeout`` (seconds, or a timedelta) as a timedelta; a ValueError for one that is not positive."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"a collective timeout must be a positive number of seconds, got {timeout!r}.")
    return datetime.timedelta(seconds=seconds)


def _has_timeout(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on gloo or NCCL, whose collectives have a timeout (torch's fake group has none)."""
    kinds = tuple(getattr(dist, name) for name in ("ProcessGroupGloo", "ProcessGroupNCCL") if hasattr(dist, name))
    return isinstance(group._get_backend(group._device_types[0]), kinds)


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """``group``'s collective timeout (its backend's for the first device type it serves); None for a
    backend without one, or one that does not show it."""
    options = getattr(group._get_backend(group._device_types[0]), "options", None)
    return getattr(options, "_timeout", None)


def default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout: the ``timeout`` given to ``init_process_group`` (None as
    :func:`group_timeout`)."""
    return group_timeout(dist.distributed_c10d._get_default_group())


def set_timeout(groups: Iterable[dist.ProcessGroup], timeout: datetime.timedelta | None) -> None:
    """Give each of ``groups`` (this rank's own) on gloo or NCCL the collective timeout ``timeout``; later
    collectives on them wait that long for a rank (gloo), or are declared timed out at that age (NCCL's
    watchdog). Other groups, and every group when ``timeout`` is None, are left as they are."""
    if timeout is None:
        return
    for group in groups:
        if _has_timeout(group):
            dist.distributed_c10d._set_pg_timeout(timeout, group)
