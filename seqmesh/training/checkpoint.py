"""Saving and resuming training with ``torch.distributed.checkpoint``, never corrupting the last one.

A checkpoint is written to ``step_NNNNNNN.partial`` and renamed to ``step_NNNNNNN`` only after
every rank has finished writing; ``latest`` (a small text file replaced atomically) then names it.
An interrupted save leaves a ``.partial`` folder that resume ignores, so the last good checkpoint is
always the one ``latest`` names. Saving a step that already has a folder (a run restarted in the same
``out``) renames the old one aside to ``step_NNNNNNN.old`` and deletes it only once ``latest`` names
the new one; were the save cut between the two renames, resume reads the ``.old`` one. Each rank
writes its own shards (FSDP2 DTensors), so the folder must be on storage every rank can reach.

Every file of a checkpoint has its size and SHA-256 in ``seqmesh.json`` (each rank hashes the files
it wrote). Loading checks them first, spread over the ranks, and every rank raises the same
ValueError naming the damaged file; :func:`newest_intact_checkpoint` finds the newest step that
passes, so a damaged newest checkpoint never ends a run that has an intact older one.

The checksums say nothing of a folder someone else wrote (they write ``seqmesh.json`` too), so loading
also reads DCP's ``.metadata`` only through :mod:`seqmesh.model.checkpoint_reader` (DCP metadata classes, nothing that
runs code; storage files inside the folder; non-tensor items as plain data), and ``latest`` must name a
``step_N`` folder beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from ..model.checkpoint_reader import UnsafeCheckpoint, load_checked, read_checked_metadata
from ..comm.ranks import agree, all_gather_object, barrier, is_rank0, local_part, rank_world

LATEST = "latest"
STEP_NAME = re.compile(r"step_[0-9]+")  # what ``latest`` may hold: a checkpoint folder beside it, by name


CHUNK = 1 << 22  # bytes read at a time while hashing


def _digest(path: str) -> list:
    """``[size, sha256 hex]`` of one file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            sha.update(block)
    return [os.path.getsize(path), sha.hexdigest()]


def _checksums(folder: str) -> dict[str, list]:
    """Size and SHA-256 of every file in ``folder``, the files dealt round-robin over the ranks."""
    rank, world = rank_world()
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)) and n != "seqmesh.json")
    mine = {n: _digest(os.path.join(folder, n)) for i, n in enumerate(names) if i % world == rank}
    merged: dict[str, list] = {}
    for part in all_gather_object(mine):
        merged.update(part)
    return merged


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or None if every file matches its checksum and
    its DCP metadata is safe to read (:func:`read_checked_metadata`, on rank 0). Collective when a
    process group is up (the files are checked in parallel, the verdict shared)."""
    meta = os.path.join(path, "seqmesh.json")
    try:
        with open(meta) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        verdict: str | None = f"{meta} cannot be read ({err})"
        return all_gather_object(verdict)[0]
    files = saved.get("files") or {}  # none: written before checksums existed, nothing to compare
    rank, world = rank_world()
    found: list[str] = []
    if rank == 0:  # checksums written with the folder prove nothing about who wrote it: check what it asks for
        try:
            read_checked_metadata(path)
        except UnsafeCheckpoint as err:
            found.append(str(err))
    for i, (name, (size, sha)) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            found.append(f"{file} is missing")
        elif os.path.getsize(file) != size:
            found.append(f"{file} has {os.path.getsize(file)} bytes, {size} were written")
        elif _digest(file)[1] != sha:
            found.append(f"{file} does not match the SHA-256 written with it (its bytes changed)")
    problems = sorted(p for part in all_gather_object(found) for p in part)
    return "; ".join(problems) if problems else None


def steps_in(folder: str) -> list[str]:
    """Complete checkpoint folders in ``folder``, newest step first."""
    if not os.path.isdir(folder):
        return []
    names = [n for n in os.listdir(folder) if n.startswith("step_") and n[5:].isdigit()]
    return [os.path.join(folder, n) for n in sorted(names, reverse=True)]


def newest_intact_checkpoint(folder: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint in ``folder`` whose files all match their checksums, and the newer ones
    passed over with the reason. Collective when a process group is up."""
    skipped: list[tuple[str, str]] = []
    candidates = steps_in(folder)
    named = _latest_or_warn(folder)
    if named is not None and named not in candidates:
        candidates.insert(0, named)  # a ``.old`` folder that latest resolves to
    candidates = agree(candidates)  # rank 0's list: every rank must check the same folders, in step
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def _latest_or_warn(folder: str) -> str | None:
    """:func:`latest_checkpoint_name`, or None with a warning (on rank 0) when ``latest`` is not a step name:
    for the callers that look at every checkpoint anyway, or only spare what it names."""
    try:
        return latest_checkpoint_name(folder)
    except ValueError as err:
        if is_rank0():
            warnings.warn(f"ignoring {os.path.join(folder, LATEST)}: {err}", stacklevel=3)
        return None


