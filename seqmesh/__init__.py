"""seqmesh: exact sequence parallelism (Ulysses, ring attention, USP) for very long sequences."""

from .attention.usp import attention
from .comm.stats import CommStats, comm_stats
from .data import SequenceInfo, shard_batch
from .loss import chunked_linear_cross_entropy, sequence_parallel_cross_entropy
from .layout import LayoutKind, Run, SequenceLayout
from .mesh import MeshAxis, SPMesh, init_mesh, mesh_from_device_mesh
from .sharding import gather_sequence, sequence_layout, sequence_positions, shard_sequence

__version__ = "0.1.0"

__all__ = [
    "attention",
    "chunked_linear_cross_entropy",
    "comm_stats",
    "CommStats",
    "gather_sequence",
    "init_mesh",
    "LayoutKind",
    "mesh_from_device_mesh",
    "MeshAxis",
    "Run",
    "sequence_layout",
    "sequence_positions",
    "SequenceInfo",
    "SequenceLayout",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shard_sequence",
    "SPMesh",
]
