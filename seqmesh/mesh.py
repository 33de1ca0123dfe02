"""The process mesh: data-parallel replicate x data-parallel shard x ring x Ulysses.

Ranks are laid out with Ulysses innermost (adjacent ranks, the fastest links), then ring, then the
data-parallel axes, so that for world rank ``w``::

    ulysses_rank = w % ulysses
    ring_rank    = (w // ulysses) % ring
    dp_shard     = (w // (ulysses * ring)) % dp_shard
    dp_replicate = w // (ulysses * ring * dp_shard)

The sequence-parallel group is ring x Ulysses flattened, ring-major: sequence shard index
``ring_rank * ulysses + ulysses_rank``. Nothing here is global: an SPMesh is passed to every call.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes, outermost first."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    RING = "ring"
    ULYSSES = "ulysses"


AXES: tuple[MeshAxis, ...] = (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.RING, MeshAxis.ULYSSES)
SP_AXIS_NAME = "sp"  # ring x ulysses flattened
DP_AXIS_NAME = "dp"  # dp_replicate x dp_shard flattened
FSDP_AXIS_NAME = "dp_shard_sp"  # dp_shard x ring x ulysses flattened: what FSDP2 shards over
ALL_AXIS_NAME = "all"  # every axis flattened


@dataclass(frozen=True)
class SPMesh:
    """A 4-D device mesh ``(dp_replicate, dp_shard, ring, ulysses)`` with its process groups.

    Build it with :func:`init_mesh` or :func:`mesh_from_device_mesh`. Attributes:

    - ``device_mesh``: the underlying torch DeviceMesh, axes named by :class:`MeshAxis`.
    - ``sp_mesh``: the sequence group as a 1-D mesh (ring x ulysses, ring-major).
    - ``dp_mesh``: the data-parallel ranks (dp_replicate x dp_shard) as a 1-D mesh.
    - ``fsdp_mesh``: what FSDP2 shards over: 1-D over dp_shard x ring x ulysses (the sequence ranks
      hold different tokens of the same samples, so they share the weight shards too), or 2-D
      ``(dp_replicate, dp_shard_sp)`` for HSDP when ``dp_replicate > 1``.
    - ``all_mesh``: every rank of the mesh as a 1-D mesh (losses pooled over the whole batch).
    - ``ulysses``, ``ring``, ``dp_shard``, ``dp_replicate``: the degree of each axis.
    """

    device_mesh: DeviceMesh
    sp_mesh: DeviceMesh  # 1-D: ring x ulysses, ring-major
    dp_mesh: DeviceMesh  # 1-D: dp_replicate x dp_shard
    fsdp_mesh: DeviceMesh  # 1-D dp_shard x ring x ulysses, or 2-D (dp_replicate, that)
    all_mesh: DeviceMesh  # 1-D: every rank of the mesh
    ulysses: int
    ring: int
    dp_shard: int
    dp_replicate: int
    # Attention calls this mesh's sequence group has already agreed on (see seqmesh.attention's
    # ``validate``): signatures, most recent last, at most VALIDATED_CALLS of them.
    validated_calls: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def sp_size(self) -> int:
        """Sequence-parallel degree P = ring x ulysses."""
        return self.ring * self.ulysses

    @property
    def dp_size(self) -> int:
        return self.dp_shard * self.dp_replicate

    # -- groups -----------------------------------------------------------------------------------
    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group(MeshAxis.ULYSSES.value)

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group(MeshAxis.RING.value)

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """All ranks that hold pieces of the same sequence (ring x ulysses, ring-major)."""
        return self.sp_mesh.get_group()

    @property
    def all_group(self) -> dist.ProcessGroup:
        """Every rank of the mesh: data-parallel and sequence-parallel ranks together."""
        return self.all_mesh.get_group()

    # -- coordinates ------------------------------------------------------------------------------
    @property
    def ulysses_rank(self) -> int:
        return self.device_mesh.get_local_rank(MeshAxis.ULYSSES.value)

    @property
    def ring_rank(self) -> int:
        return self.device_mesh.get_local_rank(MeshAxis.RING.value)

    @property
    def sp_rank(self) -> int:
        """This rank's sequence shard index: ``ring_rank * ulysses + ulysses_rank``."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    @property
    def dp_rank(self) -> int:
        """Which sample-stream this rank reads: ``dp_replicate_rank * dp_shard + dp_shard_rank``."""
        rep = self.device_mesh.get_local_rank(MeshAxis.DP_REPLICATE.value)
        shard = self.device_mesh.get_local_rank(MeshAxis.DP_SHARD.value)
        return rep * self.dp_shard + shard

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def collective_device(self) -> torch.device:
        """Where tensors for this mesh's collectives live: the current CUDA device, or the CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def __repr__(self) -> str:
        return (
            f"SPMesh(ulysses={self.ulysses}, ring={self.ring}, dp_shard={self.dp_shard}, "
            f"dp_replicate={self.dp_replicate}, device_type={self.device_type!r})"
        )


def _default_device_type() -> str:
    # get_backend() may name a combined backend such as "cpu:gloo,cuda:nccl".
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def _check_degrees(ulysses: int, ring: int, dp_shard: int, dp_replicate: int) -> None:
    for name, value in (("ulysses", ulysses), ("ring", ring), ("dp_shard", dp_shard), ("dp_replicate", dp_replicate)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def init_mesh(
    ulysses: int,
    ring: int,
    *,
    dp_shard: int = 1,
    dp_replicate: int = 1,
    device_type: str | None = None,
) -> SPMesh:
    """Build the ``(dp_replicate, dp_shard, ring, ulysses)`` mesh over the default process group.

    ``torch.distributed`` must already be initialised (torchrun + ``init_process_group``). The
    product of the degrees must equal the world size. ``device_type`` defaults to ``"cuda"`` on an
    NCCL group and ``"cpu"`` otherwise.
    """
    _check_degrees(ulysses, ring, dp_shard, dp_replicate)
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment for it), or use seqmesh.comm.launch.spawn() for local processes."
        )
    world = dist.get_world_size()
    product = ulysses * ring * dp_shard * dp_replicate
    if product != world:
        raise ValueError(
            f"mesh ulysses={ulysses} x ring={ring} x dp_shard={dp_shard} x dp_replicate={dp_replicate} "
            f"= {product} ranks, but the world has {world}. Choose degrees whose product is {world}"
            + (f", e.g. dp_shard={world // (ulysses * ring)}." if world % (ulysses * ring) == 0 else ".")
        )
    device_type = device_type or _default_device_type()
    device_mesh = init_device_mesh(
        device_type, (dp_replicate, dp_shard, ring, ulysses), mesh_dim_names=tuple(a.value for a in AXES)
    )
    return mesh_from_device_mesh(device_mesh)


def _hsdp_mesh(device_mesh: DeviceMesh, shard_sp: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard_sp) mesh for HSDP, reusing the process groups that exist.

    torch >= 2.10 can concatenate sub-meshes of one root (no new communicators); older releases get a
    new DeviceMesh, whose groups duplicate the existing ones (extra NCCL communicators)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        try:
            return concatenate([device_mesh[MeshAxis.DP_REPLICATE.value], shard_sp])
        except (RuntimeError, TypeError, AttributeError):
            pass
    dp_replicate = device_mesh.size(0)
    return DeviceMesh(
        device_mesh.device_type,
        device_mesh.mesh.reshape(dp_replicate, -1),
        mesh_dim_names=(MeshAxis.DP_REPLICATE.value, FSDP_AXIS_NAME),
    )


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> SPMesh:
    """Wrap an existing 4-D DeviceMesh whose axes are named by :class:`MeshAxis` (outermost first).

    Missing axes are not allowed: give size-1 axes for degrees you do not use. The flattened
    sequence, data and FSDP sub-meshes are created here (once per mesh).
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    expected = tuple(a.value for a in AXES)
    if names != expected:
        raise ValueError(
            f"the DeviceMesh has axes {names}; seqmesh needs exactly {expected} (outermost first). "
            "Build it with init_device_mesh(device, (dp_replicate, dp_shard, ring, ulysses), "
            f"mesh_dim_names={expected}) or use seqmesh.init_mesh()."
        )
    dp_replicate, dp_shard, ring, ulysses = (int(s) for s in device_mesh.shape)
    sp_mesh = device_mesh[(MeshAxis.RING.value, MeshAxis.ULYSSES.value)]._flatten(SP_AXIS_NAME)
    dp_mesh = device_mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]._flatten(DP_AXIS_NAME)
    shard_sp = device_mesh[(MeshAxis.DP_SHARD.value, MeshAxis.RING.value, MeshAxis.ULYSSES.value)]._flatten(FSDP_AXIS_NAME)
    if dp_replicate == 1:
        fsdp_mesh = shard_sp
    else:  # HSDP: replicate across dp_replicate, shard across everything inside it
        fsdp_mesh = _hsdp_mesh(device_mesh, shard_sp)
    all_mesh = device_mesh._flatten(ALL_AXIS_NAME)
    return SPMesh(device_mesh, sp_mesh, dp_mesh, fsdp_mesh, all_mesh, ulysses, ring, dp_shard, dp_replicate)