def check_output_dir(out: str) -> None:
    """Raise a ValueError now, before any model is built, if ``out`` cannot be created or written."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".seqmesh-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"the output directory {out!r} cannot be written ({err.strerror or err}); choose another "
                         "--out, or fix its permissions.") from None


def _save_failure(folder: str, partial: str, err: Exception) -> str:
    """What to tell the user when writing a checkpoint failed: the error, the free space, what is safe."""
    try:
        free = f"{shutil.disk_usage(folder).free / 2**30:.2f} GiB free"
    except OSError:
        free = "an unknown amount free"
    latest = _latest_or_warn(folder)
    kept = f"the last good checkpoint ({latest}) is untouched" if latest else "no earlier checkpoint exists"
    return (f"writing the checkpoint {partial} failed ({type(err).__name__}: {err}). The disk holding it has {free}; "
            f"a full disk is the usual cause (torch reports it as 'unexpected pos' or 'No space left'). Free space or "
            f"point --out at a larger disk; {kept}.")


def _refuse_nonfinite(model: nn.Module, step: int) -> None:
    """Raise on every rank if any rank holds a NaN or inf weight: such a checkpoint is never written."""
    named = list(model.named_parameters())
    # one flag per parameter, computed on the device and read back in one transfer (not one sync each)
    finite = torch.stack([torch.isfinite(local_part(p)).all() for _, p in named]).tolist() if named else []
    bad = [name for (name, _), ok in zip(named, finite) if not ok]
    verdicts = all_gather_object(bad[:3])
    names = sorted({n for part in verdicts for n in part})
    if names:
        raise RuntimeError(f"refusing to write the checkpoint of step {step}: {', '.join(names)} hold NaN or inf "
                           "values. The earlier checkpoints are untouched; resume from one with a lower --lr.")


def save_checkpoint(folder: str, step: int, model: nn.Module, optimizer: Optimizer, extra: dict | None = None) -> str:
    """Save model and optimizer state after ``step`` completed steps; returns the checkpoint path."""
    name = f"step_{step:07d}"
    final = os.path.join(folder, name)
    partial = final + ".partial"
    if is_rank0():
        os.makedirs(folder, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    _refuse_nonfinite(model, step)
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
    except Exception as err:  # dcp gathers every rank's write result, so each rank raises here
        raise RuntimeError(_save_failure(folder, partial, err)) from err
    barrier()
    files = _checksums(partial)
    if is_rank0():
        with open(os.path.join(partial, "seqmesh.json"), "w") as f:
            json.dump({"step": step, **(extra or {}), "files": files}, f)
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
    barrier()
    return final


def latest_checkpoint_name(folder: str) -> str | None:
    """The folder ``latest`` points at (its ``.old`` twin if a save was cut between renames), its files
    unchecked. Raises a ValueError when ``latest`` holds anything but a ``step_N`` name: joined unchecked,
    ``../x`` or an absolute path would lead outside the run's folder."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8", errors="replace") as f:
        name = f.read().strip()
    if not STEP_NAME.fullmatch(name):
        raise ValueError(f"{pointer} holds {name[:80]!r}, not the name of a checkpoint folder beside it (step_NNNNNNN); "
                         "seqmesh never writes that, and a path there could lead outside the run's folder. Delete the file or "
                         "write a step's folder name into it (--resume ignores it and takes the newest intact checkpoint).")
    path = os.path.join(folder, name)
    if not os.path.exists(path) and os.path.isfile(os.path.join(path + ".old", "seqmesh.json")):
        return path + ".old"  # a save of the same step was cut between renaming the old one aside and its own
    return path


