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
    "SequenceInfo": ".sequence.batch",
    "shard_batch": ".inputs",
    "chunked_linear_cross_entropy": ".model.loss",
    "sequence_parallel_cross_entropy": ".model.loss",
    "LayoutKind": ".sequence.layout",
    "Run": ".sequence.runs",
    "SequenceLayout": ".sequence.layout",
    "MeshAxis": ".mesh",
    "SPMesh": ".mesh",
    "init_mesh": ".mesh",
    "mesh_from_device_mesh": ".mesh",
    "gather_sequence": ".sequence.sharding",
    "sequence_layout": ".sequence.sharding",
    "sequence_positions": ".sequence.sharding",
    "shard_sequence": ".sequence.sharding",
}

# Packages, and the older module names users reach as attributes (``seqmesh.fsdp.apply_fsdp``).
_SUBMODULES: dict[str, str] = {
    **{name: f".{name}" for name in (
        "bench", "comm", "hf", "kernels", "mesh", "model", "planner", "sequence", "sharded_attention", "tools",
        "training",
    )},
    **{"layout": ".sequence.layout", "sharding": ".sequence.sharding", "data": ".sequence.batch"},
    **{name: f".model.{name}" for name in ("fsdp", "loss", "presets")},
    **{name: f".training.{name}" for name in (
        "checkpoint", "config", "datasets", "metrics", "train", "verify",
    )},
    **{name: f".tools.{name}" for name in ("cli",)},
    "launch": ".comm.launch",
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
    from .inputs import shard_batch
    from .sequence.batch import SequenceInfo
    from .sequence.layout import LayoutKind, SequenceLayout
    from .sequence.runs import Run
    from .model.loss import chunked_linear_cross_entropy, sequence_parallel_cross_entropy
    from .mesh import MeshAxis, SPMesh, init_mesh, mesh_from_device_mesh
    from .sequence.sharding import gather_sequence, sequence_layout, sequence_positions, shard_sequence
