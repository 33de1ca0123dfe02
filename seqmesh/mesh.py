"""The process mesh: data-parallel replicate x data-parallel shard x ring x Ulysses x tensor-parallel.

Ranks are laid out with tensor parallelism innermost (adjacent ranks, the fastest links: it talks at
every linear layer), then Ulysses, then ring, then the data-parallel axes, so that for world rank ``w``::

    tp_rank      = w % tp
    ulysses_rank = (w // tp) % ulysses
    ring_rank    = (w // (tp * ulysses)) % ring
    dp_shard     = (w // (tp * ulysses * ring)) % dp_shard
    dp_replicate = w // (tp * ulysses * ring * dp_shard)

The sequence-parallel group is ring x Ulysses flattened, ring-major: sequence shard index
``ring_rank * ulysses + ulysses_rank``. The ``tp`` ranks of one sequence shard hold the same tokens
(and, between the tensor-parallel regions, a 1/tp slice of them each). Nothing here is global: an
SPMesh is passed to every call.
"""

from __future__ import annotations

import datetime
import enum
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm.timeouts import as_timedelta, default_timeout, set_timeout


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes, outermost first."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    RING = "ring"
    ULYSSES = "ulysses"
    TP = "tp"


AXES: tuple[MeshAxis, ...] = (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.RING, MeshAxis.ULYSSES, MeshAxis.TP)
SP_AXIS_NAME = "sp"  # ring x ulysses flattened
DP_AXIS_NAME = "dp"  # dp_replicate x dp_shard flattened
FSDP_AXIS_NAME = "dp_shard_sp"  # dp_shard x ring x ulysses flattened: what FSDP2 shards over
ALL_AXIS_NAME = "all"  # every axis flattened
BATCH_AXIS_NAME = "batch"  # every axis but tp flattened: the ranks that hold different tokens


@dataclass(frozen=True)
class SPMesh:
    """A 5-D device mesh ``(dp_replicate, dp_shard, ring, ulysses, tp)`` with its process groups (4-D, without
    the ``tp`` axis, when there is no tensor parallelism).

    Build it with :func:`init_mesh` or :func:`mesh_from_device_mesh`. Attributes:

    - ``device_mesh``: the underlying torch DeviceMesh, axes named by :class:`MeshAxis`.
    - ``sp_mesh``: the sequence group as a 1-D mesh (ring x ulysses, ring-major).
    - ``dp_mesh``: the data-parallel ranks (dp_replicate x dp_shard) as a 1-D mesh.
    - ``fsdp_mesh``: what FSDP2 shards over: 1-D over dp_shard x ring x ulysses (the sequence ranks
      hold different tokens of the same samples, so they share the weight shards too), or 2-D
      ``(dp_replicate, dp_shard_sp)`` for HSDP when ``dp_replicate > 1``.
    - ``all_mesh``: every rank of the mesh as a 1-D mesh.
    - ``batch_mesh``: every rank but the tensor-parallel axis, 1-D: the ranks that hold different tokens
      (losses and token counts pooled over the whole batch); ``all_mesh`` itself when ``tp == 1``.
    - ``tp_mesh``: this rank's tensor-parallel group as a 1-D mesh (what DTensor shards weights over).
    - ``ulysses``, ``ring``, ``dp_shard``, ``dp_replicate``, ``tp``: the degree of each axis.
    """

    device_mesh: DeviceMesh
    sp_mesh: DeviceMesh  # 1-D: ring x ulysses, ring-major
    dp_mesh: DeviceMesh  # 1-D: dp_replicate x dp_shard
    fsdp_mesh: DeviceMesh  # 1-D dp_shard x ring x ulysses, or 2-D (dp_replicate, that)
    all_mesh: DeviceMesh  # 1-D: every rank of the mesh
    batch_mesh: DeviceMesh  # 1-D: every rank but the tp axis
    tp_mesh: DeviceMesh | None  # 1-D: the tensor-parallel group (None for a 4-D DeviceMesh without one)
    ulysses: int
    ring: int
    dp_shard: int
    dp_replicate: int
    tp: int = 1
    # Attention calls this mesh's sequence group has already agreed on (see seqmesh.attention's
    # ``validate``): signatures, most recent last, at most VALIDATED_CALLS of them.
    validated_calls: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)
    # The mesh as a string, for compiled code: a torch.library op takes strings, not meshes, and finds
    # the mesh again with :func:`mesh_by_name` (see seqmesh.sharded_attention.compiled).
    name: str = field(init=False, compare=False, repr=False, default="")
    # This rank's coordinate on each axis, read once: compiled code (dynamo) then reads ints, not DeviceMesh
    # lookups that torch 2.9's tracer cannot follow on a mesh of several dimensions.
    local_ranks: dict = field(init=False, compare=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        for axis in (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.RING, MeshAxis.ULYSSES):
            self.local_ranks[axis.value] = self.device_mesh.get_local_rank(axis.value)
        groups = [self.device_mesh.get_group(a.value).group_name for a in (MeshAxis.RING, MeshAxis.ULYSSES)]
        name = "/".join([*groups, self.sp_group.group_name])
        object.__setattr__(self, "name", name)
        _LIVE_MESHES[name] = self

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
        """Every rank of the mesh: data-parallel, sequence-parallel and tensor-parallel ranks together."""
        return self.all_mesh.get_group()

    @property
    def batch_group(self) -> dist.ProcessGroup:
        """The ranks that hold different tokens (all but the tensor-parallel axis): what a loss, a token count
        or a gradient of replicated weights is summed over."""
        return self.batch_mesh.get_group()

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp_mesh is None else self.tp_mesh.get_local_rank()

    # -- coordinates ------------------------------------------------------------------------------
    @property
    def ulysses_rank(self) -> int:
        return self.local_ranks[MeshAxis.ULYSSES.value]

    @property
    def ring_rank(self) -> int:
        return self.local_ranks[MeshAxis.RING.value]

    @property
    def sp_rank(self) -> int:
        """This rank's sequence shard index: ``ring_rank * ulysses + ulysses_rank``."""
        return self.ring_rank * self.ulysses + self.ulysses_rank

    @property
    def dp_rank(self) -> int:
        """Which sample-stream this rank reads: ``dp_replicate_rank * dp_shard + dp_shard_rank``."""
        rep, shard = self.local_ranks[MeshAxis.DP_REPLICATE.value], self.local_ranks[MeshAxis.DP_SHARD.value]
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
            f"dp_replicate={self.dp_replicate}, tp={self.tp}, device_type={self.device_type!r})"
        )


