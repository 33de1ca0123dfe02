"""The expert-parallel groups, cut from the ranks that hold different tokens (Megatron's "MoE parallel folding":
attention keeps its sequence groups, an MoE layer uses its own).

The ranks that hold different tokens (``SPMesh.batch_mesh``: dp_replicate x dp_shard x ring x ulysses, innermost
varying fastest) are laid out as a 2-D mesh ``(expert_shard, ep)``: row ``j`` is an expert group of ``ep``
consecutive ranks (Ulysses neighbours first, the fastest links), which between them hold every routed expert once;
column ``i`` is the ranks that hold the same experts, over which FSDP2 shards those experts' weights and sums their
gradients. Both axes come from one root mesh, which FSDP2 needs to shard a DTensor that is already split over
``ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..tensor_values import real_tensors
from ..comm.timeouts import default_timeout, set_timeout
from ..mesh import SPMesh

EP_AXIS = "ep"
EXPERT_SHARD_AXIS = "expert_shard"


@dataclass(frozen=True)
class ExpertMesh:
    """``(expert_shard, ep)`` over the ranks that hold different tokens. ``mesh[EP_AXIS]``: this rank's expert
    group; ``mesh[EXPERT_SHARD_AXIS]``: the ranks holding the same experts."""

    mesh: DeviceMesh  # 2-D (expert_shard, ep)
    ep: int

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh[EP_AXIS]

    @property
    def shard_mesh(self) -> DeviceMesh:
        return self.mesh[EXPERT_SHARD_AXIS]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(EP_AXIS)

    @property
    def ep_rank(self) -> int:
        """Which slice of the experts this rank holds: experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``."""
        return self.mesh.get_local_rank(EP_AXIS)


def expert_mesh(mesh: SPMesh, ep: int) -> ExpertMesh:
    """The expert groups of ``ep`` ranks for ``mesh`` (every rank of the mesh must call it: it creates the groups)."""
    with real_tensors():  # the rank table is host metadata, real under a rehearsal's fake mode too
        ranks = mesh.batch_mesh.mesh.reshape(-1)  # the token ranks in mesh order, innermost axis fastest
        if ranks.numel() % ep:
            raise ValueError(f"ep={ep} does not divide the {ranks.numel()} ranks that hold different tokens.")
        root = DeviceMesh(mesh.device_type, ranks.reshape(-1, ep), mesh_dim_names=(EXPERT_SHARD_AXIS, EP_AXIS))
    set_timeout([root.get_group(a) for a in (EXPERT_SHARD_AXIS, EP_AXIS)], default_timeout())
    return ExpertMesh(root, ep)
