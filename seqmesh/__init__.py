"""seqmesh: exact sequence parallelism (Ulysses, ring attention, USP) for very long sequences.

The public names load on first use, so commands that need no torch (``seqmesh plan``) start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .versions import warn_if_untested

__version__ = "0.1.0"

warn_if_untested()  # once per process: torch / transformers / accelerate outside the tested range

_EXPORTS: dict[str, str] = {
    "attention": ".sharded_attention.api",
    "comm_stats": ".comm.stats",
    "CommStats": ".comm.stats",
    "SequenceInfo": ".training.data",
    "shard_batch": ".training.data",
    "chunked_linear_cross_entropy": ".model.loss",
    "sequence_parallel_cross_entropy": ".model.loss",
    "LayoutKind": ".layout",
    "Run": ".layout",
    "SequenceLayout": ".layout",
    "MeshAxis": ".mesh",
    "SPMesh": ".mesh",
    "init_mesh": ".mesh",
    "mesh_from_device_mesh": ".mesh",
    "gather_sequence": ".sharding",
    "sequence_layout": ".sharding",
    "sequence_positions": ".sharding",
    "shard_sequence": ".sharding",
}

# Packages, and the older module names users reach as attributes (``seqmesh.fsdp.apply_fsdp``).
_SUBMODULES: dict[str, str] = {
    **{name: f".{name}" for name in (
        "comm", "hf", "kernels", "layout", "mesh", "model", "planner", "sharded_attention", "sharding", "tools",
        "training",
    )},
    **{name: f".model.{name}" for name in ("fsdp", "loss", "presets")},
    **{name: f".training.{name}" for name in (
        "checkpoint", "config", "data", "datasets", "metrics", "train", "verify",
    )},
    **{name: f".tools.{name}" for name in ("bench", "cli", "launch")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # `import seqmesh; seqmesh.hf.parallelize(...)` works without importing seqmesh.hf
        return importlib.import_module(_SUBMODULES[name], __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'seqmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # for type checkers and IDEs
    from .sharded_attention.api import attention
    from .comm.stats import CommStats, comm_stats
    from .training.data import SequenceInfo, shard_batch
    from .layout import LayoutKind, Run, SequenceLayout
    from .model.loss import chunked_linear_cross_entropy, sequence_parallel_cross_entropy
    from .mesh import MeshAxis, SPMesh, init_mesh, mesh_from_device_mesh
    from .sharding import gather_sequence, sequence_layout, sequence_positions, shard_sequence
