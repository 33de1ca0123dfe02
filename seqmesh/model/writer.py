"""Writing a model in transformers' format: a folder ``AutoModelForCausalLM.from_pretrained`` loads.

The folder holds ``config.json``, the weights in safetensors files (``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``), ``generation_config.json``
when the model has one, and the tokenizer's files when a tokenizer folder is given.

The weights are streamed, never gathered whole: every tensor's name, shape and dtype are known before
any value is, so the files and each safetensors header are planned first, and the values are then
written one tensor at a time in that order. Under FSDP2 each parameter is gathered alone
(``full_tensor()``, a collective every rank joins) and rank 0 appends it to the open file, so a rank
holds at most one whole tensor beyond its shards. The ``seqmesh export`` job
(``seqmesh.training.export``) writes a seqmesh checkpoint the same way, reading one tensor at a time.

The folder is written as ``OUT.partial`` and renamed into place once complete.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from collections.abc import Callable

import torch
import torch.nn as nn

from ..comm.ranks import agree, barrier, full_value, is_rank0
from .pretrained import INDEX, SINGLE, load_tokenizer_folder, saved_tensors, unique_parameters

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
DEFAULT_SHARD_BYTES = 5 * 2**30  # save_pretrained's default max_shard_size


def plan_files(entries: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[str]]:
    """The tensors of each file, in order: a new file starts when the next tensor would pass
    ``max_shard_bytes`` (a tensor larger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in entries.items():
        nbytes = _nbytes(shape, dtype)
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def file_names(count: int) -> list[str]:
    """``save_pretrained``'s names for ``count`` weight files."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def safetensors_header(names: list[str], entries: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding ``names`` in that order
    (padded with spaces to 8 bytes, as the format asks)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape, dtype = entries[name]
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_weights(folder: str, entries: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  tensor: Callable[[str], torch.Tensor], *, write: bool = True,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Stream the tensors named in ``entries`` (``{name: (shape, dtype)}``) into safetensors files in
    ``folder``, calling ``tensor(name)`` once per name in the planned order (every rank must, when it
    is a collective); only with ``write`` is anything written. Returns the files' names."""
    files = plan_files(entries, max_shard_bytes)
    names = file_names(len(files))
    for file, members in zip(names, files):
        handle = open(os.path.join(folder, file), "wb") if write else None
        try:
            if handle is not None:
                handle.write(safetensors_header(members, entries))
            for name in members:
                values = tensor(name)
                shape, dtype = entries[name]
                if tuple(values.shape) != tuple(shape):
                    raise ValueError(f"{name} has shape {list(values.shape)}, {list(shape)} was planned.")
                if handle is not None:
                    flat = values.detach().to("cpu", dtype).contiguous().reshape(-1)
                    handle.write(flat.view(torch.uint8).numpy().tobytes())
                del values
        finally:
            if handle is not None:
                handle.close()
    if write and len(names) > 1:
        weight_map = {name: file for file, members in zip(names, files) for name in members}
        total = sum(_nbytes(*entries[name]) for name in entries)
        with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return names


def write_metadata(lm: nn.Module, folder: str, dtype: torch.dtype, tokenizer: str | None) -> None:
    """``config.json`` (as ``save_pretrained`` writes it: architectures and dtype set), the generation
    config when the model can generate, and the tokenizer's files when ``tokenizer`` names a folder."""
    config = copy.deepcopy(lm.config)
    config.architectures = [type(lm).__name__]
    config.dtype = dtype
    config.save_pretrained(folder)
    generation = getattr(lm, "generation_config", None)
    if generation is not None and lm.can_generate():
        generation.save_pretrained(folder)
    if tokenizer is not None:
        load_tokenizer_folder(tokenizer).save_pretrained(folder)


def start_folder(out: str, overwrite: bool) -> str:
    """A fresh ``OUT.partial`` to write into; raises on every rank if ``out`` exists and not ``overwrite``."""
    exists = agree(os.path.exists(out))
    if exists and not overwrite:
        raise ValueError(f"{out} already exists; choose another output folder, or pass --overwrite to replace it.")
    partial = out.rstrip("/") + ".partial"
    if is_rank0():
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    return partial


def finish_folder(partial: str, out: str) -> None:
    """Move the complete ``partial`` folder to ``out`` (replacing what was there)."""
    if is_rank0():
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(partial, out)
    barrier()


@torch.no_grad()
def export_pretrained(module: nn.Module, out: str, *, tokenizer: str | None = None, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> str:
    """Write ``module`` (a transformers causal LM, or a ``SequenceParallelLM`` holding one as ``.lm``;
    sharded with FSDP2 or whole) to ``out`` in transformers' format; returns ``out``.

    Collective when a process group is up: every rank gathers each parameter in turn and rank 0
    writes it (see the module docstring). ``dtype``: of the saved weights (default: the parameters').
    A tied LM head is saved once, as the embedding, as ``save_pretrained`` does."""
    partial = start_folder(out, overwrite)
    write_model(module, partial, write=is_rank0(), tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes)
    finish_folder(partial, out)
    return out


@torch.no_grad()
def write_model(module: nn.Module, folder: str, *, write: bool, tokenizer: str | None = None,
                dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Stream ``module``'s weights and config into the existing ``folder`` (files of other kinds there are
    kept: a Trainer checkpoint's). Collective: every rank gathers each parameter in turn; the rank with
    ``write`` writes."""
    lm = getattr(module, "lm", module)
    params = saved_tensors(lm)  # persistent buffers in their own dtype (DeepSeek's float32 routing bias)
    dtype = dtype or next(iter(params.values())).dtype
    weights = set(unique_parameters(lm))
    entries = {name: (tuple(p.shape), dtype if name in weights and p.is_floating_point() else p.dtype)
               for name, p in params.items()}
    write_weights(folder, entries, lambda name: full_value(params[name]), write=write, max_shard_bytes=max_shard_bytes)
    if write:
        write_metadata(lm, folder, dtype, tokenizer)