def latest_checkpoint(folder: str) -> str | None:
    """The checkpoint ``latest`` names, or None when there is none yet."""
    path = latest_checkpoint_name(folder)
    if path is not None and not os.path.isfile(os.path.join(path, "seqmesh.json")):
        raise ValueError(f"{os.path.join(folder, LATEST)} names {path}, which is not a complete seqmesh checkpoint. "
                         "Resume with --resume, which takes the newest intact checkpoint in the folder, or move the "
                         "folder aside to start over.")
    return path


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizer) -> dict:
    """Load into ``model`` and ``optimizer`` (sharded as they are now); returns the saved extras.
    Every file is checked against its checksum first; a damaged one raises a ValueError on every rank.
    The optimizer keeps its own settings (its kernel, its weight decay: this run's, ``--allow-config-change``
    included) and takes the saved state (moments, step counts): torch's loading would put back the saved
    groups whole, and a checkpoint of the per-tensor AdamW would then step this run on that path."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"the checkpoint {path} is damaged: {problem}. Resume from an older step "
                         "(--resume takes the newest intact one) or start over in another --out.")
    model_state, optim_state = get_state_dict(model, optimizer)
    metadata = read_checked_metadata(path)
    _refuse_another_model(path, metadata, model_state)  # a sound checkpoint of other weights is not "damaged"
    state = {"model": model_state, "optim": optim_state}
    load_checked(state, path, fix="it is probably damaged. Resume from an older step or start over in another --out.",
                 metadata=metadata)
    # the saved groups take this run's settings, from which torch's loading also places the step counts (the fused
    # kernel's float32, beside the parameters)
    for saved, own in zip(state["optim"]["param_groups"], optimizer.param_groups):
        saved.update({k: v for k, v in own.items() if k not in ("params", "param_names")})
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "seqmesh.json")) as f:
        return json.load(f)


def _refuse_another_model(path: str, metadata, model_state: dict) -> None:
    """Raise a ValueError naming the weights the checkpoint at ``path`` lacks, holds beyond the model's, or holds in
    another shape (the first three), and the model it was saved from (``--allow-config-change`` accepts other
    settings, not another model: loading would fail on the first difference, blamed on damage)."""
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    wanted = {k: tuple(v.shape) for k, v in model_state.items()}
    short = lambda name: name.removeprefix("lm.")  # noqa: E731
    found = [f"{short(k)} is missing from it" for k in sorted(wanted.keys() - saved.keys())]
    found += [f"{short(k)} is {list(saved[k])} there, {list(wanted[k])} here" for k in sorted(wanted.keys() & saved.keys())
              if saved[k] != wanted[k]]
    found += [f"it holds {short(k)}, which this model has not" for k in sorted(saved.keys() - wanted.keys())]
    if not found:
        return
    try:
        with open(os.path.join(path, "seqmesh.json")) as f:
            model = json.load(f)["config"]["model"]
        source = f" (it was saved by a run of --model {model})"
    except (OSError, ValueError, KeyError, TypeError):
        source, model = "", "the run's model"
    more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
    raise ValueError(f"the checkpoint {path} holds another model's weights than this run builds{source}: "
                     f"{'; '.join(found[:3])}{more}. --allow-config-change continues a run with other settings, not with "
                     f"another model: resume with --model {model}, or start a new run in another --out.")


def prune_checkpoints(folder: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints in ``folder``; returns the deleted paths.

    Rank 0 deletes (the others return ``[]`` at once); call it after a save, once ``latest`` names the new
    checkpoint. Never deleted: ``protect`` (the checkpoint a resumed run started from), the one ``latest``
    names, and anything that is not a complete ``step_N`` folder (``.partial``, ``.damaged``). Each folder
    is renamed aside before it is removed, so a deletion cut short never looks like a checkpoint."""
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be at least 1, got {keep}.")
    if not is_rank0():
        return []
    complete = [p for p in steps_in(folder) if os.path.isfile(os.path.join(p, "seqmesh.json"))]
    spared = {os.path.normpath(p) for p in (protect, _latest_or_warn(folder)) if p is not None}
    deleted = []
    for path in complete[keep:]:
        if os.path.normpath(path) in spared:
            continue
        doomed = path + ".deleting"
        try:
            os.replace(path, doomed)
            shutil.rmtree(doomed)
        except OSError as err:  # a checkpoint left over is no reason to stop the run
            warnings.warn(f"could not delete the old checkpoint {path} ({err}); delete it by hand.", stacklevel=2)
            continue
        deleted.append(path)
    return deleted
