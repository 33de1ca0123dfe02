"""Loading a transformers checkpoint folder shard by shard: each rank reads only what its shards cover.

A folder written by ``save_pretrained`` holds ``config.json`` and one ``model.safetensors`` or several
shards named by ``model.safetensors.index.json``. The model is built from ``config.json`` on the meta
device and sharded with FSDP2; then every rank allocates its shards and fills each one with the rows
it covers, read with safetensors' slicing (``safe_open(...).get_slice(name)[a:b]``), converted to the
parameter's dtype (bf16 on disk, fp32 masters). No rank ever holds a whole tensor it does not own, so
a rank's host memory while loading is its shard plus the slice being read.

Before any tensor is read, from the files' headers only: every header parses and covers its file,
the index names files inside the folder that hold the tensors it maps, and the checkpoint's names,
shapes and (floating) dtypes match the model; every rank raises the same ValueError naming what is
damaged, missing, unexpected, or of another shape. While the rows are read, each value is checked:
nan, inf or an absurd magnitude (``LARGEST_WEIGHT``) is refused by tensor and file on every rank.
safetensors carries no checksum, so a weight altered within plausible values cannot be told.
A tied LM head (``tie_word_embeddings``) is the embedding; transformers drops it from the files, and
one saved anyway is accepted when it matches. Names are renamed as transformers renames them when it
loads the family (Llama and Qwen3 map one to one); per-expert tensors that transformers stacks into a
mixture of experts' ``(E, ...)`` parameters are read block by block, each rank only the experts and rows
it holds (:mod:`seqmesh.model.fused_experts`); families whose loading converts tensors otherwise are
refused with the reason.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..comm.ranks import all_gather_object, local_part
from .fused_experts import Piece, conversions, missing_blocks, overlap

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(folder: str, required: bool = True) -> dict[str, str]:
    """``{tensor name in the files: file path}`` of the safetensors checkpoint in ``folder``, from the
    files' headers only. Raises a ValueError naming the file and the fix for an index that is not JSON or
    names a file outside ``folder`` or not there, a header that is truncated or damaged, and an index
    that maps a tensor to a file that does not hold it. Cheap (no tensor is read): every rank runs it
    before any model is built. A folder without safetensors raises, or gives ``{}`` if not ``required``
    (``from_pretrained`` also reads ``.bin`` files)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        weight_map = _weight_map(index, folder)
        keys = {file: _header_keys(file) for file in sorted(set(weight_map.values()))}
        held = {name: os.path.basename(file) for file, names in keys.items() for name in names}
        misplaced = [f"{name} to {os.path.basename(file)} (" + (f"it is in {held[name]}" if name in held else "in no file it names")
                     + ")" for name, file in weight_map.items() if name not in keys[file]]
        if misplaced:
            raise ValueError(f"{index} maps tensors to files that do not hold them: {_listed(misplaced)}. The index "
                             "belongs to other files: save the folder again (save_pretrained), or copy the index "
                             "with its shards.")
        return weight_map
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files and not required:
        return {}
    if not files:
        found = ", ".join(sorted(n for n in os.listdir(folder) if n.endswith(".bin"))) or "no weight files"
        raise ValueError(f"{folder} holds {found} but no .safetensors: seqmesh reads safetensors shard by shard. "
                         "Convert it once with transformers (from_pretrained, then save_pretrained), or "
                         "train with --no-fsdp, which loads it whole.")
    names: dict[str, str] = {}
    for file in files:
        path = os.path.join(folder, file)
        names.update(dict.fromkeys(_header_keys(path), path))
    return names


