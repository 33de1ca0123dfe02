"""Training with sequence parallelism: the model wrapper and its exact loss, FSDP2, datasets,
checkpoints, metrics, the ``TrainConfig`` and the ``seqmesh train`` / ``verify`` job.

Nothing is imported here, so ``seqmesh plan`` (which reads the model presets) starts without torch.
"""

import importlib
from typing import Any

_MODULES = ("checkpoint", "config", "datasets", "export", "fsdp", "loss", "metrics", "model", "presets",
            "pretrained", "train", "verify")


def __getattr__(name: str) -> Any:  # `seqmesh.training.model` without an import statement
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'seqmesh.training' has no attribute {name!r}")