# Live meshes by name (weak: a mesh nobody holds is dropped), an index like torch's own registry of process
# groups by name, which compiled code resolves the same way; no setting lives here.
_LIVE_MESHES: "weakref.WeakValueDictionary[str, SPMesh]" = weakref.WeakValueDictionary()


def mesh_by_name(name: str) -> SPMesh:
    """The live :class:`SPMesh` whose :attr:`SPMesh.name` is ``name``."""
    mesh = _LIVE_MESHES.get(name)
    if mesh is None:
        raise ValueError(f"no live seqmesh mesh is named {name!r}; keep a reference to the SPMesh (init_mesh) for as "
                         "long as compiled code that uses it runs.")
    return mesh


def _default_device_type() -> str:
    # get_backend() may name a combined backend such as "cpu:gloo,cuda:nccl".
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def _check_degrees(**degrees: int) -> None:
    for name, value in degrees.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def init_mesh(
    ulysses: int,
    ring: int,
    *,
    dp_shard: int = 1,
    dp_replicate: int = 1,
    tp: int = 1,
    device_type: str | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> SPMesh:
    """Build the ``(dp_replicate, dp_shard, ring, ulysses, tp)`` mesh over the default process group.

    ``torch.distributed`` must already be initialised (torchrun + ``init_process_group``). The
    product of the degrees must equal the world size. ``device_type`` defaults to ``"cuda"`` on an
    NCCL group and ``"cpu"`` otherwise. ``timeout`` (seconds) is how long a collective on any of the
    process groups created for the mesh waits for a rank; by default the default group's
    (``init_process_group``'s ``timeout``), which torch would not give them (see
    :mod:`seqmesh.comm.timeouts`).
    """
    _check_degrees(ulysses=ulysses, ring=ring, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=tp)
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment for it), or use seqmesh.comm.launch.spawn() for local processes."
        )
    world = dist.get_world_size()
    product = ulysses * ring * dp_shard * dp_replicate * tp
    if product != world:
        inner = ulysses * ring * tp
        raise ValueError(
            f"mesh ulysses={ulysses} x ring={ring} x tp={tp} x dp_shard={dp_shard} x dp_replicate={dp_replicate} "
            f"= {product} ranks, but the world has {world}. Choose degrees whose product is {world}"
            + (f", e.g. dp_shard={world // inner}." if world % inner == 0 else ".")
        )
    device_type = device_type or _default_device_type()
    # without tensor parallelism the tp axis is left out (4-D): every axis costs a process group per rank, and
    # a gloo group keeps two threads for the life of the process
    axes = AXES if tp > 1 else AXES[:-1]
    sizes = (dp_replicate, dp_shard, ring, ulysses, tp)[: len(axes)]
    device_mesh = init_device_mesh(device_type, sizes, mesh_dim_names=tuple(a.value for a in axes))
    return mesh_from_device_mesh(device_mesh, timeout=timeout)


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


