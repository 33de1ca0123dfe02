"""Where each parameter of a model comes from in a transformers folder: one tensor, or (mixtures of experts) the
per-expert tensors transformers fuses while loading.

transformers 5 keeps a layer's routed experts as ``(E, ...)`` tensors but saves and reads them per expert, joined
by its conversion mapping (``transformers.conversion_mapping``), e.g. for Qwen3-MoE, DeepSeek-V3, Mixtral::

    mlp.experts.{e}.gate_proj.weight (I, H), mlp.experts.{e}.up_proj.weight (I, H)
        -> MergeModulelist(dim=0), Concatenate(dim=1) -> mlp.experts.gate_up_proj (E, 2I, H)
    mlp.experts.{e}.down_proj.weight (H, I) -> MergeModulelist(dim=0) -> mlp.experts.down_proj (E, H, I)

So each file tensor is one block of a parameter: a :class:`Piece` says which (its ``region`` of the whole
parameter). A rank reads of each piece only what overlaps its own region (expert parallelism's experts, FSDP2's
rows), so no rank reads an expert it does not hold. Conversions of any other form are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Piece:
    """One tensor of a file and the block of a parameter it fills."""

    file: str
    key: str
    region: tuple[slice, ...]  # of the whole parameter; () with ``whole``
    whole: bool = True  # the tensor is the whole parameter
    # else the tensor is region[1:]'s block of expert region[0] (the file's tensor has no expert dim)


@dataclass(frozen=True)
class ExpertMerge:
    """A transformers conversion that stacks per-expert tensors on dim 0 and (with several sources) joins them on
    dim 1: ``sources[i]`` with ``*`` the expert index -> ``target``."""

    sources: tuple[re.Pattern, ...]
    target: str
    names: tuple[str, ...]  # the source patterns as transformers writes them

    def match(self, key: str) -> tuple[str, int, int] | None:
        """``(parameter name, expert, source index)`` for checkpoint ``key``, or None."""
        for i, pattern in enumerate(self.sources):
            found = pattern.search(key)
            if found:
                return key[:found.start()] + self.target + key[found.end():], int(found.group(1)), i
        return None

    def piece(self, file: str, key: str, expert: int, source: int, shape: torch.Size) -> Piece:
        """The piece of ``(file, key)``, expert ``expert``'s ``source``-th block of a parameter of ``shape``."""
        rows = shape[1] // len(self.sources)
        region = (slice(expert, expert + 1), slice(source * rows, (source + 1) * rows),
                  *(slice(0, n) for n in shape[2:]))
        return Piece(file, key, region, whole=False)

    def block_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The shape each file tensor must have for a parameter of ``shape``."""
        return (shape[1] // len(self.sources), *shape[2:])


def _pattern(source: str) -> re.Pattern:
    """``source`` (one ``*``: the expert index) as a regex matching the end of a checkpoint name."""
    head, tail = (re.escape(part) for part in source.split("*"))
    start = "" if source.startswith(".") else r"(?:^|(?<=\.))"  # a whole name component: "mlp." is not "xmlp."
    return re.compile(rf"{start}{head}(\d+){tail}$")


def conversions(lm: nn.Module) -> tuple[list, list[ExpertMerge]]:
    """transformers' one-to-one renames of checkpoint keys for ``lm``'s family, and its expert merges; any other
    conversion is refused with the reason."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightRenaming

    quantized = getattr(lm.config, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", "")
        raise ValueError(f"{type(lm).__name__}'s config.json names a quantized checkpoint ({method}); seqmesh reads "
                         "floating-point weights. Dequantize it once with transformers (from_pretrained with "
                         "dequantize, then save_pretrained), or train with --no-fsdp.")
    renamings, merges = [], []
    for transform in get_model_conversion_mapping(lm):
        if isinstance(transform, WeightRenaming):
            renamings.append(transform)
            continue
        ops = list(getattr(transform, "operations", []))
        sources, targets = list(transform.source_patterns), list(transform.target_patterns)
        merge = (len(targets) == 1 and ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
                 and (len(ops) == 1 and len(sources) == 1 or len(ops) == 2 and isinstance(ops[1], Concatenate)
                      and ops[1].dim == 1) and all(s.count("*") == 1 for s in sources)
                 and not getattr(ops[-1], "num_shards_attribute", None))
        if not merge:
            raise ValueError(f"transformers converts {type(lm).__name__} checkpoints while loading ({transform!r}); "
                             "seqmesh loads tensors that map one to one and per-expert tensors stacked into (E, ...) "
                             "experts (Qwen3-MoE, DeepSeek-V3, Mixtral), not this conversion. Train this family "
                             "without FSDP (--no-fsdp loads it whole).")
        merges.append(ExpertMerge(tuple(_pattern(s) for s in sources), targets[0], tuple(sources)))
    return renamings, merges


def overlap(piece: Piece, region: tuple[slice, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where ``piece`` meets this rank's ``region`` of the parameter: (the slices to read of the file's tensor,
    the slices of the rank's local part to write), or None when they do not meet."""
    if piece.whole:
        return (region, tuple(slice(0, s.stop - s.start) for s in region)) if all(
            s.stop > s.start for s in region) else None
    meet = [slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(piece.region, region)]
    if any(s.stop <= s.start for s in meet):
        return None
    read = tuple(slice(m.start - p.start, m.stop - p.start) for m, p in zip(meet, piece.region))[1:]
    write = tuple(slice(m.start - r.start, m.stop - r.start) for m, r in zip(meet, region))
    return read, write


def missing_blocks(name: str, shape: torch.Size, merge: ExpertMerge, found: set[tuple[int, int]]) -> list[str]:
    """The per-expert tensors of fused parameter ``name`` that no file holds, named as the files name them."""
    experts = shape[0]
    lost = [(e, i) for e in range(experts) for i in range(len(merge.sources)) if (e, i) not in found]
    prefix = name[:name.rindex(merge.target)]  # "model.layers.0."
    return [f"{prefix}{merge.names[i].replace('*', str(e))} (of {name})" for e, i in lost]
