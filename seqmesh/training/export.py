"""``seqmesh export``: a seqmesh checkpoint (``OUT/checkpoints/step_N``) written as a transformers folder.

The checkpoint is read in one process, one tensor at a time, and streamed through the writer of
:mod:`seqmesh.model.writer` (which also writes a model in memory: ``export_pretrained``), so no
process holds more than one whole tensor. The folder is written as ``OUT.partial`` and renamed into
place once complete.
"""

from __future__ import annotations

import json
import os
import warnings

import torch

from ..comm.ranks import is_rank0
from ..model.pretrained import saved_tensors, unique_parameters
from ..model.writer import DEFAULT_SHARD_BYTES, finish_folder, start_folder, write_metadata, write_weights


def _saved_run(checkpoint: str) -> dict:
    """The run configuration a seqmesh checkpoint stores in its ``seqmesh.json``."""
    meta = os.path.join(checkpoint, "seqmesh.json")
    if not os.path.isfile(meta):
        raise ValueError(f"{checkpoint} is not a seqmesh checkpoint (no seqmesh.json); give a folder such as "
                         "OUT/checkpoints/step_0000200.")
    with open(meta, encoding="utf-8") as f:
        saved = json.load(f)
    if "config" not in saved:
        raise ValueError(f"{meta} does not record its run's configuration; pass --model to say which model it holds.")
    return saved["config"]


@torch.no_grad()
def export_checkpoint(checkpoint: str, out: str, *, model: str | None = None, tokenizer: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      overwrite: bool = False) -> str:
    """Write the model of a seqmesh checkpoint (``OUT/checkpoints/step_N``) to ``out`` in transformers'
    format, in one process, one tensor at a time. ``model`` and ``tokenizer`` default to the run's
    (its ``seqmesh.json``); ``model`` is needed when the run's model path has moved. The checkpoint is
    read only through :mod:`seqmesh.model.checkpoint_reader`: nothing in it can run code."""
    from ..model.checkpoint_reader import load_checked, read_checked_metadata
    from ..model.lm import build_model, has_weights
    from ..model.pretrained import read_generation_config
    from .checkpoint import checkpoint_problem

    run = _saved_run(checkpoint) if model is None or tokenizer is None else {}
    model = model or run["model"]
    tokenizer = tokenizer if tokenizer is not None else run.get("tokenizer")
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ValueError(f"the checkpoint {checkpoint} is damaged: {problem}; export an older step.")
    lm = build_model(model, device="meta")
    if has_weights(model):
        read_generation_config(lm, model)
    params = saved_tensors(lm)  # the weights, then persistent buffers (DeepSeek's routing bias), as save_pretrained
    weights = set(unique_parameters(lm))
    metadata = read_checked_metadata(checkpoint)
    stored = metadata.state_dict_metadata
    keys = {name: f"model.lm.{name}" for name in params}  # get_state_dict of a SequenceParallelLM, flattened
    missing = [name for name, key in keys.items() if key not in stored]
    shapes = [f"{name} is {list(stored[key].size)}, the model's is {list(params[name].shape)}"
              for name, key in keys.items() if key in stored and tuple(stored[key].size) != tuple(params[name].shape)]
    if missing or shapes:
        raise ValueError(f"the checkpoint {checkpoint} does not hold the model {model!r}: "
                         + "; ".join(([f"missing {', '.join(missing[:6])}"] if missing else []) + shapes[:6])
                         + ". Pass --model with the model the run trained.")
    dtype = dtype or stored[keys[next(iter(params))]].properties.dtype
    entries = {name: (tuple(p.shape), dtype if name in weights and p.is_floating_point() else p.dtype)
               for name, p in params.items()}  # a buffer keeps its own dtype

    def read(name: str) -> torch.Tensor:
        meta = stored[keys[name]]
        values = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load_checked({"model": {f"lm.{name}": values}}, checkpoint, no_dist=True, metadata=metadata,
                         fix="export an older step.")
        return values

    partial = start_folder(out, overwrite)
    write_weights(partial, entries, read, write=is_rank0(), max_shard_bytes=max_shard_bytes)
    write_metadata(lm, partial, dtype, tokenizer)
    finish_folder(partial, out)
    return out
