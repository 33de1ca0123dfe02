"""``seqmesh.shard_batch``: this rank's inputs from a whole batch, for a text or a vision-language model.

A text batch needs only the mesh (``seqmesh.sequence.batch``). A multimodal batch also needs the model:
its M-RoPE positions are the model's own, and its tower's order (Qwen2.5-VL's windows) and merge size
come from the model's config (``seqmesh.vision.batch``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from .hf.positions import own_positions
from .mesh import SPMesh
from .sequence.batch import IGNORE_INDEX
from .sequence.batch import shard_batch as shard_text_batch
from .vision.batch import VISION_KEYS, shard_multimodal_batch
from .vision.families import is_multimodal


def shard_batch(batch: Mapping[str, torch.Tensor], mesh: SPMesh, *, model: nn.Module | None = None,
                layout: str = "auto", ignore_index: int = IGNORE_INDEX) -> dict:
    """This rank's inputs (see :func:`seqmesh.sequence.batch.shard_batch` for a text batch and
    :func:`seqmesh.vision.batch.shard_multimodal_batch` for a vision-language one). ``model``: the
    parallelized model (or its ``SequenceParallelLM``), needed for a vision-language model, and for a family that
    numbers its positions itself (RoBERTa-style offsets, :func:`seqmesh.hf.positions.own_positions`), whose positions
    are then the family's own on the whole batch."""
    lm = getattr(model, "lm", model)
    if lm is not None and is_multimodal(lm.config):
        return shard_multimodal_batch(batch, mesh, lm, layout=layout, ignore_index=ignore_index)
    media = [key for key in VISION_KEYS if batch.get(key) is not None]
    if media:
        raise ValueError(f"the batch holds {', '.join(media)}: shard it with the vision-language model it is for, "
                         "seqmesh.shard_batch(batch, mesh, model=model).")
    numbered = own_positions(lm, batch["input_ids"]) if lm is not None and batch.get("position_ids") is None else None
    return shard_text_batch(batch, mesh, layout=layout, ignore_index=ignore_index, own_positions=numbered)