def _weight_map(index: str, folder: str) -> dict[str, str]:
    """The index's ``{tensor name: file path}``, every file a name inside ``folder`` that exists."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (ValueError, KeyError, TypeError) as err:  # json's errors are ValueErrors
        raise ValueError(f"{index} is not a safetensors index ({type(err).__name__}: {err}); save the folder "
                         "again (save_pretrained) or delete the index if a single model.safetensors holds every "
                         "tensor.") from None
    for file in sorted(set(weight_map.values())):
        # a name that leaves the folder would read whatever file it points at: a relative name is all a
        # folder written by save_pretrained holds (a file there may be a link, as in the hub's cache)
        if not file or os.path.isabs(file) or ".." in file.replace("\\", "/").split("/"):
            tensors = _listed(sorted(name for name, other in weight_map.items() if other == file))
            raise ValueError(f"{index} names {file!r} for {tensors}, a file outside {folder}; a checkpoint's index "
                             "names files inside its folder. Correct the weight_map, or save the folder again.")
        if not os.path.isfile(os.path.join(folder, file)):
            raise ValueError(f"{index} names {file}, which is not in {folder}: copy the missing shard, or the "
                             "whole folder again.")
    return {name: os.path.join(folder, file) for name, file in weight_map.items()}


def _header_keys(path: str) -> list[str]:
    """The tensor names in the header of the safetensors file ``path``; a ValueError if it cannot be read
    (safetensors checks the header's JSON, dtypes, shapes and that its offsets cover the file exactly)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}): it is truncated or damaged. "
                         "Download or save it again.") from None


def model_name(key: str, renamings: list) -> str:
    """The model's parameter name for checkpoint ``key`` (transformers' renames applied in order)."""
    for transform in renamings:
        key, _ = transform.rename_source_key(key)
    return key


def unique_parameters(lm: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}``, a tied parameter under its first name only (as ``save_pretrained`` writes)."""
    return dict(lm.named_parameters())


def saved_tensors(lm: nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes of ``lm``: :func:`unique_parameters` and the persistent buffers (e.g.
    DeepSeek-V3's routing bias ``e_score_correction_bias``, which training does not change)."""
    buffers = {name: b for name, b in lm.named_buffers() if name in lm.state_dict(keep_vars=True)}
    return {**unique_parameters(lm), **buffers}


def _aliases(lm: nn.Module) -> dict[str, str]:
    """``{second name: first name}`` of tied parameters (e.g. ``lm_head.weight``: the embedding's)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in lm.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def check_pretrained(lm: nn.Module, folder: str, files: dict[str, str] | None = None) -> dict[str, list[Piece]]:
    """Compare the checkpoint in ``folder`` with ``lm`` (on the meta device or sharded: full shapes are
    compared) from the files' headers; raises a ValueError naming every difference. Returns
    ``{parameter name: the file tensors that fill it}`` (one, or one per expert and source of a fused
    experts parameter). ``files``: :func:`checkpoint_files`'s answer, if the caller has it."""
    from safetensors import safe_open

    renamings, merges = conversions(lm)
    params, aliases, buffers = unique_parameters(lm), _aliases(lm), saved_tensors(lm)
    sources: dict[str, list[Piece]] = {}
    blocks: dict[str, set[tuple[int, int]]] = {}  # fused name: (expert, source) found
    unexpected, shapes, dtypes = [], [], []
    by_file: dict[str, list[str]] = {}
    for key, file in (checkpoint_files(folder) if files is None else files).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f:
            for key in keys:
                name = model_name(key, renamings)
                merge, merged = next(((m, m.match(name)) for m in merges if m.match(name)), (None, None))
                if merged is not None:
                    name, expert, source = merged
                target = buffers.get(name) if name in buffers else params.get(aliases.get(name, ""))
                if target is None or merged is not None and not 0 <= merged[1] < target.shape[0]:
                    unexpected.append(key)
                    continue
                stored = f.get_slice(key)
                shape, dtype = tuple(stored.get_shape()), stored.get_dtype()  # dtype: "BF16", "F32", "I64"...
                want = tuple(target.shape) if merged is None else merge.block_shape(target.shape)
                if shape != want:
                    shapes.append(f"{key} is {list(shape)} in {os.path.basename(file)}, the model's is {list(want)}"
                                  + ("" if merged is None else f" (a block of {name} {list(target.shape)})"))
                if target.is_floating_point() and not dtype.startswith(("F", "BF")):
                    dtypes.append(f"{key} is {dtype} in {os.path.basename(file)}, the model's is {target.dtype}")
                if merged is not None:
                    sources.setdefault(name, []).append(merge.piece(file, key, expert, source, target.shape))
                    blocks.setdefault(name, set()).add((expert, source))
                elif name in buffers:
                    sources[name] = [Piece(file, key, ())]
    missing = sorted(set(params) - set(sources))
    for name, found in blocks.items():
        merge = next(merge for merge in merges if merge.target in name)
        missing += missing_blocks(name, params[name].shape, merge, found)
    problems = []
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(sorted(unexpected))}")
    if shapes:
        problems.append(f"shapes differ: {_listed(shapes)}")
    if dtypes:
        problems.append(f"not floating point: {_listed(dtypes)}")
    if problems:
        raise ValueError(f"the checkpoint in {folder} does not match the model its config.json describes: "
                         f"{'; '.join(problems)}. Use the config.json saved with these weights.")
    return sources


