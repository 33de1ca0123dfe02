"""Saving and resuming training with ``torch.distributed.checkpoint``, never corrupting the last one.

A checkpoint is written to ``step_NNNNNNN.partial`` and renamed to ``step_NNNNNNN`` only after
every rank has finished writing; ``latest`` (a small text file replaced atomically) then names it.
An interrupted save leaves a ``.partial`` folder that resume ignores, so the last good checkpoint is
always the one ``latest`` names. Saving a step that already has a folder (a run restarted in the same
``out``) renames the old one aside to ``step_NNNNNNN.old`` and deletes it only once ``latest`` names
the new one; were the save cut between the two renames, resume reads the ``.old`` one. Each rank
writes its own shards (FSDP2 DTensors), so the folder must be on storage every rank can reach.
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

LATEST = "latest"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(folder: str, step: int, model: nn.Module, optimizer: Optimizer, extra: dict | None = None) -> str:
    """Save model and optimizer state after ``step`` completed steps; returns the checkpoint path."""
    name = f"step_{step:07d}"
    final = os.path.join(folder, name)
    partial = final + ".partial"
    if _is_rank0():
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
    _barrier()
    if _is_rank0():
        with open(os.path.join(partial, "seqmesh.json"), "w") as f:
            json.dump({"step": step, **(extra or {})}, f)
        old = final + ".old"
        if os.path.exists(final):  # never delete what ``latest`` may name before the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        pointer = os.path.join(folder, LATEST + ".tmp")
        with open(pointer, "w") as f:
            f.write(name)
        os.replace(pointer, os.path.join(folder, LATEST))
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(folder: str) -> str | None:
    """The checkpoint ``latest`` names, or None when there is none yet."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(folder, f.read().strip())
    if not os.path.exists(path) and os.path.isfile(os.path.join(path + ".old", "seqmesh.json")):
        return path + ".old"  # a save of the same step was cut between renaming the old one aside and its own
    if not os.path.isfile(os.path.join(path, "seqmesh.json")):
        raise ValueError(f"{pointer} names {path}, which is not a complete seqmesh checkpoint; delete {pointer} to start over.")
    return path


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizer) -> dict:
    """Load into ``model`` and ``optimizer`` (sharded as they are now); returns the saved extras."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "seqmesh.json")) as f:
        return json.load(f)
