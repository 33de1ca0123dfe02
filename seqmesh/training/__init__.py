"""The ``seqmesh train`` / ``verify`` / ``export`` job: the ``TrainConfig``, datasets, checkpoints and
resuming, metrics, the output-folder lock and the watchdogs around each step. The model it trains
(the wrapper and its loss, FSDP2, presets, pretrained loading, the transformers-folder writer) is the
library's, in :mod:`seqmesh.model`; nothing there imports this package.

Nothing is imported here: each module loads on first use.
"""

import importlib
from typing import Any

_MODULES = ("checkpoint", "config", "datasets", "export", "metrics", "outlock", "resume", "train", "verify",
            "watch")


def __getattr__(name: str) -> Any:  # `seqmesh.training.train` without an import statement
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'seqmesh.training' has no attribute {name!r}")