def _listed(items: list[str], shown: int = 6) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """The region of the full tensor that this rank's part of ``p`` covers: the whole tensor for a plain
    tensor; for a DTensor, what its placements keep locally (each ``Shard(dim)`` cut as ``torch.chunk``
    cuts, as ``distribute_tensor`` and FSDP2 do; FSDP2 over tensor-parallel shards of the same dim nests
    the cuts, which torch's own layout arithmetic resolves), ``Replicate`` leaving the dim whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def read_slices(sources: dict[str, list[Piece]], params: dict[str, torch.Tensor]) -> Iterator[tuple[str, tuple[slice, ...], torch.Tensor]]:
    """``(name, where in this rank's part, values)`` of what each file tensor holds of this rank's region of
    its parameter, read file by file, one at a time (nothing for a tensor this rank holds none of); a
    ValueError naming the file if one cannot be read (changed since its header was checked)."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[tuple[str, Piece]]] = {}
    for name, pieces in sources.items():
        for piece in pieces:
            by_file.setdefault(piece.file, []).append((name, piece))
    for file, members in sorted(by_file.items()):
        try:
            with safe_open(file, framework="pt") as f:
                for name, piece in members:
                    met = overlap(piece, local_slices(params[name]))
                    if met is not None:
                        read, write = met
                        values = f.get_slice(piece.key)[read]
                        yield name, write, values if piece.whole else values.unsqueeze(0)
        except SafetensorError as err:
            raise ValueError(f"{file} could not be read ({err}): it changed or was damaged while loading. "
                             "Download or save it again.") from None


@torch.no_grad()
def load_pretrained(root: nn.Module, folder: str, device: torch.device | str,
                    sources: dict[str, list[Piece]] | None = None) -> int:
    """Fill ``root`` (a model built on the meta device, sharded with FSDP2 or whole; or a
    ``SequenceParallelLM`` holding one as ``.lm``) with the checkpoint in ``folder``: names and shapes
    checked first, then every rank allocates its shards on ``device``, computes the buffers (RoPE
    frequencies) as random initialisation does, and reads the rows its shards cover. Returns the bytes
    this rank read from the files. ``sources``: :func:`check_pretrained`'s answer, if the caller has it."""
    from .materialize import allocate, initialize_buffers

    lm = getattr(root, "lm", root)
    sources = check_pretrained(lm, folder) if sources is None else sources
    allocate(root, device)
    initialize_buffers(lm)
    read = copy_pretrained(lm, folder, sources)
    read_generation_config(lm, folder)
    return read


@torch.no_grad()
def copy_pretrained(lm: nn.Module, folder: str, sources: dict[str, list[Piece]] | None = None) -> int:
    """Copy the checkpoint in ``folder`` into ``lm``'s allocated parameters (FSDP2 shards or whole), each
    rank reading only the rows its shards cover; names and shapes are checked first unless ``sources``
    (from :func:`check_pretrained`) is given. Every value read is checked as it passes
    (:func:`refuse_bad_values`); every rank joins that verdict, so all raise or none. Returns the bytes
    this rank read."""
    sources = check_pretrained(lm, folder) if sources is None else sources
    params = saved_tensors(lm)
    read, bad, failure = 0, {}, None
    try:
        for name, write, values in read_slices(sources, params):
            target = local_part(params[name])[write]
            if values.is_floating_point() and values.numel():
                peak = _largest_magnitude(values)
                if not peak <= LARGEST_WEIGHT:
                    bad[name] = (os.path.basename(sources[name][0].file), peak)
            target.copy_(values.reshape(target.shape))  # the dtype conversion happens in the copy
            read += values.numel() * values.element_size()
            del values
    except (ValueError, OSError) as err:  # a rank that stops here still joins the verdict below
        failure = str(err)
    refuse_bad_values(folder, bad, failure)
    return read


def _largest_magnitude(values: torch.Tensor) -> float:
    """max |values|, nan if any value is nan, without an |values| copy of the tensor."""
    low, high = torch.aminmax(values.detach())
    return float(torch.maximum(-low, high))


# The largest |weight| a checkpoint may hold. Trained language models stay orders of magnitude below it:
# projections and embeddings are O(0.01-1), their rare outliers ("super weights") a few units, and their
# largest entries, norm scales and attention biases, at most in the hundreds; the tiny models of the tests
# stay under 3 (Qwen3.5's A_log, log 16). A value past it is a damaged file or a diverged run (one flipped
# exponent bit of a bf16 or fp32 weight gives ~1e36): the model would train to nothing (loss stuck at
# ln(vocab)) and export the damage, so it is refused at load.
LARGEST_WEIGHT = 1e4


def refuse_bad_values(folder: str, bad: dict[str, tuple[str, float]], failure: str | None = None) -> None:
    """Raise, on every rank at once, a ValueError naming the tensors any rank found non-finite or past
    ``LARGEST_WEIGHT`` (``bad``: ``{name: (file, max |w| this rank saw)}``) or a rank's read ``failure``.
    A collective: every rank calls it, whatever it found (a rank that raised alone would leave the others
    waiting in their next collective)."""
    verdicts = all_gather_object((bad, failure))
    failures = [f for _, f in verdicts if f is not None]
    if failures:
        raise ValueError(failures[0])
    worst: dict[str, tuple[str, float]] = {}
    for found, _ in verdicts:  # a tensor split over ranks: its nan, or its largest value
        for name, (file, peak) in found.items():
            if name not in worst or math.isnan(peak) or peak > worst[name][1]:
                worst[name] = (file, peak)
    if worst:
        listed = _listed([f"{name} in {file} (max |w| {peak:.3g})" for name, (file, peak) in sorted(worst.items())])
        raise ValueError(f"the checkpoint in {folder} holds non-finite or absurdly large weights: {listed}. seqmesh "
                         f"refuses nan, inf and any |w| above {LARGEST_WEIGHT:g} before training on them: the file is "
                         "damaged or comes from a diverged run. Download or save it again, or start from an earlier "
                         "checkpoint.")


def check_values(lm: nn.Module, folder: str, files: dict[str, str]) -> None:
    """:func:`refuse_bad_values` for a model ``from_pretrained`` loaded whole from ``folder`` (``--no-fsdp``),
    from the parameters in memory; each named with the file that holds it (``files``:
    :func:`checkpoint_files`'s answer) where the names map one to one."""
    bad = {}
    for name, p in unique_parameters(lm).items():
        if p.is_floating_point() and p.numel():
            peak = _largest_magnitude(p)
            if not peak <= LARGEST_WEIGHT:
                bad[name] = (os.path.basename(files.get(name, folder)), peak)
    refuse_bad_values(folder, bad)


def read_generation_config(lm: nn.Module, folder: str) -> None:
    """The folder's ``generation_config.json`` on the model, as ``from_pretrained`` would set it."""
    if os.path.isfile(os.path.join(folder, "generation_config.json")) and hasattr(lm, "generation_config"):
        from transformers import GenerationConfig

        lm.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)


def check_tokenizer_path(path: str | None) -> None:
    """Raise when a tokenizer folder is named but does not exist."""
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist; give a local tokenizer folder or omit it for bytes.")


def load_tokenizer_folder(path: str):
    """The transformers tokenizer in the local folder ``path`` (never downloaded)."""
    check_tokenizer_path(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"no tokenizer could be loaded from {path!r} ({first}); give a folder holding tokenizer.json "
                         "(or tokenizer_config.json and its vocabulary), or omit the tokenizer for bytes.") from err
