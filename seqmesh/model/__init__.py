"""The model side of training, as a library: what a training loop (``seqmesh train``, the Trainer, your
own) needs around a transformers model.

- ``lm``          building models from presets or folders, and ``SequenceParallelLM``, whose forward is the loss
- ``loss``        the exact sequence-parallel cross-entropy, the LM head in chunks
- ``fsdp``        FSDP2 over the data- and sequence-parallel ranks, activation checkpointing, the gradient norm
- ``presets``     model shapes by name (torch-free: ``seqmesh plan`` reads them)
- ``pretrained``  transformers folders read shard by shard, each rank loading only its slices
- ``writer``      a model (whole or FSDP2-sharded) streamed into a transformers folder
- ``checkpoint_reader``  a ``torch.distributed.checkpoint`` folder read without running code from it

Nothing here imports :mod:`seqmesh.training` (the job). Nothing is imported on import of the package,
so ``seqmesh plan`` reads the presets without torch; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("checkpoint_reader", "fsdp", "lm", "loss", "presets", "pretrained", "writer")

_EXPORTS: dict[str, str] = {
    "SequenceParallelLM": "lm",
    "build_model": "lm",
    "decoder_layers": "lm",
    "chunked_linear_cross_entropy": "loss",
    "sequence_parallel_cross_entropy": "loss",
    "apply_fsdp": "fsdp",
    "enable_checkpointing": "fsdp",
    "sync_gradients": "fsdp",
    "MODELS": "presets",
    "ModelShape": "presets",
    "model_shape": "presets",
    "load_pretrained": "pretrained",
    "export_pretrained": "writer",
}


def __getattr__(name: str) -> Any:  # `seqmesh.model.SequenceParallelLM` as in 0.1, `seqmesh.model.fsdp` unimported
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'seqmesh.model' has no attribute {name!r}")
