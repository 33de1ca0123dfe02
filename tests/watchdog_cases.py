"""The process groups of a mesh and their collective timeouts, on spawned ranks."""

from __future__ import annotations


def mesh_group_timeouts(ulysses: int, ring: int, tp: int, timeout: float | None) -> dict[str, float]:
    """Each process group (but the default one) of a fresh ``init_mesh`` on this rank: its timeout in seconds."""
    import torch.distributed as dist

    from seqmesh.comm.timeouts import group_timeout
    from seqmesh.mesh import init_mesh, mesh_process_groups

    mesh = init_mesh(ulysses, ring, dp_shard=dist.get_world_size() // (ulysses * ring * tp), tp=tp, device_type="cpu",
                     timeout=timeout)
    return {group.group_name: group_timeout(group).total_seconds() for group in mesh_process_groups(mesh)}