def mesh_process_groups(mesh: SPMesh) -> list[dist.ProcessGroup]:
    """Every process group ``mesh`` holds for this rank (each axis and each flattened sub-mesh), once each,
    but the default group (``init_process_group``'s own, which a mesh axis over every rank reuses)."""
    default = dist.distributed_c10d._get_default_group()
    groups: dict[str, dist.ProcessGroup] = {default.group_name: default}
    for sub in (mesh.device_mesh, mesh.sp_mesh, mesh.dp_mesh, mesh.fsdp_mesh, mesh.all_mesh, mesh.batch_mesh,
                mesh.tp_mesh):
        if sub is not None:
            for axis in range(sub.ndim):
                group = sub.get_group(axis)
                groups.setdefault(group.group_name, group)
    return [group for group in groups.values() if group is not default]


def mesh_from_device_mesh(device_mesh: DeviceMesh, timeout: float | datetime.timedelta | None = None) -> SPMesh:
    """Wrap an existing 5-D DeviceMesh whose axes are named by :class:`MeshAxis` (outermost first), or a 4-D
    one without the ``tp`` axis (no tensor parallelism: the mesh seqmesh built before it had one).

    Other missing axes are not allowed: give size-1 axes for degrees you do not use. The flattened
    sequence, data, batch and FSDP sub-meshes are created here (once per mesh). Every process group of
    the mesh but the default one, the DeviceMesh's own included, gets the collective ``timeout`` (seconds;
    by default the default group's), as :func:`init_mesh` says.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    expected = tuple(a.value for a in AXES)
    if names not in (expected, expected[:-1]):
        raise ValueError(
            f"the DeviceMesh has axes {names}; seqmesh needs exactly {expected} (outermost first), or the first four "
            "of them. Build it with init_device_mesh(device, (dp_replicate, dp_shard, ring, ulysses, tp), "
            f"mesh_dim_names={expected}) or use seqmesh.init_mesh()."
        )
    dp_replicate, dp_shard, ring, ulysses = (int(s) for s in device_mesh.shape[:4])
    tp = int(device_mesh.shape[4]) if len(names) == 5 else 1
    sp_mesh = device_mesh[(MeshAxis.RING.value, MeshAxis.ULYSSES.value)]._flatten(SP_AXIS_NAME)
    dp_mesh = device_mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]._flatten(DP_AXIS_NAME)
    shard_sp = device_mesh[(MeshAxis.DP_SHARD.value, MeshAxis.RING.value, MeshAxis.ULYSSES.value)]._flatten(FSDP_AXIS_NAME)
    if dp_replicate == 1:
        fsdp_mesh = shard_sp
    else:  # HSDP: replicate across dp_replicate, shard across everything inside it
        fsdp_mesh = _hsdp_mesh(device_mesh, shard_sp)
    all_mesh = device_mesh._flatten(ALL_AXIS_NAME)
    if tp == 1:
        batch_mesh = all_mesh
    else:
        batch_mesh = device_mesh[tuple(a.value for a in AXES[:4])]._flatten(BATCH_AXIS_NAME)
    tp_mesh = device_mesh[MeshAxis.TP.value] if len(names) == 5 else None  # a 4-D mesh has no tp axis
    mesh = SPMesh(device_mesh, sp_mesh, dp_mesh, fsdp_mesh, all_mesh, batch_mesh, tp_mesh, ulysses, ring, dp_shard,
                  dp_replicate, tp)
    # torch gave the groups it created for the mesh its own default timeout (30 min on gloo, 10 on NCCL),
    # not the job's: a rank stopped under tensor parallelism kept the others waiting that long
    set_timeout(mesh_process_groups(mesh), default_timeout() if timeout is None else as_timedelta(timeout))
    return mesh
